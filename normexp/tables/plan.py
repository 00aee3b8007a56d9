"""From a table spec and a scale to the runs it needs, and which of them already have a record.

Each point is composed exactly as its job will be; its resolved config names the run's directory
(``normexp.tracking.run_dir``), and a record there that ended ``completed`` or ``diverged`` makes the point
done -- whichever table or command ran it. Points that compose to the same config share one run.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..errors import UserError
from ..preflight import validate
from ..tracking.lock import read_owner
from ..tracking.provenance import config_hash
from ..tracking.records import DONE, Record, load_record
from ..tracking.run_dir import RUN_LINK, TABLE_LINK, run_dir
from .spec import Point, Scale, TableSpec, expand_blocks, get_path

log = logging.getLogger(__name__)

ComposeFn = Callable[[list[str]], DictConfig]
SOURCE_DIVERGED = "source diverged"  # the run it starts from diverged: nothing to start from, a result


@dataclass
class PlannedRun:
    """One run a table needs: the overrides it is launched with and the points (rows x seeds) it serves.

    ``blocked``: why it cannot run yet (a run it starts from, e.g. a pretrained backbone, has no result);
    ``needs``: the table that run is in (``table run`` runs that table first). ``source_diverged``: the
    run it starts from diverged (``diverged@<step>``): a result, so this one is never launched and its
    cells say so.
    A ``damaged`` record is shown as such and never launched again over: its directory is the user's to
    repair or move away.
    """

    run_id: str
    overrides: list[str]
    config: dict[str, Any]
    dir: Path  # where its record is (normexp.tracking.run_dir)
    points: list[Point] = field(default_factory=list)
    record: Record | None = None
    blocked: str | None = None
    needs: str | None = None
    source_diverged: str | None = None

    @property
    def status(self) -> str:
        if self.record:
            return self.record.status
        if self.source_diverged:
            return SOURCE_DIVERGED
        return "blocked" if self.blocked else "missing"

    @property
    def done(self) -> bool:
        return self.status in (*DONE, SOURCE_DIVERGED)

    @property
    def damaged(self) -> bool:
        return self.status == "damaged"

    @property
    def live(self) -> bool:
        """Running in a live process (this planner's or another's): neither launched again nor a result."""
        return self.status == "running"

    def owner(self) -> str:
        found = read_owner(self.record.dir) if self.record is not None else None
        return found.describe() if found is not None else "a live process"

    @property
    def dir_name(self) -> str:
        return self.dir.name

    def read_record(self) -> None:
        """The record in its directory, if there is one (a damaged one: shown as such, never run over)."""
        has_record = (self.dir / "summary.json").is_file()
        self.record = load_record(self.dir, with_config=True) if has_record else None


@dataclass
class TablePlan:
    spec: TableSpec
    scale: Scale
    seeds: tuple[int, ...]
    runs: list[PlannedRun]

    @property
    def points(self) -> list[tuple[Point, PlannedRun]]:
        return [(p, r) for r in self.runs for p in r.points]

    def to_run(self) -> list[PlannedRun]:
        return [r for r in self.runs if not r.done and not r.live and not r.blocked and not r.damaged]

    def blocked(self) -> list[PlannedRun]:
        return [r for r in self.runs if not r.done and not r.live and r.blocked]

    def damaged(self) -> list[PlannedRun]:
        return [r for r in self.runs if r.damaged]

    def refresh(self) -> None:
        """Read the runs' records again (after a launch, or a wait for another process): same runs, new
        statuses."""
        for run in self.runs:
            run.read_record()

    def busy(self) -> list[PlannedRun]:
        """The runs another process is running now (another planner, a SLURM job): waited for."""
        return [r for r in self.runs if r.live]

    def run_name(self, run: PlannedRun) -> str:
        """What dashboards call ``run``: ``<table>/<its row labels>/s<seed>``, e.g.
        ``dyt_squash/ViT-S/tanh/s0``, ``.../lr_factor=0.5/s0`` in a ``best_of`` table (a label that differs
        between the rows one run serves lists them all: ``ViT-S,ViT-B``)."""
        labels = [",".join(dict.fromkeys(self.spec.display(k, p.labels[k]) for p in run.points))
                  for k in self.spec.label_keys]
        if self.spec.best_of:  # the rows' sweep: one run per value
            labels.append(f"{self.spec.best_of.key.split('.')[-1]}={run.points[0].choice}")
        return "/".join([self.spec.id, *labels, f"s{run.points[0].seed}"])

    def dashboard_metric(self, run: PlannedRun) -> str | None:
        """The table's headline metric as dashboards name it (``final/val/top1``; ``final/ema/val/top1`` where
        the row reads the reported weights and the recipe reports the EMA's), or None for one that is not a
        final metric (``params``)."""
        from ..tasks import get_task

        task = get_task(run.config["task"]["name"])
        reported = task.metrics(run.config) if task.metrics else []
        metric = next((m for m in self.spec.metrics if m.delta), self.spec.metrics[0])
        weights = "ema/val/" if run.config["trainer"]["ema"]["reported"] else "val/"
        names = [p.removeprefix("metrics.final.") if p.startswith("metrics.final.")
                 else weights + p.removeprefix("metrics.reported.") for p in metric.value
                 if p.startswith(("metrics.final.", "metrics.reported."))]
        return next((f"final/{n}" for n in names if n in reported), None)

    def job_overrides(self, run: PlannedRun) -> list[str]:
        """The overrides of ``run``'s job: its settings, which table row it serves and what dashboards call
        it (``table.*`` is not part of the run's identity)."""
        point = run.points[0]
        marks = [f"+table.id={self.spec.id}", f"+table.scale={self.scale.name}",
                 f"+table.run_name={_override_value(self.run_name(run))}"]
        metric = self.dashboard_metric(run)
        marks += [f"+table.metric={_override_value(metric)}"] if metric else []
        marks += [f"+table.row.{k}={_override_value(v)}" for k, v in point.labels.items()]
        return [*run.overrides, *marks]


def _override_value(value: Any) -> str:
    """A label or path as a Hydra override value: quoted unless it is a plain ASCII word, number or path
    (Hydra's grammar takes no other character unquoted: ``str.isalnum`` is true of ``ü`` too)."""
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    plain = re.fullmatch(r"[A-Za-z0-9_./-]+", text) is not None
    return text if plain else "'" + text.replace("'", "\\'") + "'"


def resolved(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def plan_table(spec: TableSpec, scale: Scale, seeds: Iterable[int] | None, compose: ComposeFn,
               root: Path | None = None, extra: list[str] = (), prepare: bool = True) -> TablePlan:
    """Compose every point at paper scale (its labels) and at ``scale`` (its run), and find its record.

    ``extra``: overrides added to every run (after the scale's). ``prepare``: apply the task's own config
    preparation (a checkpoint's model for robustness, a pretrained backbone for detection) before hashing,
    as ``normexp.run`` does before it records.
    """
    seeds = tuple(seeds) if seeds else scale.seeds
    linked: dict[str, list[tuple[Point, PlannedRun]]] = {}
    runs: dict[str, PlannedRun] = {}
    for point in expand_blocks(spec, seeds):
        paper_cfg = _compose(compose, point.overrides, spec.id)
        point.task, point.backbone = paper_cfg.task.name, OmegaConf.select(paper_cfg, "backbone.name")
        point.labels = {key: OmegaConf.select(paper_cfg, key) for key in spec.label_keys}
        if spec.best_of:
            point.choice = OmegaConf.select(paper_cfg, spec.best_of.key)
            if point.choice is None:
                raise UserError(f"table {spec.id}: the block '{' '.join(point.overrides)}' sets no value of "
                                f"best_of.key {spec.best_of.key}: every block of a best_of table sweeps it")
        point.paper = resolved(paper_cfg)
        overrides = scale.apply(point.overrides, point.task) + list(extra)
        links = _resolve_links(overrides, point, spec, scale, seeds, compose, root, linked)
        overrides = links.overrides
        cfg = paper_cfg if overrides == point.overrides else _compose(compose, overrides, spec.id)
        earlier = None
        if prepare and not links.blocked and not links.source_diverged:
            cfg, earlier = _prepared(cfg, links.found)
        config = resolved(cfg)
        run_id = config_hash(config)
        if run_id not in runs:
            try:  # the config alone: its data may live on the machines that run it
                validate(cfg, environment=False)
            except UserError as e:
                raise UserError(f"table {spec.id}: the run {' '.join(overrides)} is invalid: {e}") from None
            runs[run_id] = PlannedRun(run_id, overrides, config, run_dir(config, root), blocked=links.blocked,
                                      needs=links.needs, source_diverged=links.source_diverged)
            runs[run_id].read_record()
            if runs[run_id].record is None and earlier is not None:
                _adopt_earlier(runs[run_id], earlier, root)
        runs[run_id].points.append(point)
    return TablePlan(spec, scale, seeds, list(runs.values()))


@dataclass
class Links:
    """A point's overrides with its ``table:<id>`` links made ``run:<run_id>``; ``found``: the directory of
    each linked run that has a result, by key; ``blocked``/``needs``/``source_diverged`` as
    :class:`PlannedRun`'s."""

    overrides: list[str]
    found: dict[str, Path] = field(default_factory=dict)
    blocked: str | None = None
    needs: str | None = None
    source_diverged: str | None = None


def _resolve_links(overrides: list[str], point: Point, spec: TableSpec, scale: Scale,
                   seeds: tuple[int, ...], compose: ComposeFn, root: Path | None,
                   linked: dict[str, list[tuple[Point, PlannedRun]]]) -> Links:
    """Replace ``key=table:<id>`` by ``key=run:<run_id>`` of that table's run of the same model and seed.

    ``task.pretrained=table:dtn_backbones`` starts a detector from the ImageNet run of ``dtn_backbones``
    whose config agrees with this point's on the spec's ``link_keys`` (at paper scale; by default the
    backbone and norm names; ``table.*`` keys a block sets, e.g. ``+table.method=mae``, tell apart runs of
    one model that start from different pre-trainings). The run id, not its directory, is in this run's
    identity: the same run on any output root, wherever it is mounted (the run finds its directory when it
    starts, :func:`normexp.tracking.run_dir.resolve_source`). Until that run has a result, the point is
    blocked; where it (or the run it starts from) diverged, there is nothing to start from.
    """
    links = Links([])
    keys = spec.link_keys
    for override in overrides:
        key, _, value = override.partition("=")
        value = value.replace("\\:", ":")  # Hydra's override grammar escapes ':' in the values it prints
        if not value.startswith(TABLE_LINK):
            links.overrides.append(override)
            continue
        other = value[len(TABLE_LINK):]
        if other not in linked:
            from .spec import load_table

            linked[other] = plan_table(load_table(other, spec.searchpath), scale, seeds, compose, root).points
        mine = {k: get_path(point.paper, k) for k in keys}
        match = next((run for p, run in linked[other] if p.seed == point.seed
                      and all(get_path(p.paper, k) == v for k, v in mine.items())), None)
        if match is None:
            raise UserError(f"{key}={value}: table {other} has no run with {mine} and seed {point.seed}")
        links.overrides.append(f"{key}={RUN_LINK}{match.run_id}")
        if match.status == "diverged":
            step = get_path(match.record.summary, "diverged.step")  # type: ignore[union-attr]
            links.source_diverged = f"diverged@{step}"
        elif match.source_diverged:
            links.source_diverged = match.source_diverged
        elif match.done and match.record is not None:
            links.found[key.lstrip("+~")] = match.record.dir
        else:
            links.blocked = f"needs table {other}'s run {match.dir_name} ({match.status})"
            links.needs = other
    return links


def _compose(compose: ComposeFn, overrides: list[str], table_id: str) -> DictConfig:
    try:
        return compose(overrides)
    except UserError:
        raise
    except Exception as e:  # Hydra's composition errors say which override or group is wrong
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"table {table_id}: overrides {' '.join(overrides)} do not compose: {first}") from e


def _prepared(cfg: DictConfig, found: dict[str, Path]) -> tuple[DictConfig, dict[str, Any] | None]:
    """``cfg`` as its task prepares it, with the runs it links (``run:<run_id>``) read from where this plan
    found them (its output root may not be the environment's); the links stay run ids, as in the job. Also
    the config as planners before ``run:<run_id>`` links recorded it (the linked directories in place of the
    ids; None when nothing is linked), so that their runs are still found."""
    from ..tasks import prepare_config

    located = copy.deepcopy(cfg)
    for key, directory in found.items():
        OmegaConf.update(located, key, str(directory))
    try:
        prepared = prepare_config(located)
    except UserError:  # the job will fail and record this, as a failed run of the config as given
        return cfg, None
    earlier = resolved(prepared) if found else None
    for key in found:
        OmegaConf.update(prepared, key, OmegaConf.select(cfg, key))
    return prepared, earlier


def _adopt_earlier(run: PlannedRun, earlier: dict[str, Any], root: Path | None) -> None:
    """Take the result of ``run`` as an earlier planner recorded it, under the linked run's directory rather
    than its id, when that record is finished: a fine-tune trained before is not trained again."""
    directory = run_dir(earlier, root)
    if (directory / "summary.json").is_file():
        record = load_record(directory, with_config=True)
        if record.status in DONE:
            run.run_id, run.dir, run.record = config_hash(earlier), directory, record


def is_hydra_override(override: str) -> bool:
    """An override of Hydra's own settings (``hydra.searchpath=``, ``hydra/launcher=``), not of the run's."""
    return override.lstrip("+~").startswith(("hydra.", "hydra/"))


def memoized(compose: ComposeFn) -> ComposeFn:
    """``compose`` run once per list of config-group choices; the overrides of values are then applied to a
    copy as Hydra applies them after composing (``ConfigLoaderImpl._apply_overrides_to_config``, hydra-core
    1.3), so a sweep over values (an lr, an alpha0) composes once. Hydra's own rule tells the two apart: an
    override is a group choice when its key names a config group of the search path."""
    composed: dict[tuple[str, ...], DictConfig] = {}

    def compose_once(overrides: list[str]) -> DictConfig:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl

        choices, values = split_overrides(overrides)
        key = tuple(choices)
        if key not in composed:
            composed[key] = compose(list(choices))
        cfg = copy.deepcopy(composed[key])
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        return cfg

    return compose_once


_REPOSITORIES: dict[tuple[str, ...], Any] = {}


def split_overrides(overrides: list[str]) -> tuple[list[str], list[Any]]:
    """(the overrides that shape the defaults list: group choices, deletions, Hydra's own; the parsed
    overrides of config values), as Hydra's ``defaults_list.Overrides`` splits them."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from .. import CONFIG_DIR

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    searchpath = tuple(o.input_line for o in parsed if o.is_hydra_override())
    if searchpath not in _REPOSITORIES:  # the repository a compose with these Hydra settings searches
        loader = ConfigLoaderImpl(create_config_search_path(str(CONFIG_DIR)))
        _, repository = loader._parse_overrides_and_create_caching_repo("train", list(searchpath))
        _REPOSITORIES[searchpath] = repository
    repository = _REPOSITORIES[searchpath]
    choices, values = [], []
    for override in parsed:
        group = repository.group_exists(override.key_or_group) and not isinstance(override.value(), dict)
        if group or override.is_hydra_override() or override.is_delete():
            choices.append(override.input_line)
        else:
            values.append(override)
    return choices, values


@contextmanager
def hydra_composer(hydra_overrides: Iterable[str] = ()) -> Iterator[ComposeFn]:
    """A compose function for ``configs/train.yaml`` that composes as the command line would: with
    ``hydra_overrides`` (e.g. ``hydra.searchpath=[file://<dir>/configs]``, where a user's own options are)
    before each job's, as Hydra's launchers compose a sweep's jobs."""
    from hydra import compose

    from ..code_defaults import config_tree

    first = list(hydra_overrides)
    compose_once = memoized(lambda overrides: compose(config_name="train", overrides=overrides))

    def compose_train(overrides: list[str]) -> DictConfig:
        return compose_once([*first, *overrides])

    with config_tree():
        yield compose_train
