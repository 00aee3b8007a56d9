"""scripts/bench_norms.py: its rows cover every registered normalizer (the registry, not a hand list), and
one tiny run writes a table with the machine and every requested row."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from conftest import ROOT

from normexp.norms import list_norms
from normexp.norms.pointwise import FN_CHOICES

spec = importlib.util.spec_from_file_location("bench_norms", ROOT / "scripts" / "bench_norms.py")
bench_norms = importlib.util.module_from_spec(spec)
sys.modules["bench_norms"] = bench_norms  # its dataclass looks its module up
spec.loader.exec_module(bench_norms)


def test_every_registered_norm_has_a_row_or_is_named_as_identity():
    rows, identity = bench_norms.default_rows(), bench_norms.identity_norms()
    assert {"none", "skipinit", "fixup", "sigma_reparam"} <= set(identity)
    for name in list_norms():
        if name in bench_norms.FAMILIES:
            assert name not in rows
        else:
            assert (name in rows) != (name in identity), name
    assert {f"pointwise-{fn}" for fn in FN_CHOICES} <= set(rows)
    assert {"dyt-plain", "dtn-plain"} <= set(rows)
    for row in rows:
        bench_norms.build_row(row, 12, 2)  # every row builds


@pytest.mark.slow
def test_tiny_run_writes_every_row_and_the_machine(tmp_path):
    out = tmp_path / "norms.md"
    norms = ["ln", "pointwise-dyisru", "dyt-plain"]
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_norms.py"), "--norms", *norms,
                           "--batch", "1", "--warmup", "1", "--repeats", "1", "--rounds", "1", "--shapes",
                           "vit_s", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = out.read_text()
    assert "- machine:" in table and "torch threads" in table and "sigma_reparam" in table
    for name in [*norms, "floor"]:
        assert f"\n| {name} |" in table, name
    assert "FAIL (memory" in table or "pass (memory" in table
