"""One colour per normalizer in every figure (:func:`norm_color`); variants of one differ by hatch or line
style (:func:`member_styles`) or lightness (:func:`shades`)."""

from __future__ import annotations

import zlib
from collections.abc import Hashable, Iterable
from typing import Any

# matplotlib's tab10 order for the normalizers the papers compare most, then the others
NORM_COLORS: dict[str, str] = {
    "ln": "#1f77b4", "dtn": "#ff7f0e", "dyt": "#2ca02c", "bn": "#d62728", "rms": "#9467bd",
    "derf": "#8c564b", "in": "#e377c2", "gn": "#7f7f7f", "sn": "#bcbd22", "scale": "#17becf",
    "power": "#393b79", "pointwise": "#ad494a", "none": "#000000",
    "skipinit": "#e7969c", "fixup": "#ce6dbd", "sigma_reparam": "#6b6ecf",
}
# colours for normalizers not listed above (a plugin's): chosen by a hash of the name, so still stable
_SPARE = ("#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354", "#756bb1")
HATCHES = ("", "//", "..", "xx", "\\\\", "oo", "--", "++")
LINESTYLES: tuple[Any, ...] = ("-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 3)),
                               (0, (8, 3, 1, 3)))


def norm_color(name: str | None) -> str:
    """The colour of normalizer ``name`` (``norm.name``), the same in every figure."""
    key = str(name).lower()
    if key in NORM_COLORS:
        return NORM_COLORS[key]
    return _SPARE[zlib.crc32(key.encode()) % len(_SPARE)]


def member_styles(members: Iterable[tuple[str | None, Hashable]]) -> dict[Hashable, dict[str, Any]]:
    """Per ``(normalizer, member)``: its normalizer's colour and, the k-th such member, the k-th hatch and
    line style."""
    styles: dict[Hashable, dict[str, Any]] = {}
    seen: dict[str | None, int] = {}
    for norm, member in members:
        if member in styles:
            continue
        k = seen.get(norm, 0)
        seen[norm] = k + 1
        styles[member] = {"color": norm_color(norm), "hatch": HATCHES[k % len(HATCHES)],
                          "linestyle": LINESTYLES[k % len(LINESTYLES)]}
    return styles


def shades(color: str, n: int, lightest: float = 0.75) -> list[str]:
    """``n`` shades of ``color`` from light (mixed ``lightest`` with white) to the colour itself."""
    from matplotlib.colors import to_hex, to_rgb

    rgb = to_rgb(color)
    if n == 1:
        return [to_hex(rgb)]
    out = []
    for i in range(n):
        w = lightest * (1 - i / (n - 1))  # share of white
        out.append(to_hex(tuple(c * (1 - w) + w for c in rgb)))
    return out
