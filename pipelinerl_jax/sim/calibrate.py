"""Calibrate the simulator from a real run directory and compare its predictions.

Reads the run-directory schema of `docs/metrics.md`:
  samples.jsonl       `response_length` of every trained sample -> empirical lengths;
  engine_stats.jsonl  `active_slots`, `num_slots`, `tokens_per_s`, `decode_step_time_s` per
                      report -> decode step time vs running sequences, fitted as
                      t = a + b·active (least squares; `decode_step_time_s` where reported,
                      else active / tokens_per_s); engines = distinct `engine_id`;
  metrics.jsonl       `learner/step_time_s` vs `learner/tokens` -> t = c + d·tokens;
                      median `weight_sync/time_s`; and the measured figures below;
  config.json         the pipeline's `learner.batch_groups`, `rollout.group_size`, `max_lag`,
                      `mode` (the sim's own `train.*` names are accepted too; a key found
                      nowhere is inferred from samples.jsonl or left to the sim config).

Then simulates the run with those pieces (DecodeLatency with p = 1, i.e. linear, and a
learner on one "device" whose time per token is the fitted d) and reports, predicted vs
measured over the steady state: sampler occupancy, learner idle fraction, step time, mean
token lag and mean start_lag.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os

import numpy as np

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.sim.sim_config import build_setup, default_config
from pipelinerl_jax.sim.latency import DecodeLatency, TrainTime
from pipelinerl_jax.sim.lengths import Empirical
from pipelinerl_jax.sim.pipeline import MODES, simulate


def _jsonl(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not JSON ({e})") from None
    return rows


def _find(tree, key):
    """First value stored under `key` anywhere in a nested dict (depth-first)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        for v in tree.values():
            got = _find(v, key)
            if got is not None:
                return got
    return None


def _lookup(tree, paths, generic=None):
    """The value at the first dotted path present in `tree`, else the first `generic` key
    found anywhere in it, else None."""
    for path in paths:
        node = tree
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            return node
    return _find(tree, generic) if generic else None


def _column(rows, key):
    return np.asarray([r[key] for r in rows if r.get(key) is not None], np.float64)


def _fit_line(x, y):
    """Least-squares (intercept, slope); slope 0 when x does not vary."""
    if x.size == 0:
        raise ValueError("nothing to fit")
    if np.ptp(x) == 0:
        return float(y.mean()), 0.0
    slope, icpt = np.polyfit(x, y, 1)
    return float(icpt), float(slope)


@dataclasses.dataclass
class RunMeasurements:
    lengths: np.ndarray
    engines: int
    slots: int
    decode_fit: tuple  # (a, b): step time = a + b·active sequences
    train_fit: tuple  # (c, d): step time = c + d·tokens
    weight_sync_s: float
    batch_size: int  # groups per step
    group_size: int
    prompt_len: int
    mode: str
    max_lag: int | None
    steps: int
    measured: dict  # steady-state figures of the run


def read_run(run_dir: str, warmup_fraction: float = 0.1) -> RunMeasurements:
    """Reads and fits a run directory; raises FileNotFoundError / ValueError on bad input."""
    metrics = _jsonl(os.path.join(run_dir, "metrics.jsonl"))
    samples = [r for path in sorted(glob.glob(os.path.join(run_dir, "samples*.jsonl")))
               for r in _jsonl(path)]  # samples.jsonl, or one samples.w<i>.jsonl per worker
    stats = _jsonl(os.path.join(run_dir, "engine_stats.jsonl"))
    cfg_path = os.path.join(run_dir, "config.json")
    run_cfg = json.load(open(cfg_path, encoding="utf-8")) if os.path.exists(cfg_path) else {}
    if not metrics or not samples or not stats:
        raise ValueError(f"{run_dir}: metrics.jsonl, samples.jsonl and engine_stats.jsonl must be non-empty")

    lengths = _column(samples, "response_length")
    engines = len({r.get("engine_id", "") for r in stats})
    slots = int(max(r["num_slots"] for r in stats))
    # Reports while an engine still runs its first weights are dominated by compiling (each
    # decode bucket compiles on first use: 100-150 ms steps at 64 sequences against ~5 ms
    # later, measured here); at full occupancy they have the most leverage on the line, so
    # they are left out whenever the engine reported after a weight update too.
    first = {}
    for r in stats:
        first.setdefault(r.get("engine_id", ""), r.get("version", 0))
    later = [r for r in stats if r.get("version", 0) != first[r.get("engine_id", "")]]
    fit_stats = [r for r in later if r.get("active_slots", 0) > 0] or \
        [r for r in stats if r.get("active_slots", 0) > 0]
    step_t = np.asarray([r["decode_step_time_s"] if r.get("decode_step_time_s")
                         else r["active_slots"] / r["tokens_per_s"]
                         for r in fit_stats], np.float64)
    decode_fit = _fit_line(_column(fit_stats, "active_slots"), step_t)
    trained = [r for r in metrics if r.get("learner/tokens") is not None
               and r.get("learner/step_time_s") is not None]
    trained = trained[1:] if len(trained) > 3 else trained  # the first step compiles
    train_fit = _fit_line(_column(trained, "learner/tokens"), _column(trained, "learner/step_time_s"))
    sync = _column(metrics, "weight_sync/time_s")

    group = int(_lookup(run_cfg, ["rollout.group_size", "train.group_size"], "group_size") or 1)
    batch = _lookup(run_cfg, ["learner.batch_groups", "train.batch_size"], "batch_groups")
    if not batch:
        per_step = np.bincount(np.asarray([int(r["step"]) for r in samples]))
        batch = int(np.median(per_step[per_step > 0]) // group)
    batch = int(batch)
    mode = _lookup(run_cfg, ["mode"])
    max_lag = _lookup(run_cfg, ["max_lag"])
    prompt_len = _lookup(run_cfg, ["rollout.prompt_len", "task.prompt_len"], "prompt_len")

    n = len(metrics)
    w = min(int(n * warmup_fraction), n - 2) if n > 2 else 0
    steady = metrics[w:]
    wall = _column(metrics, "wall_time_s")
    busy = sum(r.get("learner/step_time_s", 0) + r.get("weight_sync/time_s", 0) for r in steady)
    span = wall[-1] - (wall[w - 1] if w > 0 else 0.0)
    measured = {
        "sampler_occupancy": float(np.mean(_column(steady, "sampler/occupancy")))
        if any("sampler/occupancy" in r for r in steady) else float(np.mean(_column(stats, "occupancy"))),
        "learner_idle_fraction": float(max(0.0, 1.0 - busy / span)) if span > 0 else float("nan"),
        "step_time_s": float(span / max(n - w, 1)),
        "lag_mean": float(np.mean(_column(steady, "lag/mean"))) if any("lag/mean" in r for r in steady) else None,
        "start_lag_mean": float(np.mean(_column(steady, "start_lag/mean")))
        if any("start_lag/mean" in r for r in steady) else float(np.mean(_column(samples, "start_lag"))),
    }
    return RunMeasurements(
        lengths=lengths, engines=engines, slots=slots, decode_fit=decode_fit, train_fit=train_fit,
        weight_sync_s=float(np.median(sync)) if sync.size else 0.0, batch_size=batch,
        group_size=group, prompt_len=int(prompt_len or 0),
        mode=mode if mode in MODES else "async",
        max_lag=int(max_lag) if max_lag is not None else None, steps=n, measured=measured)


def embedded_cpu_base(max_new_tokens: int, series_dt_s=None):
    """The simulator setting of this repo's embedded pipeline on a 2-core CPU (one sampler
    core, one learner core, the tiny model): the base that `calibrated_setup` refits from a
    run's logs. `max_new_tokens` bounds the simulated lengths; `series_dt_s` sets the time
    step of the occupancy series (None: the default)."""
    c = default_config()
    c.hardware.preset, c.model.preset = "cpu", "tiny"
    c.devices, c.split.samplers, c.split.trainers = 2, 1, 1
    c.rollout.max_new_tokens = max_new_tokens
    if series_dt_s is not None:
        c.output.series_dt_s = series_dt_s
    c.output.trace_steps = 0
    return build_setup(c)


def calibrated_setup(m: RunMeasurements, base):
    """A SimSetup reproducing the run: `base` (a SimSetup) supplies what the run lacks."""
    a, b = m.decode_fit
    c, d = m.train_fit
    decode = DecodeLatency(mem_fixed_s=max(a, 0.0), mem_per_ctx_s=0.0, cmp_per_seq_s=max(b, 0.0),
                           cmp_per_ctx_s=0.0, sharpness=1.0)
    max_len = int(m.lengths.max())
    # The simulator charges the learner for prompt tokens too; the fit's intercept already
    # holds them (every step trains batch_size x group_size prompts), so take them out.
    fixed = max(c - d * m.batch_size * m.group_size * m.prompt_len, 0.0)
    return dataclasses.replace(
        base, mode=m.mode, steps=m.steps, samplers=m.engines, trainers=1, tp=1,
        devices=m.engines + 1, slots=m.slots, decode=decode,
        train=TrainTime(fixed, max(d, 0.0)), lengths=Empirical(m.lengths, max_len),
        prompt_len=m.prompt_len, group_size=m.group_size, batch_size=m.batch_size,
        max_lag=m.max_lag if m.mode == "async" else None, weight_sync_s=m.weight_sync_s,
        warmup_steps=min(max(m.steps // 10, 0), m.steps - 1), trace_steps=0,
        kv_capacity_tokens=math.inf)


def calibrate(run_dir: str, base) -> dict:
    """Predicted vs measured for the run in `run_dir`; `base` is a SimSetup for the rest."""
    try:
        m = read_run(run_dir)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError("calibrate_from", f"cannot read run directory {run_dir!r}: {e}") from None
    s = calibrated_setup(m, base)
    pred = simulate(s).summary()
    predicted = {"sampler_occupancy": pred["sampler_occupancy"],
                 "learner_idle_fraction": pred["learner_idle_fraction"],
                 "step_time_s": pred["step_time_s"], "lag_mean": pred["lag_mean_steady"],
                 "start_lag_mean": pred["start_lag_mean_steady"]}
    rel = {k: (predicted[k] - v) / abs(v) if v not in (None, 0) else None
           for k, v in m.measured.items()}
    return {"run_dir": os.path.abspath(run_dir), "mode": m.mode, "steps": m.steps,
            "fit": {"decode_step_s": {"a": m.decode_fit[0], "b_per_seq": m.decode_fit[1]},
                    "train_step_s": {"c": m.train_fit[0], "d_per_token": m.train_fit[1]},
                    "weight_sync_s": m.weight_sync_s, "engines": m.engines,
                    "slots_per_engine": m.slots, "batch_size": m.batch_size,
                    "group_size": m.group_size, "response_length_mean": float(m.lengths.mean())},
            "measured": m.measured, "predicted": predicted, "relative_error": rel}
