"""The seeded streams of a run (normexp.tracking.provenance)."""

from __future__ import annotations


def test_every_seeded_stream_is_the_one_fold():
    """``stream_seed`` folds a seed with its stream indices; the streams it replaced (issue 52: seven formulas
    written per module) draw the very same numbers, so no committed result moves."""
    from normexp.tracking.provenance import stream_seed

    wide = (1_000_003, 1_000_033)
    for seed, a, b in [(0, 0, 0), (7, 3, 1), (12345, 99, 3)]:
        assert stream_seed(seed, a, b) == (seed * 1_000_003 + a) * 1_009 + b  # MAE, DiT, the loaders
        assert stream_seed(seed, 7, a, spread=wide) == (seed * 1_000_003 + 7) * 1_000_033 + a  # DiT sampling
        assert stream_seed(seed, a) == seed * 1_000_003 + a  # the sampler's epoch order
        assert stream_seed(seed, a, 0, spread=wide) == (seed * 1_000_003 + a) * 1_000_033  # per-sample seeds
