"""Extending without forking: a user's own normalizer, backbone family and table, in a directory of their
own, picked up with no edit of normexp -- the README's "Extending normexp" example, run as a user runs it.

The user's directory (``tmp_path``) holds ``mynorms.py`` (a scaled RMS norm registered as ``scaled_rms``),
``mynets.py`` (a two-block token mixer registered as ``tiny_mixer``, built with ``nn.LayerNorm`` slots like
every normexp backbone), their yaml in ``configs/norm`` and ``configs/backbone``, a table spec
``configs/table/mytable.yaml`` and a scale ``configs/scale/one_epoch.yaml``. ``python -m normexp`` runs
from that directory with ``PYTHONPATH=.``, ``plugins=[mynorms,mynets]`` and
``hydra.searchpath=[file://<dir>/configs]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from normexp.plugins import load_plugin

MYNORMS = '''
import torch
from torch import nn

from normexp.norms import register_norm


@register_norm("scaled_rms")
class ScaledRMS(nn.Module):
    """x / rms(x) * weight * gain: RMSNorm with one learnt scalar gain."""

    def __init__(self, dim: int, gain: float = 1.0, eps: float = 1e-6, data_format: str = "channels_last"):
        super().__init__()
        self.eps, self.channel = eps, -1 if data_format == "channels_last" else 1
        self.weight = nn.Parameter(torch.ones(dim))
        self.gain = nn.Parameter(torch.tensor(float(gain)))

    def forward(self, x):
        shape = [-1] + [1] * (x.dim() - 2) if self.channel == 1 else [-1]
        rms = x.pow(2).mean(self.channel, keepdim=True).add(self.eps).rsqrt()
        return x * rms * self.weight.view(shape) * self.gain
'''
MYNETS = '''
from torch import nn

from normexp.models import register_model
from normexp.models.base import Backbone


class TinyMixer(Backbone):
    """Patches, then residual blocks [norm, linear, GELU], then a final norm, mean pooling and a head."""

    def __init__(self, img_size=16, in_chans=3, num_classes=10, patch_size=4, width=32, depth=2):
        super().__init__()
        self.embed = nn.Conv2d(in_chans, width, patch_size, patch_size)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                                    for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def norm_context(self, name):
        return {"block": int(name.split(".")[1]) if name.startswith("blocks.") else None}

    def forward(self, x):
        x = self.embed(x).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x).mean(1))


@register_model
def tiny_mixer(**kwargs):
    return TinyMixer(**kwargs)
'''
FILES = {
    "mynorms.py": MYNORMS,
    "mynets.py": MYNETS,
    "configs/norm/scaled_rms.yaml": "name: scaled_rms\ngain: 1.0\nplacement:\n  keep: []\n",
    "configs/backbone/tiny_mixer.yaml": ("name: tiny_mixer\nimg_size: ${data.img_size}\n"
                                         "num_classes: ${data.num_classes}\npatch_size: 4\nwidth: 32\n"
                                         "depth: 2\n"),
    "configs/table/mytable.yaml": """
title: A scaled RMS norm against LayerNorm
source: none
rows: [norm.name]
metrics:
  - {key: top1, label: Top-1, value: metrics.final.val/top1, fmt: .2f}
  - {key: params, label: Params, value: params, fmt: .0f}
blocks:
  - backbone=tiny_mixer norm=scaled_rms,ln
""",
    "configs/scale/one_epoch.yaml": """
description: one epoch of the digits demo
seeds: [0]
overrides:
  classification: [trainer.epochs=1, trainer.warmup_epochs=0, trainer.progress=false, logger=none]
""",
}
QUICK = ("trainer.epochs=1", "trainer.warmup_epochs=0", "trainer.progress=false", "logger=none")
WIDTH, DEPTH, PATCH, CLASSES = 32, 2, 4, 10


def mixer_params(norm_params: int) -> int:
    """TinyMixer's parameter count with ``norm_params`` in each of its DEPTH + 1 norm slots."""
    embed = 3 * PATCH * PATCH * WIDTH + WIDTH
    blocks = DEPTH * (WIDTH * WIDTH + WIDTH)
    return embed + blocks + (DEPTH + 1) * norm_params + WIDTH * CLASSES + CLASSES


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text.lstrip())
    return tmp_path


def normexp(user_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """``PYTHONPATH=. python -m normexp ARGS`` in the user's directory."""
    path = os.pathsep.join(filter(None, [".", os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "NORMEXP_OUTPUT_DIR": str(user_dir / "out"),
           "WANDB_SILENT": "true"}
    return subprocess.run([sys.executable, "-m", "normexp", *args], cwd=user_dir, env=env,
                          capture_output=True, text=True, timeout=600)


def user_args(user_dir: Path) -> tuple[str, ...]:
    return ("plugins=[mynorms,mynets]", f"hydra.searchpath=[file://{user_dir / 'configs'}]")


def records(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.rglob("summary.json"))


def test_a_users_norm_and_backbone_train(user_dir):
    out = normexp(user_dir, "backbone=tiny_mixer", "norm=scaled_rms", "norm.gain=0.5", *QUICK,
                  *user_args(user_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = records(user_dir / "out")
    summary = json.loads((run / "summary.json").read_text())
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert summary["status"] == "completed"
    assert 0 <= summary["metrics"]["final"]["val/top1"] <= 100
    assert config["norm"] == {"name": "scaled_rms", "gain": 0.5, "placement": {"keep": []}}
    assert config["backbone"]["name"] == "tiny_mixer" and config["plugins"] == ["mynorms", "mynets"]
    # every slot holds the user's norm: WIDTH weights and one gain each (LayerNorm's would be 2 * WIDTH)
    assert summary["params"] == mixer_params(WIDTH + 1)


def test_a_misspelled_option_of_a_users_norm_is_one_line(user_dir):
    out = normexp(user_dir, "backbone=tiny_mixer", "norm=scaled_rms", "+norm.gian=2", *QUICK,
                  *user_args(user_dir))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: unknown config key norm.gian: did you mean norm.gain? "
                                               "norm has name, placement, gain, eps"]
    assert not (user_dir / "out").exists() or records(user_dir / "out") == []


@pytest.mark.parametrize("plugin, message", [
    ("nosuch", "error: plugins: no module named 'nosuch' (a plugin is a module importable from sys.path"),
    ("./nosuch.py", "error: plugins: no file ./nosuch.py"),
])
def test_an_unknown_plugin_is_one_line_exit_2_and_leaves_nothing(user_dir, plugin, message):
    out = normexp(user_dir, "backbone=tiny_mixer", "norm=scaled_rms", f"plugins=[{plugin}]", *QUICK,
                  f"hydra.searchpath=[file://{user_dir / 'configs'}]")
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), out.stderr[-2000:]
    out_dir = user_dir / "out"
    assert not out_dir.exists() or not any(p.is_file() for p in out_dir.rglob("*"))


def test_a_plugin_that_fails_says_where(tmp_path):
    (tmp_path / "broken.py").write_text("x = 1\nraise RuntimeError('no GPU kernel')\n")
    with pytest.raises(Exception, match=r"plugin .*broken\.py failed to import: RuntimeError: no GPU kernel "
                                        r"\(.*broken\.py:2\)"):
        load_plugin(str(tmp_path / "broken.py"))
    assert "broken" not in sys.modules


@pytest.mark.slow
def test_a_users_table_runs(user_dir):
    results = user_dir / "results"
    out = normexp(user_dir, "table", "run", "mytable", "--scale", "one_epoch", "--out", str(results),
                  *user_args(user_dir))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Launching 2 jobs" in out.stdout + out.stderr
    runs = {yaml.safe_load((r / "config.yaml").read_text())["norm"]["name"]: json.loads(
        (r / "summary.json").read_text()) for r in records(user_dir / "out" / "tables")}
    assert {n: s["status"] for n, s in runs.items()} == {"scaled_rms": "completed", "ln": "completed"}
    assert runs["scaled_rms"]["params"] == mixer_params(WIDTH + 1)
    assert runs["ln"]["params"] == mixer_params(2 * WIDTH)
    table = (results / "mytable.md").read_text()
    assert "scaled_rms" in table and str(mixer_params(WIDTH + 1)) in table
