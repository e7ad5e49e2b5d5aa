"""Versioned weight sync: the learner publishes `(version, params)`, engines subscribe.

`params` is a flat `dict[str, np.ndarray]` (e.g. `layers/0/attn/q_proj/kernel`), any dtype in
`codec.DTYPES` (float32, bfloat16 via ml_dtypes, ...). One version travels over the gRPC
stream `WeightSync.Subscribe` as
    header (names, dtypes, shapes, byte offsets, total size, chunk count)
    chunk × num_chunks (in offset order; each with its zlib.crc32)
    commit (version, total bytes, chunk count)
Tensors are laid out in one payload at 64-byte-aligned offsets, so the subscriber copies each
chunk straight into one preallocated buffer and hands out views of it: no per-tensor copies.

The header may also carry a `policy_version`: which policy the weights are when that is not
`version` itself (lag injection ships an older policy's weights as a new stream version).

Guarantees to the subscriber's `on_weights(version, params, policy_version)` callback
(`policy_version` is the header's, or `version` when the publisher gave none):
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
from concurrent import futures
from typing import Callable, Mapping, NamedTuple, Optional

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from pipelinerl_jax.transport import rollout_pb2 as pb
from pipelinerl_jax.transport.codec import dtype_from_name
from pipelinerl_jax.transport.security import (
    DEFAULT_HOST, RetryPolicy, TLSConfig, call_metadata, host_port, make_channel, make_server)

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
    """One published version. `publish` copies nothing: chunk frames are built when a stream
    sends them, straight from the tensor memory. The crc32 of every chunk is computed once,
    ahead of the streams on a background thread (zlib releases the GIL), and shared."""

    def __init__(self, version: int, publisher_id: str, params: Mapping[str, np.ndarray],
                 chunk_bytes: int, crc_pool: Optional[futures.Executor],
                 policy_version: Optional[int] = None):
        if sys.byteorder != "little":
            raise NotImplementedError("weight sync assumes a little-endian host")
        header = pb.WeightHeader(version=version, publisher_id=publisher_id,
                                 has_crc32=crc_pool is not None, policy_version=policy_version)
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
        self._crcs = None if crc_pool is None else [
            crc_pool.submit(self._crc, i) for i in range(self.num_chunks)]

    def cancel_pending(self) -> None:
        """A newer version exists: skip checksums nobody may need (computed on demand)."""
        for f in self._crcs or ():
            f.cancel()

    def frames(self):
        yield self.header
        for i in range(self.num_chunks):
            yield self._chunk(i)
        yield self.commit

    def _pieces(self, index: int) -> list:
        """The chunk's payload as views of the tensors (plus zero padding)."""
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
        return pieces

    def _crc(self, index: int) -> int:
        crc = 0
        for piece in self._pieces(index):
            crc = zlib.crc32(piece, crc)
        return crc

    def _chunk(self, index: int) -> bytes:
        pieces = self._pieces(index)
        length = sum(len(p) for p in pieces)
        crc = 0
        if self._crcs is not None:
            f = self._crcs[index]
            crc = self._crc(index) if f.cancelled() else f.result()
        # WeightMessage{chunk: WeightChunk{version, index, offset, crc32, data}} written by
        # hand around the tensor memory: the payload is copied once, by this join.
        head = pb.WeightChunk(version=self.version, index=index,
                              offset=index * self.chunk_bytes, crc32=crc).SerializeToString()
        head += _len_field(5, length)
        return b"".join([_len_field(2, len(head) + length), head, *pieces])


class WeightPublisher:
    """Serves the newest published version to every subscriber (starts on construction)."""

    def __init__(self, bind_address: str = f"{DEFAULT_HOST}:0", token: Optional[str] = None,
                 tls: Optional[TLSConfig] = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 checksum: bool = True, max_message_bytes: Optional[int] = None,
                 max_workers: int = 64):
        if chunk_bytes < 1024:
            raise ValueError(f"chunk_bytes must be >= 1024, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._crc_pool = futures.ThreadPoolExecutor(1) if checksum else None
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

    def publish(self, version: int, params: Mapping[str, np.ndarray],
                policy_version: Optional[int] = None) -> None:
        """Makes `params` the newest version. Versions must increase. `policy_version`: the
        policy these weights are, when not `version` (subscribers get `version` otherwise).

        Zero-copy: the arrays are read while streams send them, so they must not be modified
        after this call (`jax.device_get` returns fresh arrays, so the usual call is safe).
        """
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        if policy_version is not None and not 0 <= policy_version <= version:
            raise ValueError(f"policy_version must be in [0, {version}], got {policy_version}")
        latest = self.latest_version
        if version <= latest:
            raise ValueError(f"version {version} is not newer than published {latest}")
        frames = _Version(int(version), self.publisher_id, params, self.chunk_bytes,
                          self._crc_pool,
                          None if policy_version is None else int(policy_version))
        with self._cv:
            if self._latest is not None and version <= self._latest.version:
                raise ValueError(f"version {version} raced with {self._latest.version}")
            if self._latest is not None:
                self._latest.cancel_pending()
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
        if self._crc_pool is not None:
            self._crc_pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class _CorruptVersion(Exception):
    pass


class _ChunkView(NamedTuple):
    """A WeightChunk whose `data` is a zero-copy view of the received message."""
    version: int
    index: int
    offset: int
    crc32: int
    data: memoryview


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise _CorruptVersion("truncated varint")
        b = buf[pos]
        value |= (b & 0x7F) << shift
        pos += 1
        if not b & 0x80:
            return value, pos
        shift += 7


def _parse_chunk(body: memoryview) -> _ChunkView:
    """WeightChunk wire format → _ChunkView, reading `data` as a view (protobuf's parser would
    copy the payload twice: into the message, then into a new bytes object)."""
    fields = {1: 0, 2: 0, 3: 0, 4: 0, 5: memoryview(b"")}
    pos = 0
    while pos < len(body):
        tag, pos = _read_varint(body, pos)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == 0:
            value, pos = _read_varint(body, pos)
        elif wire_type == 5:
            value, pos = int.from_bytes(body[pos:pos + 4], "little"), pos + 4
        elif wire_type == 1:
            value, pos = int.from_bytes(body[pos:pos + 8], "little"), pos + 8
        elif wire_type == 2:
            n, pos = _read_varint(body, pos)
            value, pos = body[pos:pos + n], pos + n
        else:
            raise _CorruptVersion(f"unsupported wire type {wire_type}")
        if pos > len(body):
            raise _CorruptVersion("truncated chunk")
        if number in fields:
            fields[number] = value
    return _ChunkView(*(fields[i] for i in range(1, 6)))


def _parse_message(raw: bytes):
    """A WeightMessage → ('header'|'chunk'|'commit', message); chunks as _ChunkView."""
    buf = memoryview(raw)
    try:
        tag, pos = _read_varint(buf, 0)
        length, pos = _read_varint(buf, pos)
    except _CorruptVersion:
        tag = pos = length = -1
    if tag == (2 << 3 | 2) and pos + length == len(buf):  # the layout our publisher sends
        return "chunk", _parse_chunk(buf[pos:])
    msg = pb.WeightMessage.FromString(raw)  # any other valid encoding
    kind = msg.WhichOneof("kind")
    if kind == "chunk":
        c = msg.chunk
        return kind, _ChunkView(c.version, c.index, c.offset, c.crc32, memoryview(c.data))
    return kind, getattr(msg, kind) if kind else None


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
                 crc_pool: Optional[futures.Executor] = None):
        if header.total_bytes < 0 or header.total_bytes > max_bytes:
            raise _CorruptVersion(f"total_bytes {header.total_bytes} out of range")
        # crc32 runs on `crc_pool` (zlib releases the GIL) while the next chunk arrives.
        self.header, self.crc_pool, self.crcs = header, crc_pool, []
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

    def add(self, chunk) -> None:
        """`chunk`: a pb.WeightChunk or _ChunkView (same field names)."""
        h = self.header
        if chunk.version != h.version or chunk.index != self.next_index or \
                chunk.offset != self.next_offset:
            raise _CorruptVersion(f"chunk {chunk.index}@{chunk.offset} of version "
                                  f"{chunk.version} out of order")
        data = chunk.data
        start, end = self.next_offset, self.next_offset + len(data)
        if end > h.total_bytes:
            raise _CorruptVersion("chunks exceed total_bytes")
        self.buffer[start:end] = np.frombuffer(data, np.uint8)
        if self.crc_pool is not None and h.has_crc32:  # the bytes as they landed
            self.crcs.append((chunk.index, chunk.crc32,
                              self.crc_pool.submit(zlib.crc32, self.buffer[start:end])))
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
        for index, expected, crc in self.crcs:
            if crc.result() != expected:
                raise _CorruptVersion(f"chunk {index}: crc32 mismatch")
        return {name: self.buffer[off:off + n].view(dt).reshape(shape)
                for name, dt, shape, off, n in self.specs}


class WeightSubscriber:
    """Background thread that applies each complete version via
    `on_weights(version, params, policy_version)` (module docstring: the guarantees).

    `params` arrays are views of a recycled version buffer: the callback may keep them (a
    buffer is reused only once no view of it is alive).
    """

    def __init__(self, address: str, on_weights: Callable[[int, dict, int], None],
                 token: Optional[str] = None, tls: Optional[TLSConfig] = None, *,
                 max_message_bytes: int = DEFAULT_CHUNK_BYTES + (1 << 20),
                 max_version_bytes: int = 1 << 40, retry: RetryPolicy = RetryPolicy(),
                 verify_crc: bool = True, subscriber_id: Optional[str] = None):
        self.address = address
        self._on_weights = on_weights
        self._channel = make_channel(address, max_message_bytes=max_message_bytes, tls=tls)
        self._subscribe = self._channel.unary_stream(
            SUBSCRIBE, request_serializer=pb.SubscribeRequest.SerializeToString,
            response_deserializer=_identity)  # parsed by _parse_message
        self._md = call_metadata(token)
        self._retry, self._max_bytes = retry, max_version_bytes
        self._pool = _BufferPool()
        self._crc_pool = futures.ThreadPoolExecutor(1) if verify_crc else None
        self.subscriber_id = subscriber_id or uuid.uuid4().hex[:12]
        self._cv = threading.Condition()
        self._latest, self._publisher_id = -1, ""
        self._closed = False
        self._closing = threading.Event()  # wakes a reconnect backoff at close
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
                for raw in self._call:
                    kind, msg = _parse_message(raw)
                    if kind == "header":
                        if assembler is not None:
                            raise _CorruptVersion("new header before commit")
                        assembler = _Assembler(msg, self._max_bytes, self._pool,
                                               self._crc_pool)
                        self.receiving = (msg.version, 0, msg.total_bytes)
                    elif kind == "chunk" and assembler is not None:
                        assembler.add(msg)
                        self.receiving = (assembler.header.version, assembler.next_offset,
                                          assembler.header.total_bytes)
                    elif kind == "commit" and assembler is not None:
                        self._apply(assembler.header, assembler.finish(msg))
                        assembler = None  # drop our references: the buffer may be recycled
                        attempt = 0
                    else:
                        raise _CorruptVersion(f"unexpected {kind!r} message")
            except grpc.RpcError as e:
                if self._closed:
                    break
                self.last_error = f"{e.code().name}: {e.details()}"
            except (_CorruptVersion, DecodeError, ValueError) as e:
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
            self._closing.wait(self._retry.delay(attempt))
            attempt += 1

    def _apply(self, header: pb.WeightHeader, params: dict) -> None:
        newer = header.version > self._latest or header.publisher_id != self._publisher_id
        if not newer:  # a publisher never sends this; defend the monotonic contract anyway
            self.versions_discarded += 1
            return
        policy = header.policy_version if header.HasField("policy_version") else header.version
        try:
            self._on_weights(header.version, params, policy)
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
        self._closing.set()
        call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(timeout)
        self._channel.close()
        if self._crc_pool is not None:
            self._crc_pool.shutdown(wait=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
