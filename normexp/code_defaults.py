"""The code's defaults as Hydra config nodes, so a yaml states only what differs from them.

``norm/code/<name>`` holds normalizer ``<name>``'s constructor options at their defaults; a norm yaml composes
it first (``defaults: [code/<name>@_here_, ...]``), so ``norm.<option>=`` overrides every option without
``+``. ``backbone/code/<name>`` holds the options model ``<name>``'s family shows (``config_options``) at the
values its constructor builds with; a size yaml composes it after its family. :func:`register` stores them in
Hydra's ConfigStore; every composition runs after it: the training command calls it, and
:func:`config_tree` composes with it (the table planner, the tests).

``${suggested:<path>}``: another group's suggestion at ``<path>`` if there is one, else the constructor's
default (so that default is written once, in the code).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

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


_ABSENT = object()


def suggested(path: str, *, _parent_: Any, _root_: Any, _node_: Any) -> Any:
    """The resolver ``${suggested:<path>}`` (see the module docstring): the option ``<option>`` of
    ``norm`` or ``backbone`` ``<name>`` takes the value at ``path``, else its constructor's default."""
    value = OmegaConf.select(_root_, path, default=_ABSENT)
    if value is not _ABSENT:
        return value
    group, name, option = _parent_._key(), _parent_.name, _node_._key()
    defaults = (norm_defaults(name) or {}) if group == "norm" else models.built_with(name)
    if option not in defaults:
        raise KeyError(f"${{suggested:{path}}} at {group}.{option}: {group} '{name}' has no constructor "
                       f"default for '{option}'; state the value in its yaml")
    return _plain(defaults[option], f"{group} {name}, option {option}")


def register() -> None:
    """Store the code's defaults in Hydra's ConfigStore (again: the latest registrations win)."""
    OmegaConf.register_new_resolver("suggested", suggested, replace=True)
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
