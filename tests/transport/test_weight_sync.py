"""Versioned weight sync over gRPC: complete, verified, monotonic, survives publisher death."""
import multiprocessing as mp
import os
import signal
import threading
import time
from concurrent import futures

import ml_dtypes
import numpy as np
import pytest

from pipelinerl_jax.transport import rollout_pb2 as pb
from pipelinerl_jax.transport import weights
from pipelinerl_jax.transport.weight_version import WeightVersion
from pipelinerl_jax.transport.retry import RetryPolicy
from pipelinerl_jax.transport.security import TLSConfig
from tests.transport.flat_weights import FlatPublisher as WeightPublisher, FlatSubscriber as WeightSubscriber
from transport_testlib import eventually, publisher_main, self_signed_pair

CTX = mp.get_context("spawn")
FAST = RetryPolicy(initial_s=0.01, max_s=0.1)


class Recorder:
    """on_weights callback that checks each version is internally consistent."""

    def __init__(self, delay_s: float = 0.0):
        self.versions, self.errors, self.delay_s = [], [], delay_s
        self.policy_versions = []

    def __call__(self, version, params, policy_version):
        for name, a in params.items():
            if a.size and not np.all(np.asarray(a, np.float32) == version):
                self.errors.append(f"v{version}: {name} holds other values")
        self.versions.append(version)
        self.policy_versions.append(policy_version)
        time.sleep(self.delay_s)


def _params(version: int, n: int = 1000) -> dict:
    # Tensor sizes not multiples of the chunk or the alignment, so chunks span tensors.
    return {"embed": np.full((n, 3), version, np.float32),
            "layers/0/attn/q_proj/kernel": np.full((7, 13), version, ml_dtypes.bfloat16),
            "scalar": np.float32(version) * np.ones((), np.float32),
            "empty": np.zeros((0, 4), np.float32)}


def test_round_trip_keeps_names_dtypes_shapes_and_values():
    got = {}
    rng = np.random.default_rng(0)
    params = {"a/kernel": rng.standard_normal((33, 17)).astype(np.float32),
              "b/scale": rng.standard_normal(5).astype(ml_dtypes.bfloat16),
              "c": np.array(3.5, np.float32), "d": np.zeros((0,), np.float32),
              "e/ids": np.arange(1001, dtype=np.int32)}
    with WeightPublisher(chunk_bytes=1024) as pub:
        sub = WeightSubscriber(pub.address, lambda v, p, pv: got.update(v=v, p=p, pv=pv),
                               retry=FAST)
        pub.publish(7, params)
        assert sub.wait_for_version(7, 10)
        sub.close()
    assert got["v"] == 7 and got["pv"] == 7 and set(got["p"]) == set(params)
    for k, a in params.items():
        b = got["p"][k]
        assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b), k


def test_policy_version_travels_in_the_header_not_the_tensors():
    rec = Recorder()
    with WeightPublisher() as pub:
        sub = WeightSubscriber(pub.address, rec, retry=FAST)
        pub.publish(1, _params(1))
        assert sub.wait_for_version(1, 10)
        pub.publish(5, _params(5), policy_version=3)  # lag injection: v3's policy as v5
        assert sub.wait_for_version(5, 10)
        pub.publish(6, _params(6), policy_version=0)  # 0 is a version, not "absent"
        assert sub.wait_for_version(6, 10)
        sub.close()
        for bad in (8, -1):  # a policy newer than the version, or negative
            with pytest.raises(ValueError, match="policy_version"):
                pub.publish(7, _params(7), policy_version=bad)
    assert not rec.errors and rec.versions == [1, 5, 6] and rec.policy_versions == [1, 3, 0]
    header = pb.WeightHeader(kind="full", version=2)
    assert not header.HasField("policy_version")  # absent on the wire unless given


def test_rapid_publishing_never_applies_partial_or_mixed_versions():
    fast, slow = Recorder(), Recorder(delay_s=0.02)
    with WeightPublisher(chunk_bytes=4096) as pub:
        subs = [WeightSubscriber(pub.address, rec, retry=FAST) for rec in (fast, slow)]
        for v in range(1, 41):  # ~250 KB each, 60+ chunks: publishes overlap the streams
            pub.publish(v, _params(v, n=20000))
        for s in subs:
            assert s.wait_for_version(40, 30)
            s.close()
        with pytest.raises(ValueError, match="not newer"):
            pub.publish(40, _params(40))
    for rec in (fast, slow):
        assert not rec.errors, rec.errors[:3]
        assert rec.versions == sorted(set(rec.versions)) and rec.versions[-1] == 40
    assert len(slow.versions) < 40  # it fell behind and skipped to the newest


@pytest.mark.slow
def test_publisher_killed_mid_stream_leaves_subscribers_on_last_complete_version(monkeypatch):
    # Slow the subscriber down (1 ms per 64 KiB chunk) so the kill lands mid-version.
    original_add = weights._Assembler.add
    monkeypatch.setattr(weights._Assembler, "add",
                        lambda self, chunk: (time.sleep(0.001), original_add(self, chunk)))
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=publisher_main, args=(child, 64 << 10), daemon=True)
    proc.start()
    port = parent.recv()
    rec = Recorder()
    sub = WeightSubscriber(f"127.0.0.1:{port}", rec, retry=FAST)
    try:
        parent.send(("publish", 1, 4096))
        parent.recv()
        assert sub.wait_for_version(1, 30)
        parent.send(("publish", 2, 16 << 20))  # 64 MiB = 1024 chunks
        deadline = time.monotonic() + 60
        while not (sub.receiving[0] == 2 and sub.receiving[1] > 0):
            assert time.monotonic() < deadline, "version 2 never started streaming"
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert eventually(lambda: sub.versions_discarded >= 1)  # the stream broke ...
        assert sub.latest_version == 1 and rec.versions == [1]  # ... and nothing was applied
        # The publisher comes back on the same port (a restarted learner): the subscriber
        # reconnects and applies its next version.
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=publisher_main,
                           args=(child, 64 << 10, f"127.0.0.1:{port}"), daemon=True)
        proc.start()
        assert parent.recv() == port
        parent.send(("publish", 3, 4096))
        parent.recv()
        assert sub.wait_for_version(3, 30), sub.last_error
        assert rec.versions == [1, 3] and not rec.errors and sub.reconnects >= 1
    finally:
        sub.close()
        if proc.is_alive():
            proc.kill()


def test_a_new_publisher_instance_may_restart_from_an_older_version():
    rec = Recorder()
    pub = WeightPublisher()
    address = pub.address
    sub = WeightSubscriber(address, rec, retry=FAST)
    pub.publish(5, _params(5))
    assert sub.wait_for_version(5, 10)
    pub.stop(0)
    pub = WeightPublisher(address)  # learner resumed from the version-3 checkpoint
    try:
        pub.publish(3, _params(3))
        assert eventually(lambda: sub.latest_version == 3)  # (set after on_weights returns)
        assert rec.versions == [5, 3]
    finally:
        sub.close()
        pub.stop(0)


def test_token_and_tls_on_the_weight_service(tmp_path):
    cert, key = self_signed_pair(str(tmp_path))
    with WeightPublisher(token="tok", tls=TLSConfig(cert_file=cert, key_file=key)) as pub:
        pub.publish(1, _params(1))
        client_tls = TLSConfig(ca_file=cert, server_name="localhost")
        bad, good = Recorder(), Recorder()
        wrong = WeightSubscriber(pub.address, bad, token="nope", tls=client_tls, retry=FAST)
        right = WeightSubscriber(pub.address, good, token="tok", tls=client_tls, retry=FAST)
        assert right.wait_for_version(1, 10)
        assert eventually(lambda: "UNAUTHENTICATED" in (wrong.last_error or ""))
        assert wrong.latest_version == -1 and bad.versions == []
        wrong.close()
        right.close()


def _header(total=10, chunks=2):
    h = pb.WeightHeader(kind="full", version=4, publisher_id="p", total_bytes=total, num_chunks=chunks,
                        has_crc32=True)
    h.tensors.add(name="w", dtype="uint8", shape=[total], offset=0, nbytes=total)
    return h


def _chunk(index, offset, data, crc=None, version=4):
    import zlib
    return pb.WeightChunk(version=version, index=index, offset=offset, data=data,
                          crc32=zlib.crc32(data) if crc is None else crc)


@pytest.mark.parametrize("bad", ["crc", "order", "version", "overflow", "short"])
def test_corrupt_or_incomplete_versions_are_refused(bad):
    asm = weights._Assembler(_header(), 1 << 20, weights._BufferPool(),
                             futures.ThreadPoolExecutor(1))
    with pytest.raises(weights._CorruptVersion):
        if bad == "crc":
            asm.add(_chunk(0, 0, b"01234", crc=123))
            asm.add(_chunk(1, 5, b"56789"))
            asm.finish(pb.WeightCommit(version=4, total_bytes=10, num_chunks=2))
        elif bad == "order":
            asm.add(_chunk(1, 5, b"56789"))
        elif bad == "version":
            asm.add(_chunk(0, 0, b"01234", version=5))
        elif bad == "overflow":
            asm.add(_chunk(0, 0, b"0123456789ab"))
        else:
            asm.add(_chunk(0, 0, b"01234"))
            asm.finish(pb.WeightCommit(version=4, total_bytes=10, num_chunks=2))


def test_buffers_are_recycled_only_when_no_array_is_alive():
    pool = weights._BufferPool()
    a = pool.get(100)
    view = a[10:20]
    del a
    b = pool.get(100)
    assert b.base is None and view.base is not b  # a view was alive: fresh buffer
    del view
    c = pool.get(100)
    assert pool.reused == 1 and c.size == 100


def test_callback_errors_do_not_kill_the_subscription():
    calls = []

    def flaky(version, params, policy_version):
        calls.append(version)
        if version == 1:
            raise RuntimeError("engine busy")

    with WeightPublisher() as pub:
        sub = WeightSubscriber(pub.address, flaky, retry=FAST)
        pub.publish(1, _params(1))
        assert eventually(lambda: "engine busy" in (sub.last_error or ""))
        assert calls == [1] and sub.latest_version == -1 and "engine busy" in sub.last_error
        pub.publish(2, _params(2))
        assert sub.wait_for_version(2, 10)
        sub.close()
    assert calls == [1, 2]


def test_many_subscribers_share_one_serialization():
    recs = [Recorder() for _ in range(4)]
    with WeightPublisher(chunk_bytes=2048) as pub:
        subs = [WeightSubscriber(pub.address, r, retry=FAST) for r in recs]
        pub.publish(1, _params(1, n=3000))
        threads = [threading.Thread(target=s.wait_for_version, args=(1, 10)) for s in subs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in subs:
            s.close()
    assert all(r.versions == [1] and not r.errors for r in recs)


def test_hand_framed_chunks_parse_like_protobuf():
    params = {"a": np.arange(3000, dtype=np.float32), "b": np.ones(7, ml_dtypes.bfloat16)}
    version = weights._Version(WeightVersion("full").carrying(9, tensors=params), "pub", 4096,
                               futures.ThreadPoolExecutor(1))
    frames = list(version.frames())
    assert len(frames) == version.num_chunks + 2
    for raw in frames[1:-1]:
        kind, view = weights._parse_message(raw)
        ref = pb.WeightMessage.FromString(raw)
        assert kind == ref.WhichOneof("kind") == "chunk"
        assert (view.version, view.index, view.offset, view.crc32, bytes(view.data)) == (
            ref.chunk.version, ref.chunk.index, ref.chunk.offset, ref.chunk.crc32,
            ref.chunk.data)
    # Another valid encoding (fields reordered by a different publisher) still parses.
    other = pb.WeightMessage(chunk=pb.WeightChunk(data=b"xyz", crc32=5, offset=2, index=1,
                                                  version=3)).SerializeToString()
    kind, view = weights._parse_message(other)
    assert kind == "chunk" and (view.version, view.index, bytes(view.data)) == (3, 1, b"xyz")
    kind, header = weights._parse_message(frames[0])
    assert kind == "header" and header.version == 9 and len(header.tensors) == 2
    with pytest.raises(Exception):
        weights._parse_message(b"\x12\xff\xff")


def test_a_directory_publication_carries_its_path_to_the_callback():
    """What was published travels in the message: an 'hf_dir' version's header holds its
    directory (no tensors) and the subscriber hands that path to on_weights; a subscriber
    bounded by `expected_shapes` (an engine's parameters) accepts it, since the directory is
    checked where it is loaded."""
    got = []
    with WeightPublisher() as pub:
        sub = WeightSubscriber(pub.address, lambda v, p, pv: got.append((v, p, pv)),
                               retry=FAST, expected_shapes={"embed": (1000, 3)})
        pub.publish_dir(3, "/shared/weights/v00000003", policy_version=1)
        assert sub.wait_for_version(3, 10), sub.last_error
        pub.publish(4, {"embed": np.full((1000, 3), 4, np.float32)})
        assert sub.wait_for_version(4, 10), sub.last_error
        sub.close()
    assert got[0] == (3, "/shared/weights/v00000003", 1)
    assert got[1][0] == 4 and set(got[1][1]) == {"embed"} and got[1][2] == 4
    header = pb.WeightMessage.FromString(next(weights._Version(
        WeightVersion("full").carrying(5, path="/w/v00000005"), "p", 4096, None).frames())).header
    assert header.path == "/w/v00000005" and not header.tensors and header.total_bytes == 0


@pytest.mark.parametrize("path,why", [("weights/v00000001", "not absolute"),
                                      ("", "non-empty"), ("/w/a\0b", "NUL"),
                                      ("/" + "x" * weights.MAX_PATH_CHARS, "characters")])
def test_the_publisher_refuses_a_path_the_subscriber_would_refuse(path, why):
    with WeightPublisher() as pub:
        with pytest.raises(ValueError, match=why):
            pub.publish_dir(1, path)
        with pytest.raises(ValueError, match="no tensors"):
            pub.publish(1, {})
        assert pub.latest_version == -1
