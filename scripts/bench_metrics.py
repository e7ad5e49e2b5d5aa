"""Cost of writing one learner metrics row: `MetricsWriter.write` (JSONL + one synchronous
TensorBoard event per row) vs tensorboardX's `SummaryWriter` fed value by value (what
`MetricsWriter` did before: each value through a bounded multiprocessing queue to a writer
thread), on a row shaped like the learner's (`--scalars` scalars, two 64-value lists).

    PYTHONPATH=. python scripts/bench_metrics.py [--rows 200 --scalars 150]
    taskset -c 1 ...   # one core shared with other work: where the hand-offs hurt most

Both take turns in rounds so that load drifting hits them alike. Also the start-up cost every
learner and evaluator process pays: a fresh interpreter that opens a `MetricsWriter` and
writes one row, against one that opens tensorboardX's `EventsWriter` (what `MetricsWriter`
opened before `tb_events`; importing it imports torch where torch is installed), and against
a bare `import numpy` (the floor), child CPU and wall per process, `--startup_rounds` each,
interleaved. Prints ONE final JSON line: median wall and CPU milliseconds per row of each, the
ratios, and the start-up medians.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

from pipelinerl_jax.metrics import MetricsWriter


def learner_row(scalars: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    row = {f"loss/metric_{i}": float(rng.normal()) for i in range(scalars)}
    row["rollout/response_lengths"] = rng.integers(1, 64, 64).tolist()
    row["lag/per_sample"] = rng.integers(0, 8, 64).tolist()
    return row


def tensorboardx_write(tb, step: int, row: dict) -> None:
    """The former `MetricsWriter.write`'s TensorBoard part, value by value."""
    for k, v in row.items():
        if isinstance(v, list):
            tb.add_histogram(k, np.asarray(v, np.float64), step)
        else:
            tb.add_scalar(k, float(v), step)


STARTUP = {
    "floor": "import numpy",
    "ours": ("from pipelinerl_jax.metrics import MetricsWriter; w = MetricsWriter(D); "
             "w.write(1, {'x': 1.0, 'h': [1, 2, 3]}); w.close()"),
    "tensorboardx_events_writer": ("import numpy; from tensorboardX.event_file_writer import "
                                   "EventsWriter; w = EventsWriter(D + '/events'); w.close()"),
}


def startup(rounds: int) -> dict:
    """Median (wall s, child CPU s) of a fresh interpreter running each STARTUP snippet."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    got = {name: [] for name in STARTUP}
    with tempfile.TemporaryDirectory() as d:
        for r in range(rounds):
            for name, code in STARTUP.items():
                sub = os.path.join(d, f"{name}{r}")
                os.makedirs(sub)
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                t = time.perf_counter()
                subprocess.run([sys.executable, "-c", f"D = {sub!r}; {code}"], env=env,
                               check=True)
                wall = time.perf_counter() - t
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
                got[name].append((wall, cpu))
    return {name: {"wall_s": round(float(np.median([w for w, _ in v])), 3),
                   "cpu_s": round(float(np.median([c for _, c in v])), 3)}
            for name, v in got.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--scalars", type=int, default=150)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--startup_rounds", type=int, default=5)
    a = p.parse_args()
    from tensorboardX import SummaryWriter
    row = learner_row(a.scalars)
    per = a.rows // a.rounds
    out = {"ours": [], "tensorboardx": []}
    with tempfile.TemporaryDirectory() as d:
        ours = MetricsWriter(os.path.join(d, "ours"))
        tbx = SummaryWriter(os.path.join(d, "tbx"), flush_secs=10)
        step = 0
        for _ in range(a.rounds):
            for name in out:
                t, c = time.perf_counter(), time.process_time()
                for _ in range(per):
                    step += 1
                    if name == "ours":
                        ours.write(step, row)
                    else:
                        tensorboardx_write(tbx, step, row)
                out[name].append(((time.perf_counter() - t) / per * 1e3,
                                  (time.process_time() - c) / per * 1e3))
        t = time.perf_counter()
        tbx.close()  # its queue drains here: counted apart
        drain_s = time.perf_counter() - t
        ours.close()
    res = {name: {"wall_ms_per_row": round(float(np.median([w for w, _ in v])), 3),
                  "cpu_ms_per_row": round(float(np.median([c for _, c in v])), 3)}
           for name, v in out.items()}
    for name, r in res.items():
        print(f"{name:13s} wall {r['wall_ms_per_row']:8.3f} ms/row   cpu {r['cpu_ms_per_row']:8.3f} ms/row")
    res.update(rows=a.rows, scalars=a.scalars, tensorboardx_close_s=round(drain_s, 3),
               wall_ratio=round(res["tensorboardx"]["wall_ms_per_row"]
                                / res["ours"]["wall_ms_per_row"], 2),
               cpu_ratio=round(res["tensorboardx"]["cpu_ms_per_row"]
                               / res["ours"]["cpu_ms_per_row"], 2),
               machine=platform.processor() or platform.machine(), cpus=os.cpu_count())
    if a.startup_rounds:
        res["startup"] = startup(a.startup_rounds)
        for name, r in res["startup"].items():
            print(f"start-up {name:27s} wall {r['wall_s']:6.3f} s   cpu {r['cpu_s']:6.3f} s")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
