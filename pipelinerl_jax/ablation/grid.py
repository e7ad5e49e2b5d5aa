"""An ablation grid: a base experiment config, axes to vary, and their product as runs.

An ablation config (`configs/ablate/*.py`) is a `ConfigDict` built from `ablation_config()`:

    c = ablation_config(default.get_config())          # c.experiment: the base run config
    c.axes.loss = variants(("reinforce", {"loss": {"name": "reinforce"}}),
                           ("tis", {"loss": {"name": "tis", "cap": 2.0}}))
    c.axes.lag = sweep("lag_injection.k", (0, 2, 8), also=("lag_injection.max_k",))
    c.axes.seed = sweep("seed", (0, 1))

An axis is either a `sweep` (one dotted key, plus the `also` keys set to the same value, takes
each of `levels`) or named `variants` (each label applies a nested dict of overrides, for
changes that go together: a loss and its hyperparameters, `mode=sync` with `max_lag=0`).
`--config.axes.<axis>.only=a,b` keeps some levels, by label (a sweep's labels are its
values as text); `--config.axes.lag.levels=(0,8)` replaces a sweep's levels.

`expand(c)` returns one `RunSpec` per point of the product of the axes, in a deterministic
order, and refuses a grid whose runs would not share the warm start (`SHARED_SECTIONS`) or the
held-out evaluation set (`EVAL_KEYS`: the same problems in every cell, whatever its seed). A
run is named from its labels (`lag=8,loss=tis,seed=0`) and its directory is that name with
filesystem-safe characters. The seed axis (`c.seed_axis`) is the one the summary
averages over: a *cell* is a run's labels without it.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Dict, List, Sequence, Tuple

import ml_collections

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.config_checks import get as config_get


# Sections every run must share: they decide what the one shared warm start is.
SHARED_SECTIONS = ("model", "tokenizer", "task", "warm_start")
# Keys every run must share so that every cell is evaluated on the same held-out problems
# (with the task section, which fixes them: a task's eval problems never depend on the seed).
EVAL_KEYS = ("learner.eval_size",)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    name: str  # "lag=8,loss=tis,seed=0" (axes in sorted order)
    dirname: str  # filesystem-safe form of name
    labels: Dict[str, str]  # axis -> level label
    cell: str  # name without the seed axis
    config: ml_collections.ConfigDict  # the full experiment config of this run


def sweep(key: str, levels: Sequence, also: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """An axis setting `key` (and every key in `also`) to each value of `levels`."""
    return ml_collections.ConfigDict(dict(kind="sweep", key=key, also=tuple(also),
                                          levels=tuple(levels), only=""))


def variants(*pairs: Tuple[str, dict]) -> ml_collections.ConfigDict:
    """An axis of named override sets: `variants(("sync", {"mode": "sync"}), ...)`.

    `order` keeps the given order (a ConfigDict sorts its keys)."""
    labels = [label for label, _ in pairs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"duplicate variant labels in {labels}")
    return ml_collections.ConfigDict(dict(kind="variants", order=tuple(labels),
                                          levels={label: dict(o) for label, o in pairs},
                                          only=""))


def ablation_config(experiment: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The sections of an ablation config around `experiment` (the base run config)."""
    c = ml_collections.ConfigDict()
    c.experiment = experiment
    c.axes = ml_collections.ConfigDict()
    c.seed_axis = "seed"
    c.runner = ml_collections.ConfigDict(dict(
        # 'pipeline': each run launches its queue, learner, worker and evaluator processes
        # (launch/launcher.py); 'inprocess': a lag-injected run in one process, the same parts
        # wired in memory (launch/inprocess.py), several times cheaper
        mode="pipeline",
        parallel=1,  # runs at once
        pin=True,  # with parallel > 1: run i's processes all share core set i (see split_cores)
        cores="",  # cores to use, e.g. "0-1"; "" = this process's affinity
        run_timeout_s=3600.0,  # a run still going after this is stopped and marked failed
        compilation_cache="auto",  # XLA persistent cache: 'auto' = WORKDIR/xla_cache, '' = off
        warmup_steps=0,  # > 0: a throwaway run of the first run first, to fill the XLA cache
        warm_start_timeout_s=7200.0,
        # Folders of committed tables (results.export_tables; comma-separated): a run of this
        # grid found finished there is not run again. A grid that takes several sittings keeps
        # its finished runs in git, not in a workdir that may not outlive the machine.
        finished_tables="",
    ))
    c.analysis = ml_collections.ConfigDict(dict(
        target_accuracy=0.4,  # time-to-target: first eval at or above this
        collapse_ratio=0.5,  # collapse: an eval below this x the step-0 eval accuracy ...
        collapse_min_accuracy=0.05,  # ... when the step-0 accuracy is at least this
        kl_spike=0.5,  # an instability event: loss/kl_k3 above this (nats per token)
    ))
    return c


# ---------------------------------------------------------------------------- checking

def axis_labels(axis_name: str, axis) -> List[str]:
    if axis.kind == "sweep":
        labels = [_label(v) for v in axis.levels]
    elif axis.kind == "variants":
        labels = list(axis.order)
        missing = set(labels) ^ set(axis.levels.keys())
        if missing:
            raise ConfigError(f"axes.{axis_name}.order", f"must list exactly the labels of "
                              f"axes.{axis_name}.levels; differs in {sorted(missing)}")
    else:
        raise ConfigError(f"axes.{axis_name}.kind", f"must be 'sweep' or 'variants', got "
                          f"{axis.kind!r}")
    if not labels:
        raise ConfigError(f"axes.{axis_name}.levels", "is empty")
    if len(set(labels)) != len(labels):
        raise ConfigError(f"axes.{axis_name}.levels", f"has duplicate labels {labels}")
    return labels


def _label(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _selected(axis_name: str, axis) -> List[Tuple[str, object]]:
    """[(label, level)] after `only`."""
    labels = axis_labels(axis_name, axis)
    levels = list(axis.levels) if axis.kind == "sweep" else [axis.levels[k] for k in labels]
    pairs = list(zip(labels, levels))
    if axis.only:
        keep = [s.strip() for s in str(axis.only).split(",") if s.strip()]
        unknown = [k for k in keep if k not in labels]
        if unknown:
            raise ConfigError(f"axes.{axis_name}.only", f"unknown level(s) {unknown}; "
                              f"valid: {labels}")
        pairs = [p for p in pairs if p[0] in keep]
    return pairs


def _set(cfg, key: str, value, where: str) -> None:
    node, parts = cfg, key.split(".")
    for part in parts[:-1]:
        if part not in node:
            raise ConfigError(where, f"sets {key!r}, but the experiment config has no "
                                     f"section {part!r}")
        node = node[part]
    if parts[-1] not in node:
        raise ConfigError(where, f"sets {key!r}, which is not a key of the experiment config")
    with node.ignore_type():  # e.g. a float level for an int-typed default
        node[parts[-1]] = value


def _apply(cfg, overrides: dict, where: str, prefix: str = "") -> None:
    for k, v in overrides.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) or isinstance(v, ml_collections.ConfigDict):
            _apply(cfg, dict(v), where, key + ".")
        else:
            _set(cfg, key, v, where)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9=.,_+-]", "_", name)


def expand(c: ml_collections.ConfigDict) -> List[RunSpec]:
    """Every run of the grid; raises ConfigError naming the axis key that is wrong.

    Each run's experiment config is validated (`run_config.validate`) here, so a grid with a
    bad point fails before anything starts."""
    from pipelinerl_jax import run_config  # heavy (engines, JAX): configs import grid
    if not c.axes.keys():
        raise ConfigError("axes", "no axes: an ablation needs at least one (e.g. seed)")
    names = sorted(c.axes.keys())
    if c.seed_axis and c.seed_axis not in names:
        raise ConfigError("seed_axis", f"{c.seed_axis!r} is not an axis; axes: {names}")
    choices = [_selected(n, c.axes[n]) for n in names]
    runs, seen = [], set()
    for point in itertools.product(*choices):
        cfg = ml_collections.ConfigDict(c.experiment.to_dict())
        labels = {}
        for axis_name, (label, level) in zip(names, point):
            axis = c.axes[axis_name]
            labels[axis_name] = label
            where = f"axes.{axis_name}"
            if axis.kind == "sweep":
                for key in (axis.key, *axis.also):
                    _set(cfg, key, level, where)
            else:
                _apply(cfg, dict(level), f"{where}.levels.{label}")
        name = ",".join(f"{n}={labels[n]}" for n in names)
        cell = ",".join(f"{n}={labels[n]}" for n in names if n != c.seed_axis) or "all"
        for sec in SHARED_SECTIONS:
            if cfg[sec].to_dict() != c.experiment[sec].to_dict():
                raise ConfigError("axes", f"run {name} changes the {sec!r} section, but every "
                                  f"run starts from one shared warm start; run a grid per {sec}")
        for key in EVAL_KEYS:
            value, base = config_get(cfg, key), config_get(c.experiment, key)
            if value != base:
                raise ConfigError(key, f"run {name} evaluates on {value!r} where the grid's "
                                       f"experiment has {base!r}: every cell of a grid must be "
                                       f"evaluated on the same held-out set; set it in "
                                       f"experiment, not on an axis")
        try:
            run_config.validate(cfg)
        except ConfigError as e:
            raise ConfigError(f"experiment.{e.key}", f"(run {name}) {e}") from None
        dirname = _safe(name)
        if dirname in seen:
            raise ConfigError("axes", f"two runs map to the directory {dirname!r}")
        seen.add(dirname)
        runs.append(RunSpec(name, dirname, labels, cell, cfg))
    return runs
