"""Run metrics: a JSONL log, TensorBoard event files, and the reward-vs-time plot.

`MetricsWriter.write(step, scalars)` appends one JSON object to `metrics.jsonl` (with the
absolute time it was written, `time_unix`) and the same scalars to TensorBoard (`tb/`). Lists
(e.g. response lengths) go to JSONL only, histograms of them to TensorBoard. See docs/metrics.md for the keys a run writes.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Dict, Iterable, List, Optional

import numpy as np


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
    def __init__(self, workdir: str, filename: str = "metrics.jsonl", tensorboard: bool = True):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, filename)
        self._f = open(self.path, "a", buffering=1)
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter  # optional until used
            self._tb = SummaryWriter(os.path.join(workdir, "tb"), flush_secs=10)

    def write(self, step: int, scalars: Dict[str, object]) -> None:
        """Appends `{"step", "time_unix", **scalars}`; `time_unix` (seconds since the epoch,
        when the row is written) lines rows up with other logs and runs."""
        record = {"step": int(step), "time_unix": time.time()}
        record.update({k: _jsonable(v) for k, v in scalars.items()})
        self._f.write(json.dumps(record) + "\n")
        if self._tb is None:
            return
        for k, v in scalars.items():
            k = k.replace("+", "plus")  # TensorBoard tags allow [A-Za-z0-9_./-] only
            if isinstance(v, (list, tuple, np.ndarray)):
                arr = np.asarray(v, dtype=np.float64)
                if arr.size:
                    self._tb.add_histogram(k, arr, step)
            elif isinstance(v, (int, float, np.number)) and not isinstance(v, bool):
                self._tb.add_scalar(k, float(v), step)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


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


def plot_reward(workdir: str, out: Optional[str] = None, title: str = "") -> str:
    """reward and accuracy (train and held-out eval) against wall-clock, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # plots only

    rows = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
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
