"""The transport under hostile or oversized traffic, one named test per property:

- no accepted group is lost to the piece size at a small `max_message_bytes`, and a put that
  could never be delivered is refused at put time (client and server);
- a held rollout keeps only its counted bytes (no unknown fields kept alive);
- request ids and the remembered-id tables are capped (in bytes, not only entries);
- `--token_file` is read as its first line; a bad one fails with a clear error;
- a weight header claiming hundreds of GiB, or a chunk whose `data` has another wire type,
  is discarded and the subscriber lives on;
plus: RESOURCE_EXHAUSTED that is not backpressure, the standalone server's non-loopback bind,
and a malformed directory publication's path.
"""
import os
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest

from pipelinerl_jax.transport import rollout_pb2 as pb
from pipelinerl_jax.transport.codec import Limits, rollout_to_pb, validate_rollout
from pipelinerl_jax.transport.wire import len_field, varint as _varint
from pipelinerl_jax.transport.queue_client import (RolloutQueueClient, RolloutRejected,
                                                   TransportError)
from pipelinerl_jax.transport.retry import RetryPolicy
from pipelinerl_jax.transport.queue_core import QueueCore
from pipelinerl_jax.transport.queue_server import SERVICE, RolloutQueueServer
from pipelinerl_jax.transport.security import load_token
from tests.transport.flat_weights import FlatSubscriber as WeightSubscriber
from fake_weight_stream import ScriptedPublisher, good_frames, params_of
from transport_testlib import HandlerContext, eventually, make_group, make_rollout

MIB = 1 << 20
FAST = RetryPolicy(initial_s=0.01, max_s=0.1)


def _raw_put(address: str, raw: bytes, limit: int = 8 * MIB):
    channel = grpc.insecure_channel(address, options=[
        ("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)])
    try:
        channel.unary_unary(f"/{SERVICE}/Put", request_serializer=lambda b: b,
                            response_deserializer=pb.PutResponse.FromString)(raw, timeout=10)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details()
    finally:
        channel.close()


def _rollout_of_size(group_id: str, group_size: int, nbytes: int) -> pb.Rollout:
    """A valid wire rollout whose PutRequest (alone, no ids) serializes to exactly `nbytes`."""
    m = rollout_to_pb(make_rollout(group_id, group_size, completion=(nbytes - 400) // 16))
    for k in range(0, 257):
        m.task_id = "t" * k
        if pb.PutRequest(rollouts=[m]).ByteSize() == nbytes:
            return m
    raise AssertionError(f"no rollout of exactly {nbytes} bytes")


# ------------------------------------------------------------------ 1. no accepted group lost

def test_two_large_rollouts_of_one_group_are_delivered_at_a_1mib_limit():
    with RolloutQueueServer(max_message_bytes=MIB) as server:
        client = RolloutQueueClient(server.address, max_message_bytes=MIB, retry=FAST)
        group = make_group("big2", 2, completion=39_000)  # two ~0.6 MiB rollouts
        client.put(group[:1])
        client.put(group[1:])
        batch = client.get_batch(1, 5.0, 0)
        assert batch is not None and len(batch.rollouts) == 2
        assert client.ack([batch.batch_id]) == 1
        assert client.stats()["held_rollouts"] == 0


def test_a_put_that_could_never_be_delivered_is_refused_at_put_time():
    with RolloutQueueServer(max_message_bytes=MIB) as server:
        raw = pb.PutRequest(rollouts=[_rollout_of_size("exact", 1, MIB)]).SerializeToString()
        assert len(raw) == MIB  # gRPC lets exactly the limit through ...
        code, details = _raw_put(server.address, raw)
        # ... but a batch carrying it would exceed the limit: refused, naming the rollout.
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert details.startswith("rollouts[0]: ") and "max_message_bytes" in details
        client = RolloutQueueClient(server.address, max_message_bytes=MIB)
        assert client.stats()["held_rollouts"] == 0 and client.stats()["put_requests"] == 0


def test_near_limit_rollout_batched_with_a_small_group_both_arrive():
    with RolloutQueueServer(max_message_bytes=MIB) as server:
        near = _rollout_of_size("near", 1, MIB - 2048)  # deliverable on its own
        assert _raw_put(server.address, pb.PutRequest(rollouts=[near]).SerializeToString())[0] \
            == grpc.StatusCode.OK
        client = RolloutQueueClient(server.address, max_message_bytes=MIB, retry=FAST)
        client.put_group(make_group("small", 2, completion=200))  # ~3 KiB each
        batch = client.get_batch(2, 5.0, 0)
        assert batch is not None
        assert sorted(r.group_id for r in batch.rollouts) == ["near", "small", "small"]
        assert client.ack([batch.batch_id]) == 1
        assert client.stats()["held_rollouts"] == 0 and client.stats()["held_bytes"] == 0


def test_client_refuses_an_undeliverable_rollout_before_sending():
    with RolloutQueueServer(max_message_bytes=MIB) as server:
        client = RolloutQueueClient(server.address, max_message_bytes=MIB)
        exact = make_rollout("exact", 1, completion=(MIB - 200) // 16)
        with pytest.raises(RolloutRejected) as e:
            client.put_group([exact])
        assert e.value.field == "rollouts[0]" and "max_message_bytes" in e.value.details
        assert client.stats()["put_invalid"] == 0  # never sent


def test_a_batch_whose_stream_broke_is_delivered_again_to_the_same_session():
    server = RolloutQueueServer(max_message_bytes=MIB)  # handlers only, never started
    for g in ("a", "b"):
        raw = pb.PutRequest(rollouts=[_rollout_of_size(g, 1, 600_000)]).SerializeToString()
        server.handlers["Put"].unary_unary(raw, HandlerContext())
    request = pb.GetBatchRequest(num_groups=2, session_id="s", request_id="r1", timeout_s=0)
    stream = server.handlers["GetBatch"].unary_stream(request.SerializeToString(),
                                                      HandlerContext())
    first = pb.GetBatchResponse.FromString(next(stream))  # two pieces: the limit is 1 MiB
    stream.close()  # the connection broke before the second piece was sent
    again = pb.GetBatchRequest(num_groups=2, session_id="s", request_id="r2", timeout_s=0)
    pieces = [pb.GetBatchResponse.FromString(p) for p in server.handlers["GetBatch"]
              .unary_stream(again.SerializeToString(), HandlerContext())]
    assert pieces and pieces[0].batch_id == first.batch_id and pieces[0].redelivered
    assert sorted(m.group_id for p in pieces for m in p.rollouts) == ["a", "b"]
    assert all(len(p.SerializeToString()) <= MIB for p in pieces)


def test_a_batch_too_large_for_the_client_is_not_reported_as_a_rejected_rollout():
    with RolloutQueueServer(max_message_bytes=4 * MIB) as server:
        producer = RolloutQueueClient(server.address, max_message_bytes=4 * MIB)
        producer.put_group(make_group("wide", 2, completion=40_000))  # one ~1.3 MB piece
        learner = RolloutQueueClient(server.address, max_message_bytes=MIB)
        with pytest.raises(TransportError) as e:
            learner.get_batch(1, 5.0, 0)
        assert not isinstance(e.value, RolloutRejected)
        assert "max_message_bytes" in str(e.value)


# ------------------------------------------------------------------ 2. memory = what is counted

def test_a_held_rollout_keeps_only_its_counted_bytes():
    marker = b"UNKNOWN-FIELD-MARKER"
    payload = marker * (MIB // len(marker))
    m = rollout_to_pb(make_rollout("g", 1))
    inner = m.SerializeToString() + len_field(999, 3 * len(marker)) + marker * 3
    raw = (pb.PutRequest(request_id="r").SerializeToString() +
           len_field(1, len(inner)) + inner +  # rollouts[0], with an unknown field
           len_field(999, len(payload)) + payload)  # ~1 MiB of unknown field in the request
    server = RolloutQueueServer()
    resp = server.handlers["Put"].unary_unary(raw, HandlerContext())
    assert resp.accepted == 1
    core = server.core
    kept = [member for group in list(core._pending.values()) + list(core._ready)
            for member in group.members]
    assert len(kept) == 1
    # What is kept is a self-contained bytes object (it references no request message),
    # without unknown fields, and exactly as large as what capacity_bytes counts.
    assert isinstance(kept[0], bytes) and marker not in kept[0]
    assert len(kept[0]) == core.stats().held_bytes == len(m.SerializeToString())


# ------------------------------------------------------------------ 3. string caps, bounded tables

@pytest.mark.parametrize("field", ["request_id", "producer_id"])
def test_put_ids_are_capped(field):
    with RolloutQueueServer() as server:
        request = pb.PutRequest(rollouts=[rollout_to_pb(make_rollout("g", 1))])
        setattr(request, field, "x" * MIB)
        code, details = _raw_put(server.address, request.SerializeToString())
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"{field}: ")
        setattr(request, field, "x" * 128)
        assert _raw_put(server.address, request.SerializeToString())[0] == grpc.StatusCode.OK


def test_get_batch_ack_and_stats_ids_are_capped():
    server = RolloutQueueServer()
    long = "x" * 10_000
    cases = [("GetBatch", pb.GetBatchRequest(num_groups=1, session_id=long), "session_id"),
             ("GetBatch", pb.GetBatchRequest(num_groups=1, session_id="s", request_id=long),
              "request_id"),
             ("Ack", pb.AckRequest(batch_ids=["ok", long]), "batch_ids[1]"),
             ("GetStats", pb.StatsRequest(producer_id=long), "producer_id")]
    for method, request, field in cases:
        handler = server.handlers[method]
        call = handler.unary_stream if handler.response_streaming else handler.unary_unary
        with pytest.raises(HandlerContext.Aborted) as e:
            out = call(request.SerializeToString(), HandlerContext())
            list(out) if handler.response_streaming else out
        assert e.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.args[1].startswith(f"{field}: "), e.value.args


def test_remembered_ids_are_bounded_in_bytes():
    core = QueueCore(capacity_rollouts=10_000, remember_bytes=64 << 10)
    core.set_version(0)
    for i in range(2000):
        m = rollout_to_pb(make_rollout(f"g{i}-" + "y" * 120, 1))
        core.put([m.SerializeToString()], [validate_rollout(m, Limits(), 0)],
                 request_id=f"{i}-" + "r" * 120, producer_id=f"p{i}-" + "q" * 120)
    remembered = core.remembered_bytes()
    assert 0 < remembered <= 4 * (64 << 10)  # four tables, each within its byte budget
    assert core.stats().put_requests == 2000


# ------------------------------------------------------------------ 4. token files

def test_a_token_file_is_read_as_its_first_line_by_server_and_client(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("line-one\nline-two\n")
    assert load_token(token_file=str(token_file)) == "line-one"
    token = load_token(token_file=str(token_file))
    with RolloutQueueServer(token=token) as server:
        client = RolloutQueueClient(server.address, token=token)
        client.wait_ready(5)
        client.put_group(make_group("g", 1))
        channel = grpc.insecure_channel(server.address)
        stats = channel.unary_unary(f"/{SERVICE}/GetStats",
                                    request_serializer=pb.StatsRequest.SerializeToString,
                                    response_deserializer=pb.QueueStats.FromString)
        assert stats(pb.StatsRequest(), metadata=(("authorization", "Bearer line-one"),),
                     timeout=5).put_requests == 1
        channel.close()


@pytest.mark.parametrize("content,why", [("", "empty"), ("\nsecond\n", "empty"),
                                         ("tok en\n", "character"), ("t\x01k\n", "character"),
                                         ("x" * 5000, "longer")])
def test_a_bad_token_file_fails_with_a_clear_error(tmp_path, content, why):
    token_file = tmp_path / "token"
    token_file.write_text(content)
    with pytest.raises(ValueError, match=why) as e:
        load_token(token_file=str(token_file))
    assert str(token_file) in str(e.value)


@pytest.mark.slow  # starts the standalone server process
def test_standalone_server_reads_the_first_line_of_its_token_file(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("abc\ncomment: rotated 2026-12-01\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelinerl_jax.transport.queue_server", "--port", "0",
         "--token_file", str(token_file)], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        line = proc.stdout.readline()
        assert line.startswith("RolloutQueue listening on"), line
        client = RolloutQueueClient(line.split()[-1],
                                    token=load_token(token_file=str(token_file)))
        client.wait_ready(10)
        assert client.put_group(make_group("g", 1)).accepted == 1
    finally:
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------ 5, 6. weight subscribers

def _huge_header(gib: int = 900) -> bytes:
    n = gib << 30
    h = pb.WeightHeader(kind="full", version=7, publisher_id="hostile", total_bytes=n, num_chunks=1)
    h.tensors.add(name="a", dtype="uint8", shape=[n], offset=0, nbytes=n)
    return pb.WeightMessage(header=h).SerializeToString()


def _chunk_with_varint_data() -> list:
    """A good version whose first chunk carries `data` (field 5) as a varint."""
    frames = good_frames(7, params_of(7), publisher_id="hostile")
    body = pb.WeightChunk(version=7, index=0, offset=0).SerializeToString() + b"\x28\x05"
    return [frames[0], b"\x12" + _varint(len(body)) + body, *frames[2:]]


@pytest.mark.parametrize("hostile", ["huge_header", "data_wire_type"])
def test_a_hostile_version_is_discarded_and_the_subscriber_lives_on(hostile):
    bad = [_huge_header()] if hostile == "huge_header" else _chunk_with_varint_data()
    good = good_frames(8, params_of(8), publisher_id="hostile")
    applied = []
    with ScriptedPublisher([bad, good], hold_open_s=5.0) as pub:
        sub = WeightSubscriber(pub.address, lambda v, p, pv: applied.append(
            (v, float(p["a"][0]))), retry=FAST)
        try:
            assert sub.wait_for_version(8, 15), sub.last_error
            assert applied == [(8, 8.0)]
            assert sub.versions_discarded >= 1 and sub.reconnects >= 1
            assert sub.health()["alive"] and sub.health()["errors"] >= 1
            assert ("total_bytes" if hostile == "huge_header" else "wire type") in \
                sub.last_error
        finally:
            sub.close()


def test_a_version_is_bounded_by_the_shapes_the_subscriber_expects():
    expected = {"a": (300,), "b": (3, 5)}
    wrong = {"a": np.zeros(301, np.float32), "b": np.zeros((3, 5), np.int32)}
    extra = {**params_of(9), "c": np.zeros(4, np.float32)}
    scripts = [good_frames(7, wrong, "p"), good_frames(8, extra, "p"),
               good_frames(9, params_of(9), "p")]
    applied = []
    with ScriptedPublisher(scripts, hold_open_s=5.0) as pub:
        sub = WeightSubscriber(pub.address, lambda v, p, pv: applied.append(v), retry=FAST,
                               expected_shapes=expected)
        try:
            assert sub.wait_for_version(9, 15), sub.last_error
            assert applied == [9] and sub.versions_discarded == 2
        finally:
            sub.close()


def _dir_version(version: int, path, tensors: bool = False) -> list:
    """The frames of a directory publication: a header with `path`, one empty chunk, the
    commit (with `tensors`: a real version's frames whose header also claims a path)."""
    if tensors:
        frames = good_frames(version, params_of(version), publisher_id="hostile")
    else:
        frames = good_frames(version, {"x": np.zeros(1, np.float32)}, publisher_id="hostile")
        empty = pb.WeightHeader(kind="full", version=version, publisher_id="hostile", total_bytes=0,
                                num_chunks=1, has_crc32=True)
        frames = [pb.WeightMessage(header=empty).SerializeToString(),
                  pb.WeightMessage(chunk=pb.WeightChunk(version=version, index=0, offset=0,
                                                        crc32=0)).SerializeToString(),
                  pb.WeightMessage(commit=pb.WeightCommit(
                      version=version, total_bytes=0, num_chunks=1)).SerializeToString()]
    msg = pb.WeightMessage.FromString(frames[0])
    if path is not None:
        msg.header.path = path
    return [msg.SerializeToString(), *frames[1:]]


@pytest.mark.parametrize("hostile,why", [
    ("relative", "not absolute"), ("nul", "NUL"), ("long", "characters"),
    ("with_tensors", "a directory publication"), ("neither", "neither tensors nor a path")])
def test_a_malformed_directory_publication_is_refused_with_its_reason(hostile, why):
    """The path an 'hf_dir' version carries is checked at the transport boundary like every
    other header field: refused with the reason, the subscriber thread lives on and applies
    the next good version (a directory path handed over as a str)."""
    path = {"relative": "weights/v00000007", "nul": "/w/v7\0/../etc",
            "long": "/" + "x" * 5000, "with_tensors": "/w/v00000007", "neither": None}[hostile]
    bad = _dir_version(7, path, tensors=hostile == "with_tensors")
    good = _dir_version(8, "/shared/weights/v00000008")
    applied = []
    with ScriptedPublisher([bad, good], hold_open_s=5.0) as pub:
        sub = WeightSubscriber(pub.address, lambda v, p, pv: applied.append((v, p)), retry=FAST)
        try:
            assert eventually(lambda: why in (sub.last_error or "")), sub.last_error
            assert sub.wait_for_version(8, 15), sub.last_error
            assert applied == [(8, "/shared/weights/v00000008")]
            assert sub.versions_discarded >= 1 and sub.health()["alive"]
        finally:
            sub.close()


# ------------------------------------------------------------------ also

def test_resource_exhausted_that_is_not_backpressure_fails_fast():
    def put(raw, context):  # e.g. gRPC refusing oversized metadata: no backpressure marker
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      "received metadata size exceeds hard limit")

    from concurrent import futures
    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "Put": grpc.unary_unary_rpc_method_handler(put, lambda b: b,
                                                   pb.PutResponse.SerializeToString)})
    fake = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler])
    port = fake.add_insecure_port("127.0.0.1:0")
    fake.start()
    try:
        client = RolloutQueueClient(f"127.0.0.1:{port}", retry=FAST)
        out = {}

        def run():
            try:
                client.put_group(make_group("g", 1))
            except Exception as e:  # noqa: BLE001 - recorded for the assertion
                out["e"] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(5)
        assert not t.is_alive(), "a non-backpressure RESOURCE_EXHAUSTED was retried forever"
        assert isinstance(out["e"], TransportError)
        assert out["e"].code == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        fake.stop(0)


def test_backpressure_is_still_retried():
    with RolloutQueueServer(capacity_rollouts=1, max_hold_s=0.0) as server:
        client = RolloutQueueClient(server.address, retry=FAST, hold_s=0.0)
        client.put_group(make_group("first", 1))
        t = threading.Thread(target=client.put_group, args=(make_group("second", 1),),
                             daemon=True)
        t.start()
        assert eventually(lambda: client.retry_counts["RESOURCE_EXHAUSTED"] >= 2)
        batch = client.get_batch(1, 5.0, 0)
        client.ack([batch.batch_id])
        t.join(10)
        assert not t.is_alive()


@pytest.mark.slow  # starts the standalone server process
def test_standalone_server_refuses_an_insecure_non_loopback_bind():
    proc = subprocess.run(
        [sys.executable, "-m", "pipelinerl_jax.transport.queue_server", "--host", "0.0.0.0",
         "--port", "0"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode != 0 and "not a loopback address" in proc.stderr, proc.stderr
