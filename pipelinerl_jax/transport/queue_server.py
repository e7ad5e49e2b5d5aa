"""RolloutQueue gRPC server: embedded (`RolloutQueueServer(...).start()`) or standalone.

    python -m pipelinerl_jax.transport.queue_server --port 50051 [--capacity_rollouts N]
        [--max_lag K --stale_policy drop|keep] [--token_file F] [--tls_cert_file C --tls_key_file K]
        [--host H [--allow_insecure_remote]]

prints `RolloutQueue listening on HOST:PORT` once bound and exits 0 on SIGTERM/SIGINT. A
non-loopback `--host` without a token or TLS is refused (as `validate_transport_config`
refuses it) unless `--allow_insecure_remote`.
The state machine lives in `queue_core.QueueCore`; this file decodes requests, runs the
boundary checks (`codec.validate_rollout`, id lengths) and maps outcomes to status codes:
  INVALID_ARGUMENT    a rollout/request is malformed; the message is "<field>: <why>"
  FAILED_PRECONDITION a piece of a group that already expired; a superseded consumer session
  RESOURCE_EXHAUSTED  no room within hold_s (nothing stored; retry the same request). The
                      trailing metadata `BACKPRESSURE_KEY` marks it, so that a client can
                      tell it from gRPC's own RESOURCE_EXHAUSTED (oversized message or
                      metadata), which no retry will cure
  UNAVAILABLE         version > 0 before the learner announced any version (retry)
Every request is parsed here rather than by gRPC so that garbage bytes get INVALID_ARGUMENT
instead of an internal error. A put's unknown fields are dropped at parse time and each
rollout is kept as its own serialized bytes, so a held rollout retains exactly the bytes
counted against `capacity_bytes` (see `queue_core`). The standard `grpc.health.v1.Health`
service is served too.
"""
from __future__ import annotations

import argparse
import ctypes
import signal
import sys
import threading
from typing import Optional

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pipelinerl_jax.transport import rollout_pb2 as pb
from pipelinerl_jax.transport.transport_section import limits_from_config, queue_address, tls_from_config
from pipelinerl_jax.transport.codec import InvalidRollout, Limits, validate_rollout
from pipelinerl_jax.transport.queue_core import (
    GroupRejected, NoVersionYet, QueueCore, QueueFull, SessionSuperseded)
from pipelinerl_jax.transport.security import (
    DEFAULT_HOST, TLSConfig, check_bind, host_port, load_token, make_server)

SERVICE = "pipelinerl_jax.RolloutQueue"
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
_GET_BATCH_MAX_WAIT_S = 300.0
# Characters of every id a request carries (request_id, producer_id, session_id, batch ids):
# ours are 32-hex uuids or "<server>-<seq>"; anything longer is refused, naming the field.
MAX_ID_CHARS = 128
BACKPRESSURE_KEY = "pipelinerl-backpressure"  # trailing metadata of a QueueFull refusal


def _identity(x):
    return x


def _seconds(value: float, most: float) -> float:
    """A requested wait clamped to [0, most]; NaN and negatives wait 0."""
    return min(value, most) if value > 0 else 0.0


def _check_id(field: str, value: str) -> None:
    if len(value) > MAX_ID_CHARS:
        raise _Reject(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{field}: longer than {MAX_ID_CHARS} characters ({len(value)})", field)


class _Reject(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, field: str = ""):
        super().__init__(message)
        self.code, self.message, self.field = code, message, field


class RolloutQueueServer:
    """The queue service plus health checking, on one gRPC server.

    `address` defaults to 127.0.0.1 with an ephemeral port; `.address` is the bound one.
    """

    def __init__(self, address: str = f"{DEFAULT_HOST}:0", *, capacity_rollouts: int = 4096,
                 capacity_bytes: int = 1 << 30, max_lag: Optional[int] = None,
                 stale_policy: str = "drop", incomplete_group_timeout_s: float = 600.0,
                 limits: Limits = Limits(), max_hold_s: float = 5.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 token: Optional[str] = None, tls: Optional[TLSConfig] = None,
                 max_workers: int = 64):
        # A quarter of the threads may hold puts; the rest serve GetBatch/Ack/stats.
        self.core = QueueCore(capacity_rollouts, capacity_bytes, max_lag, stale_policy,
                              incomplete_group_timeout_s,
                              max_concurrent_holds=max(1, max_workers // 4),
                              max_message_bytes=max_message_bytes)
        self.limits = limits
        self.max_hold_s = max_hold_s
        self._health = health.HealthServicer()
        # Each handler takes the raw request bytes (parsed by `_parsed`) and is what gRPC
        # calls; tests and fuzzers may call them directly with a stand-in context.
        self.handlers = {
            "Put": grpc.unary_unary_rpc_method_handler(
                self._put, _identity, pb.PutResponse.SerializeToString),
            "PutStream": grpc.stream_stream_rpc_method_handler(
                self._put_stream, _identity, pb.PutResponse.SerializeToString),
            "GetBatch": grpc.unary_stream_rpc_method_handler(
                self._get_batch, _identity, _identity),
            "Ack": grpc.unary_unary_rpc_method_handler(
                self._ack, _identity, pb.AckResponse.SerializeToString),
            "SetVersion": grpc.unary_unary_rpc_method_handler(
                self._set_version, _identity, pb.SetVersionResponse.SerializeToString),
            "GetStats": grpc.unary_unary_rpc_method_handler(
                self._stats, _identity, pb.QueueStats.SerializeToString),
        }
        self.method_kinds = {name: (h.request_streaming, h.response_streaming)
                             for name, h in self.handlers.items()}
        self._server, self.port = make_server(
            address, max_message_bytes=max_message_bytes, token=token, tls=tls,
            max_workers=max_workers,
            handlers=[grpc.method_handlers_generic_handler(SERVICE, self.handlers)])
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.address = host_port(address, self.port)
        self._stop_sweeper = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, daemon=True, name="queue-sweeper")

    @classmethod
    def from_config(cls, cfg) -> "RolloutQueueServer":
        """From a validated `transport_config()` section."""
        return cls(queue_address(cfg), capacity_rollouts=cfg.capacity_rollouts,
                   capacity_bytes=cfg.capacity_bytes, max_lag=cfg.max_lag,
                   stale_policy=cfg.stale_policy,
                   incomplete_group_timeout_s=cfg.incomplete_group_timeout_s,
                   limits=limits_from_config(cfg), max_hold_s=cfg.max_hold_s,
                   max_message_bytes=cfg.max_message_bytes,
                   token=load_token(cfg.auth_token, cfg.auth_token_file),
                   tls=tls_from_config(cfg, server=True))

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> "RolloutQueueServer":
        self._server.start()
        self._sweeper.start()
        for name in ("", SERVICE):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self

    def stop(self, grace: float = 1.0) -> None:
        self._health.enter_graceful_shutdown()
        self.core.close()
        self._stop_sweeper.set()
        self._server.stop(grace).wait()

    def wait_for_termination(self) -> None:
        self._server.wait_for_termination()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _sweep(self) -> None:
        # Expire incomplete groups even when no RPC arrives, so their room is freed.
        period = min(1.0, max(0.01, self.core.incomplete_group_timeout_s / 4))
        while not self._stop_sweeper.wait(period):
            self.core.expire()

    # ---------------------------------------------------------------- handlers

    @staticmethod
    def _parsed(cls, raw: bytes):
        """`cls` parsed from `raw`, without unknown fields; _Reject on garbage."""
        try:
            message = cls.FromString(raw)
        except (DecodeError, RuntimeError, ValueError) as e:  # (upb: DecodeError)
            raise _Reject(grpc.StatusCode.INVALID_ARGUMENT,
                          f"request: not a valid {cls.__name__} protobuf ({e})",
                          "request") from None
        message.DiscardUnknownFields()  # nothing unknown is kept, or counted
        return message

    @staticmethod
    def _abort(context, r: "_Reject"):
        if r.code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # ours: backpressure
            context.set_trailing_metadata(((BACKPRESSURE_KEY, "queue-full"),))
        context.abort(r.code, r.message)

    def _apply_put(self, raw: bytes) -> pb.PutResponse:
        """Decodes, validates and stores one PutRequest; raises _Reject on failure."""
        try:
            request = self._parsed(pb.PutRequest, raw)
            if not request.rollouts:
                raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, "rollouts: request is empty",
                              "rollouts")
            _check_id("request_id", request.request_id)
            _check_id("producer_id", request.producer_id)
        except _Reject:
            self.core.count_invalid()
            raise
        announced = self.core.announced_version()
        try:
            infos = []
            for i, m in enumerate(request.rollouts):
                try:
                    infos.append(validate_rollout(m, self.limits, announced))
                except InvalidRollout as e:
                    raise e.prefixed(f"rollouts[{i}]") from None
            hold = _seconds(request.hold_s, self.max_hold_s)
            kept = [m.SerializeToString() for m in request.rollouts]  # copies, not views
            accepted, dup = self.core.put(kept, infos, request.request_id, hold,
                                          request.producer_id)
        except InvalidRollout as e:
            self.core.count_invalid()
            code = (grpc.StatusCode.FAILED_PRECONDITION
                    if isinstance(e, GroupRejected) and e.expired
                    else grpc.StatusCode.INVALID_ARGUMENT)
            raise _Reject(code, str(e), e.field)
        except QueueFull as e:
            raise _Reject(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except NoVersionYet as e:
            raise _Reject(grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.PutResponse(accepted=accepted, duplicate=dup, request_id=request.request_id)

    def _put(self, raw: bytes, context) -> pb.PutResponse:
        try:
            return self._apply_put(raw)
        except _Reject as r:
            self._abort(context, r)

    def _put_stream(self, raw_iterator, context):
        for raw in raw_iterator:
            try:
                yield self._apply_put(raw)
            except _Reject as r:
                yield pb.PutResponse(code=r.code.value[0], message=r.message, field=r.field)

    def _get_batch(self, raw: bytes, context):
        try:
            request = self._parsed(pb.GetBatchRequest, raw)
            _check_id("session_id", request.session_id)
            _check_id("request_id", request.request_id)
        except _Reject as r:
            self._abort(context, r)
        learner_version = (request.learner_version if request.HasField("learner_version")
                           else None)
        if learner_version is not None and learner_version < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"learner_version: must be >= 0, got {learner_version}")
        max_lag = request.max_lag if request.HasField("max_lag") else None
        if max_lag is not None and max_lag < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"max_lag: must be >= 0, got {max_lag}")
        if request.num_groups < 1 or not request.session_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "num_groups: must be >= 1" if request.num_groups < 1
                          else "session_id: must be non-empty")
        timeout = _seconds(request.timeout_s, _GET_BATCH_MAX_WAIT_S)
        try:
            batch = self.core.get_batch(request.num_groups, timeout, request.session_id,
                                        request.request_id, learner_version, context.is_active,
                                        max_lag)
        except SessionSuperseded as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        if batch is None:
            return  # an empty stream: no batch within the timeout
        # Protobuf merges concatenated messages: the stored pieces are sent as-is (identical
        # bytes on redelivery) with the per-delivery fields appended.
        tail = pb.GetBatchResponse(redelivered=batch.delivery_count > 1,
                                   delivery_count=batch.delivery_count).SerializeToString()
        sent = 0
        try:
            for piece in batch.pieces:
                yield piece + tail
                sent += 1
        finally:  # the stream broke (gRPC closed this generator) before the last piece
            if sent < len(batch.pieces):
                self.core.unsent(batch.batch_id)

    def _ack(self, raw: bytes, context) -> pb.AckResponse:
        try:
            request = self._parsed(pb.AckRequest, raw)
            for i, bid in enumerate(request.batch_ids):
                _check_id(f"batch_ids[{i}]", bid)
        except _Reject as r:
            self._abort(context, r)
        acked, unknown = self.core.ack(list(request.batch_ids))
        return pb.AckResponse(acked=acked, unknown=unknown)

    def _set_version(self, raw: bytes, context) -> pb.SetVersionResponse:
        try:
            request = self._parsed(pb.SetVersionRequest, raw)
        except _Reject as r:
            self._abort(context, r)
        if request.version < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"version: must be >= 0, got {request.version}")
        max_lag = request.max_lag if request.HasField("max_lag") else None
        if max_lag is not None and max_lag < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"max_lag: must be >= 0, got {max_lag}")
        return pb.SetVersionResponse(version=self.core.set_version(request.version, max_lag))

    def _stats(self, raw: bytes, context) -> pb.QueueStats:
        try:
            request = self._parsed(pb.StatsRequest, raw)
            _check_id("producer_id", request.producer_id)
        except _Reject as r:
            self._abort(context, r)
        return self.core.stats(request.producer_id)


# -------------------------------------------------------------------- standalone entry point

def return_freed_buffers_to_the_os() -> bool:
    """For a process that mostly serves the queue (the standalone server, the launcher's
    queue role); call it before any thread starts. glibc raises its mmap threshold after
    large buffers are freed, so later multi-MiB requests come from the heap and stay in the
    process once freed: in the soak benchmark RSS reached 265 MB for a 64 MiB capacity, 189
    MB with a fixed 128 KiB threshold, which makes every large buffer its own mapping,
    unmapped when freed. Two malloc arenas instead of one per core x 8 keep the gRPC
    threads' freed small blocks reusable by each other. Returns whether it applied (False
    off glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return (libc.mallopt(-3, 128 << 10) == 1 and  # M_MMAP_THRESHOLD
                libc.mallopt(-8, 2) == 1)  # M_ARENA_MAX
    except (OSError, AttributeError):
        return False


def _parse_args(argv):
    p = argparse.ArgumentParser(description="Run the RolloutQueue gRPC server.")
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    p.add_argument("--capacity_rollouts", type=int, default=4096)
    p.add_argument("--capacity_bytes", type=int, default=1 << 30)
    p.add_argument("--max_lag", type=int, default=None)
    p.add_argument("--stale_policy", choices=("drop", "keep"), default="drop")
    p.add_argument("--incomplete_group_timeout_s", type=float, default=600.0)
    p.add_argument("--vocab_size", type=int, default=0, help="0 = no upper bound check")
    p.add_argument("--max_prompt_tokens", type=int, default=Limits.max_prompt_tokens)
    p.add_argument("--max_completion_tokens", type=int, default=Limits.max_completion_tokens)
    p.add_argument("--max_message_bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    p.add_argument("--max_hold_s", type=float, default=5.0)
    p.add_argument("--token_file", default=None,
                   help="shared bearer token: the file's first line (visible ASCII)")
    p.add_argument("--tls_cert_file", default=None)
    p.add_argument("--tls_key_file", default=None)
    p.add_argument("--allow_insecure_remote", action="store_true",
                   help="permit a non-loopback --host without a token or TLS")
    args = p.parse_args(argv)
    try:
        args.token = load_token(token_file=args.token_file)
        check_bind(args.host, bool(args.token or args.tls_cert_file),
                   args.allow_insecure_remote)
    except (OSError, ValueError) as e:
        p.error(str(e))  # exits 2 with the message
    return args


def main(argv=None) -> int:
    args = _parse_args(argv)
    return_freed_buffers_to_the_os()
    tls = None
    if args.tls_cert_file or args.tls_key_file:
        tls = TLSConfig(cert_file=args.tls_cert_file, key_file=args.tls_key_file)
    server = RolloutQueueServer(
        f"{args.host}:{args.port}", capacity_rollouts=args.capacity_rollouts,
        capacity_bytes=args.capacity_bytes, max_lag=args.max_lag,
        stale_policy=args.stale_policy,
        incomplete_group_timeout_s=args.incomplete_group_timeout_s,
        limits=Limits(vocab_size=args.vocab_size, max_prompt_tokens=args.max_prompt_tokens,
                      max_completion_tokens=args.max_completion_tokens),
        max_hold_s=args.max_hold_s, max_message_bytes=args.max_message_bytes,
        token=args.token, tls=tls).start()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(f"RolloutQueue listening on {server.address}", flush=True)
    while not done.wait(0.5):
        pass
    server.stop(grace=2.0)
    print("RolloutQueue stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
