"""Simulator speed: 1,000 learner steps of a 64-device async configuration (512 prompts x 16
samples per step, `configs/sim/bench64.py`), and the full sampler/trainer split sweep.

  PYTHONPATH=. python scripts/bench_sim.py [--steps=1000] [--repeats=3]

Prints one JSON line. Wall times are best of `repeats` (the CPU may be shared); CPU times are
process time of the same runs.
"""
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

from absl import app, flags  # noqa: E402

from configs.sim import bench64  # noqa: E402
from pipelinerl_jax.sim.sim_config import build_setup  # noqa: E402
from pipelinerl_jax.sim.pipeline import simulate  # noqa: E402
from pipelinerl_jax.sim.sweep import sweep_split  # noqa: E402

_STEPS = flags.DEFINE_integer("steps", 1000, "Learner steps of the async run.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repetitions (best is reported).")
_SWEEP_STEPS = flags.DEFINE_integer("sweep_steps", 100, "Learner steps per split in the sweep.")


def _timed(fn, repeats):
    best_wall = best_cpu = float("inf")
    out = None
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        best_wall = min(best_wall, time.perf_counter() - w)
        best_cpu = min(best_cpu, time.process_time() - c)
    return out, best_wall, best_cpu


def main(argv):
    del argv
    cfg = bench64.get_config()
    cfg.steps = _STEPS.value
    setup = build_setup(cfg)
    result, wall, cpu = _timed(lambda: simulate(setup), _REPEATS.value)
    s = result.summary()
    sweep_cfg = bench64.get_config("sweep")
    sweep_cfg.sweep.steps = _SWEEP_STEPS.value
    sweep, sweep_wall, sweep_cpu = _timed(lambda: sweep_split(sweep_cfg), 1)
    simulated = sum(1 for r in sweep["splits"] if "samples_per_s" in r)
    print(json.dumps({
        "bench": "sim", "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
        "async_steps": setup.steps, "samples_per_step": setup.batch_size * setup.group_size,
        "devices": setup.devices, "split": f"{setup.samplers}/{setup.trainers}",
        "async_wall_s": round(wall, 3), "async_cpu_s": round(cpu, 3),
        "simulated_samples": s["counters"]["admitted"],
        "samples_per_wall_s": round(s["counters"]["admitted"] / wall),
        "sim_samples_per_s": round(s["samples_per_s"], 2),
        "sweep_splits": len(sweep["splits"]), "sweep_simulated": simulated,
        "sweep_steps_per_split": sweep["steps"], "sweep_wall_s": round(sweep_wall, 3),
        "sweep_cpu_s": round(sweep_cpu, 3),
        "sweep_best_trainers": sweep["best"]["trainers"] if sweep["best"] else None,
        "sweep_speedup_over_sync": round(sweep["speedup_over_sync"], 3)
        if sweep["speedup_over_sync"] else None,
    }))


if __name__ == "__main__":
    app.run(main)
