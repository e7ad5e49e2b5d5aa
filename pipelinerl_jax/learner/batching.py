"""Packing rollouts into fixed, bucketed `[B, T]` training arrays.

One sequence per row (the `LossInputs` contract). A row holds `prompt + completion`; the
logits at position i predict token i+1, so completion token j of a row with prompt length P
is scored at position `P + j - 1`. Every per-token quantity (`logp_behaviour`, `lag`, ...) is
placed at that position and `loss_mask` is 1 exactly there.

T is the smallest bucket >= the longest row, so a run compiles one train step per bucket,
never per batch. Rows are padded with `pad_id` (right padding: the causal mask keeps pad
tokens from influencing real ones) and B is fixed by config.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence

import numpy as np

from pipelinerl_jax.types import Rollout

BATCH_KEYS = ("input_ids", "targets", "loss_mask", "logp_behaviour", "advantages", "lag",
              "kv_lag")


def length_buckets(max_len: int, min_bucket: int = 32) -> List[int]:
    """Powers of two from `min_bucket`, capped by (and ending at) `max_len`."""
    out, b = [], min_bucket
    while b < max_len:
        out.append(b)
        b *= 2
    out.append(max_len)
    return out


def pick_bucket(length: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if length <= b:
            return b
    raise ValueError(f"sequence of length {length} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass
class PackedBatch:
    arrays: Dict[str, np.ndarray]  # BATCH_KEYS -> [B, T]
    num_rows: int  # real rows (the rest are all-masked padding rows)
    num_tokens: int  # trained tokens

    def __getitem__(self, key):
        return self.arrays[key]


def pack(rollouts: Sequence[Rollout], learner_version: int, batch_size: int,
         buckets: Sequence[int], pad_id: int = 0) -> PackedBatch:
    """Packs rollouts into `[batch_size, T]` arrays; lags are measured at `learner_version`."""
    if len(rollouts) > batch_size:
        raise ValueError(f"{len(rollouts)} rollouts do not fit a batch of {batch_size}")
    lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts]
    t = pick_bucket(max(lengths) if lengths else 1, buckets)
    a = {
        "input_ids": np.full((batch_size, t), pad_id, np.int32),
        "targets": np.full((batch_size, t), pad_id, np.int32),
        "loss_mask": np.zeros((batch_size, t), np.float32),
        "logp_behaviour": np.zeros((batch_size, t), np.float32),
        "advantages": np.zeros((batch_size, t), np.float32),
        "lag": np.zeros((batch_size, t), np.int32),
        "kv_lag": np.zeros((batch_size, t), np.int32),
    }
    tokens = 0
    for i, r in enumerate(rollouts):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        seq = np.concatenate([r.prompt_ids, r.completion_ids]).astype(np.int32)
        a["input_ids"][i, :p + c] = seq
        a["targets"][i, :p + c - 1] = seq[1:]
        sl = slice(p - 1, p + c - 1)
        a["loss_mask"][i, sl] = 1.0
        a["logp_behaviour"][i, sl] = r.logp_behaviour
        a["advantages"][i, sl] = r.advantage
        a["lag"][i, sl] = learner_version - np.asarray(r.version)
        a["kv_lag"][i, sl] = learner_version - np.asarray(r.kv_version)
        tokens += c
    return PackedBatch(a, len(rollouts), tokens)
