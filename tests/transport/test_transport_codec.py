"""Wire conversions and the boundary checks every rollout passes."""
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pipelinerl_jax.transport import rollout_pb2 as pb
from pipelinerl_jax.transport.codec import (
    InvalidRollout, Limits, array_from_pb, array_to_pb, rollout_from_pb, rollout_to_pb,
    validate_rollout)
from transport_testlib import make_rollout

LIMITS = Limits(vocab_size=100, max_prompt_tokens=16, max_completion_tokens=32,
                max_group_size=8)


def test_rollout_round_trip_keeps_every_field():
    r = make_rollout("grp", 4, completion=5, version=3)
    r.kv_version = np.array([1, 2, 3, 3, 3], np.int32)
    r.finish_reason, r.metrics = "length", {"correct": 1.0, "len": 5.0}
    back = rollout_from_pb(pb.Rollout.FromString(rollout_to_pb(r).SerializeToString()))
    for name in ("prompt_ids", "completion_ids", "logp_behaviour", "version", "kv_version"):
        a, b = getattr(r, name), getattr(back, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
        assert b.flags.writeable, name
    for name in ("reward", "advantage", "group_id", "group_size", "task_id", "finish_reason",
                 "start_version", "engine_id", "submit_time", "start_time", "finish_time",
                 "metrics"):
        assert getattr(r, name) == getattr(back, name), name


def test_episode_arrays_round_trip_and_absent_means_single_turn():
    r = make_rollout("grp", 4, completion=6, version=3)
    assert r.loss_mask is None and r.turn_index is None
    m = rollout_to_pb(r)
    assert not m.HasField("loss_mask") and not m.HasField("turn_index")
    back = rollout_from_pb(m)
    assert back.loss_mask is None and back.turn_index is None
    r.loss_mask = np.array([1, 1, 0, 0, 1, 1], bool)  # any integer-like dtype is cast
    r.turn_index = np.array([0, 0, 0, 0, 1, 1], np.int64)
    back = rollout_from_pb(pb.Rollout.FromString(rollout_to_pb(r).SerializeToString()))
    assert back.loss_mask.dtype == np.uint8 and back.turn_index.dtype == np.int32
    assert back.loss_mask.tolist() == [1, 1, 0, 0, 1, 1]
    assert back.turn_index.tolist() == [0, 0, 0, 0, 1, 1]
    assert validate_rollout(rollout_to_pb(r), LIMITS, max_version=10) is not None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "float16"])
def test_array_round_trip(dtype):
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    a = (np.arange(24).reshape(2, 3, 4) - 5).astype(dt)
    b = array_from_pb(pb.Array.FromString(array_to_pb(a, pb.Array()).SerializeToString()))
    assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)


def test_to_pb_refuses_lossy_casts():
    r = make_rollout()
    r.completion_ids = np.array([1, 2**40], np.int64)
    with pytest.raises(ValueError, match="completion_ids"):
        rollout_to_pb(r)


def _valid() -> pb.Rollout:
    return rollout_to_pb(make_rollout("g", 2, completion=6, version=2))


def _set_array(arr_msg: pb.Array, values, dtype="int32"):
    arr_msg.dtype, arr_msg.data = dtype, np.asarray(values, dtype).tobytes()
    arr_msg.shape[:] = [len(values)]


# Each mutation breaks one thing and names the field the server must blame.
MUTATIONS = {
    "negative prompt id": (lambda m, k: _set_array(m.prompt_ids, [1, -1 - k]), "prompt_ids"),
    "id >= vocab": (lambda m, k: _set_array(m.completion_ids, [0, 1, 2, 3, 4, 100 + k]),
                    "completion_ids"),
    "empty completion": (lambda m, k: [_set_array(getattr(m, f), [], dt) for f, dt in (
        ("completion_ids", "int32"), ("logp_behaviour", "float32"), ("version", "int32"),
        ("kv_version", "int32"))], "completion_ids"),
    "completion too long": (lambda m, k: _set_array(m.completion_ids, [1] * (33 + k)),
                            "completion_ids"),
    "prompt too long": (lambda m, k: _set_array(m.prompt_ids, [1] * (17 + k)), "prompt_ids"),
    "positive logp": (lambda m, k: _set_array(m.logp_behaviour, [-1.0] * 5 + [0.5 + k],
                                              "float32"), "logp_behaviour"),
    "nan logp": (lambda m, k: _set_array(m.logp_behaviour, [-1.0] * 5 + [math.nan],
                                         "float32"), "logp_behaviour"),
    "inf logp": (lambda m, k: _set_array(m.logp_behaviour, [-math.inf] * 6, "float32"),
                 "logp_behaviour"),
    "short logp": (lambda m, k: _set_array(m.logp_behaviour, [-1.0] * (k % 5 + 1), "float32"),
                   "logp_behaviour"),
    "long version": (lambda m, k: _set_array(m.version, [2] * (7 + k)), "version"),
    "negative version": (lambda m, k: _set_array(m.version, [2] * 5 + [-1 - k]), "version"),
    "future version": (lambda m, k: _set_array(m.version, [2] * 5 + [11 + k]), "version"),
    "future start_version": (lambda m, k: setattr(m, "start_version", 11 + k), "start_version"),
    "kv newer than version": (lambda m, k: _set_array(m.kv_version, [2] * 5 + [3]),
                              "kv_version"),
    "negative kv_version": (lambda m, k: _set_array(m.kv_version, [-1] * 6), "kv_version"),
    "float token ids": (lambda m, k: _set_array(m.completion_ids, [1.0] * 6, "float32"),
                        "completion_ids"),
    "unknown dtype": (lambda m, k: setattr(m.version, "dtype", "complex64"), "version"),
    "bytes vs shape": (lambda m, k: setattr(m.kv_version, "data", b"\x00" * (k % 23 + 1)),
                       "kv_version"),
    "2-d array": (lambda m, k: m.prompt_ids.shape.append(1), "prompt_ids"),
    "group_size 0": (lambda m, k: setattr(m, "group_size", -k), "group_size"),
    "group_size too big": (lambda m, k: setattr(m, "group_size", 9 + k), "group_size"),
    "empty group_id": (lambda m, k: setattr(m, "group_id", ""), "group_id"),
    "bad finish_reason": (lambda m, k: setattr(m, "finish_reason", f"x{k}"), "finish_reason"),
    "nan reward": (lambda m, k: setattr(m, "reward", math.nan), "reward"),
    "inf advantage": (lambda m, k: setattr(m, "advantage", -math.inf), "advantage"),
    "negative start_version": (lambda m, k: setattr(m, "start_version", -1 - k),
                               "start_version"),
    "nan metric": (lambda m, k: m.metrics.__setitem__("acc", math.nan), "metrics[acc]"),
    "long engine_id": (lambda m, k: setattr(m, "engine_id", "e" * (257 + k)), "engine_id"),
    # multi-turn episodes: loss_mask / turn_index (6 completion tokens)
    "short loss_mask": (lambda m, k: _set_array(m.loss_mask, [1] * (k % 5 + 1), "uint8"),
                        "loss_mask"),
    "loss_mask of 2": (lambda m, k: _set_array(m.loss_mask, [1] * 5 + [2 + k % 200], "uint8"),
                       "loss_mask"),
    "all-zero loss_mask": (lambda m, k: _set_array(m.loss_mask, [0] * 6, "uint8"), "loss_mask"),
    "int32 loss_mask": (lambda m, k: _set_array(m.loss_mask, [1] * 6, "int32"), "loss_mask"),
    "long turn_index": (lambda m, k: _set_array(m.turn_index, [0] * (7 + k)), "turn_index"),
    "negative turn_index": (lambda m, k: _set_array(m.turn_index, [-1 - k] + [0] * 5),
                            "turn_index"),
    "decreasing turn_index": (lambda m, k: _set_array(m.turn_index, [0, 1, 2 + k, 1, 3, 3]),
                              "turn_index"),
}


def mutated(name: str, k: int) -> tuple[pb.Rollout, str]:
    m = _valid()
    mutate, field = MUTATIONS[name]
    mutate(m, k)
    return m, field


def test_valid_rollout_passes_and_reports_versions():
    info = validate_rollout(_valid(), LIMITS, max_version=10)
    assert (info.group_id, info.group_size, info.min_version, info.max_version) == ("g", 2, 2, 2)


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_malformation_is_rejected_naming_its_field(name):
    m, field = mutated(name, 0)
    with pytest.raises(InvalidRollout) as e:
        validate_rollout(m, LIMITS, max_version=10)
    assert e.value.field == field, str(e.value)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(sorted(MUTATIONS)), st.integers(0, 1000))
def test_fuzzed_malformations_are_rejected(name, k):
    m, field = mutated(name, k)
    with pytest.raises(InvalidRollout) as e:
        validate_rollout(m, LIMITS, max_version=10)
    assert e.value.field == field and str(e.value).startswith(field)
