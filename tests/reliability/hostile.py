"""Hostile rollouts for the queue: a hypothesis strategy that corrupts any field of a wire
`Rollout` in any way (dtype, shape, byte count, values, strings, group fields), and an oracle,
written apart from `codec.validate_rollout`, that says which fields of a message are bad."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from pipelinerl_jax import records
from pipelinerl_jax.transport import rollout_pb2 as pb

VOCAB, MAX_PROMPT, MAX_COMPLETION, MAX_GROUP, ANNOUNCED = 64, 16, 12, 4, 5
ARRAYS = {"prompt_ids": "int32", "completion_ids": "int32", "logp_behaviour": "float32",
          "version": "int32", "kv_version": "int32"}
EPISODE = {"loss_mask": "uint8", "turn_index": "int32"}  # optional: multi-turn episodes
_ITEMSIZE = {"int32": 4, "float32": 4, "uint8": 1}


def problems(m: pb.Rollout) -> set:
    """Names of the fields of `m` the queue must refuse (empty: `m` is valid)."""
    bad, arrays = set(), {}
    for name, dtype in ARRAYS.items():
        a = getattr(m, name)
        shape = list(a.shape)
        if a.dtype != dtype or len(shape) != 1 or shape[0] < 0 or \
                len(a.data) != shape[0] * _ITEMSIZE[dtype]:
            bad.add(name)
        else:
            arrays[name] = np.frombuffer(a.data, np.dtype(dtype).newbyteorder("<"))
    p, c = arrays.get("prompt_ids"), arrays.get("completion_ids")
    if p is not None and (p.size > MAX_PROMPT or (p.size and (p.min() < 0 or p.max() >= VOCAB))):
        bad.add("prompt_ids")
    if c is not None and not (1 <= c.size <= MAX_COMPLETION and c.min() >= 0 and c.max() < VOCAB):
        bad.add("completion_ids")
    n = c.size if c is not None else None
    for name in ("logp_behaviour", "version", "kv_version"):
        if name in arrays and n is not None and arrays[name].size != n:
            bad.add(name)
    logp, v, kv = (arrays.get(k) for k in ("logp_behaviour", "version", "kv_version"))
    if logp is not None and logp.size and not (np.isfinite(logp).all() and logp.max() <= 0):
        bad.add("logp_behaviour")
    if v is not None and v.size and (v.min() < 0 or v.max() > ANNOUNCED):
        bad.add("version")
    if kv is not None and kv.size and kv.min() < 0:
        bad.add("kv_version")
    if v is not None and kv is not None and v.size == kv.size and (kv > v).any():
        bad.add("kv_version")
    for name, dtype in EPISODE.items():
        if not m.HasField(name):
            continue  # absent: a single-turn completion
        a = getattr(m, name)
        shape = list(a.shape)
        if a.dtype != dtype or len(shape) != 1 or shape[0] < 0 or \
                len(a.data) != shape[0] * _ITEMSIZE[dtype]:
            bad.add(name)
            continue
        x = np.frombuffer(a.data, np.dtype(dtype).newbyteorder("<")).astype(np.int64)
        if n is not None and x.size != n:
            bad.add(name)
        elif name == "loss_mask" and x.size and (x.max() > 1 or x.max() == 0):
            bad.add(name)
        elif name == "turn_index" and x.size and (x.min() < 0 or (np.diff(x) < 0).any()):
            bad.add(name)
    if not 0 <= m.start_version <= ANNOUNCED:
        bad.add("start_version")
    if not m.group_id or len(m.group_id) > 256:
        bad.add("group_id")
    if not 1 <= m.group_size <= MAX_GROUP:
        bad.add("group_size")
    if m.finish_reason not in records.FINISH_REASONS:
        bad.add("finish_reason")
    for name in ("task_id", "engine_id"):
        if len(getattr(m, name)) > 256:
            bad.add(name)
    for name in ("reward", "advantage", "submit_time", "start_time", "finish_time"):
        if not math.isfinite(getattr(m, name)):
            bad.add(name)
    if len(m.metrics) > 64 or any(not k or len(k) > 256 or not math.isfinite(x)
                                  for k, x in m.metrics.items()):
        bad.add("metrics")
    return bad


IDS = st.integers(0, VOCAB - 1)
BAD_IDS = st.one_of(st.integers(-2**31, -1), st.integers(VOCAB, 2**31 - 1))
LOGPS = st.floats(-20, 0, width=32)
BAD_LOGPS = st.one_of(st.sampled_from([float("nan"), float("inf"), -float("inf")]),
                      st.floats(0.5, 2.0 ** 100, width=32))
VERSIONS = st.integers(0, ANNOUNCED)
BAD_VERSIONS = st.one_of(st.integers(-2**31, -1), st.integers(ANNOUNCED + 1, 2**31 - 1))
BAD_FLOATS = st.sampled_from([float("nan"), float("inf"), -float("inf")])
FIELDS = ("prompt_ids", "completion_ids", "logp_behaviour", "version", "kv_version",
          "length", "reward", "advantage", "times", "group_id", "group_size", "task_id",
          "engine_id", "finish_reason", "start_version", "metrics", "loss_mask", "turn_index")


def _array(draw, msg: pb.Array, dtype: str, n: int, good, bad, hostile: bool) -> None:
    """`n` values from `good`; if `hostile`, one way of breaking it: bad values, another
    dtype, another shape, a byte count that does not match, another length."""
    how = draw(st.sampled_from(["values", "dtype", "shape", "bytes", "length"])) if hostile \
        else "ok"
    if how == "length":
        n = max(0, n + draw(st.sampled_from([-1, 1, 5])))
    values = draw(st.lists(good, min_size=n, max_size=n))
    if how == "values" and n:
        for i in draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=3)):
            values[i] = draw(bad)
    _fill(draw, msg, dtype, values, how)


def _episode_array(draw, msg: pb.Array, name: str, n: int, hostile: bool) -> None:
    """`loss_mask` (0/1, at least one 1) or `turn_index` (>= 0, non-decreasing) of length
    `n`; if `hostile`, broken in one way (for values: an all-zero or non-0/1 mask, a negative
    or decreasing turn index)."""
    how = draw(st.sampled_from(["values", "dtype", "shape", "bytes", "length"])) if hostile \
        else "ok"
    if how == "length":
        n = max(0, n + draw(st.sampled_from([-1, 1, 5])))
    if name == "loss_mask":
        values = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
        if n:
            values[draw(st.integers(0, n - 1))] = 1
        if how == "values" and n:
            if draw(st.booleans()):
                values = [0] * n
            else:
                values[draw(st.integers(0, n - 1))] = draw(st.integers(2, 255))
    else:
        values = sorted(draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)))
        if how == "values" and n:
            if n > 1 and draw(st.booleans()):
                i = draw(st.integers(0, n - 2))
                values[i] = values[i + 1] + 1  # the next token's turn is lower
            else:
                values[draw(st.integers(0, n - 1))] = draw(st.integers(-2**31, -1))
    _fill(draw, msg, EPISODE[name], values, how)


def _fill(draw, msg: pb.Array, dtype: str, values: list, how: str) -> None:
    n = len(values)
    data = np.asarray(values, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()
    msg.dtype, msg.data = dtype, data
    msg.shape[:] = [n]
    if how == "dtype":
        msg.dtype = draw(st.sampled_from(["float32", "int32", "int64", "float64", "uint8",
                                          "complex64", "bfloat16", "object", "", "<i4"]))
    elif how == "shape":
        msg.shape[:] = draw(st.sampled_from([[n, 1], [1, n], [-n - 1], [], [n // 2, 2]]))
    elif how == "bytes":
        k = draw(st.integers(1, 7))
        msg.data = data + b"\x00" * k if draw(st.booleans()) or not data else data[:-k]


@st.composite
def rollouts(draw) -> pb.Rollout:
    """A wire rollout that is valid except for 0-3 fields, each broken in one of many ways
    (about a third of the draws are entirely valid)."""
    k = draw(st.sampled_from([0, 0, 1, 1, 2, 3]))
    broken = set(draw(st.lists(st.sampled_from(FIELDS), min_size=k, max_size=k)))
    m = pb.Rollout()
    c = draw(st.integers(1, MAX_COMPLETION))
    if "length" in broken:  # empty or longer than allowed, consistently in every array
        c = draw(st.sampled_from([0, MAX_COMPLETION + 1, MAX_COMPLETION + 7]))
    p = draw(st.integers(1, MAX_PROMPT))
    if "prompt_ids" in broken and draw(st.booleans()):
        p = draw(st.sampled_from([0, MAX_PROMPT + 1]))  # empty is fine, too long is not
        broken.discard("prompt_ids")
    _array(draw, m.prompt_ids, "int32", p, IDS, BAD_IDS, "prompt_ids" in broken)
    _array(draw, m.completion_ids, "int32", c, IDS, BAD_IDS, "completion_ids" in broken)
    _array(draw, m.logp_behaviour, "float32", c, LOGPS, BAD_LOGPS, "logp_behaviour" in broken)
    _array(draw, m.version, "int32", c, VERSIONS, BAD_VERSIONS, "version" in broken)
    if "kv_version" in broken or draw(st.booleans()):
        _array(draw, m.kv_version, "int32", c, st.integers(0, 0), BAD_VERSIONS,
               "kv_version" in broken)  # all 0: never newer than version
    else:
        m.kv_version.CopyFrom(m.version)  # the usual case: kv == version
    for name in EPISODE:  # present in half the draws (a multi-turn episode)
        if name in broken or draw(st.booleans()):
            _episode_array(draw, getattr(m, name), name, c, name in broken)
    for name in ("reward", "advantage"):
        setattr(m, name, draw(BAD_FLOATS if name in broken else st.floats(-10, 10)))
    for name in ("submit_time", "start_time", "finish_time"):
        setattr(m, name, draw(st.floats(0, 2e9)))
    if "times" in broken:
        setattr(m, draw(st.sampled_from(["submit_time", "start_time", "finish_time"])),
                draw(BAD_FLOATS))
    m.group_id = draw(st.sampled_from(["", "x" * 257])) if "group_id" in broken else "g"
    m.group_size = draw(st.sampled_from([0, -1, MAX_GROUP + 1, 2**31 - 1])) \
        if "group_size" in broken else draw(st.sampled_from([1, 1, 1, 2]))
    for name in ("task_id", "engine_id"):
        setattr(m, name, draw(st.text(min_size=257, max_size=300) if name in broken
                              else st.text(max_size=12)))
    m.finish_reason = draw(st.text(max_size=6).filter(lambda x: x not in records.FINISH_REASONS)
                           if "finish_reason" in broken
                           else st.sampled_from(records.FINISH_REASONS))
    m.start_version = draw(st.one_of(st.integers(-2**40, -1), st.integers(ANNOUNCED + 1, 2**40))
                           if "start_version" in broken else VERSIONS)
    if "metrics" in broken:
        m.metrics.update(draw(st.one_of(
            st.fixed_dictionaries({"acc": BAD_FLOATS}),
            st.fixed_dictionaries({"": st.floats(-1, 1)}),
            st.fixed_dictionaries({"k" * 257: st.floats(-1, 1)}),
            st.dictionaries(st.text(min_size=1, max_size=4), st.floats(-1, 1), min_size=65,
                            max_size=66))))
    else:
        m.metrics.update(draw(st.dictionaries(st.text(min_size=1, max_size=6),
                                              st.floats(-1, 1), max_size=2)))
    return m
