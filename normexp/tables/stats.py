"""How sure a table's numbers are: t intervals over seeds, paired and Welch deltas (Welch 1947), the pooled
seed std, and the cross-backbone aggregates of Agarwal et al. (NeurIPS 2021, arXiv:2108.13264; their
``rliable`` library): probability of improvement and mean ranks with stratified bootstrap intervals."""

from __future__ import annotations

import inspect
import math
import statistics
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# scipy.stats is imported where it is used: reading a table's spec or ``normexp compare --help`` stays quick

WITHIN_NOISE = "≈"  # the mark of a delta whose interval contains 0, the same in every format and plot
CONFIDENCE = 0.95
N_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0  # the same intervals on every render of the same records


@dataclass(frozen=True)
class Interval:
    """An estimate and its confidence interval (``low``/``high`` None: no interval, e.g. one run); ``n`` runs
    or pairs, ``df`` degrees of freedom, ``kind`` (``t``, ``paired``, ``Welch``, ``bootstrap``)."""

    estimate: float
    low: float | None = None
    high: float | None = None
    n: int = 1
    df: float | None = None
    kind: str = "t"

    @property
    def half_width(self) -> float | None:
        """Half the interval's width (the ``±`` of a symmetric t interval)."""
        return None if self.low is None or self.high is None else (self.high - self.low) / 2

    @property
    def has_interval(self) -> bool:
        return self.low is not None and self.high is not None


def _t_around(estimate: float, se: float, df: float, n: int, kind: str, confidence: float) -> Interval:
    from scipy import stats

    half = 0.0 if se == 0 else se if math.isinf(se) else float(stats.t.ppf((1 + confidence) / 2, df)) * se
    return Interval(estimate, estimate - half, estimate + half, n, df, kind)


def t_half_width(std: float, n: int, confidence: float = CONFIDENCE) -> float | None:
    """The half-width of the t interval of a mean of ``n`` values of sample std ``std`` (a CSV's columns)."""
    return _t_around(0.0, std / math.sqrt(n), n - 1, n, "t", confidence).half_width


def mean(values: Sequence[float]) -> float:
    """The mean, also of values whose sum overflows a float (1e308 twice) though their mean does not."""
    try:
        return statistics.fmean(values)
    except OverflowError:
        return math.fsum(v / len(values) for v in values)


def _spread(spread: Callable[[Sequence[float]], float], values: Sequence[float]) -> float:
    """``spread`` (the sample std or variance) of ``values``: inf where it overflows a float, NaN where a
    value is not finite -- an interval that honestly says nothing, not an exception."""
    if not all(math.isfinite(v) for v in values):
        return math.nan
    try:
        return spread(values)
    except OverflowError:
        return math.inf


def std(values: Sequence[float]) -> float:
    """The sample standard deviation (two or more values; see :func:`_spread`)."""
    return _spread(statistics.stdev, values)


def variance(values: Sequence[float]) -> float:
    """The sample variance (two or more values; see :func:`_spread`)."""
    return _spread(statistics.variance, values)


def by_seed(seeds: Sequence[Hashable], values: Sequence[float]) -> dict[Hashable, float]:
    """``values`` keyed by their seeds (by seed and position where a seed repeats)."""
    if len(set(seeds)) == len(seeds):
        return dict(zip(seeds, values, strict=True))
    return {(s, i): v for i, (s, v) in enumerate(zip(seeds, values, strict=True))}


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval | None:
    """The mean of ``values`` and its Student t interval; one value: no interval; none: None."""
    n = len(values)
    if n == 0:
        return None
    estimate = mean(values)
    if n == 1:
        return Interval(estimate, n=1)
    return _t_around(estimate, std(values) / math.sqrt(n), n - 1, n, "t", confidence)


def paired_delta(x: Mapping[Hashable, float], y: Mapping[Hashable, float],
                 confidence: float = CONFIDENCE) -> Interval | None:
    """``x - y`` paired by seed over the seeds both have, with its t interval; one pair: no interval."""
    diffs = [x[k] - y[k] for k in x if k in y]
    found = t_interval(diffs, confidence)
    return None if found is None else Interval(found.estimate, found.low, found.high, found.n, found.df,
                                               "paired")


def welch_delta(x: Sequence[float], y: Sequence[float], confidence: float = CONFIDENCE) -> Interval | None:
    """``mean(x) - mean(y)`` with Welch's t interval; a side with one value: no interval; an empty side:
    None."""
    if not x or not y:
        return None
    estimate = mean(x) - mean(y)
    n = len(x) + len(y)
    if len(x) < 2 or len(y) < 2:
        return Interval(estimate, n=n, kind="Welch")
    vx, vy = variance(x) / len(x), variance(y) / len(y)
    se = math.sqrt(vx + vy)
    df = (vx + vy) ** 2 / (vx ** 2 / (len(x) - 1) + vy ** 2 / (len(y) - 1)) if se > 0 else n - 2
    return _t_around(estimate, se, df, n, "Welch", confidence)


def delta(x: Mapping[Hashable, float], y: Mapping[Hashable, float],
          confidence: float = CONFIDENCE) -> Interval | None:
    """``x - y`` for two rows keyed by seed: paired when both have the same seeds, else Welch's."""
    if x and set(x) == set(y):
        return paired_delta(x, y, confidence)
    return welch_delta(list(x.values()), list(y.values()), confidence)


def within_noise(interval: Interval | None) -> bool | None:
    """Whether the interval contains 0; None without an interval."""
    if interval is None or not interval.has_interval:
        return None
    return interval.low <= 0 <= interval.high  # type: ignore[operator]


def pooled_std(samples: Sequence[Sequence[float]]) -> tuple[float, int] | None:
    """The std pooled over samples of two or more values and its df; None when no sample has two values."""
    used = [s for s in samples if len(s) >= 2]
    df = sum(len(s) - 1 for s in used)
    if df == 0:
        return None
    return math.sqrt(sum((len(s) - 1) * variance(s) for s in used) / df), df


# ---------------------------------------------------------------- across strata (backbones)
def bootstrap_interval(samples: Sequence[Sequence[float]], statistic: Callable[..., Any],
                       confidence: float = CONFIDENCE, n_resamples: int = N_RESAMPLES) -> tuple[float, float]:
    """The percentile interval of ``statistic(*samples, axis=-1)`` under the stratified bootstrap."""
    from scipy import stats

    seed = {"rng": BOOTSTRAP_SEED} if "rng" in inspect.signature(stats.bootstrap).parameters \
        else {"random_state": BOOTSTRAP_SEED}
    found = stats.bootstrap(tuple(np.asarray(s, dtype=float) for s in samples), statistic, paired=False,
                            vectorized=True, axis=-1, method="percentile", n_resamples=n_resamples,
                            confidence_level=confidence, **seed)
    return float(found.confidence_interval.low), float(found.confidence_interval.high)


def _score(x: Any, y: Any) -> Any:
    """1 where x beats y, 1/2 for a tie, 0 otherwise (Agarwal et al.'s S(x, y))."""
    return (x > y) + 0.5 * (x == y)


def probability_of_improvement(strata: Sequence[tuple[Mapping[Hashable, float], Mapping[Hashable, float]]],
                               higher_is_better: bool = True,
                               confidence: float = CONFIDENCE) -> Interval | None:
    """P(X > Y) averaged over strata (Agarwal et al. 2021, Sec. 4.3); a stratum is ``(x, y)`` keyed by seed,
    compared seed by seed where the seeds agree, else all pairs (as ``rliable``). No interval where a stratum
    has fewer than two runs on a side."""
    sign = 1.0 if higher_is_better else -1.0
    samples: list[list[float]] = []
    layout: list[int] = []  # per stratum: 1 (one sample of per-seed scores) or 2 (x's and y's runs)
    for x, y in strata:
        if not x or not y:
            continue
        if set(x) == set(y):
            samples.append([float(_score(sign * x[k], sign * y[k])) for k in x])
            layout.append(1)
        else:
            samples += [[sign * v for v in x.values()], [sign * v for v in y.values()]]
            layout.append(2)
    if not layout:
        return None

    def statistic(*resampled: Any, axis: int = -1) -> Any:
        parts, i = [], 0
        for width in layout:
            if width == 1:
                parts.append(np.mean(resampled[i], axis=axis))
            else:
                a, b = np.moveaxis(resampled[i], axis, -1), np.moveaxis(resampled[i + 1], axis, -1)
                parts.append(np.mean(_score(a[..., :, None], b[..., None, :]), axis=(-2, -1)))
            i += width
        return np.mean(parts, axis=0)

    estimate = float(statistic(*[np.asarray(s) for s in samples]))
    n = sum(len(s) for s in samples)
    if min(len(s) for s in samples) < 2:
        return Interval(estimate, n=n, kind="bootstrap")
    low, high = bootstrap_interval(samples, statistic, confidence)
    return Interval(estimate, low, high, n, None, "bootstrap")


def mean_ranks(strata: Sequence[Mapping[Hashable, Sequence[float]]], higher_is_better: bool = True,
               confidence: float = CONFIDENCE) -> dict[Hashable, Interval]:
    """Each method's rank (1: best; ties share) averaged over its strata, with a stratified bootstrap
    interval; none where some run set has one run."""
    from scipy import stats

    sign = -1.0 if higher_is_better else 1.0  # rank 1 for the best
    strata = [{m: list(v) for m, v in s.items() if len(v)} for s in strata]
    methods = list(dict.fromkeys(m for s in strata for m in s))
    samples = [s[m] for s in strata for m in s]

    def ranks_of(method: Hashable) -> Callable[..., Any]:
        def statistic(*resampled: Any, axis: int = -1) -> Any:
            i, found = 0, []
            for s in strata:
                means = np.stack([np.mean(resampled[i + j], axis=axis) for j in range(len(s))], axis=-1)
                if method in s:
                    ranked = stats.rankdata(sign * means, axis=-1)
                    found.append(ranked[..., list(s).index(method)])
                i += len(s)
            return np.mean(found, axis=0)
        return statistic

    out = {}
    for method in methods:
        statistic = ranks_of(method)
        estimate = float(statistic(*[np.asarray(s, dtype=float) for s in samples]))
        n = sum(len(s[method]) for s in strata if method in s)
        if min(len(s) for s in samples) < 2:
            out[method] = Interval(estimate, n=n, kind="bootstrap")
            continue
        low, high = bootstrap_interval(samples, statistic, confidence)
        out[method] = Interval(estimate, low, high, n, None, "bootstrap")
    return out
