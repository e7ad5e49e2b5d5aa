"""Python client of the RolloutQueue: producers `put_group`, the learner `get_batch`/`ack`.

Retries: transient codes (UNAVAILABLE = server down or restarting, DEADLINE_EXCEEDED, and for
puts the queue's backpressure) are retried with capped exponential backoff and jitter; every
put carries a fresh `request_id`, reused by its retries, so a retry of a put the server already
applied is not stored twice. Backpressure is a RESOURCE_EXHAUSTED that the server marks
(`queue_server.BACKPRESSURE_KEY` in the trailing metadata); any other RESOURCE_EXHAUSTED
(gRPC refusing an oversized message or metadata) is final, never retried. INVALID_ARGUMENT /
FAILED_PRECONDITION raise `RolloutRejected` with the server's reason and the offending
`field`. A put is refused here, before sending, when it exceeds `max_message_bytes` or one of
its rollouts could never be delivered in a batch (`queue_core.max_rollout_bytes`).
`retry_counts` counts retries by code.

Why a retry loop here and not gRPC's service-config retry policy: gRPC clamps `maxAttempts`
to 5 (about 0.8 s of backoff, measured: BENCHMARKS.md, "Hand-written or a library"), too
short to ride out a queue restart, and it cannot tell the queue's marked backpressure from
gRPC's own RESOURCE_EXHAUSTED.
"""
from __future__ import annotations

import collections
import dataclasses
import time
import uuid
from typing import Iterable, Optional, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipelinerl_jax import records
from pipelinerl_jax.transport import rollout_pb2 as pb
from pipelinerl_jax.transport import rollout_pb2_grpc as pb_grpc
from pipelinerl_jax.transport.codec import rollout_from_pb, rollout_to_pb
from pipelinerl_jax.transport.queue_core import max_rollout_bytes
from pipelinerl_jax.transport.queue_server import (
    BACKPRESSURE_KEY, DEFAULT_MAX_MESSAGE_BYTES, SERVICE)
from pipelinerl_jax.transport.retry import RetryPolicy
from pipelinerl_jax.transport.security import TLSConfig, call_metadata, make_channel

_CODES = {c.value[0]: c for c in grpc.StatusCode}
_TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_REJECT = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION})


class TransportError(Exception):
    """A call failed for good; `code` is the gRPC status code, `details` the server's text."""

    def __init__(self, code: grpc.StatusCode, details: str):
        self.code, self.details = code, details
        super().__init__(f"{code.name}: {details}")


class RolloutRejected(TransportError):
    """The server refused the rollouts as malformed; `field` names the culprit."""

    @property
    def field(self) -> str:
        return self.details.split(": ", 1)[0] if ": " in self.details else ""


class QueueUnavailable(TransportError):
    """Transient failures outlasted the caller's timeout."""


class SessionSupersededError(TransportError):
    """Another consumer session took over the queue (a newer learner process)."""


def _transient(e: grpc.RpcError) -> bool:
    return e.code() in _TRANSIENT


def _backpressure(e: grpc.RpcError) -> bool:
    """The queue's own "full, retry later" (marked), not gRPC's size refusals."""
    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    try:
        return any(key == BACKPRESSURE_KEY for key, _ in (e.trailing_metadata() or ()))
    except Exception:  # noqa: BLE001 - an error without metadata (e.g. raised client-side)
        return False


def _put_retryable(e: grpc.RpcError) -> bool:
    return _transient(e) or _backpressure(e)


def _translate(e: grpc.RpcError, receiving: bool = False,
               max_message_bytes: int = 0) -> TransportError:
    """The TransportError for a failed call; `receiving`: the call fetched a batch."""
    code, details = e.code(), e.details() or ""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not _backpressure(e):
        if receiving and "larger than max" in details:
            return TransportError(code, f"{details}: a batch piece exceeds this client's "
                                        f"max_message_bytes={max_message_bytes}; give the "
                                        "client the server's transport.max_message_bytes")
        if "larger than max" in details:
            return RolloutRejected(code, f"request: {details}")
        return TransportError(code, details)
    if code in _REJECT:
        if "superseded" in details:
            return SessionSupersededError(code, details)
        return RolloutRejected(code, details)
    if code in _TRANSIENT or code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return QueueUnavailable(code, details)
    return TransportError(code, details)


@dataclasses.dataclass(frozen=True)
class PutResult:
    accepted: int = 0
    duplicate: bool = False
    code: grpc.StatusCode = grpc.StatusCode.OK
    message: str = ""
    field: str = ""

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK


@dataclasses.dataclass
class Batch:
    """`num_groups` whole groups, contiguous in `rollouts`. Ack `batch_id` once committed."""
    batch_id: str
    rollouts: list
    num_groups: int
    learner_version: int   # the version the staleness policy was applied against
    redelivered: bool
    delivery_count: int

    def groups(self) -> list[list[records.Rollout]]:
        out: dict[str, list] = {}
        for r in self.rollouts:
            out.setdefault(r.group_id, []).append(r)
        return list(out.values())


def message_dict(msg) -> dict:
    out = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        out[f.name] = dict(value) if f.message_type and f.message_type.GetOptions().map_entry \
            else value
    return out


class RolloutQueueClient:
    """Thread-safe. One instance = one consumer session (`session_id`) for `get_batch`.

    `producer_id` (a producer sets it once, before its first put): carried by every put, so
    the queue counts this producer's dropped groups, which `stats()` reports
    (`producer_dropped_groups`)."""

    def __init__(self, address: str, token: Optional[str] = None,
                 tls: Optional[TLSConfig] = None, *,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 retry: RetryPolicy = RetryPolicy(), hold_s: float = 1.0,
                 rpc_timeout_s: float = 30.0, session_id: Optional[str] = None):
        self.address = address
        self.max_message_bytes = max_message_bytes
        self._channel = make_channel(address, max_message_bytes=max_message_bytes, tls=tls)
        self._stub = pb_grpc.RolloutQueueStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._md = call_metadata(token)
        self.retry, self.hold_s, self.rpc_timeout_s = retry, hold_s, rpc_timeout_s
        self.session_id = session_id or uuid.uuid4().hex
        self.producer_id = ""
        self.retry_counts: collections.Counter = collections.Counter()

    # ---------------------------------------------------------------- plumbing

    def _retrying(self, call, retryable, timeout_s: Optional[float], receiving: bool = False):
        """`call()`, retried while `retryable(error)` and before `timeout_s` runs out."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        attempt = 0
        while True:
            try:
                return call()
            except grpc.RpcError as e:
                now = time.monotonic()
                if not retryable(e) or (deadline is not None and now >= deadline):
                    raise _translate(e, receiving, self.max_message_bytes) from None
                self.retry_counts[e.code().name] += 1
                delay = self.retry.delay(attempt)
                time.sleep(delay if deadline is None else min(delay, deadline - now))
                attempt += 1

    # ---------------------------------------------------------------- producers

    def _request(self, rollouts: Sequence[records.Rollout]) -> pb.PutRequest:
        request = pb.PutRequest(rollouts=[rollout_to_pb(r) for r in rollouts],
                                request_id=uuid.uuid4().hex, hold_s=self.hold_s,
                                producer_id=self.producer_id)
        most = max_rollout_bytes(self.max_message_bytes)
        for i, m in enumerate(request.rollouts):
            if m.ByteSize() > most:  # the server would refuse it: it could never be delivered
                raise RolloutRejected(grpc.StatusCode.INVALID_ARGUMENT,
                                      f"rollouts[{i}]: {m.ByteSize()} bytes serialized; a "
                                      f"batch can carry at most {most} (max_message_bytes="
                                      f"{self.max_message_bytes} minus framing)")
        size = request.ByteSize()
        if size > self.max_message_bytes:  # would be refused by gRPC on every retry
            raise RolloutRejected(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"request: {size} bytes exceed max_message_bytes="
                                  f"{self.max_message_bytes}; put fewer rollouts at once")
        return request

    def put(self, rollouts: Sequence[records.Rollout],
            timeout_s: Optional[float] = None) -> PutResult:
        """Stores `rollouts` atomically, retrying backpressure and outages.

        `timeout_s=None` retries until stored (backpressure may last as long as the learner
        is slow); otherwise `QueueUnavailable` after `timeout_s`.
        """
        request = self._request(rollouts)
        resp = self._retrying(
            lambda: self._stub.Put(request, timeout=self.hold_s + self.rpc_timeout_s,
                                   metadata=self._md),
            _put_retryable, timeout_s)
        return PutResult(resp.accepted, resp.duplicate)

    def put_group(self, rollouts: Sequence[records.Rollout],
                  timeout_s: Optional[float] = None) -> PutResult:
        """`put` of exactly one whole group (checked here before anything is sent)."""
        if not rollouts:
            raise ValueError("put_group: no rollouts")
        gid, size = rollouts[0].group_id, rollouts[0].group_size
        if any(r.group_id != gid for r in rollouts):
            raise ValueError(f"put_group: rollouts carry several group_ids, first is {gid!r}")
        if len(rollouts) != size:
            raise ValueError(f"put_group: group {gid!r} has {len(rollouts)} rollouts, "
                             f"group_size is {size}")
        return self.put(rollouts, timeout_s)

    def put_stream(self, pieces: Iterable[Sequence[records.Rollout]],
                   timeout_s: Optional[float] = None) -> list[PutResult]:
        """Sends each piece as one item of a PutStream; returns one result per piece.

        A rejected piece gets a result with its code/message/field; the others still land.
        Backpressured or unsent pieces are re-sent (same request ids) until `timeout_s`.
        """
        requests = [self._request(piece) for piece in pieces]
        results: list[Optional[PutResult]] = [None] * len(requests)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        todo, attempt = list(range(len(requests))), 0
        while todo:
            again = []
            try:
                responses = self._stub.PutStream(iter([requests[i] for i in todo]),
                                                 metadata=self._md)
                for k, resp in enumerate(responses):
                    i = todo[k]
                    code = _CODES.get(resp.code, grpc.StatusCode.UNKNOWN)
                    # Per-item codes come from the queue itself: RESOURCE_EXHAUSTED here is
                    # always its backpressure.
                    if code in _TRANSIENT or code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        self.retry_counts[code.name] += 1
                        again.append(i)
                    else:
                        results[i] = PutResult(resp.accepted, resp.duplicate, code,
                                               resp.message, resp.field)
            except grpc.RpcError as e:
                if not _put_retryable(e):
                    raise _translate(e) from None
                self.retry_counts[e.code().name] += 1
            again += [i for i in todo if results[i] is None and i not in again]
            if again and deadline is not None and time.monotonic() >= deadline:
                raise QueueUnavailable(grpc.StatusCode.DEADLINE_EXCEEDED,
                                       f"{len(again)} pieces not stored within {timeout_s}s")
            if again:
                time.sleep(self.retry.delay(attempt))
                attempt += 1
            todo = again
        return results

    # ---------------------------------------------------------------- learner

    def get_batch(self, num_groups: int, timeout_s: float,
                  learner_version: Optional[int] = None,
                  max_lag: Optional[int] = None) -> Optional[Batch]:
        """A batch of exactly `num_groups` whole groups, or None if none within `timeout_s`.

        `learner_version` and `max_lag` (if given) are announced first, as `set_version`:
        the batch is cut under that staleness limit. Retries of this call
        after a lost response return the same batch. Raises `QueueUnavailable` if the server
        stays unreachable past `timeout_s`.
        """
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        request = pb.GetBatchRequest(num_groups=num_groups, session_id=self.session_id,
                                     request_id=uuid.uuid4().hex)
        if learner_version is not None:
            request.learner_version = learner_version
        if max_lag is not None:
            request.max_lag = max_lag
        deadline = time.monotonic() + timeout_s

        def call():  # the whole stream, or an exception: a broken stream is re-asked
            request.timeout_s = max(0.0, deadline - time.monotonic())
            return list(self._stub.GetBatch(
                request, timeout=request.timeout_s + self.rpc_timeout_s, metadata=self._md))

        pieces = self._retrying(call, _transient, timeout_s, receiving=True)
        if not pieces:
            return None
        head = pieces[0]
        rollouts = [rollout_from_pb(m) for piece in pieces for m in piece.rollouts]
        return Batch(head.batch_id, rollouts, head.num_groups, head.learner_version,
                     head.redelivered, head.delivery_count)

    def ack(self, batch_ids: Sequence[str], timeout_s: float = 60.0) -> int:
        """Acknowledges committed batches (idempotent); returns how many were outstanding."""
        request = pb.AckRequest(batch_ids=list(batch_ids))
        resp = self._retrying(lambda: self._stub.Ack(request, timeout=self.rpc_timeout_s,
                                                     metadata=self._md), _transient, timeout_s)
        return resp.acked

    def set_version(self, version: int, timeout_s: float = 60.0,
                    max_lag: Optional[int] = None) -> int:
        """Announces the learner's version (and, if given, the allowed lag from now on). Call
        BEFORE publishing weights `version`."""
        request = pb.SetVersionRequest(version=version, max_lag=max_lag)
        resp = self._retrying(lambda: self._stub.SetVersion(
            request, timeout=self.rpc_timeout_s, metadata=self._md), _transient, timeout_s)
        return resp.version

    def new_session(self) -> str:
        """Starts a new consumer session: unacked batches will be redelivered to it."""
        self.session_id = uuid.uuid4().hex
        return self.session_id

    # ---------------------------------------------------------------- ops

    def stats(self, timeout_s: float = 60.0) -> dict:
        resp = self._retrying(lambda: self._stub.GetStats(
            pb.StatsRequest(producer_id=self.producer_id), timeout=self.rpc_timeout_s,
            metadata=self._md), _transient, timeout_s)
        return message_dict(resp)

    def wait_ready(self, deadline_s: float = 30.0) -> None:
        """Blocks until the server's health check says SERVING; TimeoutError otherwise."""
        end = time.monotonic() + deadline_s
        attempt, last = 0, None
        while time.monotonic() < end:
            try:
                resp = self._health.Check(health_pb2.HealthCheckRequest(service=SERVICE),
                                          timeout=max(0.1, min(5.0, end - time.monotonic())),
                                          metadata=self._md)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise _translate(e) from None
                last = e.code().name
            time.sleep(min(self.retry.delay(attempt), max(0.0, end - time.monotonic())))
            attempt += 1
        raise TimeoutError(f"RolloutQueue at {self.address} not ready after {deadline_s}s "
                           f"(last: {last})")

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
