"""A scripted WeightSync server (test double): each Subscribe call gets the next scripted list
of raw frames, then the stream ends.

It follows the real publisher (`pipelinerl_jax/transport/weights.py`, `WeightPublisher.
_subscribe`): one `WeightSync.Subscribe` unary-stream method whose responses are serialized
`WeightMessage`s (header, chunks, commit). Unlike the real one it sends whatever bytes it is
given, in the order given, so tests can play a hostile or broken publisher. Valid frames come
from the real framing code (`weights._Version.frames()`), so a scripted good version is
byte-for-byte what a publisher would send.
"""
from __future__ import annotations

import threading
from concurrent import futures
from typing import Sequence

import grpc
import numpy as np

from pipelinerl_jax.transport import weights
from pipelinerl_jax.transport.weight_version import WeightVersion


def good_frames(version: int, params: dict, publisher_id: str = "fake",
                chunk_bytes: int = 4096) -> list[bytes]:
    """The frames the real publisher sends for `params` (with crc32 per chunk)."""
    with futures.ThreadPoolExecutor(1) as pool:
        return list(weights._Version(WeightVersion("full").carrying(version, tensors=params),
                                     publisher_id, chunk_bytes,
                                     pool).frames())


def params_of(version: int, n: int = 300) -> dict:
    return {"a": np.full((n,), version, np.float32), "b": np.full((3, 5), version, np.int32)}


class ScriptedPublisher:
    """Serves `scripts[k]` to the k-th Subscribe call (the last script repeats)."""

    def __init__(self, scripts: Sequence[Sequence[bytes]], hold_open_s: float = 0.0):
        self.scripts = [list(s) for s in scripts]
        self.calls = 0
        self.hold_open_s = hold_open_s
        self._lock = threading.Lock()
        handler = grpc.method_handlers_generic_handler(weights.SERVICE, {
            "Subscribe": grpc.unary_stream_rpc_method_handler(
                self._subscribe, lambda b: b, lambda b: b)})
        self._server = grpc.server(futures.ThreadPoolExecutor(8), handlers=[handler],
                                   options=[("grpc.max_send_message_length", 64 << 20)])
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._server.start()

    def _subscribe(self, request, context):
        with self._lock:
            script = self.scripts[min(self.calls, len(self.scripts) - 1)]
            self.calls += 1
        yield from script
        self._stop.wait(self.hold_open_s)  # a quiet publisher: the stream stays open

    def stop(self) -> None:
        self._stop.set()
        self._server.stop(0).wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
