"""Recording the batches a learner trains on, and reading them back for replay.

With `learner.record_batches=True` the learner writes, for every trained step s,

    WORKDIR/recorded/step_<s:08d>.npz    the exact arrays `batching.pack` produced and the train
                                         step saw (compressed): PACKED_KEYS [chunks, R, T] and
                                         SEQ_KEYS [chunks, N/chunks, C] (loss mask, behaviour
                                         log-probs, advantages, per-token lag and kv_lag;
                                         the row's group index [chunks, N/chunks])
    WORKDIR/recorded/index.jsonl         one line per step: step, version it was trained at,
                                         batch_id, the file, per-row group ids and rewards (in the
                                         packed order) and the step's metrics.jsonl record
    WORKDIR/recorded/meta.json           the run's initial checkpoint (its warm start) and config

Per-token behaviour versions are `version - lag` (the lag is measured at train time, against
the recording learner's own version). Only process 0 of a multi-process learner writes
(`multihost.primary_or`). A learner restarted from a checkpoint trains the steps after it
again and writes them again: the step's file is replaced and a new index line appended, and
`read_index` keeps the last line of each step, so a recording always describes the trajectory
the final model took.

Replay (`learner/replay.py`, `experiments/replay.py`) trains a fresh learner on these arrays.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

import numpy as np

from pipelinerl_jax.learner.batching import PACKED_KEYS, SEQ_KEYS
from pipelinerl_jax.learner import multihost
from pipelinerl_jax.metrics import append_jsonl, read_jsonl

DIRNAME = "recorded"
INDEX = "index.jsonl"
META = "meta.json"


def step_file(step: int) -> str:
    return f"step_{step:08d}.npz"


class BatchRecorder:
    """Writes `WORKDIR/recorded/` (module docstring)."""

    def __init__(self, workdir: str, init_checkpoint: str, config: Optional[dict] = None):
        self.directory = os.path.join(workdir, DIRNAME)
        os.makedirs(self.directory, exist_ok=True)
        meta = os.path.join(self.directory, META)
        if not os.path.exists(meta):  # a restarted learner keeps the first one
            _write_atomic(meta, json.dumps({"init_checkpoint": os.path.abspath(init_checkpoint),
                                            "config": config or {}}, indent=2).encode())

    def record(self, step: int, version: int, batch_id: str, rollouts,
               arrays: Dict[str, np.ndarray], metrics: dict, engines=()) -> None:
        """Step `step` trained at policy version `version` on `arrays` (`PackedBatch.arrays`)
        packed from `rollouts` (in row order); `metrics` is the step's metrics.jsonl record;
        `engines`: `PackedBatch.engines`, the names `arrays["engine"]` indexes (a replay
        reports the per-engine metrics under them)."""
        name = step_file(step)
        path = os.path.join(self.directory, name)
        with open(path + ".tmp", "wb") as f:
            np.savez_compressed(f, **arrays)
        os.replace(path + ".tmp", path)  # the file is whole before the index names it
        append_jsonl(os.path.join(self.directory, INDEX), [{
            "step": int(step), "version": int(version), "batch_id": batch_id, "file": name,
            "group_ids": [r.group_id for r in rollouts],
            "rewards": [float(r.reward) for r in rollouts],
            "engines": list(engines), "metrics": metrics}])


def recorder(cfg, workdir: str, init_checkpoint: str) -> Optional[BatchRecorder]:
    """The run's recorder: None unless `learner.record_batches`, and on every process but 0."""
    if not cfg.learner.get("record_batches", False):
        return None
    return multihost.primary_or(
        lambda: BatchRecorder(workdir, init_checkpoint, cfg.to_dict()), None)


def _write_atomic(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


# ============================================================================ reading back

def recording_dir(run_or_recording: str) -> str:
    """`RUN_DIR/recorded` given a run directory, or the recording directory itself."""
    inner = os.path.join(run_or_recording, DIRNAME)
    return inner if os.path.isdir(inner) else run_or_recording


def read_meta(directory: str) -> dict:
    path = os.path.join(directory, META)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {directory} a recording "
                                f"(a run with learner.record_batches=True)?")
    with open(path) as f:
        return json.load(f)


def read_index(directory: str) -> List[dict]:
    """The recorded steps in step order, the last line of each step (a restarted learner's
    retrained steps replace the first attempt's). Raises if a step is missing."""
    by_step = {r["step"]: r for r in read_jsonl(os.path.join(directory, INDEX))}
    steps = sorted(by_step)
    if steps != list(range(1, len(steps) + 1)):
        missing = sorted(set(range(1, (steps[-1] if steps else 0) + 1)) - set(steps))
        raise ValueError(f"recording {directory} lacks steps {missing[:10]}")
    return [by_step[s] for s in steps]


def _groups_from_index(group_ids, shape) -> np.ndarray:
    """`batching.pack`'s `group` array rebuilt from an index line's per-row group ids (in the
    packed order; rows past them are padding, -1)."""
    index, out = {}, np.full(int(np.prod(shape)), -1, np.int32)
    for i, g in enumerate(group_ids or []):
        out[i] = index.setdefault(g, len(index))
    return out.reshape(shape)


def load_arrays(directory: str, entry: dict) -> Dict[str, np.ndarray]:
    """The packed arrays of one index entry, exactly as the recorded train step saw them."""
    with np.load(os.path.join(directory, entry["file"])) as z:
        arrays = {k: z[k] for k in z.files}
    if "engine" not in arrays and "lag" in arrays:  # recorded before rows named their engine
        arrays["engine"] = np.zeros_like(arrays["lag"])
    if "group" not in arrays and "lag" in arrays:  # recorded before rows named their group
        arrays["group"] = _groups_from_index(entry.get("group_ids"), arrays["lag"].shape[:2])
    missing = set(PACKED_KEYS + SEQ_KEYS) - set(arrays)
    if missing:
        raise ValueError(f"{entry['file']} lacks arrays {sorted(missing)}")
    return arrays
