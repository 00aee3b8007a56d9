"""The package's layers: every import inside normexp points down (or stays inside its own unit), so each
layer can be read, tested and replaced without the ones above it; and no module imports itself through
others (no import circles, inside a unit either). docs/layout.md draws the layers."""

from __future__ import annotations

import ast
import shutil

from conftest import ROOT

# bottom first; a unit is a top-level module or subpackage of normexp
LAYERS = [
    {"__init__", "errors", "distributed", "plotting"},
    {"tracking", "metrics", "norms", "plugins", "optim"},
    {"config"},  # the schema: a leaf, below everything that reads a config
    {"models", "data", "diffusion"},
    {"code_defaults"},  # the code's defaults as Hydra config nodes, registered before every composition
    {"engine"},
    {"tasks"},
    {"preflight"},  # the checks before any work: the schema, and what each task needs, asked of its registry
    {"run", "tables"},
    {"compare", "dashboard", "sync", "analysis", "command_line", "export"},
    {"__main__"},
]
LEVEL = {unit: level for level, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path, module: str) -> set[str]:
    """The normexp modules ``path`` imports, at module level or inside functions."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [f"{target}.{a.name}" for a in node.names] if not node.module else [target]
            else:
                names = [node.module or ""]
            found.update(n for n in names if n.startswith("normexp"))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("normexp"))
    return found


def modules(root=ROOT) -> dict[str, object]:
    """Every module of the normexp tree under ``root``, by dotted name (a package by its own name)."""
    return {".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): path
            for path in sorted((root / "normexp").rglob("*.py"))}


def import_graph(root=ROOT) -> dict[str, set[str]]:
    """module -> the normexp modules it imports, at module level, inside functions or for type checking
    only (``from .x import name`` is an import of ``.x``; a name from a package, of the package)."""
    found = modules(root)

    def module_of(target: str) -> str:
        while target not in found:
            target = target.rsplit(".", 1)[0]
        return target

    return {module: {module_of(target) for target in imports(path, module)} - {module}
            for module, path in found.items()}


def import_cycles(root=ROOT) -> list[list[str]]:
    """The import circles among normexp modules: each strongly connected part of :func:`import_graph` with
    more than one module, sorted (Tarjan's algorithm)."""
    graph = import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                cycles.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def upward_imports(root=ROOT) -> list[str]:
    """Every import of the normexp tree under ``root`` that points to its own layer or one above."""
    bad = []
    for path in sorted((root / "normexp").rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        source = unit_of(module)
        for target in imports(path, module):
            unit = unit_of(target)
            if target == "normexp":
                unit = "__init__"
            if unit != source and LEVEL.get(unit, -1) >= LEVEL[source]:
                bad.append(f"{module} -> {target} ({source}, layer {LEVEL[source]} -> {unit}, layer "
                           f"{LEVEL.get(unit)})")
    return bad


def test_every_unit_has_a_layer():
    units = {unit_of(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"))
             for p in (ROOT / "normexp").rglob("*.py")}
    assert units <= set(LEVEL), sorted(units - set(LEVEL))


def test_imports_point_down():
    assert upward_imports() == []


def test_an_upward_import_is_found(tmp_path):
    # the check itself, on a copy of the tree whose data layer imports the trainer
    shutil.copytree(ROOT / "normexp", tmp_path / "normexp", ignore=shutil.ignore_patterns("__pycache__"))
    with (tmp_path / "normexp" / "data" / "loaders.py").open("a") as f:
        f.write("\nfrom ..engine import trainer\n")
    assert upward_imports(tmp_path) == [
        f"normexp.data.loaders -> normexp.engine (data, layer {LEVEL['data']} -> engine, "
        f"layer {LEVEL['engine']})"]


def test_no_import_cycles():
    assert import_cycles() == []


def test_an_import_cycle_is_found(tmp_path):
    # the check itself, on a copy of the tree whose batch helpers import the trainer (same layer,
    # so only the cycle check sees it); a type-checking-only import counts too
    shutil.copytree(ROOT / "normexp", tmp_path / "normexp", ignore=shutil.ignore_patterns("__pycache__"))
    with (tmp_path / "normexp" / "engine" / "batches.py").open("a") as f:
        f.write("\nif TYPE_CHECKING:\n    from .trainer import Trainer\n")
    assert upward_imports(tmp_path) == []
    assert import_cycles(tmp_path) == [["normexp.engine.batches", "normexp.engine.trainer"]]


def test_the_schema_reads_no_task_engine_data_tracking_or_model_code():
    # norms and optim: the names a config may give (a normalizer's options, an optimizer)
    assert {unit_of(m) for m in import_graph()["normexp.config"]} <= {"__init__", "errors", "norms", "optim"}
