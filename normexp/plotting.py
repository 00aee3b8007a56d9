"""What every plot of the suite shares: one colour per normalizer, the same in every figure and table plot.

``norm_color(name)`` gives a fixed colour for each registered normalizer (the colour-blind-safe Okabe-Ito
palette first, then Tableau's) and, for any other name (a researcher's own normalizer), a colour derived
deterministically from the name, so the same name gets the same colour in every run, figure and machine.
"""

from __future__ import annotations

import hashlib

# LayerNorm, the baseline of both papers, is a neutral dark grey; the papers' normalizers the strongest hues.
NORM_COLORS: dict[str, str] = {
    "ln": "#4d4d4d",     # LayerNorm: dark grey
    "dyt": "#d55e00",    # DyT: vermillion
    "dtn": "#0072b2",    # DTN: blue
    "in": "#e69f00",     # InstanceNorm: orange
    "bn": "#009e73",     # BatchNorm: bluish green
    "rms": "#cc79a7",    # RMSNorm: reddish purple
    "derf": "#8c564b",   # Derf: brown
    "gn": "#56b4e9",     # GroupNorm: sky blue
    "sn": "#9467bd",     # Switchable Norm: purple
    "scale": "#bcbd22",  # ScaleNorm: olive
    "power": "#17becf",  # PowerNorm: cyan
}

# for names outside the table: hues that none of the above takes
_FALLBACK = ("#7f7f7f", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2",
             "#dbdb8d", "#9edae5")


def norm_color(name: str) -> str:
    """The colour of normalizer ``name`` (a hex string matplotlib takes)."""
    key = str(name).lower()
    if key in NORM_COLORS:
        return NORM_COLORS[key]
    digest = int(hashlib.sha1(key.encode()).hexdigest(), 16)  # stable across processes, unlike hash()
    return _FALLBACK[digest % len(_FALLBACK)]


def shades(color: str, n: int, lightest: float = 0.75) -> list[str]:
    """``n`` shades of ``color`` from light (mixed ``lightest`` with white) to the colour itself: one hue
    per normalizer, its depth or order shown by lightness."""
    from matplotlib.colors import to_hex, to_rgb

    rgb = to_rgb(color)
    if n == 1:
        return [to_hex(rgb)]
    out = []
    for i in range(n):
        w = lightest * (1 - i / (n - 1))  # share of white
        out.append(to_hex(tuple(c * (1 - w) + w for c in rgb)))
    return out
