"""Re-draw the committed pictures from the numbers committed beside them, where the run records are not kept:
each table's ``<id>.png`` from its ``<id>.csv``, each stability figure from its ``<id>.json``; no number is
read from anywhere else, so none moves (``python -m normexp.analysis.pictures [<id> ...]``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..tables.render import RESULTS_DIR, bars_from_csv, draw_bars
from ..tables.spec import DEFAULT_SCALE, load_table
from .figures import chance_level, load_figure, make_plan
from .render import plot_stability


def redraw(ids: list[str], results: Path = RESULTS_DIR) -> list[Path]:
    """The pictures of ``ids`` (every committed table and stability figure if empty), drawn again."""
    written = []
    for path in sorted((results / "tables").glob("**/*.csv")):
        scale = DEFAULT_SCALE if path.parent.name == "tables" else path.parent.name
        if path.stem.endswith("_across") or (ids and path.stem not in ids):
            continue
        spec = load_table(path.stem)
        draw_bars(spec, scale, bars_from_csv(spec, path), path.with_suffix(".png"))
        written.append(path.with_suffix(".png"))
    for path in sorted((results / "figures").glob("*.json")):
        figure = json.loads(path.read_text())
        if figure.get("analysis") != "stability" or (ids and path.stem not in ids):
            continue
        spec = load_figure(path.stem)
        chance = chance_level(make_plan(spec, figure["scale"], None, []))
        plot_stability(figure["numbers"], path.with_suffix(".png"), spec.grid["x"], spec.grid["y"],
                       title=f"{spec.title} [{figure['scale']} scale]", caption=figure["caption"],
                       names=spec.headers, chance=chance)
        written.append(path.with_suffix(".png"))
    return written


if __name__ == "__main__":
    for written in redraw(sys.argv[1:]):
        print(f"wrote {written}")
