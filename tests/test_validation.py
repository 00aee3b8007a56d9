"""Bad input is refused before any work: one line naming the key, the value and what is allowed; exit 2."""

from __future__ import annotations

import pytest
from conftest import compose_cfg, run_cli

from normexp.config import validate
from normexp.errors import UserError


@pytest.mark.parametrize("override,message", [
    ("data.batch_size=0", "data.batch_size=0: must be >= 1"),
    ("trainer.epochs=0", "trainer.epochs=0: must be >= 1"),
    ("seed=abc", "bad value for seed: Value 'abc' of type 'str' could not be converted to Integer"),
])
def test_cli_bad_values_are_one_line_and_exit_2(tmp_path, override, message):
    out = run_cli(override, "logger=none", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == f"error: {message}"
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "checkpoint.pth").exists()


def test_unknown_key_is_refused_before_any_work(tmp_path):
    out = run_cli("trainer.epoch=3", "logger=none", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode != 0 and "Could not override 'trainer.epoch'" in out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override,message", [
    ("+trainer.epoch=3", "unknown config key trainer.epoch: trainer has epochs, "),
    ("+data.bogus=1", "unknown config key data.bogus: data has name, "),
    ("trainer.amp=fp8", "trainer.amp=fp8: must be one of bf16, fp16, null"),
    ("trainer.mixup.prob=1.5", "trainer.mixup.prob=1.5: must be <= 1"),
    ("trainer.lr=0", "trainer.lr=0.0: must be > 0"),
    ("data.num_workers=-1", "data.num_workers=-1: must be >= 0"),
])
def test_schema_refuses(override, message):
    with pytest.raises(UserError) as error:
        validate(compose_cfg(override))
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("group", ["data", "trainer", "task", "experiment", "launcher"])
def test_every_shipped_option_fits_the_schema(group):
    from test_configs import options

    for option in options(group):
        validate(compose_cfg(f"{group}={option}"))
