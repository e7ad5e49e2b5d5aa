"""Weight sync with payload='socket': the header and commit on the gRPC stream, the bytes on a
ticketed TCP connection (sendmsg from the tensors, recv_into the version buffer)."""
import hashlib
import socket
import threading
import time

import ml_dtypes
import numpy as np
import pytest

from pipelinerl_jax.models.lora import LoRASpec
from pipelinerl_jax.transport import payload_socket, weights
from pipelinerl_jax.transport.retry import RetryPolicy
from pipelinerl_jax.transport.security import TLSConfig
from pipelinerl_jax.transport.weight_version import WeightVersion
from pipelinerl_jax.transport.weights import WeightPublisher, WeightSubscriber
from transport_testlib import eventually, self_signed_pair

FAST = RetryPolicy(initial_s=0.01, max_s=0.1)
FULL = WeightVersion("full")
CHUNK = 1024


def _tensors(seed: int) -> dict:
    """Several dtypes, a 0-d tensor, an empty one, one larger than a chunk, odd sizes (so
    alignment gaps and chunk boundaries fall inside tensors)."""
    rng = np.random.default_rng(seed)
    return {"embed": rng.standard_normal((301, 7)).astype(np.float32),  # > one chunk
            "q_proj/kernel": rng.standard_normal((13, 11)).astype(ml_dtypes.bfloat16),
            "scale": rng.standard_normal(5).astype(np.float16),
            "ids": np.arange(-17, 1000, dtype=np.int32),
            "scalar": np.array(seed + 0.5, np.float32),
            "empty": np.zeros((0, 4), np.float32),
            "mask": rng.integers(0, 2, 37).astype(np.uint8)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and
        a[k].tobytes() == b[k].tobytes() for k in a)


class _Keep:
    def __init__(self):
        self.messages = []

    def __call__(self, message):
        self.messages.append(message)


def _received(payload: str, message: WeightVersion, **pub_kw) -> WeightVersion:
    got = _Keep()
    with WeightPublisher(chunk_bytes=CHUNK, payload=payload, **pub_kw) as pub:
        sub = WeightSubscriber(pub.address, got, retry=FAST)
        try:
            pub.publish(message)
            assert sub.wait_for_version(message.version, 20), sub.health()
            if payload == "socket":
                assert pub.payloads_sent == 1 and pub.latest_assembled_bytes == 0
        finally:
            sub.close()
    return got.messages[-1]


@pytest.mark.parametrize("checksum", [True, False])
def test_socket_payload_is_bit_identical_to_grpc(checksum):
    sent = _tensors(3)
    over_grpc = _received("grpc", FULL.carrying(4, tensors=sent), checksum=checksum)
    over_socket = _received("socket", FULL.carrying(4, tensors=sent), checksum=checksum)
    assert _same(over_grpc.tensors, sent) and _same(over_socket.tensors, sent)
    assert over_socket.kind == "full" and over_socket.version == 4


def test_socket_payload_carries_a_lora_version():
    lora = LoRASpec(4, 8.0, ("q_proj",))
    desc = WeightVersion("lora", hashlib.sha256(b"base").hexdigest(), lora)
    rng = np.random.default_rng(1)
    adapters = {"layers/0/attn/q_proj/lora_a": rng.standard_normal((64, 4)).astype(
                    ml_dtypes.bfloat16),
                "layers/0/attn/q_proj/lora_b": rng.standard_normal((4, 64)).astype(
                    ml_dtypes.bfloat16)}
    got = _received("socket", desc.carrying(2, tensors=adapters))
    assert got.kind == "lora" and got.lora == lora and got.base_sha256 == desc.base_sha256
    assert _same(got.tensors, adapters)


def test_many_versions_and_subscribers_and_a_directory_publication(tmp_path):
    a, b = _Keep(), _Keep()
    with WeightPublisher(chunk_bytes=CHUNK, payload="socket") as pub:
        subs = [WeightSubscriber(pub.address, k, retry=FAST) for k in (a, b)]
        try:
            for v in range(1, 6):
                pub.publish(FULL.carrying(v, tensors=_tensors(v)))
                time.sleep(0.02)
            assert all(s.wait_for_version(5, 20) for s in subs)
            pub.publish(FULL.carrying(6, path=str(tmp_path)))  # no bytes: on the stream
            assert all(s.wait_for_version(6, 20) for s in subs)
        finally:
            for s in subs:
                s.close()
    for k in (a, b):
        assert _same(k.messages[-2].tensors, _tensors(5)) and k.messages[-1].path == str(tmp_path)
        assert [m.version for m in k.messages] == sorted({m.version for m in k.messages})


def test_tls_with_the_socket_payload_is_refused(tmp_path):
    cert, key = self_signed_pair(str(tmp_path))
    with pytest.raises(ValueError, match="payload='socket'.*TLS"):
        WeightPublisher(tls=TLSConfig(cert_file=cert, key_file=key), payload="socket")
    with pytest.raises(ValueError, match="payload must be one of"):
        WeightPublisher(payload="shm")


def test_a_wrong_ticket_gets_nothing_and_the_version_is_not_applied(monkeypatch):
    # A stranger with a made-up ticket: the listener closes without a byte.
    got = _Keep()
    real_open = payload_socket.open_payload
    with WeightPublisher(chunk_bytes=CHUNK, payload="socket") as pub:
        with socket.create_connection(("127.0.0.1", pub.payload_port), timeout=5) as s:
            s.sendall(bytes(weights.TICKET_BYTES))
            assert s.recv(1 << 16) == b""
        assert eventually(lambda: pub.payload_refused == 1)
        # A subscriber whose ticket is altered: refused, the version discarded, not applied.
        monkeypatch.setattr(payload_socket, "open_payload", lambda h, p, t, to: real_open(
            h, p, bytes([t[0] ^ 1]) + t[1:], to))
        sub = WeightSubscriber(pub.address, got, retry=FAST)
        try:
            pub.publish(FULL.carrying(1, tensors=_tensors(1)))
            assert eventually(lambda: sub.versions_discarded >= 2)
            assert got.messages == [] and sub.latest_version == -1
            assert pub.payload_refused >= 3 and pub.payloads_sent == 0
            monkeypatch.setattr(payload_socket, "open_payload", real_open)
            assert sub.wait_for_version(1, 20)
            assert _same(got.messages[-1].tensors, _tensors(1))
        finally:
            sub.close()


@pytest.mark.parametrize("how", ["closes", "fails"])
def test_a_payload_cut_half_way_leaves_the_last_complete_version(monkeypatch, how):
    got = _Keep()
    real_send = weights._Version.send_payload

    def half(self, conn):
        if self.version == 2:
            conn.sendall(b"".join(bytes(memoryview(p)) for p in self.payload_pieces())
                         [:self.nbytes // 2])
            if how == "fails":  # the publisher knows: its stream ends without a commit
                raise OSError("cut half way (test)")
            return  # the connection closes half way, and the stream still commits
        real_send(self, conn)

    monkeypatch.setattr(weights._Version, "send_payload", half)
    # Without checksums: the short read alone must catch it.
    with WeightPublisher(chunk_bytes=CHUNK, payload="socket", checksum=False) as pub:
        sub = WeightSubscriber(pub.address, got, retry=FAST)
        try:
            pub.publish(FULL.carrying(1, tensors=_tensors(1)))
            assert sub.wait_for_version(1, 20)
            pub.publish(FULL.carrying(2, tensors=_tensors(2)))
            assert eventually(lambda: sub.versions_discarded >= 2)
            assert sub.latest_version == 1 and [m.version for m in got.messages] == [1]
            assert _same(got.messages[-1].tensors, _tensors(1))
            pub.publish(FULL.carrying(3, tensors=_tensors(3)))
            assert sub.wait_for_version(3, 20)
            assert _same(got.messages[-1].tensors, _tensors(3))
            assert [m.version for m in got.messages] == [1, 3]
        finally:
            sub.close()


def test_a_corrupted_payload_byte_is_caught_by_crc32(monkeypatch):
    got = _Keep()
    real_pieces = weights._Version.payload_pieces
    corrupt = {"on": True}

    def flipped(self):
        pieces = real_pieces(self)
        if corrupt["on"]:
            pieces = list(pieces)
            big = max(range(len(pieces)), key=lambda i: len(pieces[i]))
            bad = bytearray(bytes(memoryview(pieces[big])))
            bad[len(bad) // 2] ^= 0x10
            pieces[big] = bytes(bad)
        return pieces

    monkeypatch.setattr(weights._Version, "payload_pieces", flipped)
    with WeightPublisher(chunk_bytes=CHUNK, payload="socket") as pub:
        sub = WeightSubscriber(pub.address, got, retry=FAST)
        try:
            pub.publish(FULL.carrying(1, tensors=_tensors(1)))
            assert eventually(lambda: sub.versions_discarded >= 2)
            assert got.messages == [] and "crc32 mismatch" in (sub.last_error or "")
            corrupt["on"] = False
            assert sub.wait_for_version(1, 20)
            assert _same(got.messages[-1].tensors, _tensors(1))
        finally:
            sub.close()


def test_the_listener_survives_hostile_clients_and_serves_the_next_subscriber():
    got = _Keep()
    with WeightPublisher(chunk_bytes=CHUNK, payload="socket", payload_timeout=1.0) as pub:
        addr = ("127.0.0.1", pub.payload_port)
        hang = socket.create_connection(addr, timeout=5)  # connects, never sends a ticket
        hang_half = socket.create_connection(addr, timeout=5)
        hang_half.sendall(b"x" * (weights.TICKET_BYTES // 2))  # half a ticket, then silence
        with socket.create_connection(addr, timeout=5) as s:  # a garbage ticket
            s.sendall(b"\xff" * 1000)
        socket.create_connection(addr, timeout=5).close()  # an early close
        s = socket.create_connection(addr, timeout=5)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
        s.close()  # a reset
        # Meanwhile a real subscriber is served.
        sub = WeightSubscriber(pub.address, got, retry=FAST)
        try:
            pub.publish(FULL.carrying(1, tensors=_tensors(1)))
            assert sub.wait_for_version(1, 20), sub.health()
            assert _same(got.messages[-1].tensors, _tensors(1))
            # The hanging ones are dropped after payload_timeout, counted.
            assert eventually(lambda: pub.payload_refused + pub.payload_errors >= 5)
            assert hang.recv(10) == b"" and hang_half.recv(10) == b""
            assert pub.payload_listener.alive
            pub.publish(FULL.carrying(2, tensors=_tensors(2)))
            assert sub.wait_for_version(2, 20)
        finally:
            hang.close()
            hang_half.close()
            sub.close()
    assert not pub.payload_listener.alive
    with pytest.raises(OSError):  # stop() closed the listener
        socket.create_connection(addr, timeout=2).recv(1)


def test_a_stream_whose_subscriber_never_fetches_expires_its_ticket():
    with WeightPublisher(chunk_bytes=CHUNK, payload="socket", payload_timeout=0.5) as pub:
        pub.publish(FULL.carrying(1, tensors=_tensors(1)))
        channel_got = []

        def read_header():
            from pipelinerl_jax.transport import rollout_pb2 as pb
            from pipelinerl_jax.transport.security import make_channel
            ch = make_channel(pub.address, max_message_bytes=1 << 20)
            call = ch.unary_stream(weights.SUBSCRIBE,
                                   request_serializer=pb.SubscribeRequest.SerializeToString,
                                   response_deserializer=pb.WeightMessage.FromString)
            try:
                for m in call(pb.SubscribeRequest(have_version=-1)):
                    channel_got.append(m)
            except Exception as e:  # noqa: BLE001
                channel_got.append(e)
            ch.close()

        t = threading.Thread(target=read_header)
        t.start()
        t.join(10)
        assert not t.is_alive()
        header = channel_got[0].header
        assert header.payload_port == pub.payload_port and len(header.payload_ticket) == 32
        assert len(channel_got) == 1  # no chunks, no commit: the stream ended
        assert not pub.payload_listener.pending
        with socket.create_connection(("127.0.0.1", pub.payload_port), timeout=5) as s:
            s.sendall(header.payload_ticket)  # expired
            assert s.recv(10) == b""


def test_close_does_not_wait_out_a_stalled_payload(monkeypatch):
    release, stalled = threading.Event(), threading.Event()

    def stall(self, conn):
        stalled.set()
        release.wait(30)

    monkeypatch.setattr(weights._Version, "send_payload", stall)
    with WeightPublisher(chunk_bytes=CHUNK, payload="socket") as pub:
        sub = WeightSubscriber(pub.address, _Keep(), retry=FAST, payload_timeout=30)
        pub.publish(FULL.carrying(1, tensors=_tensors(1)))
        assert stalled.wait(10)
        assert eventually(lambda: getattr(sub._reader.assembler, "conn", None) is not None)
        t = time.monotonic()
        sub.close()
        assert time.monotonic() - t < 4 and not sub._thread.is_alive()
        release.set()


def test_a_tls_subscriber_refuses_a_socket_payload_before_connecting(monkeypatch):
    """A publisher refuses TLS with the socket payload; a subscriber on TLS must also refuse a
    header that offers one (a hostile or misconfigured publisher), never fetch in plaintext."""
    connects = []
    monkeypatch.setattr(payload_socket, "open_payload", lambda *a: connects.append(a))
    version = weights._Version(WeightVersion("full", version=3, tensors=_tensors(3)), "p",
                               CHUNK, None)
    header = version.socket_header(port=1234, ticket=b"t" * weights.TICKET_BYTES)
    tls_reader = weights._StreamReader(1 << 30, weights._BufferPool(), payload_host=None)
    with pytest.raises(weights._CorruptVersion, match="TLS subscriber"):
        tls_reader.feed(header)
    assert connects == []
    # the same header on a plaintext subscriber goes on to fetch (here: the stub connects)
    plain = weights._StreamReader(1 << 30, weights._BufferPool(), payload_host="127.0.0.1")
    with pytest.raises(weights._CorruptVersion):
        plain.feed(header)
    assert connects and connects[0][:2] == ("127.0.0.1", 1234)
