"""The demo's accuracy targets (slow: each run is the full ~2.5 minute demo on 2 CPU cores)."""

from __future__ import annotations

import pytest
from conftest import compose_cfg

from normexp.run import run


@pytest.mark.demo
@pytest.mark.parametrize("norm,target", [("ln", 90.0), ("dyt", 85.0), ("dtn", 85.0)])
def test_demo_reaches_its_target(tmp_path, norm, target):
    cfg = compose_cfg(f"norm={norm}", "logger=none", "trainer.progress=false")
    summary = run(cfg, tmp_path / norm)
    top1 = summary["metrics"]["final"]["val/top1"]
    print(f"demo norm={norm}: val/top1 {top1:.2f} in {summary['wall_time_s']:.0f} s")
    assert top1 >= target
