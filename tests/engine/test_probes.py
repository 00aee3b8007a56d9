"""Per-epoch probes: the task's list (``task.probes``), run by the loop at each epoch end; alpha rows only
with the alpha probe; an unknown name is one line; the default list keeps run ids."""

from __future__ import annotations

import pytest
from conftest import compose_cfg, quick_cfg
from omegaconf import OmegaConf

from normexp.data import build_classification_data
from normexp.engine.alpha_probe import ALPHA_KEY, STD_KEY
from normexp.engine.probes import PROBES, get_probes
from normexp.engine.trainer import Trainer
from normexp.errors import UserError
from normexp.models import build_backbone
from normexp.preflight import validate
from normexp.run import run
from normexp.tasks.classification import ClassificationTrainer
from normexp.tracking.provenance import config_hash
from normexp.tracking.records import RunRecord, read_metrics

SMALL = ("norm=dyt", "data.val_fraction=0.9")  # a tenth of the digits trains: seconds


def alpha_keys(rows: list[dict]) -> set[str]:
    return {k for row in rows for k in row if k.startswith((ALPHA_KEY, STD_KEY))}


def test_a_run_logs_alpha_rows_only_with_the_alpha_probe(tmp_path):
    with_probe = run(quick_cfg(*SMALL), tmp_path / "on")  # classification's default: [alpha]
    without = run(quick_cfg(*SMALL, "task.probes=[]"), tmp_path / "off")
    assert with_probe["status"] == without["status"] == "completed"
    assert any(k.startswith(ALPHA_KEY + "blocks.0") for k in alpha_keys(read_metrics(tmp_path / "on")))
    assert alpha_keys(read_metrics(tmp_path / "off")) == set()
    # the probe draws no random number: the same training numbers either way
    assert with_probe["metrics"]["final"] == without["metrics"]["final"]


def test_the_loop_runs_the_probes_it_is_given_with_the_tasks_forward(tmp_path):
    cfg = quick_cfg(*SMALL)
    record = RunRecord(tmp_path / "run", OmegaConf.to_container(cfg, resolve=True))
    data = build_classification_data(cfg.data, 0)
    calls = []

    def probe(model, loader, forward):
        calls.append((model, loader, forward))
        return {"probe/x": 1.5}

    model = build_backbone(cfg.backbone, cfg.norm)
    trainer = ClassificationTrainer(cfg.trainer, model, data, record, [probe])
    trainer.fit()
    rows = read_metrics(tmp_path / "run")
    assert [r["probe/x"] for r in rows if "probe/x" in r] == [1.5]
    assert calls == [(trainer.module, data.val, None)]  # classification: model(images)
    assert alpha_keys(rows) == set()  # the loop itself adds no alpha rows
    assert Trainer(cfg.trainer, build_backbone(cfg.backbone, cfg.norm), data, record).probes == []


def test_an_unknown_probe_is_one_line_naming_the_known_ones():
    with pytest.raises(UserError, match=r"unknown probe\(s\) \['alpah'\] in task.probes; known: alpha$"):
        validate(compose_cfg("task.probes=[alpah]"), environment=False)
    with pytest.raises(UserError, match="a list of probe names"):
        validate(compose_cfg("task.probes=alpha"), environment=False)
    with pytest.raises(UserError, match=r"known: .*alpha"):
        get_probes(["nope"])
    assert get_probes(["alpha"]) == [PROBES["alpha"]] and get_probes(None) == []


@pytest.mark.parametrize("task", ["classification", "mae", "dino", "dit"])
def test_the_tasks_default_probes_keep_run_ids(task):
    """Runs made when every run logged alpha keep their ids; a run without the probe is another run."""
    values = OmegaConf.to_container(compose_cfg(f"task={task}"), resolve=True)
    assert values["task"]["probes"] == ["alpha"]
    before = {**values, "task": {k: v for k, v in values["task"].items() if k != "probes"}}
    assert config_hash(values) == config_hash(before)
    assert config_hash({**values, "task": {**values["task"], "probes": []}}) != config_hash(values)
