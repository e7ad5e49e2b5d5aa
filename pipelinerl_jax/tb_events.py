"""TensorBoard event files written directly: the TFRecord framing and the few protobuf messages a
run's metrics need (`Event`, `Summary`, `Summary.Value` with a scalar or a `HistogramProto`),
encoded by hand from their field numbers.

Why not tensorboardX: importing any part of it runs `tensorboardX/__init__.py`, which imports
`torch` whenever torch is installed (the dev extra installs it for reference checks), so every
learner and evaluator process paid ~1.7 s of CPU and torch's memory at start for a file
writer (`scripts/bench_metrics.py --startup`, BENCHMARKS.md). Nothing here imports more than
numpy. Why not the `tensorboard` package's own writer (no torch): it would be a new dependency
(with werkzeug, markdown and a data server) and costs more CPU for the same events (0.36 s
against 0.23 s: BENCHMARKS.md, "Hand-written or a library").

The format (tensorflow/core/lib/io/record_writer.cc, tensorboard's event_file_loader): each
record is `uint64 length`, `uint32 masked_crc32c(length bytes)`, `data`,
`uint32 masked_crc32c(data)`, little-endian; the first event of a file carries
`file_version = "brain.Event:2"`. Field numbers (tensorboard/compat/proto/event.proto,
summary.proto): Event {wall_time = 1 double, step = 2 int64, file_version = 3 string,
summary = 5}; Summary {value = 1 repeated}; Value {tag = 1, simple_value = 2 float,
histo = 5}; HistogramProto {min = 1, max = 2, num = 3, sum = 4, sum_squares = 5 (doubles),
bucket_limit = 6, bucket = 7 (packed doubles)}.
"""
from __future__ import annotations

import os
import socket
import struct
import time
from typing import Iterable, Optional

import numpy as np

from pipelinerl_jax.transport.wire import FIXED32, FIXED64, VARINT, len_field, varint


def _crc_table():
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    return tuple(table)


_CRC_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), reflected, the checksum TFRecord uses."""
    crc = 0xFFFFFFFF
    table = _CRC_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the data, the data's masked CRC."""
    header = struct.pack("<Q", len(data))
    return (header + struct.pack("<I", masked_crc32c(header)) + data
            + struct.pack("<I", masked_crc32c(data)))


# --- protobuf wire format (varints and length prefixes: transport/wire.py) ------------------

def _key(field: int, wire_type: int) -> bytes:
    return varint((field << 3) | wire_type)


# proto3 leaves a field at its default (0, +0.0, empty) off the wire; so do these, so that
# an event is byte for byte what protobuf itself would serialize.

def _double(field: int, value: float) -> bytes:
    raw = struct.pack("<d", value)
    return _key(field, FIXED64) + raw if raw != bytes(8) else b""


def _float(field: int, value: float) -> bytes:
    raw = struct.pack("<f", value)
    return _key(field, FIXED32) + raw if raw != bytes(4) else b""


def _int(field: int, value: int) -> bytes:
    """int64: a negative value as its 64-bit two's complement (ten bytes)."""
    return _key(field, VARINT) + varint(value & (1 << 64) - 1) if value else b""


def _bytes(field: int, value: bytes) -> bytes:
    return len_field(field, len(value)) + value if value else b""


def _packed_doubles(field: int, values: np.ndarray) -> bytes:
    return _bytes(field, np.asarray(values, dtype="<f8").tobytes())


def scalar_value(tag: str, value: float) -> bytes:
    """A `Summary.Value` with `simple_value` (float32, as TensorBoard stores scalars)."""
    return _bytes(1, tag.encode()) + _float(2, value)


def histogram_value(tag: str, values) -> bytes:
    """A `Summary.Value` with a `HistogramProto` of `values` (non-empty), binned as numpy's
    'auto' rule bins them. TensorBoard reads bucket i as (bucket_limit[i-1], bucket_limit[i]],
    so a leading empty bucket ending at the lowest edge keeps the left edge visible."""
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    counts, edges = np.histogram(arr, bins="auto")
    histo = (_double(1, float(arr.min())) + _double(2, float(arr.max()))
             + _double(3, float(arr.size)) + _double(4, float(arr.sum()))
             + _double(5, float(arr.dot(arr)))
             + _packed_doubles(6, edges)
             + _packed_doubles(7, np.concatenate([[0.0], counts.astype(np.float64)])))
    return _bytes(1, tag.encode()) + _bytes(5, histo)


def event(wall_time: float, step: int = 0, summary_values: Iterable[bytes] = (),
          file_version: Optional[str] = None) -> bytes:
    """An `Event`: its summary holds the given encoded `Summary.Value`s."""
    out = _double(1, wall_time) + _int(2, int(step))
    if file_version is not None:
        out += _bytes(3, file_version.encode())
    return out + _bytes(5, b"".join(len_field(1, len(v)) + v for v in summary_values))


class EventFileWriter:
    """`<logdir>/events.out.tfevents.<unix seconds>.<hostname><suffix>` (the name TensorBoard
    globs for), opened with its file-version event; `write` appends one event and flushes it
    to the OS."""

    def __init__(self, logdir: str, suffix: str = ""):
        os.makedirs(logdir, exist_ok=True)
        now = time.time()
        self.path = os.path.join(logdir, f"events.out.tfevents.{int(now):010d}."
                                         f"{socket.gethostname()}{suffix}")
        self._f = open(self.path, "ab")
        self._f.write(tfrecord(event(now, file_version="brain.Event:2")))
        self._f.flush()

    def write(self, wall_time: float, step: int, summary_values: Iterable[bytes]) -> None:
        self._f.write(tfrecord(event(wall_time, step, summary_values)))
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
