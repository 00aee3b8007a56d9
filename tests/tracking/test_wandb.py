"""A table run's W&B offline run: group = the table, job type = the task, tags with scale and seed, and the
resolved config as a nested dict (so the runs table groups by backbone.name, norm.name, seed)."""

from __future__ import annotations

import json
import time

from conftest import quick_cfg
from test_run import wandb_log_payload

from normexp.run import run


def test_table_run_in_wandb(run_dir):
    cfg = quick_cfg("logger=wandb", "+table.id=dyt_squash", "+table.scale=smoke",
                    "+table.row.norm.squash=tanh", "norm=dyt")
    run(cfg, run_dir)
    (offline,) = list((run_dir / "wandb").glob("offline-run-*"))
    (log_file,) = list(offline.glob("run-*.wandb"))
    nested = json.dumps({"name": "vit_micro"})[:-1]  # the backbone's nested config, as W&B stores its JSON
    expected = [b"dyt_squash", b"classification", b"scale:smoke", b"seed:0", b"vit_micro", b"dyt",
                b'"squash": "tanh"', nested.encode()]
    for _ in range(60):  # W&B's service may still be writing when finish() returns (seen under load)
        data = wandb_log_payload(log_file)
        if all(e in data for e in expected):
            break
        time.sleep(0.5)
    for e in expected:
        assert e in data, e
