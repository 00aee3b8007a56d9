"""The prose budget: docstring lines per code line in normexp/ stay <= 0.15 (scripts/prose_metrics.py)."""

from __future__ import annotations

import importlib.util

from conftest import ROOT

spec = importlib.util.spec_from_file_location("prose_metrics", ROOT / "scripts" / "prose_metrics.py")
prose_metrics = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prose_metrics)


def test_docstring_lines_per_code_line_within_budget():
    table = prose_metrics.measure(ROOT)
    worst = sorted(table, key=lambda name: -table[name][0] / max(1, table[name][1]))[:5]
    assert prose_metrics.ratio(table) <= prose_metrics.BUDGET, f"most docstring-heavy: {worst}"
