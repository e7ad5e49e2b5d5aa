"""The sampler/trainer split optimiser: simulate every split, keep the fastest one whose
staleness stays within a limit, and compare it with synchronous RL on the same devices.

For `devices` = N, each candidate gives `trainers` = n_t devices to the learner and the rest
(rounded down to whole engines) to sampling. A split is feasible when the learner can hold
the training state (`config.trainer_fits`) and its steady-state maximum start_lag is at most
`sweep.max_staleness`. Throughput is trained samples/s in steady state.
"""
from __future__ import annotations

import dataclasses

from pipelinerl_jax.config import ConfigError, positive_int
from pipelinerl_jax.sim.config import accelerator, build_setup, model_spec, trainer_fits
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
    return {"devices": n, "max_staleness": limit, "steps": steps, "splits": rows, "best": best,
            "sync": sync, "speedup_over_sync": speedup}
