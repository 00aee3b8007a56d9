"""Table specs (``configs/table/<id>.yaml``: blocks, rows, metrics, baseline, best_of, paper) and scales
(``configs/scale/<name>.yaml``: replace, overrides, caption) as plain data; docs/tables-and-figures.md
describes both."""

from __future__ import annotations

import fnmatch
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from .. import CONFIG_DIR
from ..errors import UserError

TABLE_DIR = CONFIG_DIR / "table"
SCALE_DIR = CONFIG_DIR / "scale"


# ---------------------------------------------------------------- where specs are found: Hydra's search path
def searchpath_of(overrides: Iterable[str]) -> tuple[str, ...]:
    """The entries of the first ``hydra.searchpath=[...]`` override, parsed by Hydra's override grammar."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    found = [o for o in overrides if o.lstrip("+~").startswith("hydra.searchpath=")]
    if not found:
        return ()
    value = OverridesParser.create().parse_override(found[0]).value()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UserError(f"{found[0]}: hydra.searchpath takes a list, e.g. hydra.searchpath=[file://<dir>]")
    return tuple(value)


def config_dirs(searchpath: Iterable[str] = ()) -> list[Path]:
    """normexp's config tree, then each directory of Hydra's search path; the first holding a name wins."""
    dirs = [CONFIG_DIR]
    for entry in searchpath:
        scheme, _, where = entry.partition("://") if "://" in entry else ("file", "", entry)  # as Hydra
        if scheme == "file":
            dirs.append(Path(where))
        elif scheme == "pkg":
            import importlib.resources

            try:
                dirs.append(Path(str(importlib.resources.files(where.replace("/", ".")))))
            except (ModuleNotFoundError, TypeError):
                continue  # Hydra warns that this entry is not available
        else:
            raise UserError(f"hydra.searchpath entry {entry}: use file://<dir> or pkg://<package>")
    return dirs


def _available(kind: str, searchpath: Iterable[str]) -> list[str]:
    return sorted({p.stem for d in config_dirs(searchpath) for p in (d / kind).glob("*.yaml")})


def list_tables(searchpath: Iterable[str] = ()) -> list[str]:
    return _available("table", searchpath)


def list_scales(searchpath: Iterable[str] = ()) -> list[str]:
    return _available("scale", searchpath)


def _load_yaml(path: Path, kind: str, available: list[str]) -> dict[str, Any]:
    if not path.is_file():
        raise UserError(f"no {kind} '{path.stem}' ({path}); available: {', '.join(available)}")
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a mapping")
    return data


def _unknown_keys(data: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise UserError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def get_path(tree: Any, path: str) -> Any:
    """``tree['a']['b/c']`` for ``path='a.b/c'`` (keys of metrics hold '/', never '.'); None if absent."""
    for part in path.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


# ---------------------------------------------------------------- tables
@dataclass(frozen=True)
class Metric:
    """One metric column: ``value`` paths into summary.json (the first present wins), scaled and formatted."""

    key: str
    label: str
    value: tuple[str, ...]
    fmt: str = ".2f"
    scale: float = 1.0
    delta: bool = False       # show our delta and the paper's delta against the baseline row
    derive: str | None = None  # computed across runs when no value path is present (see aggregate.DERIVED)
    better: str = "max"       # max | min: which way is an improvement (ranks, probability of improvement)

    @property
    def higher_is_better(self) -> bool:
        return self.better == "max"


@dataclass(frozen=True)
class BestOf:
    """A sweep inside each row: the rows' cells are those of the ``key`` value whose ``metric`` is best."""

    key: str
    metric: str
    mode: str = "max"  # max | min

    def better(self, a: float, b: float) -> bool:
        return a > b if self.mode == "max" else a < b


@dataclass(frozen=True)
class CurvePanel:
    """One training-loss panel of a table's curves figure: the rows whose labels match ``where`` (a value or a
    list of values per row key), drawn as a paper's loss-curve figure draws them."""

    title: str
    where: dict[str, tuple[str, ...]]

    def matches(self, labels: dict[str, Any]) -> bool:
        return all(str(labels.get(k)) in v for k, v in self.where.items())


@dataclass(frozen=True)
class TableSpec:
    id: str
    title: str
    source: str
    rows: tuple[str, ...]
    metrics: tuple[Metric, ...]
    blocks: tuple[str, ...]
    columns: str | None = None
    baseline: tuple[dict[str, Any], ...] = ()
    labels: dict[str, dict[str, str]] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    paper: tuple[dict[str, Any], ...] = ()
    setting_labels: tuple[dict[str, Any], ...] = ()  # {<row key>: value, ..., label: words}: a setting's name
    paper_note: str = ""
    notes: str = ""
    link_keys: tuple[str, ...] = ("backbone.name", "norm.name")
    best_of: BestOf | None = None
    curves: tuple[CurvePanel, ...] = ()  # empty: every row's loss and validation curves side by side
    curves_mirror: str = ""  # the paper figure the panels mirror
    searchpath: tuple[str, ...] = ()  # the search path it was found on: where the tables it links are found

    @property
    def label_keys(self) -> tuple[str, ...]:
        return (*self.rows, self.columns) if self.columns else self.rows

    def header(self, key: str) -> str:
        return self.headers.get(key, key.split(".")[-1])

    def display(self, key: str, value: Any) -> str:
        shown = self.labels.get(key, {})
        return str(shown.get(str(value), shown.get(value, value)))

    def baseline_of(self, labels: dict[str, Any]) -> dict[str, Any] | None:
        """The labels of the row ``labels`` is compared with (the first rule whose ``when`` matches)."""
        for rule in self.baseline:
            when = rule.get("when", {})
            if all(fnmatch.fnmatchcase(str(labels.get(k)), str(v)) for k, v in when.items()):
                return {**labels, **rule["set"]}
        return None

    def baseline_keys(self, labels: dict[str, Any]) -> tuple[str, ...]:
        for rule in self.baseline:
            when = rule.get("when", {})
            if all(fnmatch.fnmatchcase(str(labels.get(k)), str(v)) for k, v in when.items()):
                return tuple(rule["set"])
        return ()

    def setting_label(self, labels: dict[str, Any]) -> str | None:
        """The words for the setting ``labels`` (some row keys' values): the first ``setting_labels`` entry
        whose keys other than ``label`` are exactly those keys, with these values."""
        for entry in self.setting_labels:
            keys = set(entry) - {"label"}
            if keys == set(labels) and all(str(entry[k]) == str(labels[k]) for k in keys):
                return str(entry["label"])
        return None

    def paper_value(self, labels: dict[str, Any], metric: str) -> Any:
        for entry in self.paper:
            if all(str(entry.get(k)) == str(labels[k]) for k in self.label_keys) and metric in entry:
                return entry[metric]
        return None


TABLE_KEYS = {"title", "source", "rows", "columns", "metrics", "blocks", "baseline", "labels", "headers",
              "paper", "paper_note", "notes", "link_keys", "best_of", "curves", "setting_labels"}
BEST_OF_KEYS = {"key", "metric", "mode"}
CURVES_KEYS = {"mirrors", "panels"}
METRIC_KEYS = {"key", "label", "value", "fmt", "scale", "delta", "derive", "better"}


def _spec_path(name: str, kind: str, searchpath: Iterable[str]) -> Path:
    """``<kind>/<name>.yaml`` in the first config directory that has it, or ``name`` if it is a yaml path."""
    if name.endswith((".yaml", ".yml")):
        return Path(name)
    found = (d / kind / f"{name}.yaml" for d in config_dirs(searchpath))
    return next((p for p in found if p.is_file()), CONFIG_DIR / kind / f"{name}.yaml")


def load_table(name: str, searchpath: Iterable[str] = ()) -> TableSpec:
    """The table ``configs/table/<name>.yaml`` (or on Hydra's search path), or the spec file ``name``."""
    searchpath = tuple(searchpath)
    path = _spec_path(name, "table", searchpath)
    if path.parent.name == "table" and path.parent.parent.resolve() not in \
            {d.resolve() for d in config_dirs(searchpath)}:  # a spec file: the tables it links are beside it
        searchpath = (*searchpath, f"file://{path.parent.parent.resolve()}")
    table_id = path.stem
    data = _load_yaml(path, "table", list_tables(searchpath))
    _unknown_keys(data, TABLE_KEYS, str(path))
    metrics = []
    for m in data.get("metrics", []):
        _unknown_keys(m, METRIC_KEYS, f"{path} metric {m.get('key')}")
        value = m.get("value") or ()
        if m.get("better", "max") not in ("max", "min"):
            raise UserError(f"{path} metric {m.get('key')}: better is max or min")
        metrics.append(Metric(
            key=m["key"], label=m.get("label", m["key"]),
            value=(value,) if isinstance(value, str) else tuple(value), fmt=m.get("fmt", ".2f"),
            scale=float(m.get("scale", 1.0)), delta=bool(m.get("delta", False)), derive=m.get("derive"),
            better=m.get("better", "max")))
    if not metrics or not data.get("blocks") or not data.get("rows"):
        raise UserError(f"{path}: a table needs 'rows', 'metrics' and 'blocks'")
    if data.get("columns") and len(metrics) != 1:
        raise UserError(f"{path}: a table with 'columns' (a pivot) shows exactly one metric")
    for rule in data.get("baseline", []):
        if "set" not in rule:
            raise UserError(f"{path}: every baseline rule needs 'set' (and optionally 'when')")
    best_of = data.get("best_of")
    if best_of is not None:
        _unknown_keys(best_of, BEST_OF_KEYS, f"{path} best_of")
        if best_of.get("metric") not in {m.key for m in metrics} or not best_of.get("key"):
            raise UserError(f"{path}: best_of needs 'key' (the config path swept) and 'metric' (one of the "
                            f"metrics' keys: {[m.key for m in metrics]})")
        if best_of.get("mode", "max") not in ("max", "min") or best_of["key"] in data["rows"] \
                or data.get("columns"):
            raise UserError(f"{path}: best_of.mode is max or min, best_of.key is not a row key, and a "
                            "best_of table has no 'columns'")
        best_of = BestOf(best_of["key"], best_of["metric"], best_of.get("mode", "max"))
    curves = data.get("curves") or {}
    _unknown_keys(curves, CURVES_KEYS, f"{path} curves")
    panels = []
    for panel in curves.get("panels", []):
        where = panel.get("where") or {}
        if not isinstance(where, dict) or set(where) - set(data["rows"]):
            raise UserError(f"{path}: each curves panel needs 'where', a mapping of row keys "
                            f"{data['rows']} to a value or a list of values")
        panels.append(CurvePanel(str(panel.get("title", "")), {
            k: tuple(str(x) for x in (v if isinstance(v, list) else [v])) for k, v in where.items()}))
    return TableSpec(
        id=table_id, title=data.get("title", table_id), source=data.get("source", ""),
        rows=tuple(data["rows"]), columns=data.get("columns"), metrics=tuple(metrics),
        blocks=tuple(data["blocks"]), baseline=tuple(data.get("baseline", [])),
        labels=data.get("labels", {}), headers=data.get("headers", {}), paper=tuple(data.get("paper", [])),
        setting_labels=tuple(data.get("setting_labels", [])),
        paper_note=data.get("paper_note", ""), notes=data.get("notes", ""),
        link_keys=tuple(data.get("link_keys", ("backbone.name", "norm.name"))), best_of=best_of,
        curves=tuple(panels), curves_mirror=str(curves.get("mirrors", "")), searchpath=searchpath)


# ---------------------------------------------------------------- scales
@dataclass(frozen=True)
class Scale:
    name: str
    description: str
    seeds: tuple[int, ...]
    replace: dict[str, dict[str, list[str]]]
    overrides: dict[str, list[str]]
    caption: str = ""  # one sentence every table at this scale carries: what its numbers are evidence of

    def apply(self, overrides: list[str], task: str) -> list[str]:
        """The overrides of a point at this scale: replaced by the first matching pattern, then the task's."""
        out: list[str] = []
        for override in overrides:
            key, _, value = override.partition("=")
            patterns = self.replace.get(key.lstrip("+~"), {})
            match = next((p for p in patterns if fnmatch.fnmatchcase(value, p)), None)
            out += [override] if match is None else list(patterns[match] or [])
        return out + list(self.overrides.get(task, []))


DEFAULT_SCALE = "smoke"  # what `make table-<id>` and `normexp table run` use unless told
SCALE_KEYS = {"extends", "description", "caption", "seeds", "replace", "overrides"}


def load_scale(name: str, searchpath: Iterable[str] = ()) -> Scale:
    """The scale ``configs/scale/<name>.yaml`` or the file ``name``; ``extends: <scale>`` starts from that
    scale (this file's patterns first, its overrides replacing the base's task by task)."""
    path = _spec_path(name, "scale", searchpath)
    name = path.stem
    data = _load_yaml(path, "scale", list_scales(searchpath))
    _unknown_keys(data, SCALE_KEYS, str(path))
    replace, overrides = data.get("replace") or {}, data.get("overrides") or {}
    if data.get("extends"):
        base = load_scale(str(data["extends"]), searchpath)
        merged = {key: dict(patterns) for key, patterns in replace.items()}
        for key, patterns in base.replace.items():
            for pattern, values in patterns.items():
                merged.setdefault(key, {}).setdefault(pattern, values)
        replace = merged
        overrides = {**base.overrides, **overrides}
    seeds = distinct_seeds(tuple(int(s) for s in data.get("seeds") or [0]), f"{path}: seeds")
    return Scale(name=name, description=str(data.get("description", "")).strip(), seeds=seeds,
                 replace=replace, overrides=overrides,
                 caption=str(data.get("caption", "")).strip())


# ---------------------------------------------------------------- points
@dataclass
class Point:
    """One grid point of a table: its paper-scale overrides (seed included) and, once composed, labels."""

    overrides: list[str]
    seed: int
    labels: dict[str, Any] = field(default_factory=dict)
    choice: Any = None  # its value of the spec's best_of key (at paper scale)
    task: str | None = None
    backbone: str | None = None  # at paper scale (a scale may run another member)
    paper: dict[str, Any] = field(default_factory=dict)  # its resolved config at paper scale

    @property
    def row_key(self) -> tuple[str, ...]:
        """Identity of the point's row (its labels, seed excluded), as strings."""
        return tuple(str(v) for v in self.labels.values())


def expand_sweep(args: list[str]) -> list[list[str]]:
    """The jobs of a Hydra sweep (``a=1,2 b=x``), in Hydra's order, parsed by Hydra's override grammar."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices = []
    for override in OverridesParser.create().parse_overrides(args):
        key = override.get_key_element()
        if override.is_sweep_override():
            if not override.is_discrete_sweep():
                raise ValueError(f"'{override.input_line}': only discrete sweeps (a,b,c or range) work")
            choices.append([f"{key}={v}" for v in override.sweep_string_iterator()])
        else:
            choices.append([f"{key}={override.get_value_element_as_str()}"])
    return [list(job) for job in itertools.product(*choices)]


def distinct_seeds(seeds: tuple[int, ...], where: str = "seeds") -> tuple[int, ...]:
    """``seeds`` when no seed repeats: a repeated seed is the same run again, not another sample: counted
    again, it would shrink a cell's interval to nothing."""
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        raise UserError(f"{where} {','.join(map(str, seeds))} repeats seed(s) "
                        f"{','.join(map(str, repeated))}: a seed is one run, so give each once, e.g. 0,1,2")
    return seeds


def expand_blocks(spec: TableSpec, seeds: tuple[int, ...]) -> list[Point]:
    """Every combination of every block, once per seed (a block that sets ``seed`` itself keeps it)."""
    distinct_seeds(tuple(seeds))
    points = []
    for block in spec.blocks:
        args = block.split()
        if not any(a.split("=")[0] == "seed" for a in args):
            args.append("seed=" + ",".join(str(s) for s in seeds))
        try:
            jobs = expand_sweep(args)
        except Exception as e:  # Hydra's grammar errors name the bad override
            raise UserError(f"table {spec.id}: cannot parse block '{block}': {e}") from e
        for overrides in jobs:
            seed = int(next(o for o in overrides if o.startswith("seed=")).partition("=")[2])
            points.append(Point(overrides=overrides, seed=seed))
    return points
