"""Run metrics: a JSONL log, TensorBoard event files, and the reward-vs-time plot.

`MetricsWriter.write(step, scalars)` appends one JSON object to `metrics.jsonl` (with the
absolute time it was written, `time_unix`) and the same scalars to TensorBoard (`tb/`). Lists
(e.g. response lengths) go to JSONL only, histograms of them to TensorBoard. See docs/metrics.md for the keys a run writes.

Two processes write a run's metrics: the learner one row per step (`metrics.jsonl`), the
evaluator role one row per evaluated version (`eval.jsonl`, `eval/*` at the version's step;
both into `tb/`, each its own event file). `read_metrics(workdir)` is the run's metrics as
one table: the learner's rows with the evaluations merged into the row of their step.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Dict, Iterable, List, Optional

import numpy as np

from pipelinerl_jax import tb_events


def _jsonable(v):
    if isinstance(v, (np.generic,)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them visible rather than dropping
    if isinstance(v, np.ndarray):
        return [_jsonable(x) for x in v.tolist()]
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


class MetricsWriter:
    """`tb_suffix`: ends the TensorBoard event file's name, so that two processes writing
    into one run's `tb/` (the learner, the evaluator) never pick the same file.

    TensorBoard events are written synchronously, one event per row holding all of its values,
    and flushed to the OS with the row (a buffered write, no fsync), like `metrics.jsonl`, by
    `tb_events` (no tensorboardX: its import pulls in torch where torch is installed). Not a
    `SummaryWriter`-style queue: tensorboardX's puts every value through a bounded
    `multiprocessing.Queue` to a writer thread, so a learner step's ~80 values cost dozens of
    thread hand-offs; on the staleness grid's one core per run that cost 2.6x the wall time and
    3.4x the CPU of writing the row in one event (`scripts/bench_metrics.py`, BENCHMARKS.md).
    A list becomes a histogram of its finite values (none: no histogram)."""

    def __init__(self, workdir: str, filename: str = "metrics.jsonl", tensorboard: bool = True,
                 tb_suffix: str = ""):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, filename)
        self._f = open(self.path, "a", buffering=1)
        self._tb = None
        if tensorboard:
            self._tb = tb_events.EventFileWriter(os.path.join(workdir, "tb"), tb_suffix)

    def write(self, step: int, scalars: Dict[str, object]) -> None:
        """Appends `{"step", "time_unix", **scalars}`; `time_unix` (seconds since the epoch,
        when the row is written) lines rows up with other logs and runs."""
        record = {"step": int(step), "time_unix": time.time()}
        record.update({k: _jsonable(v) for k, v in scalars.items()})
        self._f.write(json.dumps(record) + "\n")
        if self._tb is None:
            return
        values = []
        for k, v in scalars.items():
            k = k.replace("+", "plus")  # TensorBoard tags allow [A-Za-z0-9_./-] only
            if isinstance(v, (list, tuple, np.ndarray)):
                arr = np.asarray(v, dtype=np.float64)
                arr = arr[np.isfinite(arr)]
                if arr.size:
                    values.append(tb_events.histogram_value(k, arr))
            elif isinstance(v, (int, float, np.number)) and not isinstance(v, bool):
                values.append(tb_events.scalar_value(k, float(v)))
        if values:
            self._tb.write(record["time_unix"], int(step), values)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def append_jsonl(path: str, records: Iterable[dict]) -> None:
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps({k: _jsonable(v) for k, v in r.items()}) + "\n")


def read_jsonl(path: str) -> List[dict]:
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash
    return out


EVAL_LOG = "eval.jsonl"  # the evaluator role's records (rollout/eval_role.py)


def merge_evals(rows: List[dict], evals: Iterable[dict]) -> List[dict]:
    """`rows` (one per learner step) with each evaluation record's keys but `step` and
    `time_unix` merged into the newest row of its step (a row of its own when the learner
    logged none, placed before the first row of a later step). A version evaluated twice (a
    learner restarted from an older checkpoint trained it again): the later record wins."""
    out = [dict(r) for r in rows]
    newest = {}
    for i, r in enumerate(out):
        if isinstance(r.get("step"), int):
            newest[r["step"]] = i
    extra = []
    for e in evals:
        fields = {k: v for k, v in e.items() if k not in ("step", "time_unix")}
        if e.get("step") in newest:
            out[newest[e["step"]]].update(fields)
        else:
            extra.append(dict(e))
    for e in extra:
        later = [i for i, r in enumerate(out)
                 if isinstance(r.get("step"), int) and r["step"] > e.get("step", 0)]
        out.insert(later[0] if later else len(out), e)
    return out


def eval_on_learner_step(workdir: str) -> bool:
    """Whether the run's held-out evaluation ran on the learner's step, so its `eval/time_s`
    is inside the learner's `wall_time_s` (runs from before the evaluator role, which have no
    `eval.jsonl`), rather than beside it."""
    return not os.path.exists(os.path.join(workdir, EVAL_LOG))


def read_metrics(workdir: str) -> List[dict]:
    """The run's metrics as one table: `metrics.jsonl` with `eval.jsonl` merged in."""
    return merge_evals(read_jsonl(os.path.join(workdir, "metrics.jsonl")),
                       read_jsonl(os.path.join(workdir, EVAL_LOG)))


def plot_reward(workdir: str, out: Optional[str] = None, title: str = "") -> str:
    """reward and accuracy (train and held-out eval) against wall-clock, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # plots only

    rows = read_metrics(workdir)
    out = out or os.path.join(workdir, "reward.png")
    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)

    def series(key):
        pts = [(r["wall_time_s"] / 60, r[key]) for r in rows
               if isinstance(r.get(key), (int, float)) and "wall_time_s" in r]
        return [np.asarray(v, np.float64) for v in zip(*pts)] if pts else (None, None)

    def smooth(y, n=10):  # trailing moving average: per-batch reward is noisy
        c = np.cumsum(np.insert(y, 0, 0.0))
        k = np.minimum(np.arange(1, len(y) + 1), n)
        return (c[1:] - c[np.arange(1, len(y) + 1) - k]) / k

    x, reward = series("reward/mean")
    _, acc = series("accuracy")
    if x is not None:
        ax.plot(x, reward, color="tab:blue", alpha=0.2, linewidth=0.8)
        ax.plot(x, smooth(reward), color="tab:blue", label="train reward (10-step mean)")
        if acc is not None and not np.allclose(acc, reward):
            ax.plot(x, smooth(acc), color="tab:orange", label="train accuracy (10-step mean)")
    x, ev = series("eval/accuracy")
    if x is not None:
        ax.plot(x, ev, "o-", color="tab:green", markersize=4, label="held-out greedy accuracy")
    ax.set_xlabel("wall-clock (minutes)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title or os.path.basename(os.path.abspath(workdir)))
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
