"""The RolloutQueue over real gRPC on 127.0.0.1: producers in separate processes, one consumer."""
import collections
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings, strategies as st

from pipelinerl_jax.transport import rollout_pb2 as pb
from pipelinerl_jax.transport.codec import Limits
from pipelinerl_jax.transport.queue_client import (
    QueueUnavailable, RolloutQueueClient, RolloutRejected, SessionSupersededError, TransportError)
from pipelinerl_jax.transport.retry import RetryPolicy
from pipelinerl_jax.transport.queue_server import SERVICE, RolloutQueueServer
from pipelinerl_jax.transport.security import TLSConfig
from test_transport_codec import MUTATIONS, mutated
from transport_testlib import make_group, make_rollout, producer_main, self_signed_pair

CTX = mp.get_context("spawn")
FAST_RETRY = RetryPolicy(initial_s=0.005, max_s=0.05)


@pytest.fixture
def server():
    s = RolloutQueueServer(limits=Limits(vocab_size=100, max_prompt_tokens=16,
                                         max_completion_tokens=32, max_group_size=8)).start()
    yield s
    s.stop(0)


def _key(r):
    return int(r.metrics["producer"]), r.group_id, int(r.metrics["member"])


def _check_whole_groups(batch):
    sizes = collections.Counter(r.group_id for r in batch.rollouts)
    assert len(sizes) == batch.num_groups
    for r in batch.rollouts:
        assert sizes[r.group_id] == r.group_size, f"group {r.group_id} split"


def _run_producers(address, n, groups, group_size, split_every, hold_s=1.0, completion=6):
    out_q = CTX.Queue()
    procs = [CTX.Process(target=producer_main,
                         args=(address, p, groups, group_size, split_every, out_q, hold_s,
                               completion), daemon=True)
             for p in range(n)]
    for p in procs:
        p.start()
    return procs, out_q


@pytest.mark.slow
def test_producer_processes_one_consumer_nothing_lost_or_split():
    n_prod, groups, size = 3, 24, 4
    with RolloutQueueServer(capacity_rollouts=48) as server:
        procs, out_q = _run_producers(server.address, n_prod, groups, size, split_every=3)
        consumer = RolloutQueueClient(server.address)
        seen, redelivered_keys, unacked = collections.Counter(), set(), []
        total = n_prod * groups * size
        deadline = time.monotonic() + 60
        reconnected = False
        while len(seen) < total and time.monotonic() < deadline:
            batch = consumer.get_batch(2 if total - len(seen) >= 2 * size else 1, 5.0, 0)
            if batch is None:
                continue
            _check_whole_groups(batch)
            for r in batch.rollouts:
                seen[_key(r)] += 1
                if batch.redelivered:
                    redelivered_keys.add(_key(r))
            if not reconnected and len(seen) >= total // 3:
                unacked.append(batch.batch_id)  # "crash" with this batch unacked
                if len(unacked) == 2:
                    consumer.close()
                    consumer = RolloutQueueClient(server.address)  # new session
                    reconnected = True
                continue
            consumer.ack([batch.batch_id])
        results = dict(out_q.get(timeout=30) for _ in procs)
        for p in procs:
            p.join(10)
        expected = {(p, f"p{p}-g{g}", m) for p in range(n_prod) for g in range(groups)
                    for m in range(size)}
        assert set(seen) == expected
        dupes = {k for k, c in seen.items() if c > 1}
        assert dupes == redelivered_keys and len(dupes) == 2 * 2 * size  # 2 batches x 2 groups
        stats = consumer.stats()
        assert stats["batches_redelivered"] == 2 and stats["max_held_rollouts"] <= 48
        assert stats["put_rollouts"] == total and stats["outstanding_batches"] == 0
        assert stats["put_refused_full"] == sum(r.get("RESOURCE_EXHAUSTED", 0)
                                                for r in results.values())


@pytest.mark.slow
def test_backpressure_keeps_the_queue_bounded_and_loses_nothing():
    capacity, n_prod, groups, size = 16, 2, 30, 4
    with RolloutQueueServer(capacity_rollouts=capacity, capacity_bytes=64 << 10) as server:
        # Producers hold at most 20 ms, then back off; the consumer takes one group per ~30 ms
        # while producers could put one every few ms: they outrun it well over 10x.
        procs, out_q = _run_producers(server.address, n_prod, groups, size, split_every=0,
                                      hold_s=0.02, completion=32)
        consumer = RolloutQueueClient(server.address)
        seen = collections.Counter()
        while sum(seen.values()) < n_prod * groups * size:
            batch = consumer.get_batch(1, 30.0, 0)
            assert batch is not None, "stalled"
            _check_whole_groups(batch)
            seen.update(_key(r) for r in batch.rollouts)
            time.sleep(0.03)
            consumer.ack([batch.batch_id])
        results = dict(out_q.get(timeout=30) for _ in procs)
        stats = consumer.stats()
    assert all(c == 1 for c in seen.values()) and len(seen) == n_prod * groups * size
    assert stats["max_held_rollouts"] <= capacity
    assert stats["max_held_bytes"] <= 64 << 10
    refused = sum(r.get("RESOURCE_EXHAUSTED", 0) for r in results.values())
    assert refused > 0, "producers never saw backpressure"
    # Every put was stored exactly once; every refusal was seen, and retried, by a producer.
    assert stats["put_rollouts"] == n_prod * groups * size
    assert stats["put_refused_full"] == refused


def test_at_least_once_across_sessions_over_grpc(server):
    producer = RolloutQueueClient(server.address)
    for i in range(5):
        producer.put_group(make_group(f"g{i}", 2))
    learner = RolloutQueueClient(server.address)
    b = [learner.get_batch(1, 1.0, learner_version=0) for _ in range(3)]
    learner.ack([b[1].batch_id])
    restarted = RolloutQueueClient(server.address)  # the learner process restarted
    r0, r2 = (restarted.get_batch(1, 1.0, 0) for _ in range(2))
    for old, new in ((b[0], r0), (b[2], r2)):
        assert new.batch_id == old.batch_id and new.redelivered and new.delivery_count == 2
        assert [(x.group_id, x.metrics) for x in new.rollouts] == \
               [(x.group_id, x.metrics) for x in old.rollouts]
        assert all(np.array_equal(x.completion_ids, y.completion_ids)
                   for x, y in zip(new.rollouts, old.rollouts))
    fresh = restarted.get_batch(1, 1.0, 0)
    assert not fresh.redelivered and fresh.rollouts[0].group_id == "g3"
    with pytest.raises(SessionSupersededError):
        learner.get_batch(1, 0.1, 0)
    assert restarted.ack([r0.batch_id, r2.batch_id, fresh.batch_id, b[1].batch_id]) == 3
    assert restarted.get_batch(1, 1.0, 0).rollouts[0].group_id == "g4"
    assert RolloutQueueClient(server.address).get_batch(1, 0.2, 0).redelivered  # last unacked


def test_stale_groups_never_reach_a_batch_under_drop():
    with RolloutQueueServer(max_lag=1, stale_policy="drop") as server:
        client = RolloutQueueClient(server.address)
        client.set_version(6)
        for i, v in enumerate([6, 2, 5, 4, 6, 3]):
            client.put_group(make_group(f"v{v}-{i}", 2, version=v))
        delivered = []
        while (batch := client.get_batch(1, 0.2, learner_version=6)) is not None:
            delivered += [min(int(r.version.min()) for r in batch.rollouts)]
            client.ack([batch.batch_id])
        s = client.stats()
    assert sorted(delivered) == [5, 6, 6]
    assert s["dropped_groups"] == {"stale": 3} and s["dropped_rollouts"] == {"stale": 6}
    assert s["lag_histogram"] == {0: 2, 1: 1}


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(sorted(MUTATIONS)), st.integers(0, 1000))
def test_fuzzed_malformed_rollouts_are_rejected_over_grpc(server, name, k):
    client = RolloutQueueClient(server.address, retry=FAST_RETRY)
    client.set_version(10)
    m, field = mutated(name, k)
    stub = client._stub
    with pytest.raises(grpc.RpcError) as e:
        stub.Put(pb.PutRequest(rollouts=[make_rollout_pb(), m], request_id=f"{name}{k}"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(f"rollouts[1].{field}:"), e.value.details()
    # The atomic put stored nothing; a valid rollout sent afterwards lands.
    gid = f"after-{name}-{k}-{uuid.uuid4().hex[:6]}"  # hypothesis may repeat an example
    client.put_group(make_group(gid, 1))
    batch = client.get_batch(1, 2.0, 10)
    client.ack([batch.batch_id])
    assert [r.group_id for r in batch.rollouts] == [gid]


def make_rollout_pb():
    from pipelinerl_jax.transport.codec import rollout_to_pb
    return rollout_to_pb(make_rollout("companion", 1))


def test_put_stream_keeps_valid_items_around_bad_ones(server):
    client = RolloutQueueClient(server.address)
    client.set_version(3)
    bad = make_rollout("bad", 1)
    bad.logp_behaviour[2] = 0.1
    future = make_rollout("future", 1, version=9)
    pieces = [make_group("ok0", 1), [bad], make_group("ok1", 2)[:1], [future],
              make_group("ok1", 2)[1:], make_group("ok2", 1)]
    results = client.put_stream(pieces)
    assert [r.ok for r in results] == [True, False, True, False, True, True]
    assert results[1].code == grpc.StatusCode.INVALID_ARGUMENT
    assert results[1].field == "rollouts[0].logp_behaviour"
    assert results[3].field == "rollouts[0].version" and "future" in results[3].message
    got = client.get_batch(3, 2.0, 3)
    assert sorted({r.group_id for r in got.rollouts}) == ["ok0", "ok1", "ok2"]
    with pytest.raises(RolloutRejected) as e:
        client.put([bad])
    assert e.value.field == "rollouts[0].logp_behaviour"
    assert client.stats()["put_invalid"] == 3


def test_garbage_bytes_do_not_hurt_the_server(server):
    rng = np.random.default_rng(0)
    channel = grpc.insecure_channel(server.address)
    valid = pb.PutRequest(rollouts=[make_rollout_pb()], request_id="x").SerializeToString()
    blobs = [rng.bytes(int(n)) for n in rng.integers(1, 400, 20)]
    blobs += [valid[:n] for n in range(1, len(valid), max(1, len(valid) // 25))]
    for method in ("Put", "GetBatch", "Ack", "SetVersion", "GetStats"):
        call = channel.unary_unary(f"/{SERVICE}/{method}") if method != "GetBatch" else \
            channel.unary_stream(f"/{SERVICE}/{method}")
        for blob in blobs:
            try:
                resp = call(blob, timeout=5)
                if method == "GetBatch":
                    list(resp)
            except grpc.RpcError as e:
                allowed = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}
                if method != "Put":  # decoded by gRPC itself: its own error code
                    allowed |= {grpc.StatusCode.INTERNAL}
                assert e.code() in allowed, (method, e.code(), e.details())
    stream = channel.stream_stream(f"/{SERVICE}/PutStream")
    codes = [pb.PutResponse.FromString(r).code for r in stream(iter(blobs[:10]), timeout=10)]
    assert len(codes) == 10 and grpc.StatusCode.INVALID_ARGUMENT.value[0] in codes
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(
        service=SERVICE), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    client = RolloutQueueClient(server.address)
    client.put_group(make_group("still-fine", 1))
    assert client.get_batch(1, 2.0, 0).rollouts[0].group_id == "still-fine"


def test_wrong_or_missing_token_is_unauthenticated():
    with RolloutQueueServer(token="s3cret") as server:
        for token in (None, "wrong", "s3cret-but-longer"):
            client = RolloutQueueClient(server.address, token=token)
            with pytest.raises(TransportError) as e:
                client.put_group(make_group("g", 1))
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(TransportError) as e:
                client.wait_ready(2)
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        channel = grpc.insecure_channel(server.address)
        with pytest.raises(grpc.RpcError) as e:
            list(channel.stream_stream(f"/{SERVICE}/PutStream")(iter([b""]), timeout=5))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = RolloutQueueClient(server.address, token="s3cret")
        good.wait_ready(5)
        good.put_group(make_group("g", 1))
        assert good.get_batch(1, 2.0, 0).rollouts[0].group_id == "g"


def test_tls_round_trip_with_a_self_signed_pair(tmp_path):
    cert, key = self_signed_pair(str(tmp_path))
    with RolloutQueueServer(tls=TLSConfig(cert_file=cert, key_file=key),
                            token="tok") as server:
        client = RolloutQueueClient(server.address, token="tok",
                                    tls=TLSConfig(ca_file=cert, server_name="localhost"))
        client.wait_ready(10)
        client.put_group(make_group("tls", 2))
        assert len(client.get_batch(1, 2.0, 0).rollouts) == 2
        plaintext = RolloutQueueClient(server.address, token="tok", retry=FAST_RETRY)
        with pytest.raises(QueueUnavailable):
            plaintext.put_group(make_group("plain", 1), timeout_s=0.5)


@pytest.mark.slow
def test_standalone_server_prints_address_and_exits_on_sigterm(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("abc\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelinerl_jax.transport.queue_server", "--port", "0",
         "--token_file", str(token_file), "--max_lag", "3"],
        stdout=subprocess.PIPE, text=True, cwd=os.getcwd(),
        env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        line = proc.stdout.readline()
        assert line.startswith("RolloutQueue listening on 127.0.0.1:"), line
        client = RolloutQueueClient(line.split()[-1], token="abc")
        client.wait_ready(10)
        client.put_group(make_group("g", 1))
        assert client.get_batch(1, 2.0, 0) is not None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow  # sleeps while the client backs off
def test_client_retries_through_a_server_restart():
    server = RolloutQueueServer().start()
    address = server.address
    client = RolloutQueueClient(address, retry=RetryPolicy(initial_s=0.02, max_s=0.2))
    client.put_group(make_group("before", 1))
    server.stop(0)
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("r", client.put_group(
        make_group("during", 1), timeout_s=30)))
    t.start()
    time.sleep(0.5)  # the put is failing and backing off meanwhile
    assert "r" not in done
    server = RolloutQueueServer(address).start()  # same port: the queue came back (empty)
    try:
        t.join(30)
        assert done["r"].accepted == 1 and client.retry_counts["UNAVAILABLE"] > 0
        batch = client.get_batch(1, 2.0, 0)
        assert batch.rollouts[0].group_id == "during"
    finally:
        server.stop(0)


def test_oversized_requests_fail_fast_instead_of_retrying_forever():
    with RolloutQueueServer(max_message_bytes=1 << 20) as server:
        big = make_group("big", 1, completion=100_000)  # ~1.6 MB
        client = RolloutQueueClient(server.address, max_message_bytes=4 << 20)
        with pytest.raises(RolloutRejected, match="larger than max"):
            client.put_group(big)  # refused by the server's limit: not retried
        small_limit = RolloutQueueClient(server.address, max_message_bytes=1 << 20)
        with pytest.raises(RolloutRejected, match="max_message_bytes"):
            small_limit.put_group(big)  # caught before sending
        assert client.retry_counts == {}
