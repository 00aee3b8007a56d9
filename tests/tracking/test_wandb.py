"""A table run's W&B offline run: group = the table, job type = the task, tags with scale and seed, and the
resolved config as a nested dict (so the runs table groups by backbone.name, norm.name, seed)."""

from __future__ import annotations

import re
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
    # the config as nested JSON per top-level key (compact or spaced, depending on the W&B version)
    expected = [rb"dyt_squash", rb"classification", rb"scale:smoke", rb"seed:0", rb"vit_micro", rb"dyt",
                rb'"squash":\s*"tanh"', rb'"name":\s*"vit_micro"']
    for _ in range(60):  # W&B's service may still be writing when finish() returns (seen under load)
        data = wandb_log_payload(log_file)
        if all(re.search(e, data) for e in expected):
            break
        time.sleep(0.5)
    for e in expected:
        assert re.search(e, data), e
