"""Config values that restate a default of the code (the yaml states only what differs): a norm yaml value
equal to its normalizer constructor's default, a data yaml value equal to its dataset schema's default (the
schemas hold none: the data yamls are the one source), a backbone yaml value equal to its model constructor's
default. ``PYTHONPATH=. python tests/restated_defaults.py`` prints them and their count per group."""

from __future__ import annotations

import re
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import yaml
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
# keys that are no constructor option: the option's name, what it composes, suggestions to other groups
NOT_OPTIONS = {"name", "defaults", "placement", "model_defaults", "kind", "norm_defaults", "trainer_defaults",
               "dense_settings", "dense"}


def _same(value: Any, default: Any) -> bool:
    """``value`` (yaml) is ``default`` (code): equal, a bool only to a bool, a list to a tuple."""
    if isinstance(default, tuple):
        default = list(default)
    if isinstance(value, (list, dict)) or isinstance(default, (list, dict)):
        return _plain(value) == _plain(default)
    return isinstance(value, bool) == isinstance(default, bool) and value == default


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _statements(path: Path) -> dict[str, Any]:
    """The file's own values (not what it composes): a plain value as it is, an interpolation with a fallback
    (``${oc.select:<path>,<fallback>}``) by its fallback, which restates the default as surely as a value
    does; other interpolations left out (``${suggested:<path>}`` falls back on the code itself)."""
    values = yaml.safe_load(path.read_text()) or {}
    found = {}
    for key, value in values.items():
        if key in NOT_OPTIONS:
            continue
        if isinstance(value, str) and value.startswith("${"):
            fallback = re.fullmatch(r"\$\{oc\.select:[^,}]+,(.+)\}", value)
            if fallback is None or "${" in fallback.group(1):
                continue
            value = yaml.safe_load(fallback.group(1))
        found[key] = value
    return found


def norm_defaults(name: str) -> dict[str, Any]:
    """What ``norm=<name>``'s yaml composes first: its constructor's defaults (``norm/code/<name>``)."""
    from normexp.code_defaults import norm_defaults as code

    return code(name) or {}


def data_defaults(name: str) -> dict[str, Any]:
    """The defaults of ``data=<name>``'s schema."""
    from normexp.config import DATA_SCHEMAS

    return _defaults(DATA_SCHEMAS[name])


def _defaults(schema: type | None) -> dict[str, Any]:
    found = {}
    for f in fields(schema) if schema is not None else ():
        if f.name in NOT_OPTIONS:
            continue
        if f.default is not MISSING:
            found[f.name] = f.default
        elif f.default_factory is not MISSING:
            found[f.name] = f.default_factory()
    return found


class _Built(Exception):
    def __init__(self, module: nn.Module, arguments: dict[str, Any]) -> None:
        super().__init__(type(module).__name__)
        self.cls, self.arguments = type(module), arguments


def _stop_at_the_first_module(frame: Any, event: str, arg: Any) -> None:
    if event == "call" and frame.f_code.co_name == "__init__" \
            and isinstance(frame.f_locals.get("self"), nn.Module):
        arguments = dict(frame.f_locals)
        raise _Built(arguments.pop("self"), {**arguments.pop("kwargs", {}), **arguments})
    return None


def backbone_defaults(name: str) -> dict[str, Any]:
    """What ``create_model(name)`` hands its model class (its size's settings, then that constructor's
    defaults), and the defaults of the constructors up its bases: the model is not built (the first
    module's constructor is stopped on entry)."""
    import sys

    import normexp.models  # noqa: F401  (registers every model)
    from normexp.models.registry import _MODELS, _constructor_defaults

    sys.settrace(_stop_at_the_first_module)
    try:
        _MODELS[name]()
        raise AssertionError(f"model '{name}' made no module")
    except _Built as built:
        cls, found = built.cls, built.arguments
    finally:
        sys.settrace(None)
    return {**_constructor_defaults(cls), **found}


def backbone_files() -> dict[Path, list[str]]:
    """Each backbone yaml and the backbones (size files) whose composition reads it: a size file its own
    name, a family file every size that composes it (directly or through another family)."""
    composes: dict[Path, list[Path]] = {}
    for path in sorted((CONFIGS / "backbone").rglob("*.yaml")):
        values = yaml.safe_load(path.read_text()) or {}
        composes[path] = [CONFIGS / "backbone" / f"{d.split('@')[0]}.yaml" if "/" in d
                          else path.parent / f"{d.split('@')[0]}.yaml"
                          for d in values.get("defaults", []) if isinstance(d, str) and d != "_self_"]

    def readers(path: Path) -> list[str]:
        if path.parent.name != "family":
            return [path.stem]
        return sorted({name for other, parents in composes.items() if path in parents
                       for name in readers(other)})

    return {path: readers(path) for path in composes}


def restatements() -> dict[str, list[str]]:
    """``group -> ["<file>: <key>=<value>", ...]``: every statement that equals the code's default (in a
    family file: the default of every size that reads it, unless a size file states the key itself)."""
    found: dict[str, list[str]] = {"norm": [], "data": [], "backbone": []}
    for group, defaults in (("norm", norm_defaults), ("data", data_defaults)):
        for path in sorted((CONFIGS / group).glob("*.yaml")):
            code = defaults(path.stem)
            found[group] += [f"{group}/{path.name}: {k}={v}" for k, v in _statements(path).items()
                             if k in code and _same(v, code[k])]
    code = {}
    for path, names in backbone_files().items():
        for key, value in _statements(path).items():
            sizes = [n for n in names if path.parent.name != "family"
                     or key not in _statements(CONFIGS / "backbone" / f"{n}.yaml")]
            for n in sizes:
                code.setdefault(n, backbone_defaults(n))
            if sizes and all(key in code[n] and _same(value, code[n][key]) for n in sizes):
                found["backbone"].append(f"{path.relative_to(CONFIGS)}: {key}={value}")
    return found


if __name__ == "__main__":
    for group, statements in restatements().items():
        print(f"{group}: {len(statements)}")
        for statement in statements:
            print(f"  {statement}")
