"""The weight message (`WeightVersion`): receivers refuse LoRA adapters of another base
(naming both hashes) and versions of an unknown kind, in memory and at the transport
boundary (a real gRPC stream, refused before anything is allocated); a version's frames are
assembled once whatever the number of subscribers."""
import time

import numpy as np
import pytest

from pipelinerl_jax.models import LoRASpec
from pipelinerl_jax.transport import rollout_pb2 as pb
from pipelinerl_jax.transport.retry import RetryPolicy
from pipelinerl_jax.transport.weight_version import (WeightVersion, WeightVersionRefused,
                                                     check_receivable)
from pipelinerl_jax.transport.weights import WeightPublisher, WeightSubscriber
from tests.transport.fake_weight_stream import ScriptedPublisher, good_frames

FAST = RetryPolicy(initial_s=0.01, max_s=0.05)
SPEC = LoRASpec(4, 8.0, ("q_proj",))
OURS, THEIRS = "a" * 64, "b" * 64
ADAPTERS = {"layers/0/attn/q_proj_lora_a": np.ones((8, 4), np.float32)}


def _lora(version, base=OURS):
    return WeightVersion("lora", base, SPEC).carrying(version, tensors=ADAPTERS)


def test_a_receiver_refuses_adapters_of_another_base_naming_both_hashes():
    serves = WeightVersion("lora", OURS, SPEC)
    check_receivable(serves, _lora(1))  # the same base: fine
    with pytest.raises(WeightVersionRefused, match=f"base sha256 {THEIRS}.*base sha256 {OURS}"):
        check_receivable(serves, _lora(1, THEIRS))
    with pytest.raises(WeightVersionRefused, match="kind 'full'"):
        check_receivable(serves, WeightVersion("full").carrying(1, tensors=ADAPTERS))
    with pytest.raises(WeightVersionRefused, match="does not match"):
        check_receivable(serves, WeightVersion("lora", OURS, LoRASpec(2, 8.0, ("q_proj",)))
                         .carrying(1, tensors=ADAPTERS))


def test_an_unknown_kind_is_refused():
    with pytest.raises(WeightVersionRefused, match="unknown kind 'int4'"):
        WeightVersion("int4")
    with pytest.raises(WeightVersionRefused, match="without their base's sha256"):
        WeightVersion("lora", "", SPEC)


def _header_frames(version, **fields):
    """Frames of a one-tensor version whose header carries `fields`."""
    frames = good_frames(version, {"layers/0/attn/q_proj_lora_a": ADAPTERS[
        "layers/0/attn/q_proj_lora_a"]})
    msg = pb.WeightMessage.FromString(frames[0])
    for k, v in fields.items():
        if isinstance(v, list):
            getattr(msg.header, k)[:] = v
        else:
            setattr(msg.header, k, v)
    return [msg.SerializeToString(), *frames[1:]]


@pytest.mark.parametrize("fields,why", [
    (dict(kind="int4"), "unknown kind 'int4'"),
    (dict(kind=""), "unknown kind ''"),
    (dict(kind="lora", base_sha256=THEIRS, lora_rank=4, lora_alpha=8.0,
          lora_targets=["q_proj"]), f"base sha256 {THEIRS}, this receiver holds base sha256 "
                                    f"{OURS}"),
])
def test_the_subscriber_refuses_them_at_the_transport_boundary(fields, why):
    """A hostile or mismatched header is refused before its buffer is allocated; the
    callback never runs, and a good version afterwards still arrives."""
    got = []
    good = _header_frames(2, kind="lora", base_sha256=OURS, lora_rank=4, lora_alpha=8.0,
                          lora_targets=["q_proj"])
    with ScriptedPublisher([_header_frames(1, **fields), good]) as pub:
        sub = WeightSubscriber(pub.address, got.append, retry=FAST,
                               accepts=WeightVersion("lora", OURS, SPEC))
        try:
            assert sub.wait_for_version(2, 30), sub.last_error
        finally:
            sub.close()
    assert [m.version for m in got] == [2]
    assert got[0].kind == "lora" and got[0].base_sha256 == OURS and got[0].lora == SPEC
    assert sub.errors >= 1


def test_a_real_publisher_and_subscriber_refuse_another_base():
    got = []
    with WeightPublisher() as pub:
        sub = WeightSubscriber(pub.address, got.append, retry=FAST,
                               accepts=WeightVersion("lora", OURS, SPEC))
        try:
            pub.publish(_lora(1, THEIRS))
            deadline = time.monotonic() + 30
            while not (got or sub.errors) and time.monotonic() < deadline:
                time.sleep(0.01)  # until version 1 was refused (or, wrongly, applied)
            assert not got and OURS in sub.last_error and THEIRS in sub.last_error
            pub.publish(_lora(2))
            assert sub.wait_for_version(2, 30)
        finally:
            sub.close()
    assert [m.version for m in got] == [2]


def test_frames_are_assembled_once_for_every_subscriber():
    params = {"w": np.arange(50_000, dtype=np.float32)}
    with WeightPublisher(chunk_bytes=16 << 10) as pub:
        subs = [WeightSubscriber(pub.address, lambda m: None, retry=FAST) for _ in range(3)]
        try:
            pub.publish(WeightVersion("full").carrying(1, tensors=params))
            assert all(s.wait_for_version(1, 30) for s in subs)
        finally:
            for s in subs:
                s.close()
        assert pub.latest_assembled_bytes == params["w"].nbytes  # once, not three times
