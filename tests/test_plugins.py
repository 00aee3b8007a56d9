"""Extending without forking: a user's own normalizer, backbone family and table, in a directory of their
own, picked up with no edit of normexp -- the "Extending normexp" example (docs/extending.md), run as a user
runs it.

The files and command lines are read from that page: ``mynorms.py`` (a scaled RMS norm
registered as ``scaled_rms``), ``mynets.py`` (a two-block token mixer registered as ``tiny_mixer``, built
with ``nn.LayerNorm`` slots like every normexp backbone), their yaml, a table spec
``configs/table/mytable.yaml`` and a scale ``configs/scale/one_epoch.yaml``, written into ``tmp_path``; the
commands run from there (``PYTHONPATH=.``), with ``logger=none trainer.progress=false`` added to the run and
``--out`` to the table (the test writes nothing outside ``tmp_path``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, run_cli

from normexp.errors import UserError
from normexp.plugins import load_plugin
from normexp.tables.spec import list_tables, load_scale, load_table, searchpath_of

PAGE = ROOT / "docs" / "extending.md"
PYTHON = "PYTHONPATH=. python -m normexp "


def page_example() -> tuple[dict[str, str], list[str]]:
    """The page's example: its files (each fenced block opening with ``# <path>``) and its command lines."""
    section = PAGE.read_text()
    blocks = re.findall(r"^```\w*\n(.*?)^```", section, flags=re.S | re.M)
    files = {b.split("\n", 1)[0][2:]: b.split("\n", 1)[1] for b in blocks if b.startswith("# ")}
    lines = [line for b in blocks for line in b.replace("\\\n", " ").splitlines()]
    commands = [line for line in lines if line.startswith(PYTHON)]
    return files, commands


FILES, COMMANDS = page_example()
WIDTH, DEPTH, PATCH, CLASSES = 32, 2, 4, 10  # tiny_mixer as its yaml and defaults make it


def mixer_params(norm_params: int) -> int:
    """tiny_mixer's parameter count with ``norm_params`` in each of its DEPTH + 1 norm slots."""
    embed = 3 * PATCH * PATCH * WIDTH + WIDTH
    blocks = DEPTH * (WIDTH * WIDTH + WIDTH)
    return embed + blocks + (DEPTH + 1) * norm_params + WIDTH * CLASSES + CLASSES


def command(index: int, user_dir: Path) -> list[str]:
    """The arguments of the page's command ``index``, run from ``user_dir``."""
    return shlex.split(COMMANDS[index].removeprefix(PYTHON).replace("$PWD", str(user_dir)))


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def normexp(user_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """``PYTHONPATH=. python -m normexp ARGS`` in the user's directory."""
    path = os.pathsep.join(filter(None, [".", os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "NORMEXP_OUTPUT_DIR": str(user_dir / "out"),
           "WANDB_SILENT": "true"}
    return subprocess.run([sys.executable, "-m", "normexp", *args], cwd=user_dir, env=env,
                          capture_output=True, text=True, timeout=600)


def records(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.rglob("summary.json"))


def test_the_page_shows_the_whole_example():
    assert set(FILES) == {"mynorms.py", "mynets.py", "configs/norm/scaled_rms.yaml",
                          "configs/backbone/tiny_mixer.yaml", "configs/table/mytable.yaml",
                          "configs/scale/one_epoch.yaml", "mytasks.py", "configs/task/count.yaml"}
    assert len(COMMANDS) == 3 and "table run mytable" in COMMANDS[1] and "task=count" in COMMANDS[2]


def test_a_users_norm_and_backbone_train(user_dir):
    out = normexp(user_dir, *command(0, user_dir), "logger=none", "trainer.progress=false")
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = records(user_dir / "out")
    summary = json.loads((run / "summary.json").read_text())
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert summary["status"] == "completed"
    assert 0 <= summary["metrics"]["final"]["val/top1"] <= 100
    assert config["norm"] == {"name": "scaled_rms", "gain": 0.5}
    assert config["backbone"]["name"] == "tiny_mixer" and config["plugins"] == ["mynorms", "mynets"]
    # every slot holds the user's norm: WIDTH weights and one gain each (LayerNorm's would be 2 * WIDTH)
    assert summary["params"] == mixer_params(WIDTH + 1)


def test_a_misspelled_option_of_a_users_norm_is_one_line(user_dir):
    out = normexp(user_dir, *command(0, user_dir), "+norm.gian=2", "logger=none")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: unknown config key norm.gian: did you mean norm.gain? "
                                               "norm has name, placement, model_defaults, gain, eps"]
    assert not (user_dir / "out").exists() or records(user_dir / "out") == []


@pytest.mark.parametrize("plugin, message", [
    ("nosuch", "plugins: no module named 'nosuch' (a plugin is a module importable from sys.path"),
    ("./nosuch.py", "plugins: no file ./nosuch.py"),
])
def test_an_unknown_plugin_says_what_a_plugin_is(user_dir, monkeypatch, plugin, message):
    monkeypatch.chdir(user_dir)
    with pytest.raises(UserError) as error:
        load_plugin(plugin)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_an_unknown_plugin_is_one_line_exit_2_and_leaves_nothing(user_dir):
    args = [a if not a.startswith("plugins=") else "plugins=[nosuch]" for a in command(0, user_dir)]
    out = normexp(user_dir, *args, "logger=none")
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: plugins: no module named 'nosuch'"), out.stderr
    out_dir = user_dir / "out"
    assert not out_dir.exists() or not any(p.is_file() for p in out_dir.rglob("*"))


def test_a_plugin_that_fails_says_where(tmp_path):
    (tmp_path / "broken.py").write_text("x = 1\nraise RuntimeError('no GPU kernel')\n")
    with pytest.raises(Exception, match=r"plugin .*broken\.py failed to import: RuntimeError: no GPU kernel "
                                        r"\(.*broken\.py:2\)"):
        load_plugin(str(tmp_path / "broken.py"))
    assert "broken" not in sys.modules


def test_a_users_tables_and_scales_are_found_on_the_search_path(user_dir):
    searchpath = searchpath_of(command(1, user_dir))
    assert searchpath == (f"file://{user_dir / 'configs'}",)
    assert load_table("mytable", searchpath).rows == ("norm.name",)
    assert load_scale("one_epoch", searchpath).overrides["classification"][0] == "trainer.epochs=1"
    assert "mytable" in list_tables(searchpath) and "mytable" not in list_tables()
    with pytest.raises(UserError, match=r"no table 'mytabel' .*available: .*mytable"):
        load_table("mytabel", searchpath)


@pytest.mark.slow
def test_a_users_table_runs(user_dir):
    results = user_dir / "results"
    out = normexp(user_dir, *command(1, user_dir), "--out", str(results))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Launching 2 jobs" in out.stdout + out.stderr
    runs = {yaml.safe_load((r / "config.yaml").read_text())["norm"]["name"]: json.loads(
        (r / "summary.json").read_text()) for r in records(user_dir / "out")}
    assert {n: s["status"] for n, s in runs.items()} == {"scaled_rms": "completed", "ln": "completed"}
    assert runs["scaled_rms"]["params"] == mixer_params(WIDTH + 1)
    assert runs["ln"]["params"] == mixer_params(2 * WIDTH)
    table = (results / "one_epoch" / "mytable.md").read_text()  # a scale other than smoke: its own folder
    assert "scaled_rms" in table and str(mixer_params(WIDTH + 1)) in table


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["torchrun", "submitit_local"])
def test_every_process_of_a_job_has_the_plugins(user_dir, launch):
    """Two torchrun workers, and a job of submitit's local executor: each imports the plugins itself."""
    args = [*command(0, user_dir), "logger=none", "trainer.progress=false"]
    if launch == "torchrun":
        env = {**os.environ, "PYTHONPATH": ".", "NORMEXP_OUTPUT_DIR": str(user_dir / "out"),
               "OMP_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                              "--master_port=29531", "-m", "normexp", *args, "trainer.device=cpu",
                              "data.batch_size=32"], cwd=user_dir, env=env, capture_output=True, text=True,
                             timeout=900)
    else:
        out = normexp(user_dir, "-m", "launcher=submitit_local", *args)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (run,) = records(user_dir / "out")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["params"] == mixer_params(WIDTH + 1)
    assert summary.get("world_size", 1) == (2 if launch == "torchrun" else 1)


TASK_PLUGIN = FILES["mytasks.py"]  # the page's task example


def test_a_task_from_a_plugin_runs_as_a_shipped_one(user_dir, monkeypatch):
    """The page's task example: one module and one yaml, from the user's directory (no edit of normexp), run
    by the page's command line (in this process)."""
    from normexp.run import run
    from normexp.tables.plan import hydra_composer

    tmp_path = user_dir
    monkeypatch.syspath_prepend(str(user_dir))  # PYTHONPATH=.
    searchpath = [a for a in command(2, user_dir) if a.startswith("hydra.searchpath=")]
    overrides = [a for a in command(2, user_dir) if a not in searchpath]
    with hydra_composer(searchpath) as compose:
        cfg = compose([*overrides, "logger=none"])
    summary = run(cfg, tmp_path / "run")
    assert summary["status"] == "completed" and summary["task"] == "count"
    assert summary["metrics"]["final"]["params"] == summary["params"] > 0
    with hydra_composer(searchpath) as compose:
        wrong = compose([*overrides, "logger=none", "data=imagenet"])
    with pytest.raises(UserError, match="task=count reads data=digits, not data=imagenet"):
        run(wrong, tmp_path / "wrong")


def test_a_plugin_cannot_take_a_shipped_tasks_name_by_loading_first(tmp_path):
    """Issue 47 (17): the shipped tasks register before a plugin's, in a fresh process too (where the plugin
    loads before any task is looked up), so a plugin's task of a shipped name is one line, exit 2 -- not a
    run under the genuine task's run id."""
    (tmp_path / "thief.py").write_text(TASK_PLUGIN.replace('"count"', '"classification"'))
    out = run_cli(f"plugins=[{tmp_path}/thief.py]", "logger=none", env={"NORMEXP_OUTPUT_DIR": str(tmp_path)})
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        "error: task 'classification' is registered twice (normexp.tasks.classification and thief): give the "
        "plugin's task a name of its own"]
    assert not list(tmp_path.rglob("summary.json"))


def test_a_plugin_that_exits_on_import_is_one_line(tmp_path):
    """Issue 47 (22): sys.exit in a plugin ended normexp without a word."""
    (tmp_path / "leaves.py").write_text("import sys\n\nsys.exit(3)\n")
    with pytest.raises(UserError) as error:
        load_plugin(str(tmp_path / "leaves.py"))
    assert str(error.value).startswith(f"plugin {tmp_path}/leaves.py exits on import (sys.exit(3) "
                                       f"({tmp_path}/leaves.py:3)): a plugin module only registers")
    assert "leaves" not in sys.modules
