"""The prose budgets (scripts/prose_metrics.py): docstring lines per code line in normexp/ stay <= 0.15, and
the docs' median sentence is at most 22 words."""

from __future__ import annotations

import importlib.util
import statistics

from conftest import ROOT

spec = importlib.util.spec_from_file_location("prose_metrics", ROOT / "scripts" / "prose_metrics.py")
prose_metrics = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prose_metrics)


def test_docstring_lines_per_code_line_within_budget():
    table = prose_metrics.measure(ROOT)
    worst = sorted(table, key=lambda name: -table[name][0] / max(1, table[name][1]))[:5]
    assert prose_metrics.ratio(table) <= prose_metrics.BUDGET, f"most docstring-heavy: {worst}"


def test_docs_sentences_are_short():
    found = prose_metrics.docs_sentences(ROOT)
    medians = {name: statistics.median(counts) for name, counts in found.items() if counts}
    longest = sorted(medians, key=medians.get, reverse=True)
    assert prose_metrics.median_words(found) <= prose_metrics.SENTENCE_BUDGET, f"longest: {longest[:5]}"
