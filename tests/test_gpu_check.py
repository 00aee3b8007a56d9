"""scripts/gpu_check.py on the CPU (``--dry-run``): every section's code path at tiny sizes, so that the
check a GPU machine runs cannot rot between the runs that machines are lent for."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from normexp.norms import list_norms
from normexp.norms.registry import hyperparameters

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


def fused_cases_expected() -> int:
    """13 DyT and DTN slots, and a token case per function of every other normalizer with a fused path."""
    count = 13
    for norm in set(list_norms()) - {"dyt", "dtn"}:
        options = {h.name: h for h in hyperparameters(norm) or []}
        if "kernels" in options:
            count += len(options["fn"].checks["choices"]) if "fn" in options else 1
    return count


def test_fused_section_dry_run(tmp_path):
    # every DyT squash and layout, every DTN slot kind: compiled path's kernels (op by op here) = plain ops
    proc = gpu_check("--dry-run", "--sections", "fused", "--fused-mode", "eager", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = assert_section_passed(tmp_path, "fused")
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    assert len(rows) == fused_cases_expected() and all(row.split("|")[-3].strip() == "pass" for row in rows)
    for squash in ("tanh", "hardtanh", "sigmoid", "identity"):
        assert any(f"dyt {squash}" in row for row in rows)
    assert any("pooled" in row for row in rows) and any("prefix" in row for row in rows)
    # round-robin over the normalizers: a cut leaves each checked once
    assert rows[0].startswith("| dyt") and rows[1].startswith("| dtn")


def test_budget_keeps_finished_sections_most_valuable_first(tmp_path):
    # asked in any order, the sections run fused, layers, steps, run; a budget too short for the benchmarks
    # leaves fused's table and says in every later section's file what it cut (a command stopped, a part or
    # the whole section not started)
    proc = gpu_check("--dry-run", "--sections", "run,steps,layers,fused", "--fused-mode", "eager",
                     "--budget-s", "2", "--out", str(tmp_path), timeout=300)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    done = re.findall(r"^== (\w+): (\w+)", proc.stdout, re.MULTILINE)
    assert [name for name, _ in done] == ["fused", "layers", "steps", "run"]
    fused = (tmp_path / "fused.md").read_text()
    assert "- section: FAIL" not in fused and "| pass |" in fused
    for later in ("layers", "steps", "run"):
        table = (tmp_path / f"{later}.md").read_text()
        assert "- section: incomplete" in table and re.search(r"NOT RUN \(budget\)|CUT \(budget\)", table)


def test_budget_stops_a_benchmark_at_the_section_end(tmp_path):
    # a command still running when its section's time is up is stopped, its last output kept; the rest of
    # the section is not started
    proc = gpu_check("--dry-run", "--sections", "steps", "--budget-s", "3", "--out", str(tmp_path),
                     timeout=300)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (tmp_path / "steps.md").read_text()
    assert "- section: incomplete" in table and "CUT (budget): ViT step, bf16, compiled" in table
    assert table.count("NOT RUN (budget)") == 3


def test_targets_marked_met_or_not(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    rows = module.target_rows({"dyt": 0.99, "derf": 1.03}, {"dyt": 1.0, "derf": 1.02, "dtn": 1.15}, "ours ln")
    assert rows[2:5] == ["| dyt | 0.990x | <= 1.00x | met |", "| derf | 1.030x | <= 1.02x | NOT MET |",
                         "| dtn | not measured | <= 1.15x | not measured |"]


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
