"""Whether two run directories trained the same thing: batches, samples, losses, evaluations.

    differences(dir_a, dir_b)  ->  ["step 3: loss/loss = 0.12 vs 0.13", ...]   ([] = the same)

Compares, bit for bit, everything a run logs that is not a wall-clock measurement: the group
ids trained at each step (`batches.jsonl`), every sample (`samples.w0.jsonl`: completions'
lengths, rewards, finish reasons, versions), every `metrics.jsonl` row (losses, diagnostics,
lags, rewards) and the held-out evaluations (`eval.jsonl`). What the single-process mode
(`launch/inprocess.py`) is checked against the pipeline with (tests/launch/test_inprocess.py,
scripts/bench_inprocess.py).
"""
from __future__ import annotations

import math
import os
from typing import List

from pipelinerl_jax.metrics import EVAL_LOG, read_jsonl

# Wall-clock measurements and what depends on them: the only values two identical runs may
# disagree on.
TIMING = ("wall_time_s", "time_unix", "learner/step_time_s", "learner/wait_time_s",
          "learner/tokens_per_s", "weight_sync/time_s", "weight_sync/background_s",
          "sampler/occupancy", "sampler/tokens_per_s", "eval/time_s", "queue/unavailable_errors")
SAMPLE_TIMING = ("time_s", "gen_time_s", "queue_time_s")
BATCH_TIMING = ("time_s", "pid", "batch_id")


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a)
                      and math.isnan(b))


def _rows(path: str, drop) -> List[dict]:
    if not os.path.exists(path):
        return []
    return [{k: v for k, v in r.items() if k not in drop} for r in read_jsonl(path)]


def differences(a: str, b: str, limit: int = 20) -> List[str]:
    """Up to `limit` differences between run directories `a` and `b` (module docstring)."""
    out: List[str] = []
    for name, drop, key in (("batches.jsonl", BATCH_TIMING, "step"),
                            ("samples.w0.jsonl", SAMPLE_TIMING, None),
                            ("metrics.jsonl", TIMING, "step"),
                            (EVAL_LOG, TIMING, "step")):
        ra, rb = _rows(os.path.join(a, name), drop), _rows(os.path.join(b, name), drop)
        if not ra:
            out.append(f"{name}: empty or missing in {a}")
        if len(ra) != len(rb):
            out.append(f"{name}: {len(ra)} vs {len(rb)} records")
        for i, (x, y) in enumerate(zip(ra, rb)):
            where = f"{name} {key} {x.get(key)}" if key else f"{name} record {i}"
            for k in sorted(set(x) | set(y)):
                if not _same(x.get(k), y.get(k)):
                    out.append(f"{where}: {k} = {x.get(k)!r} vs {y.get(k)!r}")
                    if len(out) >= limit:
                        return out
    return out
