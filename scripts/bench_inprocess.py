"""Seconds per staleness-grid run: the single-process lag-injected mode against the pipeline,
side by side on the same runs, and whether they trained the same thing.

  PYTHONPATH=. python scripts/bench_inprocess.py --warm_start=results/staleness_study/warm_start

Both schedules run the same seeds of one cell of configs/ablate/staleness.py (default ppo at
lag 4, 60 steps, evaluations every 20, as the study runs them), two at a time, each run
pinned to its own core (`runner.parallel=2`), with one shared, warmed XLA cache; each grid
first runs the runner's untimed compile warm-up. Per mode: wall seconds of the grid per run
(the study's cost of a run: two at a time on two cores), the mean seconds of one run, and of
them the learner's loop. Then `same_run.differences` of every pair of same-seed runs across
the two modes ([] = bit-identical batches, samples, metrics and evaluations).

Prints one JSON line.
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
from pipelinerl_jax.ablation.same_run import differences  # noqa: E402

_WARM = flags.DEFINE_string("warm_start", "results/staleness_study/warm_start",
                            "Warm-start model directory.")
_STEPS = flags.DEFINE_integer("steps", 60, "Learner steps per run.")
_RUNS = flags.DEFINE_integer("runs", 2, "Runs per mode (seeds of one cell).")
_LOSS = flags.DEFINE_string("loss", "ppo", "The cell's loss arm.")
_LAG = flags.DEFINE_integer("lag", 4, "The cell's injected lag.")
_KEEP = flags.DEFINE_string("keep", "", "Keep the grids in this folder (default: a temp dir, "
                            "removed).")


def _grid(mode: str, cache: str):
    c = staleness.get_config()
    c.experiment.warm_start.checkpoint = os.path.abspath(_WARM.value)
    c.experiment.learner.total_steps = _STEPS.value
    c.axes.loss.only = _LOSS.value
    c.axes.lag.levels = (_LAG.value,)
    c.axes.seed.levels = tuple(range(_RUNS.value))
    c.runner.mode = mode
    c.runner.parallel = 2
    c.runner.compilation_cache = cache
    c.runner.warmup_steps = 3
    return c


def main(argv):
    del argv
    root = _KEEP.value or tempfile.mkdtemp(prefix="bench_inprocess_")
    os.makedirs(root, exist_ok=True)
    cache = os.path.join(root, "xla_cache")
    out = {"bench": "inprocess", "machine": f"{os.uname().machine}, {os.cpu_count()} cpus",
           "load_avg_1m_start": round(os.getloadavg()[0], 1), "steps_per_run": _STEPS.value,
           "runs_per_mode": _RUNS.value, "cell": f"loss={_LOSS.value},lag={_LAG.value}"}
    dirs = {}
    for mode in ("pipeline", "inprocess"):
        d = dirs[mode] = os.path.join(root, mode)
        t0 = time.time()
        res = runner.run_grid(_grid(mode, cache), d, log=lambda m: None)
        wall = time.time() - t0 - res["warmup_s"]
        runs, _ = results.load_runs([os.path.join(d, "runs")])
        seconds = [json.load(open(os.path.join(r.path, "status.json")))["seconds"] for r in runs]
        learner = [r.rows[-1]["wall_time_s"] for r in runs]
        out[f"{mode}_grid_s_per_run"] = round(wall / len(runs), 1)
        out[f"{mode}_run_s_mean"] = round(sum(seconds) / len(runs), 1)
        out[f"{mode}_learner_loop_s_mean"] = round(sum(learner) / len(runs), 1)
        out[f"{mode}_warmup_s"] = round(res["warmup_s"], 1)
        out[f"{mode}_failed"] = len(res["failed"])
    out["speedup_grid_s_per_run"] = round(out["pipeline_grid_s_per_run"]
                                          / out["inprocess_grid_s_per_run"], 2)
    same = {}
    for name in sorted(os.listdir(os.path.join(dirs["pipeline"], "runs"))):
        diff = differences(os.path.join(dirs["pipeline"], "runs", name),
                           os.path.join(dirs["inprocess"], "runs", name), limit=5)
        same[name] = diff
    out["identical_runs"] = sum(not d for d in same.values())
    out["differences"] = {k: v for k, v in same.items() if v}
    out["load_avg_1m_end"] = round(os.getloadavg()[0], 1)
    if not _KEEP.value:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
