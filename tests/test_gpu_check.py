"""scripts/gpu_check.py on the CPU (``--dry-run``): every section's code path at tiny sizes, so that the
check a GPU machine runs cannot rot between the runs that machines are lent for."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.py"


def gpu_check(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def assert_section_passed(out, section: str) -> str:
    table = (out / f"{section}.md").read_text()
    header = table.split("\n\n")[1]
    for field in ("- machine:", "- GPU:", "driver", "- versions:", "torch", "- command:"):
        assert field in header, (field, header)
    assert "- section: pass" in table, table
    return table


def test_fused_section_dry_run(tmp_path):
    # every DyT squash and layout, every DTN slot kind: compiled path's kernels (op by op here) = plain ops
    proc = gpu_check("--dry-run", "--sections", "fused", "--fused-mode", "eager", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = assert_section_passed(tmp_path, "fused")
    rows = [line for line in table.splitlines() if line.startswith("| dyt") or line.startswith("| dtn")]
    assert len(rows) == 13 and all(row.endswith("| pass |") for row in rows)
    for squash in ("tanh", "hardtanh", "sigmoid", "identity"):
        assert any(f"dyt {squash}" in row for row in rows)
    assert any("pooled" in row for row in rows) and any("prefix" in row for row in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_one_line_and_exit_2(tmp_path):
    proc = gpu_check("--out", str(tmp_path), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "--dry-run" in proc.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("section", ["fused", "steps", "layers", "run"])
def test_every_section_dry_run(tmp_path, section):
    # compiled kernels (more specialisations of one kernel than dynamo's default recompile limit), the
    # benchmarks' command lines (compile on and off), and a torchrun run killed with SIGKILL and resumed
    # by the same command with loader workers: per-epoch losses equal to an uninterrupted run's
    proc = gpu_check("--dry-run", "--sections", section, "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = assert_section_passed(tmp_path, section)
    if section == "run":
        assert "max |diff| 0.00e+00" in table and "(running)" in table
