"""Draw the analyses (matplotlib, Agg) with the numbers behind each picture beside it; a run's analysis and
a paper figure are drawn by the same code, each normalizer in its ``normexp.plotting`` colour."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..plotting import norm_color, shades
from .attention import uniform_distance
from .core import RunAnalysis

DPI = 130


@dataclass
class LabelledRun:
    """A run as a figure shows it: its label (e.g. "LN") and its analysis."""

    label: str
    analysis: RunAnalysis

    @property
    def norm(self) -> str:
        return self.analysis.run.norm

    @property
    def color(self) -> str:
        return norm_color(self.norm)

    @property
    def title(self) -> str:
        top1 = self.analysis.run.top1
        return f"{self.label} (top-1 {top1:.1f} %)" if top1 is not None else self.label


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "axes.titlesize": 10, "axes.labelsize": 10, "legend.fontsize": 8,
                         "figure.titlesize": 12})
    return plt


def _save(fig: Any, path: Path, caption: str, tight: bool = True) -> None:
    if caption:
        fig.text(0.5, 0.08 / fig.get_figheight(), caption, ha="center", va="bottom", fontsize=8,
                 color="#444444", wrap=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight" if tight else None)
    _plt().close(fig)


def short(slot: str) -> str:
    """A slot name for a panel title: names of more than four parts (Swin, LeViT) keep their last four."""
    parts = slot.split(".")
    return ".".join(parts[-4:]) if len(parts) > 4 else slot


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, default=_json_default) + "\n")


def _json_default(value: Any) -> Any:
    """``json.dumps``' default: numpy numbers and arrays as Python ones, anything else as its str."""
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def _finite(v: float | None) -> float | None:
    return None if v is None or (isinstance(v, float) and not math.isfinite(v)) else v


# ---------------------------------------------------------------- io
SQUASH_FN = {"tanh": np.tanh, "hardtanh": lambda z: np.clip(z, -1, 1),
             "sigmoid": lambda z: 1 / (1 + np.exp(-z)), "identity": lambda z: z}


def _io_panel(ax: Any, shown: LabelledRun, slot: str, color_by: str) -> dict[str, Any]:
    analysis = shown.analysis
    sample = analysis.io[slot]  # type: ignore[index]
    numbers = next(n for n in analysis.io_numbers if n["slot"] == slot)  # type: ignore[union-attr]
    pts = sample.points
    background = "#bbbbbb" if color_by in ("token", "channel") else shown.color
    ax.scatter(pts["x"], pts["y_pre"], s=2, color=background, alpha=0.35 if color_by == "norm" else 0.5,
               linewidths=0, rasterized=True)
    if color_by in ("token", "channel"):
        group = sample.tokens if color_by == "token" else sample.channels
        key = "token" if color_by == "token" else "channel"
        palette = ["#1b9e77", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d"]
        for i, value in enumerate(np.unique(group[key])):
            sel = group[key] == value
            where = (f"token ({value // sample.grid[1]},{value % sample.grid[1]})" if key == "token"
                     and sample.grid and value >= 0 else f"{key} {value}")
            ax.scatter(group["x"][sel], group["y_pre"][sel], s=4, color=palette[i % len(palette)],
                       linewidths=0, label=where, rasterized=True)
    x = np.linspace(float(pts["x"].min()), float(pts["x"].max()), 200)
    if _finite(numbers["r2"]) is not None:
        ax.plot(x, numbers["a"] * np.tanh(numbers["b"] * x) + numbers["c"], color="black", lw=1.2, ls="--",
                label="fit a tanh(bx)+c")
    if numbers.get("layer_alpha") is not None:
        squash = SQUASH_FN.get(numbers.get("layer_squash") or "tanh", np.tanh)
        ax.plot(x, squash(numbers["layer_alpha"] * x), color=norm_color("dyt"), lw=1.6, alpha=0.8,
                label=f"layer: {numbers.get('layer_squash') or 'tanh'}({numbers['layer_alpha']:.2f}x)")
    r2, lin = numbers["r2"], numbers["linear_r2"]
    saturated = 100 * numbers["saturated_fraction"]
    ax.set_title(f"{short(slot)}\nR² tanh {r2:.3f} | line {lin:.3f} | sat. {saturated:.0f} %", fontsize=8.5)
    ax.tick_params(labelsize=8)
    return numbers


def _grid(nrow: int, ncol: int, panel: tuple[float, float], margins: tuple[float, float, float, float],
          gaps: tuple[float, float]) -> tuple[Any, Any]:
    """A figure of nrow x ncol panels laid out once in inches (no tight_layout pass)."""
    plt = _plt()
    (pw, ph), (left, right, top, bottom), (wgap, hgap) = panel, margins, gaps
    width = left + right + ncol * pw + (ncol - 1) * wgap
    height = top + bottom + nrow * ph + (nrow - 1) * hgap
    fig, axes = plt.subplots(nrow, ncol, figsize=(width, height), squeeze=False)
    fig.subplots_adjust(left=left / width, right=1 - right / width, top=1 - top / height,
                        bottom=bottom / height, wspace=wgap / pw, hspace=hgap / ph)
    return fig, axes


def plot_io(runs: list[LabelledRun], slots: list[list[str]], path: Path, color_by: str = "token",
            title: str = "", caption: str = "") -> list[dict[str, Any]]:
    """One row of panels per run (one panel per slot; a single run's panels wrap into a grid)."""
    rows = []
    labelled = len(runs) > 1
    if not labelled:
        chosen = slots[0]
        ncol = min(5, len(chosen)) or 1
        nrow = math.ceil(len(chosen) / ncol)
        grid = [[(runs[0], s) for s in chosen[r * ncol:(r + 1) * ncol]] for r in range(nrow)]
    else:
        ncol, nrow = max(len(s) for s in slots), len(runs)
        grid = [[(run, s) for s in run_slots] for run, run_slots in zip(runs, slots, strict=True)]
    fig, axes = _grid(nrow, ncol, (2.6, 2.2), (1.25 if labelled else 0.75, 0.15, 1.05, 0.85), (0.45, 0.75))
    for r, line in enumerate(grid):
        for c in range(ncol):
            ax = axes[r][c]
            if c >= len(line):
                ax.axis("off")
                continue
            shown, slot = line[c]
            numbers = _io_panel(ax, shown, slot, color_by)
            rows.append({"run": shown.label, "norm": shown.norm, **numbers})
            ax.locator_params(nbins=5)
            if c == 0:
                ax.set_ylabel((f"{shown.title}\n" if labelled else "") + "output before affine")
                if labelled:
                    ax.yaxis.label.set_color(shown.color)
                    ax.yaxis.label.set_fontweight("bold")
            if r == nrow - 1 or (r == nrow - 2 and c >= len(grid[-1])):
                ax.set_xlabel("input value")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.suptitle(title or f"{runs[0].title}: input vs output of each norm slot",
                 y=1 - 0.12 / fig.get_figheight())
    if handles:
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.42 / fig.get_figheight()),
                   ncol=min(len(labels), 6), frameon=False, fontsize=8.5, markerscale=3)
    _save(fig, path, caption, tight=False)
    return rows


def io_point_rows(runs: list[LabelledRun], slots: list[list[str]],
                  color_by: str | None = None) -> list[dict[str, Any]]:
    """Every plotted point: run, slot, set (uniform / token / channel), position, x, y, y_pre."""
    out = []
    for shown, run_slots in zip(runs, slots, strict=True):
        for slot in run_slots:
            sample = shown.analysis.io[slot]  # type: ignore[index]
            sets = [("uniform", sample.points), ("token", sample.tokens), ("channel", sample.channels)]
            for kind, store in [(k, v) for k, v in sets if color_by is None or k in ("uniform", color_by)]:
                for i in range(len(store.get("x", []))):
                    out.append({"run": shown.label, "slot": slot, "set": kind,
                                "image": int(store["image"][i]),
                                "token": int(store["token"][i]), "channel": int(store["channel"][i]),
                                "x": f"{store['x'][i]:.6g}", "y": f"{store['y'][i]:.6g}",
                                "y_pre": f"{store['y_pre'][i]:.6g}"})
    return out


# ---------------------------------------------------------------- alpha
def plot_alpha(runs: list[LabelledRun], path: Path, title: str = "", caption: str = ""
               ) -> list[dict[str, Any]]:
    """alpha and 1/std over the epochs, and every layer's final alpha against 1/std (DyT Fig. 8)."""
    plt = _plt()
    fig, (ax_t, ax_f) = plt.subplots(1, 2, figsize=(11, 4.6))
    markers = "osD^v"
    rows = []
    correlations: list[str] = []
    for k, shown in enumerate(runs):
        layers = shown.analysis.alpha or []
        colors = shades(shown.color, len(layers), lightest=0.7)
        history = shown.analysis.alpha_history or {}
        picks = sorted({0, len(layers) // 2, len(layers) - 1}) if layers else []
        for i in picks:
            slot = layers[i].slot
            hist = history.get(slot)
            if not hist:
                continue
            epochs = [h[0] for h in hist]
            ax_t.plot(epochs, [h[1] for h in hist], color=colors[i], lw=1.8, marker=".",
                      label=f"{shown.label} {short(slot)}: α")
            ax_t.plot(epochs, [1 / h[2] if h[2] else np.nan for h in hist], color=colors[i], lw=1.4, ls="--",
                      label=f"{shown.label} {short(slot)}: 1/std")
        xs = [layer.inverse_std for layer in layers]
        ys = [layer.alpha for layer in layers]
        ax_f.scatter(xs, ys, c=colors, marker=markers[k % len(markers)], s=42, edgecolors="black",
                     linewidths=0.4, label=shown.title, zorder=3)
        if len(layers) > 2 and np.std(xs) > 0 and np.std(ys) > 0:
            r = float(np.corrcoef(xs, ys)[0, 1])
            correlations.append(f"{shown.label}: Pearson r = {r:.2f} ({len(layers)} layers)")
        for depth, layer in enumerate(layers):
            rows.append({"run": shown.label, "depth": depth, "slot": layer.slot, "alpha": layer.alpha,
                         "input_std": layer.input_std, "inverse_std": layer.inverse_std})
    if not ax_t.lines:
        ax_t.text(0.5, 0.5, "no per-epoch alpha in metrics.jsonl\n(run trained before the alpha log)",
                  ha="center", va="center", transform=ax_t.transAxes, color="#666666")
    ax_t.set_xlabel("epoch")
    ax_t.set_ylabel("α (solid), 1/std of the layer input (dashed)")
    ax_t.set_title("over training: first, middle, last layer (fixed probe batch)")
    if ax_t.lines:
        ax_t.legend(fontsize=7, ncol=2, loc="best", framealpha=0.9)
    ax_f.set_xlabel("1/std of the layer input (after training)")
    ax_f.set_ylabel("α (after training)")
    # both axes from 0, with alpha = 1/std dotted: how far alpha follows 1/std, at a glance
    top = max([1e-9, *ax_f.get_xlim(), *ax_f.get_ylim()])
    ax_f.plot([0, top], [0, top], color="#999999", lw=1, ls=":", label="α = 1/std", zorder=1)
    ax_f.set_xlim(0, top)
    ax_f.set_ylim(0, top)
    ax_f.set_title("per layer (lighter = earlier)" + ("\n" + "; ".join(correlations) if correlations else ""))
    ax_f.legend(loc="lower right", frameon=False)
    fig.suptitle(title or f"{runs[0].title}: DyT's α and 1/std of its input")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    _save(fig, path, caption)
    return rows


# ---------------------------------------------------------------- activation statistics
ACTIVATION_PANELS = (("kurtosis", "kurtosis of the input", "log"), ("max_abs", "max |input|", "log"),
                     ("saturated_fraction", "saturated fraction (point-wise layers)", "linear"))


def plot_activations(runs: list[LabelledRun], path: Path, title: str = "", caption: str = ""
                     ) -> list[dict[str, Any]]:
    """Per norm slot in depth order, each run a line in its normalizer's colour: the input's kurtosis and
    largest magnitude, and the saturated fraction of point-wise layers (:mod:`.activations`)."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(ACTIVATION_PANELS), figsize=(5 * len(ACTIVATION_PANELS), 4.2))
    rows = []
    for k, shown in enumerate(runs):  # runs of one normalizer share its colour: a line style each
        layers = shown.analysis.activations or []
        for depth, layer in enumerate(layers):
            rows.append({"run": shown.label, "depth": depth, **layer})
        for ax, (key, _, _) in zip(axes, ACTIVATION_PANELS, strict=True):
            values = [_finite(layer[key]) for layer in layers]
            if any(v is not None for v in values):
                ax.plot(range(len(layers)), [np.nan if v is None else v for v in values], color=shown.color,
                        marker="osD^vP"[k % 6], ms=4, ls=("-", "--", ":", "-.")[k % 4], label=shown.title)
    for ax, (_, label, scale) in zip(axes, ACTIVATION_PANELS, strict=True):
        ax.set_xlabel("norm slot (depth order)")
        ax.set_ylabel(label)
        if ax.lines:
            ax.set_yscale(scale)
            ax.legend(fontsize=7, frameon=False)
        else:
            ax.text(0.5, 0.5, "no point-wise layer", ha="center", va="center", transform=ax.transAxes,
                    color="#666666")
    fig.suptitle(title or f"{runs[0].title}: activation statistics per norm slot")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    _save(fig, path, caption)
    return rows


def alpha_history_rows(runs: list[LabelledRun]) -> list[dict[str, Any]]:
    return [{"run": shown.label, "slot": slot, "epoch": epoch, "alpha": alpha, "input_std": std,
             "inverse_std": 1 / std if std else None}
            for shown in runs for slot, hist in (shown.analysis.alpha_history or {}).items()
            for epoch, alpha, std in hist]


# ---------------------------------------------------------------- tokens
def plot_tokens(runs: list[LabelledRun], path: Path, title: str = "", caption: str = ""
                ) -> list[dict[str, Any]]:
    """Per run: the image, then each head's token magnitudes at the slot input and output (mean 1)."""
    plt = _plt()
    heads = max(s.analysis.tokens.heads for s in runs)  # type: ignore[union-attr]
    ncol = 1 + 2 * heads
    fig, axes = plt.subplots(len(runs), ncol, figsize=(1.55 * ncol + 1.2, 1.75 * len(runs) + 1.0),
                             squeeze=False)
    image_ax_cmap = "gray"
    last = None
    numbers = []
    for r, shown in enumerate(runs):
        maps = shown.analysis.tokens
        assert maps is not None
        img = shown.analysis.images[0]
        img = img.mean(0).numpy() if img.dim() == 3 else img.numpy()
        axes[r][0].imshow(img, cmap=image_ax_cmap)
        axes[r][0].set_ylabel(shown.title, color=shown.color, fontsize=10, fontweight="bold")
        if r == 0:
            axes[r][0].set_title("image", fontsize=9)
        for side, stack in enumerate((maps.input, maps.output)):
            for h in range(heads):
                ax = axes[r][1 + side * heads + h]
                if h >= stack.shape[0]:
                    ax.axis("off")
                    continue
                rel = stack[h] / stack[h].mean() if stack[h].mean() else stack[h]
                last = ax.imshow(rel, cmap="magma", vmin=0, vmax=2)
                cv = stack[h].std() / stack[h].mean() if stack[h].mean() else float("nan")
                ax.set_xlabel(f"cv {cv:.2f}", fontsize=8, labelpad=1)
                if r == 0:
                    ax.set_title(f"{'input' if side == 0 else 'output'}, head {h}", fontsize=9)
        numbers.append({"run": shown.label, "norm": shown.norm,
                        "image_index": shown.analysis.image_indices[0], **maps.numbers()})
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    if last is not None:
        bar = fig.colorbar(last, ax=axes.ravel().tolist(), fraction=0.02, pad=0.01)
        bar.set_label("token norm / mean over tokens")
    slot = runs[0].analysis.tokens.slot  # type: ignore[union-attr]
    fig.suptitle(title or f"Token magnitudes per head at {slot}, input and output (cv: std / mean)")
    _save(fig, path, caption)
    return numbers


# ---------------------------------------------------------------- attention
def plot_attention(runs: list[LabelledRun], path: Path, title: str = "", caption: str = ""
                   ) -> list[dict[str, Any]]:
    """Per run: each attention layer's heads' mean distance, their mean, and uniform attention's."""
    plt = _plt()
    computed = [s for s in runs if s.analysis.attention and s.analysis.attention.layers]
    fig, axes = plt.subplots(1, max(len(computed), 1), figsize=(max(3.8 * len(computed), 5.5), 4.2),
                             sharey=True, squeeze=False)
    rows: list[dict[str, Any]] = []
    top = 0.0
    rng = np.random.default_rng(0)  # horizontal jitter of the dots, the same in every rendering
    for ax, shown in zip(axes[0], computed, strict=False):
        result = shown.analysis.attention
        assert result is not None
        for row in result.rows():
            rows.append({"run": shown.label, "norm": shown.norm, **row})
        for depth, layer in enumerate(result.layers):
            heads = layer.per_head
            top = max(top, *heads)
            x = depth + rng.uniform(-0.15, 0.15, len(heads))
            ax.scatter(x, heads, s=26, color=shown.color, edgecolors="black", linewidths=0.3, zorder=3)
            ax.plot([depth - 0.3, depth + 0.3], [np.mean(heads)] * 2, color=shown.color, lw=2, zorder=2)
            if layer.query_grid == layer.key_grid:
                ref = uniform_distance(layer.query_grid, result.image)
                top = max(top, ref)
                ax.plot([depth - 0.35, depth + 0.35], [ref] * 2, color="#999999", lw=1, ls="--", zorder=1)
        ax.set_xticks(range(len(result.layers)))
        ax.set_xticklabels([str(layer.block if layer.block is not None else i)
                            for i, layer in enumerate(result.layers)], fontsize=8)
        ax.set_xlabel("block")
        ax.set_title(shown.title, color=shown.color)
        ax.grid(axis="y", alpha=0.3)
    if not computed:
        axes[0][0].text(0.5, 0.5, "mean attention distance does not apply:\n"
                        + "\n".join(n for s in runs for n in (s.analysis.notes.get("attention") or [])[:2]),
                        ha="center", va="center", transform=axes[0][0].transAxes, fontsize=8, wrap=True)
        axes[0][0].axis("off")
    axes[0][0].set_ylabel(f"mean attention distance (px, {runs[0].analysis.image_size[0]} px input)")
    if computed:
        axes[0][0].set_ylim(0, 1.1 * top)  # from 0: how far a head looks, against the uniform reference
    fig.suptitle(title or "Mean attention distance per head (dots), mean over heads (bar), uniform attention "
                 "(grey dashes)")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    _save(fig, path, caption)
    return rows


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    if path.suffix == ".csv":
        _write_csv(path, rows)
    else:
        write_json(path, rows)



CHANCE_TOLERANCE = 1.0  # percentage points above chance a top-1 may be and still count as not learned


def plot_stability(cells: list[dict[str, Any]], path: Path, x: str, y: str, title: str = "",
                   caption: str = "", names: dict[str, str] | None = None,
                   chance: float | None = None) -> None:
    """Per ``panel`` label, a grid of runs' outcomes over ``x`` and ``y``, as DyT Fig. 10 draws it: top-1 on
    one colour scale (its bar beside the panels), a run within ``CHANCE_TOLERANCE`` of ``chance`` (it never
    learned) grey and hatched, a diverged run red; panels that are the very same runs drawn once, titled with
    every panel's name. ``names``: the axes' words per key."""
    plt = _plt()
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    names = names or {}
    runs_of: dict[str, tuple[Any, ...]] = {}
    for c in cells:
        runs_of[c["panel"]] = (*runs_of.get(c["panel"], ()), (c[x], c[y], c.get("run_id")))
    merged: dict[tuple[Any, ...], list[str]] = {}
    for panel, runs in runs_of.items():
        merged.setdefault(tuple(sorted(runs, key=str)), []).append(panel)
    panels = [found[0] for found in merged.values()]
    titles = {found[0]: _same_names(found) for found in merged.values()}

    def order(values: set[Any]) -> list[Any]:  # numbers ascending; a run without the key (None) first
        return sorted(values, key=lambda v: (v is not None, float(v) if isinstance(v, (int, float)) else 0.0,
                                             str(v)))

    def unlearned(cell: dict[str, Any]) -> bool:
        return chance is not None and cell["top1"] is not None and cell["top1"] <= chance + CHANCE_TOLERANCE

    xs = order({c[x] for c in cells})
    ys = order({c[y] for c in cells if c[y] is not None}) or [None]
    top = [c["top1"] for c in cells if c["top1"] is not None and not unlearned(c)]
    lo, hi = (min(top), max(top)) if top else (0.0, 100.0)
    hi = hi if hi > lo else lo + 1.0
    cmap = plt.get_cmap("viridis")
    size = (2.6 + 1.0 * len(xs) * len(panels), 2.6 + 0.55 * len(ys))
    fig, axes = plt.subplots(1, len(panels), figsize=size, squeeze=False)
    fig.subplots_adjust(bottom=1.2 / size[1], top=1 - 0.7 / size[1], wspace=0.25, left=0.9 / size[0],
                        right=1 - 1.7 / size[0])
    for k, (ax, panel) in enumerate(zip(axes[0], panels, strict=True)):
        rows = [yv for yv in ys if any(c["panel"] == panel and c[y] == yv for c in cells)] or [None]
        for i, yv in enumerate(rows):
            for j, xv in enumerate(xs):
                cell = next((c for c in cells if c["panel"] == panel and c[x] == xv and c[y] == yv), None)
                if cell is None:
                    continue
                hatch, ink = "", "black"
                if cell["status"] == "diverged":
                    color, text, ink = "#d62728", f"div@{cell['diverged_step']}", "white"
                elif unlearned(cell):
                    color, text, hatch = "#d9d9d9", f"{cell['top1']:.1f}\nchance", "//"
                elif cell["top1"] is not None:
                    share = (cell["top1"] - lo) / (hi - lo)
                    color, text = cmap(share), f"{cell['top1']:.1f}"
                    ink = "white" if share < 0.6 else "black"
                else:
                    color, text = "#cccccc", cell["status"]
                ax.add_patch(plt.Rectangle((j, i), 1, 1, facecolor=color, hatch=hatch, edgecolor="white",
                                           lw=0.5))
                ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", fontsize=7, color=ink)
        ax.set_xlim(0, len(xs))
        ax.set_ylim(len(rows), 0)
        ax.set_xticks([j + 0.5 for j in range(len(xs))], ["—" if v is None else str(v) for v in xs])
        ax.set_yticks([i + 0.5 for i in range(len(rows))], ["—" if v is None else str(v) for v in rows])
        ax.set_xlabel(names.get(x, x))
        if k == 0:
            ax.set_ylabel(names.get(y, y))
        ax.set_title(titles[panel], fontsize=9)
    bar = fig.colorbar(ScalarMappable(Normalize(lo, hi), cmap), ax=list(axes[0]), fraction=0.04, pad=0.03)
    bar.set_label("top-1 (%)", fontsize=8)
    notes = [f"{_and_names(found)} are the same runs: one panel" for found in merged.values()
             if len(found) > 1]
    if chance is not None:
        notes.append(f"grey, hatched: at chance ({chance:g} % top-1: the run never learned); red: diverged")
    if title:
        fig.suptitle(title)
    _save(fig, path, "\n".join([*notes, caption] if caption else notes), tight=False)


def _same_names(panels: list[str]) -> str:
    """``ViT-S / DyT``, ``ViT-B / DyT`` -> ``ViT-S = ViT-B / DyT`` (the parts they share said once)."""
    split = [p.split(" / ") for p in panels]
    if len(panels) == 1 or len({len(s) for s in split}) > 1:
        return " = ".join(panels)
    return " / ".join(" = ".join(dict.fromkeys(parts)) for parts in zip(*split, strict=True))


def _and_names(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " and " + names[-1]
