"""Hostile producers against a real RolloutQueue server (gRPC on 127.0.0.1).

Beyond tests/transport (one named corruption per message, garbage bytes answered with an
allowed code): here hypothesis corrupts any combination of fields at once and an independent
oracle (`hostile.problems`) decides what is valid, so the server must accept a rollout
*exactly* when it is valid and, when not, name one of its bad fields; serialized requests are
also truncated, bit-flipped and spliced. Then a consumer takes everything the server will
deliver and checks every row again: zero bad rows, zero partial groups. Counts are printed."""
import collections
import itertools
import time
import uuid

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings, strategies as st

from pipelinerl_jax.transport import rollout_pb2 as pb
from pipelinerl_jax.transport.codec import Limits, rollout_to_pb
from pipelinerl_jax.transport.queue_client import RolloutQueueClient
from pipelinerl_jax.transport.queue_server import SERVICE, RolloutQueueServer
from tests.reliability import hostile
from tests.reliability.hostile import ANNOUNCED, problems

COUNTS = collections.Counter()
IDS = itertools.count()
FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(scope="module")
def queue():
    server = RolloutQueueServer(
        limits=Limits(vocab_size=hostile.VOCAB, max_prompt_tokens=hostile.MAX_PROMPT,
                      max_completion_tokens=hostile.MAX_COMPLETION,
                      max_group_size=hostile.MAX_GROUP),
        capacity_rollouts=1 << 20, incomplete_group_timeout_s=1.0,
        max_message_bytes=1 << 20).start()
    client = RolloutQueueClient(server.address)
    client.set_version(ANNOUNCED)
    channel = grpc.insecure_channel(server.address)
    put = channel.unary_unary(f"/{SERVICE}/Put", request_serializer=lambda b: b,
                              response_deserializer=pb.PutResponse.FromString)
    yield server, client, put
    channel.close()
    client.close()
    server.stop(0)


def _send(put, raw: bytes):
    """(status code, details) of one raw Put."""
    try:
        put(raw, timeout=10)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details()


@settings(FUZZ, max_examples=250)
@given(hostile.rollouts())
def test_a_rollout_is_stored_exactly_when_valid(queue, m):
    _, _, put = queue
    if m.group_id == "g":
        m.group_id = f"g{next(IDS)}"  # every fuzzed rollout is its own group
    bad = problems(m)
    code, details = _send(put, pb.PutRequest(rollouts=[m], request_id=uuid.uuid4().hex)
                          .SerializeToString())
    if not bad:
        assert code == grpc.StatusCode.OK, f"valid rollout refused: {details}"
        COUNTS["accepted"] += 1
        COUNTS["accepted_whole" if m.group_size == 1 else "accepted_partial"] += 1
        return
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details, bad)
    field = details.split(":")[0]
    assert field.startswith("rollouts[0].") and \
        any(field[len("rollouts[0]."):].startswith(b) for b in bad), (details, bad)
    COUNTS["rejected"] += 1
    COUNTS[f"rejected:{field[len('rollouts[0].'):].split('[')[0]}"] += 1


def _valid_group(size=2):
    gid = f"ok{next(IDS)}"
    msgs = []
    for i in range(size):
        m = pb.Rollout(group_id=gid, group_size=size, finish_reason="stop", task_id="t",
                       engine_id="e", start_version=ANNOUNCED, reward=1.0, advantage=0.5)
        for name, values in (("prompt_ids", [1, 2, 3]), ("completion_ids", [4, 5, i]),
                             ("logp_behaviour", [-0.5, -1.0, -2.0]),
                             ("version", [ANNOUNCED] * 3), ("kv_version", [ANNOUNCED] * 3),
                             ("loss_mask", [1, 0, 1]), ("turn_index", [0, 0, 1])):
            a = getattr(m, name)
            a.dtype = {**hostile.ARRAYS, **hostile.EPISODE}[name]
            a.shape[:] = [len(values)]
            a.data = np.asarray(values, a.dtype).tobytes()
        msgs.append(m)
    return msgs


@settings(FUZZ, max_examples=250)
@given(st.data())
def test_corrupted_request_bytes_never_store_a_bad_row(queue, data):
    _, _, put = queue
    raw = bytearray(pb.PutRequest(rollouts=_valid_group(), request_id=uuid.uuid4().hex)
                    .SerializeToString())
    for _ in range(data.draw(st.integers(1, 3))):
        op = data.draw(st.sampled_from(["truncate", "flip", "insert", "delete"]))
        i = data.draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "truncate":
            del raw[i:]
        elif op == "flip" and raw:
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "insert":
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del raw[i:i + data.draw(st.integers(1, 8))]
    code, details = _send(put, bytes(raw))
    # Stored whole, or refused with a reason; nothing in between (rows are checked when
    # delivered, in the last test).
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.FAILED_PRECONDITION), (code, details)
    assert code == grpc.StatusCode.OK or ": " in details
    COUNTS["bytes_accepted" if code == grpc.StatusCode.OK else "bytes_rejected"] += 1


def test_empty_oversize_and_foreign_messages(queue):
    server, client, put = queue
    assert _send(put, b"") == (grpc.StatusCode.INVALID_ARGUMENT, "rollouts: request is empty")
    code, details = _send(put, b"\x0a" + b"\xff" * 10)  # a length prefix past the end
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request: not a valid")
    code, _ = _send(put, pb.SetVersionRequest(version=3).SerializeToString())  # wrong message
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    big = _valid_group(1)
    big[0].metrics["pad"] = 0.0
    big[0].task_id = "x" * 200
    raw = pb.PutRequest(rollouts=big * 8000).SerializeToString()  # > 1 MiB
    code, details = _send(put, raw)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details
    COUNTS["rejected"] += 4


@pytest.mark.slow  # sleeps past the queue's group timeout
def test_a_partial_group_is_never_delivered_and_expires_counted(queue):
    server, client, put = queue
    first, second = _valid_group(2)
    assert _send(put, pb.PutRequest(rollouts=[first]).SerializeToString())[0] == \
        grpc.StatusCode.OK  # ... and the producer goes silent
    time.sleep(1.5)  # > incomplete_group_timeout_s: the queue expires it before the next put
    code, details = _send(put, pb.PutRequest(rollouts=[second]).SerializeToString())
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "expired" in details  # too late
    COUNTS["rejected"] += 1
    assert client.stats()["dropped_groups"]["incomplete_timeout"] >= 1


@pytest.mark.slow  # sleeps past the queue's group timeout
def test_every_delivered_row_is_valid_and_the_server_keeps_serving(queue, report):
    server, client, put = queue
    for _ in range(5):  # valid traffic goes on around the garbage
        assert _send(put, pb.PutRequest(rollouts=_valid_group()).SerializeToString())[0] == \
            grpc.StatusCode.OK
    time.sleep(1.2)  # let incomplete groups made by the corruptions expire
    delivered = groups = 0
    while (batch := client.get_batch(1, 0.5, learner_version=ANNOUNCED)) is not None:
        members = collections.Counter(r.group_id for r in batch.rollouts)
        assert len(members) == 1
        for r in batch.rollouts:
            assert members[r.group_id] == r.group_size, "a partial group was delivered"
            bad = problems(rollout_to_pb(r))
            assert not bad, f"delivered a bad row ({bad}): {r}"
            delivered += 1
        groups += 1
        client.ack([batch.batch_id])
    stats = client.stats()
    # Every valid whole group came out (plus corrupted requests that were still valid); the
    # valid first members of larger groups never completed and expired, counted.
    assert groups >= COUNTS["accepted_whole"] + 5 and delivered >= groups
    assert stats["dropped_groups"].get("incomplete_timeout", 0) >= COUNTS["accepted_partial"]
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.address)).Check(
        health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    tried = COUNTS["accepted"] + COUNTS["rejected"] + COUNTS["bytes_accepted"] + \
        COUNTS["bytes_rejected"]
    by_field = ", ".join(f"{k.split(':')[1]} {v}" for k, v in sorted(COUNTS.items())
                         if k.startswith("rejected:"))
    report(f"[fuzz] queue put path: {tried} hostile requests ({COUNTS['accepted']} valid "
           f"stored, {COUNTS['rejected']} refused naming a bad field [{by_field}]; "
           f"{COUNTS['bytes_accepted']} + {COUNTS['bytes_rejected']} corrupted byte strings "
           f"stored / refused); delivered {delivered} rows in {groups} groups, 0 bad; "
           f"server: {stats['put_invalid']} invalid puts counted, "
           f"{stats['dropped_groups'].get('incomplete_timeout', 0)} partial groups expired")
