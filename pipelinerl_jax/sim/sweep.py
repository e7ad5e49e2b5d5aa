"""The sampler/trainer split optimiser: simulate every split, keep the fastest one whose
staleness stays within a limit, and compare it with synchronous RL on the same devices.

For `devices` = N, each candidate gives `trainers` = n_t devices to the learner and the rest
(rounded down to whole engines) to sampling. A split is feasible when the learner can hold
the training state (`config.trainer_fits`) and its steady-state maximum start_lag is at most
`sweep.max_staleness`. Throughput is trained samples/s in steady state.

The best split is also stated in the run config's keys (`recommended`, `paste`): the first
`trainers` devices to the learner, the next `samplers` to `samplers / devices_per_engine`
rollout workers (pipelinerl_jax/resources.py splits them evenly), ready to paste into a
config for one host, e.g. `resources.learner_devices='0-3' resources.sampler_devices='4-7'`.
"""
from __future__ import annotations

import dataclasses

from pipelinerl_jax.config_checks import ConfigError, positive_int
from pipelinerl_jax.resources import format_indices
from pipelinerl_jax.sim.sim_config import accelerator, build_setup, model_spec, trainer_fits
from pipelinerl_jax.sim.pipeline import simulate


def sweep_split(cfg) -> dict:
    """Returns {'splits': [...], 'best': {...} | None, 'sync': {...}, 'speedup': float | None}."""
    base = build_setup(cfg, "async")  # validates everything but the split itself
    steps = positive_int(cfg, "sweep.steps")
    limit = positive_int(cfg, "sweep.max_staleness", allow_zero=True)
    n = base.devices
    candidates = list(cfg.sweep.trainers) or list(range(1, n))
    for t in candidates:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 < t < n:
            raise ConfigError("sweep.trainers", f"each entry must be an integer in [1, {n - 1}], got {t!r}")
    acc, model = accelerator(cfg), model_spec(cfg)
    base = dataclasses.replace(base, steps=steps, warmup_steps=min(base.warmup_steps, steps // 4),
                               trace_steps=0)
    rows = []
    for t in sorted(set(candidates)):
        samplers = (n - t) // base.tp * base.tp
        row = {"trainers": t, "samplers": samplers}
        if samplers == 0 or not trainer_fits(cfg, acc, model, t):
            row.update(feasible=False, reason="no sampler engine" if samplers == 0
                       else "training state does not fit")
            rows.append(row)
            continue
        s = simulate(dataclasses.replace(base, samplers=samplers, trainers=t)).summary()
        row.update(samples_per_s=s["samples_per_s"], tokens_per_s=s["tokens_per_s"],
                   step_time_s=s["step_time_s"], max_staleness=s["start_lag_max_steady"],
                   mean_staleness=s["start_lag"]["mean"], sampler_occupancy=s["sampler_occupancy"],
                   learner_idle_fraction=s["learner_idle_fraction"],
                   dropped=s["counters"]["dropped"])
        row["feasible"] = row["max_staleness"] <= limit
        if not row["feasible"]:
            row["reason"] = f"max staleness {row['max_staleness']} > {limit}"
        rows.append(row)
    ok = [r for r in rows if r["feasible"]]
    best = max(ok, key=lambda r: r["samples_per_s"]) if ok else None
    sync = {}
    if trainer_fits(cfg, acc, model, n):
        s = simulate(dataclasses.replace(base, mode="sync", max_lag=None)).summary()
        sync = {"samples_per_s": s["samples_per_s"], "step_time_s": s["step_time_s"]}
    speedup = best["samples_per_s"] / sync["samples_per_s"] if best and sync else None
    keys = split_keys(best["trainers"], best["samplers"], base.tp) if best else None
    return {"devices": n, "max_staleness": limit, "steps": steps, "splits": rows, "best": best,
            "sync": sync, "speedup_over_sync": speedup, "recommended": keys,
            "paste": paste(keys) if keys else None}


def split_keys(trainers: int, samplers: int, devices_per_engine: int = 1) -> dict:
    """A split as run-config keys: learner on devices [0, trainers), samplers on the next
    `samplers`, one rollout worker per engine."""
    return {"resources.learner_devices": format_indices(range(trainers)),
            "resources.sampler_devices": format_indices(range(trainers, trainers + samplers)),
            "rollout.num_workers": samplers // devices_per_engine}


def paste(keys: dict) -> str:
    """`keys` as one line for a config file or, with `--config.` before each, a command line."""
    return " ".join(f"{k}={v!r}" for k, v in keys.items())
