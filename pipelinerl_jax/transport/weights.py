"""Versioned weight sync: the learner publishes `WeightVersion`s, engines subscribe.

A version is a `weight_version.WeightVersion` (kind 'full' | 'lora', base sha256, LoRA
rank/alpha/targets, policy version) carrying a flat `dict[str, np.ndarray]` (e.g.
`layers/0/attn/q_proj/kernel`), any dtype in `codec.DTYPES` (float32, bfloat16 via ml_dtypes,
...), or a directory's path. One version travels over the gRPC stream `WeightSync.Subscribe` as
    header (the message's fields; names, dtypes, shapes, byte offsets, total size, chunks)
    chunk × num_chunks (in offset order; each with its zlib.crc32)
    commit (version, total bytes, chunk count)
Tensors are laid out in one payload at 64-byte-aligned offsets, so the subscriber copies each
chunk straight into one preallocated buffer and hands out views of it: no per-tensor copies.

The header's `policy_version` says which policy the weights are when that is not `version`
itself (lag injection ships an older policy's weights as a new stream version); a version
published as a directory (`weight_sink.HFDirSink`) carries no tensors, only its `path`.
What was published travels in the message: the receiver rebuilds nothing from its own config.

Guarantees to the subscriber's `on_weights(message)` callback (a `WeightVersion` with the
tensors or the path):
- called only for a version whose every chunk arrived, in order, with matching crc32, version
  and sizes; a partial, corrupt or interleaved version is discarded, never applied;
- versions are increasing per publisher instance; a subscriber that fell behind (or connects
  late) gets the newest version only. The publisher finishes a version it has started
  sending before jumping to the newest, so rapid publishing cannot starve a subscriber;
- a publisher that dies mid-stream leaves the subscriber on its last complete version; the
  subscriber reconnects with backoff and resumes when a publisher is back at the address.
  A *new* publisher instance (a restarted learner, new `publisher_id`) may start from an
  older version (resumed checkpoint); subscribers follow it;
- a hostile or broken stream cannot take the subscriber down: every frame is read with its
  wire types checked, a header is checked against what the subscriber accepts *before* its
  buffer is allocated (a known kind, and with `accepts` the receiver's kind, base sha256 and
  LoRA shape; consistent tensor specs; `total_bytes` within `max_version_bytes`
  and this machine's physical memory; with `expected_shapes`, exactly those names and
  shapes; tensors or a path, never both nor neither; a path absolute, without NUL, at most
  `MAX_PATH_CHARS`), and any exception while reading a version (a failed allocation included)
  discards that version, is recorded in `last_error`/`health()`, and the subscriber
  reconnects. The thread's loop is itself restarted if it ever raises (`thread_restarts`).
The learner must announce version v to the RolloutQueue (`set_version`) BEFORE `publish(v)`,
or rollouts sampled with v could be rejected as coming from the future.

Speed (see docs/transport.md): `publish` copies nothing; each chunk frame is assembled by
hand straight from the tensor memory the first time a stream sends it (one copy, instead of
the two more a protobuf message would make) and kept for every other subscriber, with its
crc32, until a newer version replaces it.
The subscriber copies each chunk once into a version buffer that it recycles once the
previous callback's arrays are no longer referenced (fresh pages cost more than the copy).

`WeightPublisher(payload="socket")` takes the payload off gRPC (no frame assembly, none of
gRPC's own copies): the stream carries the header, with the port of a plain TCP listener the
publisher runs on its bind host and a one-time random ticket for this version on this
stream, then the commit, carrying the crc32 of every `chunk_bytes` slice (the header's
`num_chunks` counts those slices; no chunk frame is sent). The subscriber, after every header
check and once the buffer is allocated, connects to that port on the host it dialled (never
a host the stream names), sends the ticket and `recv_into`s exactly `total_bytes` into the
version buffer; the listener sends them with `sendmsg` from the tensors' own memory (plus
the alignment gaps' zeros). A short read, a refused ticket, a connection error or a crc32
mismatch discards the version like a corrupt stream. A ticket is valid once, until its
stream moves on (or `payload_timeout`); the stream sends the commit only after the payload
went out. The raw connection is plaintext: refused with TLS.
"""
from __future__ import annotations

import logging
import math
import os
import socket
import sys
import threading
import time
import uuid
import zlib
from concurrent import futures
from typing import Callable, Mapping, NamedTuple, Optional

import grpc
import numpy as np

from pipelinerl_jax.transport import rollout_pb2 as pb
from pipelinerl_jax.transport import payload_socket, wire
from pipelinerl_jax.transport.payload_socket import TICKET_BYTES, PayloadListener
from pipelinerl_jax.transport.codec import dtype_from_name
from pipelinerl_jax.transport.retry import RetryPolicy
from pipelinerl_jax.transport.security import (
    DEFAULT_HOST, TLSConfig, address_host, call_metadata, host_port, make_channel,
    make_server)
from pipelinerl_jax.transport.weight_version import KINDS, WeightVersion, refusal
from pipelinerl_jax.models.lora import LoRASpec

log = logging.getLogger(__name__)

SERVICE = "pipelinerl_jax.WeightSync"
SUBSCRIBE = f"/{SERVICE}/Subscribe"
DEFAULT_CHUNK_BYTES = 4 << 20
MAX_PATH_CHARS = 4096  # a published directory's path (PATH_MAX on Linux)
_ALIGN = 64
PAYLOADS = ("grpc", "socket")


def path_problem(path) -> Optional[str]:
    """Why `path` cannot be a published directory's path (None if it can): publisher and
    subscriber check it alike."""
    if not isinstance(path, str) or not path:
        return f"must be a non-empty string, got {path!r:.100}"
    if len(path) > MAX_PATH_CHARS:
        return f"{len(path)} characters, more than {MAX_PATH_CHARS}"
    if "\0" in path:
        return "contains a NUL character"
    if not os.path.isabs(path):
        return f"{path[:200]!r} is not absolute"
    return None


def _identity(x):
    return x


def _physical_memory() -> int:
    """Bytes of RAM on this machine (no version larger than this can be held)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return 1 << 62


def header_fields(message: WeightVersion) -> dict:
    """The `WeightHeader` fields that describe `message` (kind, base, LoRA shape, versions,
    path)."""
    out = dict(version=message.version, kind=message.kind, base_sha256=message.base_sha256,
               policy_version=message.policy_version, path=message.path)
    if message.lora is not None:
        out.update(lora_rank=message.lora.rank, lora_alpha=message.lora.alpha,
                   lora_targets=list(message.lora.targets))
    return out


def message_of(header: pb.WeightHeader, tensors=None, path=None) -> WeightVersion:
    """The `WeightVersion` a header describes (raises `WeightVersionRefused` if malformed)."""
    lora = (LoRASpec(int(header.lora_rank), float(header.lora_alpha),
                     tuple(header.lora_targets)) if header.kind == "lora" else None)
    return WeightVersion(header.kind, header.base_sha256, lora, header.version,
                         header.policy_version if header.HasField("policy_version") else None,
                         tensors, path)


class _Version:
    """One published version. `publish` copies nothing: a chunk frame is built the first time
    a stream sends it, straight from the tensor memory, and kept for the other streams
    (assembled once for all subscribers). The crc32 of every chunk is computed once, ahead
    of the streams on a background thread (zlib releases the GIL), and shared."""

    def __init__(self, message: WeightVersion, publisher_id: str, chunk_bytes: int,
                 crc_pool: Optional[futures.Executor]):
        if sys.byteorder != "little":
            raise NotImplementedError("weight sync assumes a little-endian host")
        header = pb.WeightHeader(publisher_id=publisher_id, has_crc32=crc_pool is not None,
                                 **header_fields(message))
        version = message.version
        self.segments, offset = [], 0  # (payload offset, uint8 view of the tensor)
        for name, value in (message.tensors or {}).items():
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
        self.header_pb = header
        self.header = pb.WeightMessage(header=header).SerializeToString()
        self._socket_commit: Optional[bytes] = None
        self.commit = pb.WeightMessage(commit=pb.WeightCommit(
            version=version, total_bytes=offset, num_chunks=self.num_chunks)).SerializeToString()
        self._crcs = None if crc_pool is None else [
            crc_pool.submit(self._crc, i) for i in range(self.num_chunks)]
        self._frames: list = [None] * self.num_chunks  # assembled chunk frames, shared
        self._frame_lock = threading.Lock()
        self.assembled_bytes = 0  # payload bytes copied into frames (once per chunk)

    def cancel_pending(self) -> None:
        """A newer version exists: skip checksums nobody may need (computed on demand)."""
        for f in self._crcs or ():
            f.cancel()

    def frames(self):
        yield self.header
        for i in range(self.num_chunks):
            yield self._frame(i)
        yield self.commit

    def _frame(self, index: int) -> bytes:
        """Chunk `index`'s frame, assembled by the first stream that needs it."""
        frame = self._frames[index]
        if frame is None:
            with self._frame_lock:
                frame = self._frames[index]
                if frame is None:
                    frame = self._frames[index] = self._chunk(index)
                    self.assembled_bytes += min(self.chunk_bytes,
                                                self.nbytes - index * self.chunk_bytes)
        return frame

    def _pieces(self, index: int) -> list:
        """The chunk's payload as views of the tensors (plus zero padding)."""
        start = index * self.chunk_bytes
        return self._span(start, min(self.nbytes, start + self.chunk_bytes))

    def payload_pieces(self) -> list:
        """The whole payload as views of the tensors plus the alignment gaps' zeros."""
        return self._span(0, self.nbytes)

    def _span(self, start: int, end: int) -> list:
        """Payload bytes [start, end) as views of the tensors (plus zero padding)."""
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

    def send_payload(self, conn: socket.socket) -> None:
        """Sends the payload on `conn` from the tensors' own memory (nothing is joined).
        Raises OSError if the connection fails."""
        payload_socket.send_buffers(conn, self.payload_pieces())

    def socket_header(self, port: int, ticket: bytes) -> bytes:
        """The header frame for one stream of a socket payload."""
        header = pb.WeightHeader()
        header.CopyFrom(self.header_pb)
        header.payload_port, header.payload_ticket = port, ticket
        header.payload_chunk_bytes = self.chunk_bytes
        return pb.WeightMessage(header=header).SerializeToString()

    def socket_commit(self) -> bytes:
        """The commit frame of a socket payload: it carries every chunk's crc32."""
        if self._socket_commit is None:
            crcs = []
            if self._crcs is not None:
                crcs = [self._crc(i) if f.cancelled() else f.result()
                        for i, f in enumerate(self._crcs)]
            self._socket_commit = pb.WeightMessage(commit=pb.WeightCommit(
                version=self.version, total_bytes=self.nbytes, num_chunks=self.num_chunks,
                crc32s=crcs)).SerializeToString()
        return self._socket_commit

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
        head += wire.len_field(5, length)
        return b"".join([wire.len_field(2, len(head) + length), head, *pieces])


class WeightPublisher:
    """Serves the newest published version to every subscriber (starts on construction).

    `payload="socket"` sends each version's payload off gRPC: the stream carries the header
    (with a port and a one-time ticket) and the commit (with the crc32s); the subscriber reads
    the bytes from a plain TCP listener beside the server, which sends them straight from the
    tensors' memory (no frame assembly). Plaintext, so refused with `tls`. `payload_timeout`
    bounds how long a payload connection may wait for its ticket or stall, and how long a
    stream waits for its subscriber to fetch the payload. `payload_port`: the payload
    listener's port (0: any free one; fixed where a firewall must allow it).
    """

    def __init__(self, bind_address: str = f"{DEFAULT_HOST}:0", token: Optional[str] = None,
                 tls: Optional[TLSConfig] = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 checksum: bool = True, max_message_bytes: Optional[int] = None,
                 max_workers: int = 64, payload: str = "grpc",
                 payload_timeout: float = 60.0, payload_port: int = 0):
        if chunk_bytes < 1024:
            raise ValueError(f"chunk_bytes must be >= 1024, got {chunk_bytes}")
        if payload not in PAYLOADS:
            raise ValueError(f"payload must be one of {PAYLOADS}, got {payload!r}")
        if payload == "socket" and tls is not None:
            raise ValueError("payload='socket' sends the weights on a plaintext TCP connection "
                             "and cannot be combined with TLS: use payload='grpc'")
        self.payload, self.payload_timeout = payload, payload_timeout
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
        self.payload_listener: Optional[PayloadListener] = None
        if payload == "socket":
            self.payload_listener = PayloadListener(address_host(bind_address),
                                                    payload_timeout, max_workers,
                                                    self.publisher_id, port=payload_port)
            self.payload_port = self.payload_listener.port
        self._server.start()

    @property
    def payloads_sent(self) -> int:
        """Socket payloads sent (0 on the gRPC path); `payload_refused`: connections without
        a valid ticket or beyond the slots; `payload_errors`: connections that failed."""
        return self.payload_listener.sent if self.payload_listener else 0

    @property
    def payload_refused(self) -> int:
        return self.payload_listener.refused if self.payload_listener else 0

    @property
    def payload_errors(self) -> int:
        return self.payload_listener.errors if self.payload_listener else 0

    @property
    def latest_version(self) -> int:
        with self._cv:
            return -1 if self._latest is None else self._latest.version

    @property
    def latest_assembled_bytes(self) -> int:
        """Payload bytes copied into frames for the newest version so far (whatever the
        number of subscribers: at most its size)."""
        with self._cv:
            return 0 if self._latest is None else self._latest.assembled_bytes

    def publish(self, message: WeightVersion) -> None:
        """Makes `message` the newest version (versions must increase). It carries at least
        one tensor, or the absolute path of a complete directory (subscribers' callbacks get
        the path instead of arrays).

        Zero-copy: the arrays are read while streams send them, so they must not be modified
        after this call (`jax.device_get` returns fresh arrays, so the usual call is safe).
        """
        if not isinstance(message, WeightVersion):
            raise TypeError(f"publish takes a WeightVersion, got {type(message).__name__}")
        version, policy_version = message.version, message.policy_version
        if message.path is not None:
            problem = path_problem(message.path)
            if problem is not None:
                raise ValueError(f"version {version}: path {problem}")
        elif not message.tensors:
            raise ValueError(f"version {version}: no tensors and no path")
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        if policy_version is not None and not 0 <= policy_version <= version:
            raise ValueError(f"policy_version must be in [0, {version}], got {policy_version}")
        latest = self.latest_version
        if version <= latest:
            raise ValueError(f"version {version} is not newer than published {latest}")
        frames = _Version(message, self.publisher_id, self.chunk_bytes, self._crc_pool)
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
            if self.payload_listener is not None and frames.nbytes:
                if not (yield from self._socket_frames(frames, context)):
                    return  # the payload failed: end the stream, the subscriber reconnects
            else:
                yield from frames.frames()
            have_version, have_publisher = frames.version, self.publisher_id

    def _socket_frames(self, frames: _Version, context):
        """Header with a fresh ticket; the commit once the payload connection sent it.
        Returns whether it did; the ticket expires either way."""
        ticket, claim = self.payload_listener.issue(frames)
        try:
            yield frames.socket_header(self.payload_port, ticket)
            deadline = time.monotonic() + self.payload_timeout
            while not claim.done.wait(0.2):
                if self._stopped or not context.is_active():
                    return False
                if time.monotonic() > deadline:
                    log.warning("weight publisher: version %d: no payload fetch within %.0f s",
                                frames.version, self.payload_timeout)
                    return False
            if not claim.ok:
                return False
            yield frames.socket_commit()
            return True
        finally:
            self.payload_listener.revoke(ticket)

    def stop(self, grace: float = 0.5) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._server.stop(grace).wait()
        if self.payload_listener is not None:
            self.payload_listener.stop()
            log.info("weight payload socket %s:%d: %d payloads sent, %d connections refused, "
                     "%d failed", address_host(self.address), self.payload_port,
                     self.payloads_sent, self.payload_refused, self.payload_errors)
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


# WeightChunk fields: number -> (name, wire type); the reader refuses any other wire type.
_CHUNK_FIELDS = {1: ("version", wire.VARINT), 2: ("index", wire.VARINT),
                 3: ("offset", wire.VARINT), 4: ("crc32", wire.FIXED32),
                 5: ("data", wire.LEN)}


def _signed64(value: int) -> int:
    """A varint as int64/int32 (negative values are sent as 10-byte two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _parse_chunk(body: memoryview) -> _ChunkView:
    """WeightChunk wire format → _ChunkView, reading `data` as a view (protobuf's parser would
    copy the payload twice: into the message, then into a new bytes object). Raises
    _CorruptVersion on truncation or a known field sent with another wire type."""
    fields = {1: 0, 2: 0, 3: 0, 4: 0, 5: memoryview(b"")}
    pos = 0
    try:
        while pos < len(body):
            tag, pos = wire.read_varint(body, pos)
            number, wire_type = tag >> 3, tag & 7
            if wire_type == wire.VARINT:
                value, pos = wire.read_varint(body, pos)
                value = _signed64(value)
            elif wire_type == wire.FIXED32:
                value, pos = int.from_bytes(body[pos:pos + 4], "little"), pos + 4
            elif wire_type == wire.FIXED64:
                value, pos = int.from_bytes(body[pos:pos + 8], "little"), pos + 8
            elif wire_type == wire.LEN:
                n, pos = wire.read_varint(body, pos)
                value, pos = body[pos:pos + n], pos + n
            else:
                raise _CorruptVersion(f"chunk: unsupported wire type {wire_type}")
            if pos > len(body):
                raise _CorruptVersion("chunk: truncated")
            known = _CHUNK_FIELDS.get(number)
            if known is not None:
                if wire_type != known[1]:
                    raise _CorruptVersion(f"chunk.{known[0]}: wire type {wire_type}, "
                                          f"expected {known[1]}")
                fields[number] = value
    except wire.WireError as e:
        raise _CorruptVersion(f"chunk: {e}") from None
    return _ChunkView(*(fields[i] for i in range(1, 6)))


def _parse_message(raw: bytes):
    """A WeightMessage → ('header'|'chunk'|'commit', message); chunks as _ChunkView."""
    buf = memoryview(raw)
    try:
        tag, pos = wire.read_varint(buf, 0)
        length, pos = wire.read_varint(buf, pos)
    except wire.WireError:
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
    """Collects one version's chunks into a single buffer, checking everything.

    The header is checked before anything is allocated: its kind known (and, with
    `accepts`, the receiver's: kind, base sha256, LoRA shape), tensor specs consistent (known
    dtype, non-negative dims, `nbytes` = elements × itemsize, aligned, inside the payload),
    `total_bytes` no more than the tensors' extent plus alignment, within `max_bytes`, and,
    with `expected_shapes` ({name: shape}), exactly those tensors. A version carries
    tensors or a `path` (a directory publication: no tensors, no bytes), never both nor
    neither.
    """

    def __init__(self, header: pb.WeightHeader, max_bytes: int, pool: _BufferPool,
                 crc_pool: Optional[futures.Executor] = None,
                 expected_shapes: Optional[Mapping[str, tuple]] = None,
                 accepts: Optional[WeightVersion] = None):
        if header.kind not in KINDS:
            raise _CorruptVersion(f"version {header.version}: unknown kind {header.kind!r}; "
                                  f"known {KINDS}")
        try:
            problem = message_of(header).problem() if accepts is None else \
                refusal(accepts, message_of(header))
        except ValueError as e:  # a malformed description
            problem = str(e)
        if problem is not None:
            raise _CorruptVersion(problem)
        total = header.total_bytes
        if total < 0 or total > max_bytes:
            raise _CorruptVersion(f"total_bytes {total} out of range: this subscriber "
                                  f"accepts at most {max_bytes}")
        if not 1 <= header.num_chunks <= max(1, total):
            raise _CorruptVersion(f"num_chunks {header.num_chunks} impossible for "
                                  f"total_bytes {total}")
        if header.HasField("path"):
            problem = path_problem(header.path)
            if problem is not None:
                raise _CorruptVersion(f"path {problem}")
            if header.tensors or total:
                raise _CorruptVersion(f"a directory publication ({header.path[:200]!r}) with "
                                      f"{len(header.tensors)} tensors, {total} bytes")
            expected_shapes = None  # the directory is checked where it is loaded
        elif not header.tensors:
            raise _CorruptVersion("a version with neither tensors nor a path")
        self.specs = self._check_specs(header, expected_shapes)
        extent = max((off + n for _, _, _, off, n in self.specs), default=0)
        if not extent <= total < extent + _ALIGN:
            raise _CorruptVersion(f"total_bytes {total} does not match the tensors' extent "
                                  f"{extent}")
        # crc32 runs on `crc_pool` (zlib releases the GIL) while the next chunk arrives.
        self.header, self.crc_pool, self.crcs = header, crc_pool, []
        try:
            self.buffer = pool.get(total)
        except MemoryError:
            raise _CorruptVersion(f"total_bytes {total}: cannot allocate the buffer") from None
        self.next_index = self.next_offset = 0
        self.socket = False  # the payload came on a socket (fetch), its crc32s with the commit
        self.conn: Optional[socket.socket] = None

    @staticmethod
    def _check_specs(header: pb.WeightHeader, expected: Optional[Mapping[str, tuple]]):
        specs, names = [], set()
        for i, t in enumerate(header.tensors):
            where = f"tensors[{i}] ({t.name[:80]!r})"
            if t.name in names:
                raise _CorruptVersion(f"{where}: duplicate name")
            names.add(t.name)
            try:
                dt = dtype_from_name(t.dtype)
            except ValueError as e:
                raise _CorruptVersion(f"{where}: {e}") from None
            shape = tuple(t.shape)
            if any(d < 0 for d in shape):
                raise _CorruptVersion(f"{where}: negative dimension in {list(shape)[:8]}")
            n = math.prod(shape) * dt.itemsize
            if n != t.nbytes or t.offset < 0 or t.offset % dt.itemsize or \
                    t.offset + n > header.total_bytes:
                raise _CorruptVersion(f"{where}: inconsistent spec")
            if expected is not None and (t.name not in expected or
                                         tuple(expected[t.name]) != shape):
                raise _CorruptVersion(
                    f"{where}: shape {list(shape)[:8]} where the subscriber expects "
                    f"{list(expected[t.name]) if t.name in expected else 'no such tensor'}")
            specs.append((t.name, dt, shape, t.offset, n))
        if expected is not None and names != set(expected):
            missing = sorted(set(expected) - names)[:5]
            raise _CorruptVersion(f"tensors: missing {missing} the subscriber expects")
        return specs

    def fetch(self, host: str, timeout: float) -> None:
        """Reads a socket payload (the header's `payload_port`) straight into the buffer:
        connects to `host`, sends the ticket, then `recv_into` until `total_bytes` arrived.
        A short read or any connection error is a _CorruptVersion (via _StreamReader.feed)."""
        h = self.header
        total, chunk = h.total_bytes, h.payload_chunk_bytes
        if h.HasField("path") or not total:
            raise _CorruptVersion("a socket payload on a version without bytes")
        if len(h.payload_ticket) != TICKET_BYTES or not 0 < h.payload_port < 65536:
            raise _CorruptVersion("socket payload: malformed port or ticket")
        if chunk < 1 or h.num_chunks != -(-total // chunk):
            raise _CorruptVersion(f"socket payload: {h.num_chunks} chunks of {chunk} bytes "
                                  f"for total_bytes {total}")
        view = memoryview(self.buffer)
        with payload_socket.open_payload(host, h.payload_port, h.payload_ticket,
                                          timeout) as conn:
            self.conn = conn  # close() shuts it down rather than wait out the timeout
            while self.next_offset < total:
                got = conn.recv_into(view[self.next_offset:],
                                     min(total - self.next_offset, 1 << 24))
                if not got:
                    raise _CorruptVersion(f"socket payload closed after {self.next_offset}/"
                                          f"{total} bytes")
                self.next_offset += got
        if self.crc_pool is not None and h.has_crc32:
            for i in range(h.num_chunks):  # expected values come with the commit
                self.crcs.append((i, None, self.crc_pool.submit(
                    zlib.crc32, self.buffer[i * chunk:(i + 1) * chunk])))
        self.next_index = h.num_chunks
        self.socket = True

    def add(self, chunk) -> None:
        """`chunk`: a pb.WeightChunk or _ChunkView (same field names)."""
        h = self.header
        if chunk.version != h.version or chunk.index != self.next_index or \
                chunk.offset != self.next_offset:
            raise _CorruptVersion(f"chunk {chunk.index}@{chunk.offset} of version "
                                  f"{chunk.version} out of order")
        if self.next_index >= h.num_chunks:
            raise _CorruptVersion(f"more than the announced {h.num_chunks} chunks")
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

    def finish(self, commit: pb.WeightCommit) -> WeightVersion:
        """The version: its `{name: array}` dict, or its path (a directory publication)."""
        h = self.header
        if (commit.version, commit.total_bytes, commit.num_chunks) != \
                (h.version, h.total_bytes, h.num_chunks) or \
                self.next_index != h.num_chunks or self.next_offset != h.total_bytes:
            raise _CorruptVersion(f"version {h.version} incomplete: {self.next_index}/"
                                  f"{h.num_chunks} chunks, {self.next_offset}/"
                                  f"{h.total_bytes} bytes")
        crcs = self.crcs
        if self.socket and self.crc_pool is not None and h.has_crc32:
            if len(commit.crc32s) != h.num_chunks:
                raise _CorruptVersion(f"commit carries {len(commit.crc32s)} crc32s for "
                                      f"{h.num_chunks} chunks")
            crcs = [(i, expected, crc) for (i, _, crc), expected in zip(crcs, commit.crc32s)]
        for index, expected, crc in crcs:
            if crc.result() != expected:
                raise _CorruptVersion(f"chunk {index}: crc32 mismatch")
        if h.HasField("path"):
            return message_of(h, path=h.path)
        return message_of(h, tensors={name: self.buffer[off:off + n].view(dt).reshape(shape)
                                      for name, dt, shape, off, n in self.specs})


class _StreamReader:
    """Reads one connection's frames into complete versions: `feed(raw)` returns
    `(header, message)` when a commit completes a version, None otherwise, and raises
    _CorruptVersion for anything wrong with the stream (whatever the underlying error)."""

    def __init__(self, max_bytes: int, pool: _BufferPool,
                 crc_pool: Optional[futures.Executor] = None,
                 expected_shapes: Optional[Mapping[str, tuple]] = None,
                 accepts: Optional[WeightVersion] = None,
                 payload_host: Optional[str] = DEFAULT_HOST,  # None: refuse socket payloads
                 payload_timeout: float = 60.0):
        self.payload_host, self.payload_timeout = payload_host, payload_timeout
        self.max_bytes, self.pool, self.crc_pool = max_bytes, pool, crc_pool
        self.expected_shapes, self.accepts = expected_shapes, accepts
        self.assembler: Optional[_Assembler] = None
        self.receiving: tuple[int, int, int] = (-1, 0, 0)  # (version, bytes so far, total)
        self.in_progress = False  # a header arrived (accepted or not), its commit not yet

    def feed(self, raw: bytes):
        try:
            return self._feed(raw)
        except _CorruptVersion:
            raise
        except Exception as e:  # DecodeError, a failed allocation, anything: not a version
            raise _CorruptVersion(f"{type(e).__name__}: {e}") from e

    def _feed(self, raw: bytes):
        kind, msg = _parse_message(raw)
        if kind == "header":
            if self.in_progress:
                raise _CorruptVersion("new header before commit")
            self.in_progress = True
            self.assembler = _Assembler(msg, self.max_bytes, self.pool, self.crc_pool,
                                        self.expected_shapes, self.accepts)
            self.receiving = (msg.version, 0, msg.total_bytes)
            if msg.payload_port:  # the bytes come on a socket, not as chunk frames
                if self.payload_host is None:
                    raise _CorruptVersion("a socket payload offered to a TLS subscriber: "
                                          "it fetches weights over TLS only")
                self.assembler.fetch(self.payload_host, self.payload_timeout)
                self.receiving = (msg.version, msg.total_bytes, msg.total_bytes)
        elif kind == "chunk" and self.assembler is not None:
            self.assembler.add(msg)
            h = self.assembler.header
            self.receiving = (h.version, self.assembler.next_offset, h.total_bytes)
        elif kind == "commit" and self.assembler is not None:
            header, params = self.assembler.header, self.assembler.finish(msg)
            self.assembler = None  # drop our references: the buffer may be recycled
            self.receiving, self.in_progress = (-1, 0, 0), False
            return header, params
        else:
            raise _CorruptVersion(f"unexpected {kind!r} message")
        return None


class WeightSubscriber:
    """Background thread that applies each complete version via `on_weights(message)`, a
    `WeightVersion` (module docstring: the guarantees).

    The message's tensors are views of a recycled version buffer: the callback may keep them
    (a buffer is reused only once no view of it is alive). A version published as a
    directory carries its `path` instead. `accepts` (a `WeightVersion` description, e.g. the
    engine's `serves`) refuses, before anything is allocated, a version of another kind, or
    LoRA adapters of another base or shape; a version of an unknown kind is always refused.
    `expected_shapes` ({name: shape}, e.g. the engine's parameters) bounds what a version
    may carry: a header with other names or shapes is refused before anything is allocated. `max_version_bytes` (and this machine's
    physical memory) bounds it otherwise. `health()` tells whether the thread is alive and
    what went wrong last.
    """

    def __init__(self, address: str, on_weights: Callable[[WeightVersion], None],
                 token: Optional[str] = None, tls: Optional[TLSConfig] = None, *,
                 max_message_bytes: int = DEFAULT_CHUNK_BYTES + (1 << 20),
                 max_version_bytes: int = 1 << 40, retry: RetryPolicy = RetryPolicy(),
                 verify_crc: bool = True, subscriber_id: Optional[str] = None,
                 expected_shapes: Optional[Mapping[str, tuple]] = None,
                 accepts: Optional[WeightVersion] = None, payload_timeout: float = 60.0):
        self.address = address
        # A socket payload is fetched from the host this subscriber dials (never a host the
        # stream names); `payload_timeout` bounds each connect and read.
        # A TLS subscriber never reads weights off the encrypted channel: it refuses them.
        self._payload_host = None if tls is not None else address_host(address)
        self._payload_timeout = payload_timeout
        self._accepts = None if accepts is None else accepts.description()
        self._on_weights = on_weights
        self._channel = make_channel(address, max_message_bytes=max_message_bytes, tls=tls)
        self._subscribe = self._channel.unary_stream(
            SUBSCRIBE, request_serializer=pb.SubscribeRequest.SerializeToString,
            response_deserializer=_identity)  # parsed by _parse_message
        self._md = call_metadata(token)
        self._retry = retry
        self._max_bytes = min(max_version_bytes, _physical_memory())
        self._expected = (None if expected_shapes is None else
                          {str(k): tuple(int(d) for d in v) for k, v in expected_shapes.items()})
        self._pool = _BufferPool()
        self._crc_pool = futures.ThreadPoolExecutor(1) if verify_crc else None
        self.subscriber_id = subscriber_id or uuid.uuid4().hex[:12]
        self._cv = threading.Condition()
        self._latest, self._publisher_id = -1, ""
        self._closed = False
        self._closing = threading.Event()  # wakes a reconnect backoff at close
        self._call = None
        self._reader: Optional[_StreamReader] = None
        # Observability (read without locks; ints are updated atomically under the GIL).
        self.versions_applied = self.versions_discarded = self.reconnects = 0
        self.errors = self.thread_restarts = 0
        self.last_error: Optional[str] = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"weights-{self.subscriber_id}")
        self._thread.start()

    @property
    def latest_version(self) -> int:
        return self._latest

    @property
    def receiving(self) -> tuple[int, int, int]:
        """(version, bytes so far, total) of the version being received; (-1, 0, 0): none."""
        reader = self._reader
        return (-1, 0, 0) if reader is None else reader.receiving

    def health(self) -> dict:
        """Whether the subscriber thread runs, and its counters and last error."""
        return {"alive": self._thread.is_alive() and not self._closed,
                "latest_version": self._latest, "versions_applied": self.versions_applied,
                "versions_discarded": self.versions_discarded, "reconnects": self.reconnects,
                "errors": self.errors, "thread_restarts": self.thread_restarts,
                "last_error": self.last_error}

    def wait_for_version(self, version: int, timeout: Optional[float] = None) -> bool:
        """True once a version >= `version` has been applied (False on timeout)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._latest >= version, timeout)

    def _error(self, message: str, warn: bool = True) -> None:
        self.errors += 1
        self.last_error = message
        if warn:
            log.warning("weight subscriber %s: %s", self.subscriber_id, message)

    def _run(self) -> None:
        """The thread: follows the stream until closed. `_follow` handles every error of a
        version or connection itself; should it ever raise anyway (a bug), the error is
        recorded and the loop restarted, so the thread never ends silently."""
        while not self._closed:
            try:
                self._follow()
            except Exception as e:  # noqa: BLE001 - kept visible: last_error, health
                self.thread_restarts += 1
                self._error(f"subscriber loop failed and was restarted: {e!r}")
                log.exception("weight subscriber %s: loop failed", self.subscriber_id)
                self._closing.wait(self._retry.delay(self.thread_restarts))

    def _follow(self) -> None:
        attempt = 0
        while not self._closed:
            reader = self._reader = _StreamReader(self._max_bytes, self._pool, self._crc_pool,
                                                  self._expected, self._accepts,
                                                  self._payload_host, self._payload_timeout)
            try:
                self._call = self._subscribe(
                    pb.SubscribeRequest(have_version=self._latest,
                                        publisher_id=self._publisher_id,
                                        subscriber_id=self.subscriber_id), metadata=self._md)
                if self._closed:  # close() raced with the call's creation
                    self._call.cancel()
                for raw in self._call:
                    done = reader.feed(raw)
                    if done is not None:
                        self._apply(*done)
                        attempt = 0
            except grpc.RpcError as e:
                if self._closed:
                    break
                self._error(f"{e.code().name}: {e.details()}", warn=False)
            except _CorruptVersion as e:  # any error while reading a version
                self._error(f"corrupt stream: {e}")
                if self._call is not None:
                    self._call.cancel()
            if reader.in_progress:
                self.versions_discarded += 1
            self._reader = None
            if self._closed:
                break
            self.reconnects += 1
            self._closing.wait(self._retry.delay(attempt))
            attempt += 1

    def _apply(self, header: pb.WeightHeader, message: WeightVersion) -> None:
        newer = header.version > self._latest or header.publisher_id != self._publisher_id
        if not newer:  # a publisher never sends this; defend the monotonic contract anyway
            self.versions_discarded += 1
            return
        try:
            self._on_weights(message)
        except Exception as e:  # a failing callback must not kill the subscription
            self._error(f"on_weights({header.version}) raised {e!r}", warn=False)
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
        reader = self._reader
        conn = getattr(reader and reader.assembler, "conn", None)
        if conn is not None:  # a socket payload being read
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout)
        self._channel.close()
        if self._crc_pool is not None:
            self._crc_pool.shutdown(wait=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
