"""What `experiments/simulate.py` does: one simulation, a split sweep, or a calibration,
each writing `WORKDIR/summary.json` and a plot (a simulation also writes series.csv,
steps.csv and, when synchronous, sync_completion.csv)."""
from __future__ import annotations

import json
import os

import numpy as np

from pipelinerl_jax.config_checks import one_of
from pipelinerl_jax.sim import plots
from pipelinerl_jax.sim.calibrate import calibrate
from pipelinerl_jax.sim.sim_config import build_setup
from pipelinerl_jax.sim.pipeline import MODES, simulate
from pipelinerl_jax.sim.sweep import sweep_split


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not np.isfinite(x):
        return str(x)
    return x


def _write_tables(result, workdir):
    """series.csv (per time bin, per device averages), steps.csv (per learner step) and, for
    sync/one_step, sync_completion.csv (seconds from step start to each sample's finish)."""
    r = plots.rates(result)
    cols = ("t", "tokens_per_s", "batch", "occupancy", "learner_busy")
    np.savetxt(os.path.join(workdir, "series.csv"), np.column_stack([r[c] for c in cols]),
               delimiter=",", header="time_s,gen_tokens_per_s,batch_per_engine,"
               "sampler_occupancy,learner_busy_fraction", comments="", fmt="%.6g")
    st = result.steps
    names = list(st)
    np.savetxt(os.path.join(workdir, "steps.csv"), np.column_stack([st[n] for n in names]),
               delimiter=",", header=",".join(names), comments="", fmt="%.6g")
    if result.sync_completion:
        rows = [(k, t) for k, ts in enumerate(result.sync_completion) for t in ts]
        np.savetxt(os.path.join(workdir, "sync_completion.csv"), np.asarray(rows),
                   delimiter=",", header="step,seconds", comments="", fmt="%.6g")


def _sweep_line(out: dict) -> str:
    b = out["best"]
    if b is None:
        return (f"no split of {out['devices']} devices keeps staleness within "
                f"{out['max_staleness']}")
    vs = f", {out['speedup_over_sync']:.2f}x sync" if out["speedup_over_sync"] else ""
    return (f"best split: {b['trainers']} learner + {b['samplers']} sampler devices "
            f"({b['samples_per_s']:.3g} samples/s{vs}); paste into a config: {out['paste']}")


def run(cfg, workdir: str) -> dict:
    """Runs what `cfg` asks for; validates first, so a bad config fails before any work."""
    mode = one_of(cfg, "mode", MODES + ("sweep",))
    base = build_setup(cfg)
    os.makedirs(workdir, exist_ok=True)
    want_plots = bool(cfg.output.plots)
    if cfg.calibrate_from:
        out = {"kind": "calibration", **calibrate(cfg.calibrate_from, base)}
        if want_plots:
            plots.plot_calibration(out, os.path.join(workdir, "calibration.png"))
    elif mode == "sweep":
        out = {"kind": "sweep", **sweep_split(cfg)}
        if want_plots:
            plots.plot_sweep(out, os.path.join(workdir, "sweep.png"))
        print(_sweep_line(out), flush=True)
    else:
        result = simulate(base)
        out = {"kind": "simulation", **result.summary()}
        _write_tables(result, workdir)
        if want_plots:
            plots.plot_run(result, os.path.join(workdir, "run.png"))
    out["config"] = json.loads(cfg.to_json_best_effort())
    with open(os.path.join(workdir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(_jsonable(out), f, indent=1)
    return out
