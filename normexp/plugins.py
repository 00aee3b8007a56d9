"""A user's own normalizers and backbone families, with no edit of normexp (docs/extending.md): modules that
register on import, named by the config's ``plugins`` (a module name or a ``.py`` path) or by an installed
package's ``normexp.plugins`` entry point. ``normexp.preflight.validate`` loads them first, so every process
that builds a model has them; their yamls are found on Hydra's search path."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from collections.abc import Iterable
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType

from .errors import UserError

ENTRY_POINT_GROUP = "normexp.plugins"
_loaded: dict[str, ModuleType] = {}  # by the name or path the config gives, and "entry point <name>"


def _where(error: BaseException, origin: str | None = None) -> str:
    """Where ``error`` was raised as `` (file:line)``: the innermost frame in the plugin's file ``origin``,
    if any (not a library's hook around ``sys.exit``), else the innermost."""
    frames = traceback.extract_tb(error.__traceback__)
    own = [f for f in frames if origin is not None and Path(f.filename) == Path(origin)]
    frame = (own or frames or [None])[-1]
    return f" ({frame.filename}:{frame.lineno})" if frame is not None else ""


def _failed(what: str, error: BaseException, origin: str | None = None) -> UserError:
    where = _where(error, origin)
    if isinstance(error, SystemExit):  # would end normexp without a word
        return UserError(f"{what} exits on import (sys.exit({error.code!r}){where}): a plugin module only "
                         "registers; put the exit under `if __name__ == '__main__':`")
    return UserError(f"{what} failed to import: {type(error).__name__}: {error}{where}")


def _origin(name: str) -> str | None:
    """The file of the module ``name``, if it can be found."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None


def _import_file(path: Path) -> ModuleType:
    """The module of the file ``path``, imported under its stem (as ``import <stem>`` would name it)."""
    name = path.stem
    known = sys.modules.get(name)
    if known is not None and Path(getattr(known, "__file__", "") or "").resolve() == path.resolve():
        return known
    if known is not None:
        raise UserError(f"plugins: {path} would be imported as module '{name}', but that name is taken by "
                        f"{getattr(known, '__file__', None) or 'a built-in module'}: rename the file")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"plugins: {path} is not a Python module (a plugin file ends in .py)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: its dataclasses and type hints look it up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_plugin(name: str) -> ModuleType:
    """Import the plugin ``name``: a module name (``mynorms``, ``mypackage.norms``) or a ``.py`` file."""
    if name in _loaded:
        return _loaded[name]
    is_file = name.endswith(".py") or "/" in name or "\\" in name
    try:
        if is_file:
            path = Path(name).expanduser()
            if not path.is_file():
                raise UserError(f"plugins: no file {name} (from {Path.cwd()}; a plugin is a module name or "
                                "a path to a .py file)")
            module = _import_file(path)
        else:
            module = importlib.import_module(name)
    except UserError:
        raise
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            raise UserError(f"plugins: no module named '{name}' (a plugin is a module importable from "
                            "sys.path -- for ./<name>.py run with PYTHONPATH=. -- or a path to a .py file)"
                            ) from None
        raise _failed(f"plugin {name}", e) from None
    except (Exception, SystemExit) as e:  # the plugin's own mistake: where it is, in one line
        origin = str(Path(name).expanduser()) if is_file else _origin(name)
        raise _failed(f"plugin {name}", e, origin) from None
    _loaded[name] = module
    return module


def load_entry_points() -> list[ModuleType]:
    """Import every installed package's ``normexp.plugins`` entry point (each once per process)."""
    modules = []
    for point in entry_points(group=ENTRY_POINT_GROUP):
        key = f"entry point {point.name}"
        if key not in _loaded:
            try:
                _loaded[key] = point.load()
            except (Exception, SystemExit) as e:
                package = f" of {point.dist.name}" if point.dist is not None else ""
                raise _failed(f"the {ENTRY_POINT_GROUP} entry point {point.name} = {point.value}{package}",
                              e) from None
        modules.append(_loaded[key])
    return modules


def load_plugins(names: Iterable[str] | str | None = ()) -> list[ModuleType]:
    """The installed packages' entry points, then each plugin ``names`` gives (the config's ``plugins``)."""
    if isinstance(names, str):
        names = [names]
    return [*load_entry_points(), *(load_plugin(str(name)) for name in names or ())]
