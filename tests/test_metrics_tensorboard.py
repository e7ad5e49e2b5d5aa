"""`MetricsWriter`'s TensorBoard event file, read back with a TFRecord reader written here from
the format's definition (length, masked CRC-32C of the length, data, masked CRC-32C of the
data; CRC-32C computed bit by bit, not with the writer's table) and decoded by the real
protobuf classes (tensorboardX's compiled `event_pb2`, an oracle independent of our hand
encoder): every row is one event at its step holding the row's scalars (tags cleaned) and a
histogram per list; the file is readable row by row while the run goes on (an evaluator
writes a row every few minutes); writing metrics imports neither tensorboardX nor torch."""
import glob
import struct
import subprocess
import sys

import numpy as np
import pytest

from pipelinerl_jax.metrics import MetricsWriter
from tests.optional_deps import optional

event_pb2 = optional("tensorboardX.proto.event_pb2")


def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    crc = _crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _read_events(path, raw=False):
    events, records = [], []
    with open(path, "rb") as f:
        blob = f.read()
    i = 0
    while i < len(blob):
        header = blob[i:i + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", blob[i + 8:i + 12])
        assert header_crc == _masked(header)
        data = blob[i + 12:i + 12 + length]
        (data_crc,) = struct.unpack("<I", blob[i + 12 + length:i + 16 + length])
        assert data_crc == _masked(data)
        events.append(event_pb2.Event.FromString(data))
        records.append(data)
        i += 16 + length
    return (events, records) if raw else events


def test_each_row_is_one_event_with_its_scalars_and_histograms(tmp_path):
    w = MetricsWriter(str(tmp_path), tb_suffix=".learner")
    w.write(1, {"reward/mean": 0.25, "lag/p99+": 3, "flag": True, "name": "x",
                "rollout/response_lengths": [3, 5, 8]})
    files = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*.learner"))
    assert len(files) == 1
    mid_run = _read_events(files[0])  # flushed: readable while the run goes on
    assert [e.step for e in mid_run if e.HasField("summary")] == [1]
    w.write(2, {"reward/mean": np.float32(0.5), "rollout/response_lengths": []})
    w.close()
    w.close()  # idempotent

    events = _read_events(files[0])
    assert events[0].file_version == "brain.Event:2"
    rows = [e for e in events if e.HasField("summary")]
    assert [e.step for e in rows] == [1, 2]
    first = {v.tag: v for v in rows[0].summary.value}
    assert set(first) == {"reward/mean", "lag/p99plus", "rollout/response_lengths"}
    assert first["reward/mean"].simple_value == 0.25
    assert first["lag/p99plus"].simple_value == 3.0
    histo = first["rollout/response_lengths"].histo
    assert (histo.num, histo.min, histo.max, histo.sum, histo.sum_squares) == (
        3, 3.0, 8.0, 16.0, 98.0)
    # TensorBoard's reading: bucket i holds (bucket_limit[i-1], bucket_limit[i]]; the first,
    # empty, bucket ends at the lowest edge
    limits, counts = np.array(histo.bucket_limit), np.array(histo.bucket)
    assert len(limits) == len(counts) and counts[0] == 0 and counts.sum() == 3
    assert limits[0] == 3.0 and limits[-1] == 8.0 and np.all(np.diff(limits) > 0)
    second = {v.tag: v.simple_value for v in rows[1].summary.value}
    assert second == {"reward/mean": 0.5}  # an empty list writes no histogram


def test_every_row_is_on_disk_as_soon_as_it_is_written(tmp_path):
    w = MetricsWriter(str(tmp_path))
    for step in range(1, 51):
        w.write(step, {"loss/loss": float(step)})
    (path,) = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    rows = [e for e in _read_events(path) if e.HasField("summary")]  # before close
    w.close()
    assert [e.step for e in rows] == list(range(1, 51))
    assert [e.summary.value[0].simple_value for e in rows] == [float(s) for s in range(1, 51)]


def test_hostile_values_and_steps_are_encoded_as_protobuf_would(tmp_path):
    w = MetricsWriter(str(tmp_path))
    w.write(2**40 + 3, {"a": float("nan"), "b": -1e30, "c": np.int64(7),
                        "l": [1.0, float("inf"), float("nan"), 2.0], "only_nan": [float("nan")],
                        "t/\u00e9": 1.5})
    w.write(-1, {"a": 0.0, "z": -0.0, "h": [0.0, 0.0]})
    w.write(0, {})
    w.close()
    (path,) = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    events, records = _read_events(path, raw=True)
    # canonical: protobuf serializes each parsed event to exactly the bytes we wrote
    assert [e.SerializeToString() for e in events] == records
    rows = [e for e in events if e.HasField("summary")]
    assert [e.step for e in rows] == [2**40 + 3, -1]
    v = {x.tag: x for x in rows[0].summary.value}
    assert np.isnan(v["a"].simple_value) and v["b"].simple_value == np.float32(-1e30)
    assert v["c"].simple_value == 7.0 and v["t/\u00e9"].simple_value == 1.5
    assert (v["l"].histo.num, v["l"].histo.sum) == (2, 3.0)  # finite values only
    assert "only_nan" not in v
    v = {x.tag: x for x in rows[1].summary.value}
    assert v["a"].simple_value == 0.0 and str(v["z"].simple_value) == "-0.0"
    assert (v["h"].histo.num, v["h"].histo.min, v["h"].histo.max) == (2, 0.0, 0.0)
    assert len(events) == 3 and events[0].file_version == "brain.Event:2"  # no empty event


@pytest.mark.slow  # a fresh interpreter, to see what importing the writer imports
def test_writing_metrics_imports_neither_tensorboardx_nor_torch(tmp_path):
    code = ("import sys; from pipelinerl_jax.metrics import MetricsWriter; "
            f"w = MetricsWriter({str(tmp_path)!r}); w.write(1, {{'x': 1.0, 'h': [1, 2]}}); "
            "w.close(); print(sorted(m for m in ('torch', 'tensorboardX') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    assert out == "[]"
