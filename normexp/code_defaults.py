"""The code's defaults as Hydra config nodes, so a yaml states only what differs from them.

``norm/code/<name>`` holds normalizer ``<name>``'s constructor options at their defaults; a norm yaml composes
it first (``defaults: [code/<name>@_here_, ...]``), so ``norm.<option>=`` overrides every option without
``+``. ``backbone/code/<name>`` holds the options model ``<name>``'s family shows (``config_options``) at the
values its constructor builds with; a size yaml composes it after its family. :func:`register` stores them in
Hydra's ConfigStore; every composition runs after it: the training command calls it, and
:func:`config_tree` composes with it (the table planner, the tests).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra

from . import CONFIG_DIR
from .models import registry as models
from .norms import registry as norms


def _plain(value: Any, where: str) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v, f"{where}, {k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{where}: default {value!r} has no config form")


def norm_defaults(name: str) -> dict[str, Any] | None:
    """Normalizer ``name``'s options at its constructor's defaults (None: it takes ``**kwargs``)."""
    options = norms.hyperparameters(name)
    if options is None:
        return None
    return {o.name: _plain(o.default, f"normalizer {name}, option {o.name}") for o in options
            if o.default is not inspect.Parameter.empty}  # an option without a default: its yaml states it


def register() -> None:
    """Store the code's defaults in Hydra's ConfigStore (again: the latest registrations win)."""
    store = ConfigStore.instance()
    for name in norms.list_norms():
        defaults = norm_defaults(name)
        if defaults is not None:
            store.store(group="norm/code", name=name, node=defaults)
    for name in models.list_models():
        node = _plain(models.config_defaults(name), f"model {name}")
        store.store(group="backbone/code", name=name, node=node)


@contextmanager
def config_tree() -> Iterator[None]:
    """Hydra on normexp's config tree, the code's defaults registered: ``hydra.compose`` works inside (as it
    does inside the training command, whose Hydra is kept when already initialised)."""
    register()
    if GlobalHydra.instance().is_initialized():
        yield
        return
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        yield
