"""How to run an ablation grid fastest on this machine: the same runs one at a time (learner
and sampler on their own cores) vs two at a time (each run's processes pinned to one core),
with a warm XLA compilation cache, and the per-run overhead (wall-clock of a run minus its
learner's training time: process start-up, restore, shutdown).

  PYTHONPATH=. python scripts/bench_ablate.py --warm_start=runs/quick/warm_start/model \
      --xla_cache=runs/quick/xla_cache --steps=10

Prints one JSON line: wall seconds of each schedule, runs per hour and mean overhead per run.
The runs are lag-injected (lock-step), as in configs/ablate/staleness.py. Each schedule's grid
first runs the runner's compile warm-up (`--warmup_steps`, a throwaway copy of its first run),
so no timed run is charged for compiling; its seconds are reported apart and left out of the
schedule's wall time.
"""
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from configs.ablate import staleness  # noqa: E402
from pipelinerl_jax.ablation import results, runner  # noqa: E402

_WARM = flags.DEFINE_string("warm_start", None, "Warm-start model directory.", required=True)
_CACHE = flags.DEFINE_string("xla_cache", "", "XLA cache to use (warm it first for a fair "
                             "comparison); '' = a fresh one per schedule.")
_STEPS = flags.DEFINE_integer("steps", 10, "Learner steps per run.")
_RUNS = flags.DEFINE_integer("runs", 2, "Runs per schedule (seeds of one cell).")
_WARMUP = flags.DEFINE_integer("warmup_steps", None, "Steps of the untimed warm-up run of each "
                               "grid (default --steps; 0: none).")


def _grid(parallel: int):
    c = staleness.get_config("quick")
    c.runner.mode = "pipeline"  # this bench times the pipeline's schedules (quick: in-process)
    c.experiment.warm_start.checkpoint = _WARM.value
    c.experiment.learner.total_steps = _STEPS.value
    c.experiment.learner.eval_every = 0
    c.axes.loss.only = "ppo"
    c.axes.lag.levels = (4,)
    c.axes.seed.levels = tuple(range(_RUNS.value))
    c.runner.parallel = parallel
    c.runner.compilation_cache = _CACHE.value or "auto"
    c.runner.warmup_steps = _STEPS.value if _WARMUP.value is None else _WARMUP.value
    return c


def main(argv):
    del argv
    out = {"bench": "ablate", "machine": f"{os.uname().machine}, {os.cpu_count()} cpus",
           "load_avg_1m": os.getloadavg()[0], "steps_per_run": _STEPS.value,
           "runs": _RUNS.value}
    for parallel in (1, 2):
        d = tempfile.mkdtemp(prefix=f"bench_ablate_p{parallel}_")
        t0 = time.time()
        res = runner.run_grid(_grid(parallel), d, log=lambda m: None)
        wall = time.time() - t0 - res["warmup_s"]
        runs, _ = results.load_runs([os.path.join(d, "runs")])
        train = [r.rows[-1]["wall_time_s"] for r in runs]
        per_run = [json.load(open(os.path.join(r.path, "status.json")))["seconds"] for r in runs]
        out[f"parallel{parallel}_wall_s"] = round(wall, 1)
        out[f"parallel{parallel}_warmup_s"] = round(res["warmup_s"], 1)
        out[f"parallel{parallel}_runs_per_hour"] = round(3600 * len(runs) / wall, 1)
        out[f"parallel{parallel}_learner_s_per_step"] = round(
            sum(train) / (len(runs) * _STEPS.value), 2)
        out[f"parallel{parallel}_overhead_s_per_run"] = round(
            sum(p - t for p, t in zip(per_run, train)) / len(runs), 1)
        out[f"parallel{parallel}_failed"] = len(res["failed"])
        shutil.rmtree(d, ignore_errors=True)
    out["speedup_parallel2"] = round(out["parallel1_wall_s"] / out["parallel2_wall_s"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
