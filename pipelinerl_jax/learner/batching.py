"""Packing rollouts into fixed-shape training arrays: packed rows for the model, one row per
sequence for the loss.

RL batches have long-tailed lengths: padding every sequence to the longest one wastes most of
the forward/backward (here 5-8x). So sequences are *packed* back to back into rows of a fixed
length `pack_len` (first-fit decreasing), with `segment_ids` (0 = padding) that stop
attention at sequence boundaries and `positions` that restart at 0 for each sequence, so the
packed forward computes exactly what separate forwards would. The loss still sees the
`LossInputs` contract — one sequence per row, `[N, C]` with C the completion length bound —
through `gather_idx`: the flat index into the packed `[R, pack_len]` positions whose logits
predict completion token j (`row * pack_len + offset + P - 1 + j` for a prompt of length P).

A multi-turn episode's completion holds environment tokens too: its `Rollout.loss_mask`
becomes the loss mask (0 on env tokens, which stay in the packed rows as context), and
`completion_len` must be the episode token budget (`run_config.completion_tokens`).
`episode_metrics` reports lag per turn index, turns per episode and end reasons.

The batch is cut into `chunks` (minibatches x micro-batches) of equal sequence count, each
packed on its own, all padded to the same number of rows R (a multiple of the mesh's batch
split, rounded up in half-octave steps so a run compiles only a handful of shapes).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence

import numpy as np

from pipelinerl_jax.records import Rollout

PACKED_KEYS = ("input_ids", "targets", "positions", "segment_ids")  # [chunks, R, pack_len]
SEQ_KEYS = ("gather_idx", "loss_mask", "logp_behaviour", "advantages", "lag", "kv_lag",
            "engine", "group")  # engine: index into PackedBatch.engines of the row's sampler
# group [chunks, N/chunks]: the index of the row's group (one prompt's samples) in the batch,
# by first appearance; -1 on padding rows. VCPO's off-policy optimal baseline averages over it.


def row_bucket(rows: int, divisor: int) -> int:
    """Smallest `divisor * m` >= rows with m in 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, ...
    (half-octave steps: at most 1/3 padding rows, and only a few compiled shapes per run —
    each costs a compilation, ~10 s for the default model on this CPU)."""
    m = 1
    while divisor * m < rows:
        m = m * 3 // 2 if m >= 2 and m & (m - 1) == 0 else (m + 1 if m < 2 else m * 4 // 3)
    return divisor * m


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> List[List[int]]:
    """Bins (lists of item indices) of total length <= capacity."""
    bins: List[List[int]] = []
    free: List[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"sequence of {n} tokens does not fit a packed row of {capacity}")
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(capacity - n)
    return bins


@dataclasses.dataclass
class PackedBatch:
    arrays: Dict[str, np.ndarray]
    num_seqs: int  # real sequences (the rest are all-masked padding sequences)
    num_tokens: int  # trained tokens (completion tokens under the loss mask)
    packed_tokens: int  # real tokens in the packed rows (prompt + completion)
    engines: tuple = ()  # engine ids, sorted: arrays["engine"] indexes them

    def __getitem__(self, key):
        return self.arrays[key]

    @property
    def fill(self) -> float:
        """Fraction of the packed positions holding real tokens."""
        return self.packed_tokens / self.arrays["input_ids"].size


def pack(rollouts: Sequence[Rollout], learner_version: int, *, num_seqs: int, chunks: int,
         pack_len: int, completion_len: int, row_divisor: int = 1,
         pad_id: int = 0) -> PackedBatch:
    """Packs rollouts; per-token lags are measured at `learner_version` (train time)."""
    if len(rollouts) > num_seqs:
        raise ValueError(f"{len(rollouts)} rollouts do not fit a batch of {num_seqs}")
    if num_seqs % chunks:
        raise ValueError(f"batch of {num_seqs} sequences does not split into {chunks} chunks")
    per = num_seqs // chunks
    parts = [list(rollouts[i * per:(i + 1) * per]) for i in range(chunks)]
    layouts = []
    for part in parts:
        for r in part:
            if len(r.completion_ids) > completion_len:
                raise ValueError(f"completion of {len(r.completion_ids)} tokens exceeds "
                                 f"completion_len={completion_len}")
            if len(r.prompt_ids) < 1:
                raise ValueError("a rollout has an empty prompt")
        lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in part]
        layouts.append(first_fit_decreasing(lengths, pack_len))
    rows = row_bucket(max([len(b) for b in layouts] + [1]), row_divisor)

    a = {k: np.zeros((chunks, rows, pack_len), np.int32) for k in PACKED_KEYS}
    a["input_ids"][:] = pad_id
    a["targets"][:] = pad_id
    shape = (chunks, per, completion_len)
    a.update(gather_idx=np.zeros(shape, np.int32), loss_mask=np.zeros(shape, np.float32),
             logp_behaviour=np.zeros(shape, np.float32), advantages=np.zeros(shape, np.float32),
             lag=np.zeros(shape, np.int32), kv_lag=np.zeros(shape, np.int32),
             engine=np.zeros(shape, np.int32), group=np.full((chunks, per), -1, np.int32))
    group_index = {}
    for r in rollouts:
        group_index.setdefault(r.group_id, len(group_index))
    engines = tuple(sorted({r.engine_id for r in rollouts}))
    engine_index = {name: i for i, name in enumerate(engines)}
    tokens = packed = 0
    for ch, (part, bins) in enumerate(zip(parts, layouts)):
        for row, members in enumerate(bins):
            offset = 0
            for seg, i in enumerate(members, start=1):
                r = part[i]
                p, c = len(r.prompt_ids), len(r.completion_ids)
                seq = np.concatenate([r.prompt_ids, r.completion_ids]).astype(np.int32)
                span = slice(offset, offset + p + c)
                a["input_ids"][ch, row, span] = seq
                a["targets"][ch, row, offset:offset + p + c - 1] = seq[1:]
                a["positions"][ch, row, span] = np.arange(p + c)
                a["segment_ids"][ch, row, span] = seg
                j = np.arange(c)
                a["gather_idx"][ch, i, :c] = row * pack_len + offset + p - 1 + j
                a["loss_mask"][ch, i, :c] = 1.0 if r.loss_mask is None else r.loss_mask
                a["logp_behaviour"][ch, i, :c] = r.logp_behaviour
                a["advantages"][ch, i, :c] = r.advantage
                a["lag"][ch, i, :c] = learner_version - np.asarray(r.version)
                a["kv_lag"][ch, i, :c] = learner_version - np.asarray(r.kv_version)
                a["engine"][ch, i, :c] = engine_index[r.engine_id]
                a["group"][ch, i] = group_index[r.group_id]
                offset += p + c
                tokens += c if r.loss_mask is None else int(np.count_nonzero(r.loss_mask))
                packed += p + c
    return PackedBatch(a, len(rollouts), tokens, packed, engines)


def episode_metrics(rollouts: Sequence[Rollout], learner_version: int,
                    max_turns_reported: int = 8) -> Dict[str, float]:
    """Multi-turn metrics of a batch (empty when no rollout has a `turn_index`): token lag per
    turn index over model tokens (`lag/turn_<i>/mean`, `/max`; turns past
    `max_turns_reported` pooled into the last), turns and env tokens per episode, and the
    fraction of episodes per end reason (`episode/end_<reason>`, from the worker's
    `end/<reason>` rollout metrics)."""
    multi = [r for r in rollouts if r.turn_index is not None]
    if not multi:
        return {}
    out: Dict[str, float] = {}
    lags: Dict[int, List[np.ndarray]] = {}
    for r in multi:
        mask = np.ones(len(r.completion_ids), bool) if r.loss_mask is None else r.loss_mask > 0
        turns = np.minimum(np.asarray(r.turn_index)[mask], max_turns_reported - 1)
        lag = learner_version - np.asarray(r.version)[mask]
        for t in np.unique(turns):
            lags.setdefault(int(t), []).append(lag[turns == t])
    for t, parts in sorted(lags.items()):
        lag = np.concatenate(parts)
        out[f"lag/turn_{t}/mean"] = float(lag.mean())
        out[f"lag/turn_{t}/max"] = int(lag.max())
    out["episode/turns_mean"] = float(np.mean([int(r.turn_index[-1]) + 1 if len(r.turn_index)
                                               else 0 for r in multi]))
    out["episode/env_tokens_mean"] = float(np.mean([
        0 if r.loss_mask is None else int(np.count_nonzero(r.loss_mask == 0)) for r in multi]))
    ends = [k for r in multi for k in r.metrics if k.startswith("end/")]
    for reason in sorted(set(ends)):
        out[f"episode/end_{reason[4:]}"] = float(np.mean([r.metrics.get(reason, 0.0) > 0
                                                          for r in multi]))
    return out
