"""The run identities every table plans, at full scale and at smoke, as committed in ``run_ids.json``: a
change that moves one (a new constructor option missing from ``IDENTITY_DEFAULTS``, a config default restated
differently, a task building another config) would orphan every finished run of it. ``test_specs`` compares
each table's plans with this file; after a deliberate change, write it again:
``python tests/run_ids.py`` (and say in the commit which tables' runs it re-makes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from normexp.tables.plan import hydra_composer, plan_table
from normexp.tables.spec import list_tables, load_scale, load_table

RUN_IDS = Path(__file__).with_name("run_ids.json")
SCALES = ("full", "smoke")


def run_ids(plan) -> list[str]:
    """The distinct runs of a plan, by identity, sorted."""
    return sorted({run.run_id for run in plan.runs})


def main(tables: list[str]) -> None:
    known = json.loads(RUN_IDS.read_text()) if RUN_IDS.exists() else {}
    with hydra_composer() as compose:
        for table in tables or list_tables():
            known[table] = {scale: run_ids(plan_table(load_table(table), load_scale(scale), None, compose))
                            for scale in SCALES}
            print(f"{table}: {', '.join(f'{len(ids)} {scale}' for scale, ids in known[table].items())} runs")
    RUN_IDS.write_text(json.dumps(dict(sorted(known.items())), indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
