"""Per-epoch probes: the task's list (``task.probes``), run by the loop at each epoch end, their values in the
final metrics; alpha rows only with the alpha probe; the activations probe against a direct computation; an
unknown name is one line; the default list keeps run ids."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import scipy.stats
import torch
from conftest import compose_cfg, quick_cfg
from omegaconf import OmegaConf

from normexp.data import build_classification_data
from normexp.engine.activation_probe import ACTIVATIONS_KEY, activation_probe
from normexp.engine.alpha_probe import ALPHA_KEY, STD_KEY, probe_batch
from normexp.engine.probes import PROBES, get_probes
from normexp.engine.trainer import Trainer
from normexp.errors import UserError
from normexp.models import build_backbone
from normexp.norms.placement import norm_slot_names
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
    # the probe draws no random number: the same training numbers either way, the probe's beside them
    final = with_probe["metrics"]["final"]
    assert {k: v for k, v in final.items() if k not in alpha_keys([final])} == without["metrics"]["final"]
    assert alpha_keys([final])


def test_the_activations_probe_logs_each_epoch_and_its_last_values_are_final(tmp_path):
    """``task.probes=[alpha,activations]``: a table reads ``metrics.final.activations/<stat>``."""
    summary = run(quick_cfg(*SMALL, "task.probes=[alpha,activations]", "trainer.epochs=2"), tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    stats = [f"{ACTIVATIONS_KEY}{s}" for s in ("kurtosis", "max_abs", "saturated_fraction")]
    assert all(key in row for row in rows for key in stats) and len(rows) == 2
    assert {key: summary["metrics"]["final"][key] for key in stats} == {key: rows[-1][key] for key in stats}
    assert summary["metrics"]["final"][ALPHA_KEY + "blocks.0.norm1"] == rows[-1][ALPHA_KEY + "blocks.0.norm1"]


def test_the_activations_probe_against_a_direct_computation():
    """The slots' mean kurtosis, their largest |x|, and DyT's share of |alpha x| > 2 over all its inputs."""
    cfg = compose_cfg("norm=dyt", "data.img_size=8")
    torch.manual_seed(0)
    model = build_backbone(cfg.backbone, cfg.norm)
    slots = norm_slot_names(model)
    for i, slot in enumerate(slots):  # alphas that saturate some inputs and not others
        model.get_submodule(slot).alpha.data.fill_(0.5 + i)
    dataset = [(torch.randn(3, 8, 8), 0) for _ in range(20)]
    inputs = {}
    def keep(name: str):
        return lambda _module, args, _out: inputs.__setitem__(name, args[0].detach().double().flatten())

    handles = [model.get_submodule(s).register_forward_hook(keep(s)) for s in slots]
    with torch.no_grad():
        model.eval()(probe_batch(dataset))
    for handle in handles:
        handle.remove()
    model.train()
    row = activation_probe(model, SimpleNamespace(dataset=dataset))
    kurtosis = [scipy.stats.kurtosis(inputs[s].numpy(), fisher=False) for s in slots]
    alphas = [float(model.get_submodule(s).alpha.detach()) for s in slots]
    saturated = sum(float((a * inputs[s]).abs().gt(2).sum()) for s, a in zip(slots, alphas, strict=True))
    assert row[ACTIVATIONS_KEY + "kurtosis"] == pytest.approx(sum(kurtosis) / len(kurtosis), rel=1e-6)
    assert row[ACTIVATIONS_KEY + "max_abs"] == pytest.approx(max(float(inputs[s].abs().max()) for s in slots))
    assert row[ACTIVATIONS_KEY + "saturated_fraction"] == pytest.approx(
        saturated / sum(inputs[s].numel() for s in slots))
    assert model.training  # the probe leaves the mode as it found it


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
    known = "known: activations, alpha$"
    with pytest.raises(UserError, match=r"unknown probe\(s\) \['alpah'\] in task.probes; " + known):
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
