"""Progress bars over the files a run writes (the processes write them; we only read).

`Monitor`: RL steps from `metrics.jsonl` with reward, lag, occupancy and the train-inference
mismatch (mean |Δ log p| of the lag-0 tokens), and the held-out accuracy from `eval.jsonl`.
`SftProgress`: warm-start steps from `warm_start/sft_metrics.jsonl` with the loss.
"""
from __future__ import annotations

import json
import os
from typing import Dict

from tqdm import tqdm


class _Tail:
    """The complete lines appended to a JSONL file since the last call."""

    def __init__(self, path: str):
        self.path, self._pos = path, 0

    def rows(self):
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            f.seek(self._pos)
            chunk = f.read()
        lines = chunk.split("\n")
        self._pos += len(chunk) - len(lines[-1])
        out = []
        for line in lines[:-1]:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out


class Monitor:
    """Progress bar over `metrics.jsonl` (the learner writes it) and `eval.jsonl` (the
    evaluator's held-out accuracy); we only read."""

    def __init__(self, workdir: str, total: int):
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.bar = tqdm(total=total, desc="RL", unit="step", dynamic_ncols=True)
        self._steps, self._evals = _Tail(self.path), _Tail(os.path.join(workdir, "eval.jsonl"))
        self.last: Dict = {}

    def update(self) -> None:
        changed = False
        for row in self._steps.rows():
            self.last.update({k: v for k, v in row.items() if not isinstance(v, list)})
            changed = True
        for row in self._evals.rows():  # an evaluation trails the learner's step
            self.last.update({k: v for k, v in row.items() if k.startswith("eval/")})
            changed = True
        if changed:
            self.bar.n = self.last.get("step", 0)
            post = {}
            for key, short, fmt in (("reward/mean", "reward", ".3f"),
                                    ("eval/accuracy", "eval_acc", ".3f"),
                                    ("lag/mean", "lag", ".3f"), ("sampler/occupancy", "occ", ".3f"),
                                    ("loss/mismatch/abs_mean", "mismatch", ".2g")):
                if isinstance(self.last.get(key), (int, float)):
                    post[short] = format(self.last[key], fmt)
            self.bar.set_postfix(post)
            self.bar.refresh()

    def close(self):
        self.update()
        self.bar.close()


class SftProgress:
    """Progress bar over the warm start's `sft_metrics.jsonl`, shown from its first row."""

    def __init__(self, ws_dir: str, total: int):
        self.path = os.path.join(ws_dir, "sft_metrics.jsonl")
        self.total = total
        self.bar = None

    def update(self) -> None:
        from pipelinerl_jax.metrics import read_jsonl  # numpy: roles pin cores first
        rows = read_jsonl(self.path)
        if not rows:
            return
        if self.bar is None:
            self.bar = tqdm(total=self.total, desc="warm start", unit="step",
                            dynamic_ncols=True)
        if self.bar.n != rows[-1]["step"] + 1:
            self.bar.n = rows[-1]["step"] + 1
            # the last training row: an evaluation row (warm_start.eval_every) has no loss
            loss = next((r["sft/loss"] for r in reversed(rows) if "sft/loss" in r), None)
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.3f}")
            self.bar.refresh()

    def close(self, done: bool) -> None:
        if self.bar is not None:
            if done:
                self.bar.n = self.total
            self.bar.close()
