"""Conversions between NumPy / `records.Rollout` and the wire messages, and the boundary checks.

Arrays travel as `pb.Array(dtype, shape, data)` with little-endian C-order bytes. Every
rollout entering the queue passes `validate_rollout`, which raises `InvalidRollout(field, why)`
for the first problem it finds; the server turns that into INVALID_ARGUMENT with the message
`"<field>: <why>"`, so a producer sees exactly what to fix.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from typing import Optional

import ml_dtypes
import numpy as np

from pipelinerl_jax import records
from pipelinerl_jax.transport import rollout_pb2 as pb

# dtype names a wire array may carry; anything else is rejected before any bytes are read.
DTYPES = {name: np.dtype(t) for name, t in {
    "bool": np.bool_, "int8": np.int8, "uint8": np.uint8, "int16": np.int16,
    "int32": np.int32, "int64": np.int64, "float16": np.float16, "float32": np.float32,
    "float64": np.float64, "bfloat16": ml_dtypes.bfloat16}.items()}

_BIG_ENDIAN = sys.byteorder == "big"

# Per-token arrays of a rollout and the dtype each must have on the wire.
TOKEN_ARRAYS = (("completion_ids", "int32"), ("logp_behaviour", "float32"),
                ("version", "int32"), ("kv_version", "int32"))
# Optional per-token arrays of a multi-turn episode (absent: all trained, one turn).
EPISODE_ARRAYS = (("loss_mask", "uint8"), ("turn_index", "int32"))
_INT32_MAX = np.iinfo(np.int32).max


class InvalidRollout(ValueError):
    """A rollout (or request) failed a boundary check; `field` names the culprit."""

    def __init__(self, field: str, why: str):
        self.field = field
        self.why = why
        super().__init__(f"{field}: {why}")

    def prefixed(self, prefix: str) -> "InvalidRollout":
        return InvalidRollout(f"{prefix}.{self.field}" if self.field else prefix, self.why)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the queue accepts. `vocab_size=0` skips the token-id upper bound."""
    vocab_size: int = 0
    max_prompt_tokens: int = 65536
    max_completion_tokens: int = 65536
    max_group_size: int = 1024
    max_string_len: int = 256
    max_metrics: int = 64


# ------------------------------------------------------------------------------- arrays

def dtype_from_name(name: str) -> np.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; supported: {sorted(DTYPES)}") from None


def to_le_bytes(arr: np.ndarray) -> bytes:
    """C-order little-endian bytes of `arr` (the one copy protobuf needs anyway)."""
    arr = np.ascontiguousarray(arr)
    if _BIG_ENDIAN and arr.dtype.itemsize > 1:
        arr = arr.byteswap()
    return arr.tobytes()


def array_to_pb(arr: np.ndarray, out: pb.Array) -> pb.Array:
    if arr.dtype.name not in DTYPES:
        raise ValueError(f"unsupported dtype {arr.dtype.name!r}; supported: {sorted(DTYPES)}")
    out.dtype = arr.dtype.name
    out.shape[:] = arr.shape
    out.data = to_le_bytes(arr)
    return out


def array_from_pb(msg: pb.Array, field: str = "array",
                  expected_dtype: Optional[str] = None, ndim: Optional[int] = None,
                  copy: bool = True) -> np.ndarray:
    """Decodes a wire array, checking dtype, shape and byte count.

    With `copy` (default) the result is a writable array; without, a read-only view.
    """
    if expected_dtype is not None and msg.dtype != expected_dtype:
        raise InvalidRollout(field, f"dtype must be {expected_dtype}, got {msg.dtype!r}")
    try:
        dt = dtype_from_name(msg.dtype)
    except ValueError as e:
        raise InvalidRollout(field, str(e)) from None
    shape = tuple(msg.shape)
    if ndim is not None and len(shape) != ndim:
        raise InvalidRollout(field, f"must be {ndim}-d, got shape {list(shape)}")
    if any(d < 0 for d in shape):
        raise InvalidRollout(field, f"negative dimension in shape {list(shape)}")
    n = math.prod(shape)
    if len(msg.data) != n * dt.itemsize:
        raise InvalidRollout(field, f"has {len(msg.data)} data bytes, shape {list(shape)} of "
                                    f"{msg.dtype} needs {n * dt.itemsize}")
    arr = np.frombuffer(msg.data, dtype=dt).reshape(shape)
    if _BIG_ENDIAN and dt.itemsize > 1:
        arr = arr.byteswap()
    return arr.copy() if copy else arr  # frombuffer views the immutable bytes


def _cast(field: str, x, dtype: np.dtype) -> np.ndarray:
    """Casts a per-token array to its wire dtype, refusing casts that would change values."""
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ValueError(f"{field}: must be 1-d, got shape {arr.shape}")
    if arr.dtype == dtype:
        return arr
    if dtype.kind in "iu":
        if arr.dtype.kind not in "iub" and arr.size:
            raise ValueError(f"{field}: must hold integers, got dtype {arr.dtype}")
        if arr.size and (arr.min() < np.iinfo(dtype).min or arr.max() > np.iinfo(dtype).max):
            raise ValueError(f"{field}: values out of {dtype} range")
    return arr.astype(dtype)


# ------------------------------------------------------------------------------- rollouts

def rollout_to_pb(r: records.Rollout, out: Optional[pb.Rollout] = None) -> pb.Rollout:
    m = pb.Rollout() if out is None else out
    array_to_pb(_cast("prompt_ids", r.prompt_ids, DTYPES["int32"]), m.prompt_ids)
    for name, dt in TOKEN_ARRAYS:
        array_to_pb(_cast(name, getattr(r, name), DTYPES[dt]), getattr(m, name))
    for name, dt in EPISODE_ARRAYS:
        if getattr(r, name, None) is not None:
            array_to_pb(_cast(name, getattr(r, name), DTYPES[dt]), getattr(m, name))
    m.reward, m.advantage = float(r.reward), float(r.advantage)
    m.group_id, m.group_size = r.group_id, int(r.group_size)
    m.task_id, m.finish_reason, m.engine_id = r.task_id, r.finish_reason, r.engine_id
    m.start_version = int(r.start_version)
    m.submit_time, m.start_time, m.finish_time = r.submit_time, r.start_time, r.finish_time
    for k, v in r.metrics.items():
        m.metrics[str(k)] = float(v)
    return m


def rollout_from_pb(m: pb.Rollout) -> records.Rollout:
    arrays = {name: array_from_pb(getattr(m, name), name, dt, ndim=1)
              for name, dt in (("prompt_ids", "int32"),) + TOKEN_ARRAYS}
    arrays.update({name: array_from_pb(getattr(m, name), name, dt, ndim=1)
                   if m.HasField(name) else None for name, dt in EPISODE_ARRAYS})
    return records.Rollout(
        **arrays, reward=m.reward, advantage=m.advantage, group_id=m.group_id,
        group_size=m.group_size, task_id=m.task_id, finish_reason=m.finish_reason,
        start_version=m.start_version, engine_id=m.engine_id, submit_time=m.submit_time,
        start_time=m.start_time, finish_time=m.finish_time, metrics=dict(m.metrics))


@dataclasses.dataclass(frozen=True)
class RolloutInfo:
    """What the queue needs to know about a validated rollout."""
    group_id: str
    group_size: int
    min_version: int
    max_version: int


def validate_rollout(m: pb.Rollout, limits: Limits,
                     max_version: Optional[int]) -> RolloutInfo:
    """Checks one wire rollout; raises `InvalidRollout` naming the first bad field.

    `max_version` is the newest version the learner announced: a token sampled by a newer
    version cannot exist. `None` (nothing announced yet) is handled by the caller.
    """
    prompt = array_from_pb(m.prompt_ids, "prompt_ids", "int32", ndim=1, copy=False)
    if prompt.size > limits.max_prompt_tokens:
        raise InvalidRollout("prompt_ids", f"length {prompt.size} exceeds max_prompt_tokens="
                                           f"{limits.max_prompt_tokens}")
    arrays = {name: array_from_pb(getattr(m, name), name, dt, ndim=1, copy=False)
              for name, dt in TOKEN_ARRAYS}
    c = arrays["completion_ids"].size
    if c == 0:
        raise InvalidRollout("completion_ids", "completion is empty")
    if c > limits.max_completion_tokens:
        raise InvalidRollout("completion_ids", f"length {c} exceeds max_completion_tokens="
                                               f"{limits.max_completion_tokens}")
    for name, arr in arrays.items():
        if arr.size != c:
            raise InvalidRollout(name, f"length {arr.size} != completion length {c}")
    for name, ids in (("prompt_ids", prompt), ("completion_ids", arrays["completion_ids"])):
        if ids.size and ids.min() < 0:
            raise InvalidRollout(name, f"negative token id {int(ids.min())}")
        if limits.vocab_size and ids.size and ids.max() >= limits.vocab_size:
            raise InvalidRollout(name, f"token id {int(ids.max())} >= vocab_size="
                                       f"{limits.vocab_size}")
    logp = arrays["logp_behaviour"]
    if not np.all(np.isfinite(logp)):
        raise InvalidRollout("logp_behaviour", "contains NaN or inf")
    if logp.max() > 0:
        raise InvalidRollout("logp_behaviour", f"log-prob {float(logp.max())} > 0")
    version, kv_version = arrays["version"], arrays["kv_version"]
    if version.min() < 0:
        raise InvalidRollout("version", f"negative version {int(version.min())}")
    if kv_version.min() < 0:
        raise InvalidRollout("kv_version", f"negative version {int(kv_version.min())}")
    bad = np.nonzero(kv_version > version)[0]
    if bad.size:
        t = int(bad[0])
        raise InvalidRollout("kv_version", f"kv_version[{t}]={int(kv_version[t])} > "
                                           f"version[{t}]={int(version[t])}")
    _validate_episode_arrays(m, c)
    if m.start_version < 0:
        raise InvalidRollout("start_version", f"negative version {m.start_version}")
    newest = max(int(version.max()), m.start_version)
    if max_version is not None and newest > max_version:
        field = "version" if int(version.max()) == newest else "start_version"
        raise InvalidRollout(field, f"version {newest} is from the future: the learner "
                                    f"announced {max_version}")
    if not m.group_id:
        raise InvalidRollout("group_id", "is empty")
    if not 1 <= m.group_size <= limits.max_group_size:
        raise InvalidRollout("group_size", f"must be in [1, {limits.max_group_size}], "
                                           f"got {m.group_size}")
    if m.finish_reason not in records.FINISH_REASONS:
        raise InvalidRollout("finish_reason", f"must be one of {list(records.FINISH_REASONS)}, "
                                              f"got {m.finish_reason!r}")
    for name in ("group_id", "task_id", "engine_id"):
        if len(getattr(m, name)) > limits.max_string_len:
            raise InvalidRollout(name, f"longer than {limits.max_string_len} characters")
    for name in ("reward", "advantage", "submit_time", "start_time", "finish_time"):
        if not math.isfinite(getattr(m, name)):
            raise InvalidRollout(name, f"must be finite, got {getattr(m, name)}")
    if len(m.metrics) > limits.max_metrics:
        raise InvalidRollout("metrics", f"more than {limits.max_metrics} entries")
    for k, v in m.metrics.items():
        if not k or len(k) > limits.max_string_len:
            raise InvalidRollout("metrics", f"key {k[:40]!r} is empty or too long")
        if not math.isfinite(v):
            raise InvalidRollout(f"metrics[{k}]", f"must be finite, got {v}")
    return RolloutInfo(m.group_id, m.group_size, int(version.min()), newest)


def _validate_episode_arrays(m: pb.Rollout, c: int) -> None:
    """`loss_mask` / `turn_index` of a multi-turn episode, when present (proto docs)."""
    if m.HasField("loss_mask"):
        mask = array_from_pb(m.loss_mask, "loss_mask", "uint8", ndim=1, copy=False)
        if mask.size != c:
            raise InvalidRollout("loss_mask", f"length {mask.size} != completion length {c}")
        if mask.max() > 1:
            raise InvalidRollout("loss_mask", f"values must be 0 or 1, got {int(mask.max())}")
        if not mask.any():
            raise InvalidRollout("loss_mask", "no token is trained (all zeros)")
    if m.HasField("turn_index"):
        turns = array_from_pb(m.turn_index, "turn_index", "int32", ndim=1, copy=False)
        if turns.size != c:
            raise InvalidRollout("turn_index", f"length {turns.size} != completion length {c}")
        if turns.min() < 0:
            raise InvalidRollout("turn_index", f"negative turn index {int(turns.min())}")
        down = np.nonzero(np.diff(turns) < 0)[0]
        if down.size:
            t = int(down[0]) + 1
            raise InvalidRollout("turn_index", f"decreases at {t}: {int(turns[t - 1])} -> "
                                               f"{int(turns[t])}")
