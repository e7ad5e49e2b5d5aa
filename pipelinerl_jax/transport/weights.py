"""Versioned weight sync: the learner publishes `(version, params)`, engines subscribe.

`params` is a flat `dict[str, np.ndarray]` (e.g. `layers/0/attn/q_proj/kernel`), any dtype in
`codec.DTYPES` (float32, bfloat16 via ml_dtypes, ...). One version travels over the gRPC
stream `WeightSync.Subscribe` as
    header (names, dtypes, shapes, byte offsets, total size, chunk count)
    chunk × num_chunks (in offset order; each with its zlib.crc32)
    commit (version, total bytes, chunk count)
Tensors are laid out in one payload at 64-byte-aligned offsets, so the subscriber copies each
chunk straight into one preallocated buffer and hands out views of it: no per-tensor copies.

Guarantees to the subscriber's `on_weights(version, params)` callback:
- called only for a version whose every chunk arrived, in order, with matching crc32, version
  and sizes; a partial, corrupt or interleaved version is discarded, never applied;
- versions are increasing per publisher instance; a subscriber that fell behind (or connects
  late) gets the newest version only. The publisher finishes a version it has started
  sending before jumping to the newest, so rapid publishing cannot starve a subscriber;
- a publisher that dies mid-stream leaves the subscriber on its last complete version; the
  subscriber reconnects with backoff and resumes when a publisher is back at the address.
  A *new* publisher instance (a restarted learner, new `publisher_id`) may start from an
  older version (resumed checkpoint); subscribers follow it.
The learner must announce version v to the RolloutQueue (`set_version`) BEFORE `publish(v)`,
or rollouts sampled with v could be rejected as coming from the future.

Speed (see docs/transport.md): `publish` copies nothing; each chunk frame is assembled by
hand straight from the tensor memory when a stream sends it (one copy, instead of the two
more a protobuf message would make), and its crc32 is computed once for all subscribers.
The subscriber copies each chunk once into a version buffer that it recycles once the
previous callback's arrays are no longer referenced (fresh pages cost more than the copy).
"""
from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
import zlib
from typing import Callable, Mapping, Optional

import grpc
import numpy as np

from pipelinerl_jax.transport import rollout_pb2 as pb
from pipelinerl_jax.transport.codec import dtype_from_name
from pipelinerl_jax.transport.queue_client import RetryPolicy
from pipelinerl_jax.transport.security import (
    DEFAULT_HOST, TLSConfig, call_metadata, host_port, make_channel, make_server)

log = logging.getLogger(__name__)

SERVICE = "pipelinerl_jax.WeightSync"
SUBSCRIBE = f"/{SERVICE}/Subscribe"
DEFAULT_CHUNK_BYTES = 4 << 20
_ALIGN = 64


def _identity(x):
    return x


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _len_field(field: int, length: int) -> bytes:
    """Tag + length prefix of a length-delimited protobuf field (wire type 2)."""
    return _varint(field << 3 | 2) + _varint(length)


class _Version:
    """One published version. Chunk frames are built lazily, as a stream asks for them, so
    streaming starts at once and publish() copies nothing; each chunk's crc32 is computed
    once and shared by all subscribers."""

    def __init__(self, version: int, publisher_id: str, params: Mapping[str, np.ndarray],
                 chunk_bytes: int):
        if sys.byteorder != "little":
            raise NotImplementedError("weight sync assumes a little-endian host")
        header = pb.WeightHeader(version=version, publisher_id=publisher_id)
        self.segments, offset = [], 0  # (payload offset, uint8 view of the tensor)
        for name, value in params.items():
            arr = np.asarray(value)
            if not arr.flags.c_contiguous:  # (ascontiguousarray would turn 0-d into 1-d)
                arr = np.ascontiguousarray(arr)
            dtype_from_name(arr.dtype.name)  # raises on an unsupported dtype
            offset = -(-offset // _ALIGN) * _ALIGN
            header.tensors.add(name=name, dtype=arr.dtype.name, shape=arr.shape,
                               offset=offset, nbytes=arr.nbytes)
            if arr.nbytes:
                self.segments.append((offset, arr.reshape(-1).view(np.uint8)))
            offset += arr.nbytes
        self.version, self.nbytes, self.chunk_bytes = version, offset, chunk_bytes
        self.num_chunks = max(1, -(-offset // chunk_bytes))
        header.total_bytes, header.num_chunks = offset, self.num_chunks
        self.header = pb.WeightMessage(header=header).SerializeToString()
        self.commit = pb.WeightMessage(commit=pb.WeightCommit(
            version=version, total_bytes=offset, num_chunks=self.num_chunks)).SerializeToString()
        self._crcs: list[Optional[int]] = [None] * self.num_chunks

    def frames(self):
        yield self.header
        for i in range(self.num_chunks):
            yield self._chunk(i)
        yield self.commit

    def _chunk(self, index: int) -> bytes:
        start = index * self.chunk_bytes
        end = min(self.nbytes, start + self.chunk_bytes)
        pieces, pos = [], start
        for seg_off, seg in self.segments:  # a few hundred tensors: a linear scan is fine
            seg_end = seg_off + seg.size
            if seg_end <= start or seg_off >= end:
                continue
            if seg_off > pos:  # alignment padding
                pieces.append(bytes(seg_off - pos))
                pos = seg_off
            piece = seg[pos - seg_off:min(end, seg_end) - seg_off]
            pieces.append(piece)
            pos += piece.size
        if pos < end:
            pieces.append(bytes(end - pos))
        if self._crcs[index] is None:
            crc = 0
            for piece in pieces:
                crc = zlib.crc32(piece, crc)
            self._crcs[index] = crc
        # WeightMessage{chunk: WeightChunk{version, index, offset, crc32, data}} written by
        # hand around the tensor memory: the payload is copied once, by this join.
        head = pb.WeightChunk(version=self.version, index=index, offset=start,
                              crc32=self._crcs[index]).SerializeToString()
        head += _len_field(5, end - start)
        return b"".join([_len_field(2, len(head) + end - start), head, *pieces])


class WeightPublisher:
    """Serves the newest published version to every subscriber (starts on construction)."""

    def __init__(self, bind_address: str = f"{DEFAULT_HOST}:0", token: Optional[str] = None,
                 tls: Optional[TLSConfig] = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 max_message_bytes: Optional[int] = None, max_workers: int = 64):
        if chunk_bytes < 1024:
            raise ValueError(f"chunk_bytes must be >= 1024, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.max_message_bytes = max_message_bytes or chunk_bytes + (1 << 20)
        self.publisher_id = uuid.uuid4().hex[:12]
        self._cv = threading.Condition()
        self._latest: Optional[_Version] = None
        self._stopped = False
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            "Subscribe": grpc.unary_stream_rpc_method_handler(
                self._subscribe, pb.SubscribeRequest.FromString, _identity)})
        self._server, self.port = make_server(
            bind_address, max_message_bytes=self.max_message_bytes, token=token, tls=tls,
            max_workers=max_workers, handlers=[handler])
        self.address = host_port(bind_address, self.port)
        self._server.start()

    @property
    def latest_version(self) -> int:
        with self._cv:
            return -1 if self._latest is None else self._latest.version

    def publish(self, version: int, params: Mapping[str, np.ndarray]) -> None:
        """Makes `params` the newest version. Versions must increase.

        Zero-copy: the arrays are read while streams send them, so they must not be modified
        after this call (`jax.device_get` returns fresh arrays, so the usual call is safe).
        """
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        latest = self.latest_version
        if version <= latest:
            raise ValueError(f"version {version} is not newer than published {latest}")
        frames = _Version(int(version), self.publisher_id, params, self.chunk_bytes)
        with self._cv:
            if self._latest is not None and version <= self._latest.version:
                raise ValueError(f"version {version} raced with {self._latest.version}")
            self._latest = frames
            self._cv.notify_all()

    def _subscribe(self, request: pb.SubscribeRequest, context):
        have_version, have_publisher = request.have_version, request.publisher_id
        while True:
            with self._cv:
                while True:
                    frames = self._latest
                    if self._stopped or not context.is_active():
                        return
                    if frames is not None and (have_publisher != self.publisher_id or
                                               frames.version > have_version):
                        break
                    self._cv.wait(0.5)
            # Sent whole even if a newer version is published meanwhile (no starvation).
            yield from frames.frames()
            have_version, have_publisher = frames.version, self.publisher_id

    def stop(self, grace: float = 0.5) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._server.stop(grace).wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class _CorruptVersion(Exception):
    pass


class _BufferPool:
    """Recycles version buffers whose arrays nobody references any more.

    Every array handed to `on_weights` is a view whose `.base` is the buffer, so the buffer's
    reference count tells whether any of them is still alive (e.g. kept by the engine, or
    aliased by a CPU jax array). Only a buffer with no live views is overwritten.
    """

    def __init__(self, size: int = 2):
        self._buffers: list[np.ndarray] = []
        self._size = size
        self.reused = 0

    def get(self, nbytes: int) -> np.ndarray:
        for buf in self._buffers:
            # 3 = this list + `buf` + getrefcount's argument: no views alive.
            if buf.size == nbytes and sys.getrefcount(buf) <= 3:
                self.reused += 1
                return buf
        buf = np.empty(nbytes, np.uint8)
        self._buffers = (self._buffers + [buf])[-self._size:]
        return buf


class _Assembler:
    """Collects one version's chunks into a single buffer, checking everything."""

    def __init__(self, header: pb.WeightHeader, max_bytes: int, pool: _BufferPool,
                 verify_crc: bool = True):
        if header.total_bytes < 0 or header.total_bytes > max_bytes:
            raise _CorruptVersion(f"total_bytes {header.total_bytes} out of range")
        self.header, self.verify_crc = header, verify_crc
        self.buffer = pool.get(header.total_bytes)
        self.next_index = self.next_offset = 0
        self.specs = []
        for t in header.tensors:
            dt = dtype_from_name(t.dtype)
            n = int(np.prod(t.shape, dtype=np.int64)) * dt.itemsize
            if n != t.nbytes or t.offset < 0 or t.offset + n > header.total_bytes or \
                    t.offset % dt.itemsize:
                raise _CorruptVersion(f"tensor {t.name!r}: inconsistent spec")
            self.specs.append((t.name, dt, tuple(t.shape), t.offset, n))

    def add(self, chunk: pb.WeightChunk) -> None:
        h = self.header
        if chunk.version != h.version or chunk.index != self.next_index or \
                chunk.offset != self.next_offset:
            raise _CorruptVersion(f"chunk {chunk.index}@{chunk.offset} of version "
                                  f"{chunk.version} out of order")
        data = chunk.data
        if self.next_offset + len(data) > h.total_bytes:
            raise _CorruptVersion("chunks exceed total_bytes")
        if self.verify_crc and zlib.crc32(data) != chunk.crc32:
            raise _CorruptVersion(f"chunk {chunk.index}: crc32 mismatch")
        self.buffer[self.next_offset:self.next_offset + len(data)] = \
            np.frombuffer(data, np.uint8)
        self.next_index += 1
        self.next_offset += len(data)

    def finish(self, commit: pb.WeightCommit) -> dict[str, np.ndarray]:
        h = self.header
        if (commit.version, commit.total_bytes, commit.num_chunks) != \
                (h.version, h.total_bytes, h.num_chunks) or \
                self.next_index != h.num_chunks or self.next_offset != h.total_bytes:
            raise _CorruptVersion(f"version {h.version} incomplete: {self.next_index}/"
                                  f"{h.num_chunks} chunks, {self.next_offset}/"
                                  f"{h.total_bytes} bytes")
        return {name: self.buffer[off:off + n].view(dt).reshape(shape)
                for name, dt, shape, off, n in self.specs}


class WeightSubscriber:
    """Background thread that applies each complete version via `on_weights(version, params)`.

    `params` arrays are views of one fresh buffer per version; the callback may keep them.
    """

    def __init__(self, address: str, on_weights: Callable[[int, dict], None],
                 token: Optional[str] = None, tls: Optional[TLSConfig] = None, *,
                 max_message_bytes: int = DEFAULT_CHUNK_BYTES + (1 << 20),
                 max_version_bytes: int = 1 << 40, retry: RetryPolicy = RetryPolicy(),
                 verify_crc: bool = True, subscriber_id: Optional[str] = None):
        self.address = address
        self._on_weights = on_weights
        self._channel = make_channel(address, max_message_bytes=max_message_bytes, tls=tls)
        self._subscribe = self._channel.unary_stream(
            SUBSCRIBE, request_serializer=pb.SubscribeRequest.SerializeToString,
            response_deserializer=pb.WeightMessage.FromString)
        self._md = call_metadata(token)
        self._retry, self._max_bytes = retry, max_version_bytes
        self._pool = _BufferPool()
        self._verify_crc = verify_crc
        self.subscriber_id = subscriber_id or uuid.uuid4().hex[:12]
        self._cv = threading.Condition()
        self._latest, self._publisher_id = -1, ""
        self._closed = False
        self._call = None
        # Observability (read without locks; ints are updated atomically under the GIL).
        self.receiving: tuple[int, int, int] = (-1, 0, 0)  # (version, bytes so far, total)
        self.versions_applied = self.versions_discarded = self.reconnects = 0
        self.last_error: Optional[str] = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"weights-{self.subscriber_id}")
        self._thread.start()

    @property
    def latest_version(self) -> int:
        return self._latest

    def wait_for_version(self, version: int, timeout: Optional[float] = None) -> bool:
        """True once a version >= `version` has been applied (False on timeout)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._latest >= version, timeout)

    def _run(self) -> None:
        attempt = 0
        while not self._closed:
            assembler = None
            try:
                self._call = self._subscribe(
                    pb.SubscribeRequest(have_version=self._latest,
                                        publisher_id=self._publisher_id,
                                        subscriber_id=self.subscriber_id), metadata=self._md)
                if self._closed:  # close() raced with the call's creation
                    self._call.cancel()
                for msg in self._call:
                    kind = msg.WhichOneof("kind")
                    if kind == "header":
                        if assembler is not None:
                            raise _CorruptVersion("new header before commit")
                        assembler = _Assembler(msg.header, self._max_bytes, self._pool,
                                               self._verify_crc)
                        self.receiving = (msg.header.version, 0, msg.header.total_bytes)
                    elif kind == "chunk" and assembler is not None:
                        assembler.add(msg.chunk)
                        self.receiving = (assembler.header.version, assembler.next_offset,
                                          assembler.header.total_bytes)
                    elif kind == "commit" and assembler is not None:
                        self._apply(assembler.header, assembler.finish(msg.commit))
                        assembler = None  # drop our references: the buffer may be recycled
                        attempt = 0
                    else:
                        raise _CorruptVersion(f"unexpected {kind!r} message")
            except grpc.RpcError as e:
                if self._closed:
                    break
                self.last_error = f"{e.code().name}: {e.details()}"
            except (_CorruptVersion, ValueError) as e:
                self.last_error = f"corrupt stream: {e}"
                log.warning("weight subscriber %s: %s", self.subscriber_id, self.last_error)
                if self._call is not None:
                    self._call.cancel()
            if assembler is not None:
                self.versions_discarded += 1
            self.receiving = (-1, 0, 0)
            if self._closed:
                break
            self.reconnects += 1
            time.sleep(self._retry.delay(attempt))
            attempt += 1

    def _apply(self, header: pb.WeightHeader, params: dict) -> None:
        newer = header.version > self._latest or header.publisher_id != self._publisher_id
        if not newer:  # a publisher never sends this; defend the monotonic contract anyway
            self.versions_discarded += 1
            return
        try:
            self._on_weights(header.version, params)
        except Exception as e:  # a failing callback must not kill the subscription
            self.last_error = f"on_weights({header.version}) raised {e!r}"
            log.exception("weight subscriber %s: on_weights failed", self.subscriber_id)
            return
        with self._cv:
            self._latest, self._publisher_id = header.version, header.publisher_id
            self.versions_applied += 1
            self._cv.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        self._closed = True
        call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(timeout)
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
