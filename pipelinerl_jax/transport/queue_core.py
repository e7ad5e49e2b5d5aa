"""The RolloutQueue's state machine, free of gRPC: groups, capacity, staleness, delivery.

Life of a rollout: `put` (validated by the caller) → its group is *pending* until all
`group_size` members have arrived → *ready* (FIFO by completion) → cut into a batch by
`get_batch` → *outstanding* until `ack`ed → forgotten.

Capacity (`capacity_rollouts`, `capacity_bytes`) bounds everything held: pending + ready +
outstanding. A pending group reserves all `group_size` rollout slots when its first member
is admitted, so groups that have started can always finish (no deadlock from half-groups
filling the queue); bytes are counted as they arrive, and a new group is admitted only if its
estimated full size (first piece's bytes per rollout × group_size) fits. A put that does not
fit waits up to `hold_s` for room (at most `max_concurrent_holds` puts wait at once; the rest
are refused at once), then raises `QueueFull` (RESOURCE_EXHAUSTED); nothing is stored by a
refused put, so the producer retries the same request.

Staleness at get time, against the learner's current version L: a group's lag is
`L - min(version)` over all its tokens. With `max_lag` set, groups with lag > max_lag are
dropped (`stale_policy='drop'`, counted in `dropped_groups['stale']`) or delivered and
counted (`'keep'`). Groups holding a version > L (possible only after the learner rolled
back to an older checkpoint) are dropped as `'future'`. The learner may change `max_lag` while
running (closed-loop staleness control, `pipelinerl_jax.lag_control`): `set_version` and
`get_batch` carry it, and `stats().max_lag` tells the producers.

Every dropped group is also counted for the producer that put it (`put(producer_id=...)`;
`stats(producer_id).producer_dropped_groups`): a worker that reserved a place in a learner
batch for the group learns it will never arrive and frees the place.

Delivery is at-least-once, per consumer session (see `get_batch`).

Sizes and memory. Every delivered piece of a batch must fit the server's
`max_message_bytes`, so a rollout is refused at put time when it could never be delivered
(serialized larger than `max_rollout_bytes(max_message_bytes)`: the limit minus
`MESSAGE_FRAMING_BYTES`), and batches are cut into pieces of at most `PIECE_BYTES`, never
more than the limit allows. What the queue keeps of a rollout is its serialized bytes (the
caller has dropped unknown fields), an immutable copy that references no request: the bytes
counted against `capacity_bytes` are the bytes held. The tables that remember ids after their
groups are gone (request ids for idempotency, closed group ids, old sessions, producers'
drop counts) are bounded in entries and in bytes (`remember_bytes` each), oldest forgotten
first.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
import uuid
from typing import Callable, Optional, Sequence

from pipelinerl_jax.transport import rollout_pb2 as pb
from pipelinerl_jax.transport import wire
from pipelinerl_jax.transport.codec import InvalidRollout, RolloutInfo

STALE_POLICIES = ("drop", "keep")
_REMEMBER = 65536  # request ids / closed group ids / old sessions remembered (bounded) ...
REMEMBER_BYTES = 8 << 20  # ... and at most this many bytes per table
PIECE_BYTES = 4 << 20  # a delivered batch streams in pieces of about this size
# Room a GetBatchResponse piece needs around one rollout (batch id, counts, versions, the
# delivery fields, the rollout's tag and length): a generous bound of the ~130 it takes.
MESSAGE_FRAMING_BYTES = 1024
_PIECE_HEAD_ROOM = 256  # head + delivery tail of a piece (< 100 bytes), with room to spare
_ROLLOUTS_FIELD = pb.GetBatchResponse.DESCRIPTOR.fields_by_name["rollouts"].number


def max_rollout_bytes(max_message_bytes: int) -> int:
    """The largest serialized rollout a batch piece can carry within `max_message_bytes`."""
    return max_message_bytes - MESSAGE_FRAMING_BYTES


def _check_max_lag(max_lag: Optional[int]) -> None:
    if max_lag is not None and max_lag < 0:
        raise ValueError(f"max_lag must be >= 0, got {max_lag}")


class QueueFull(Exception):
    """No room within the hold time; nothing was stored (RESOURCE_EXHAUSTED)."""


class NoVersionYet(Exception):
    """A rollout carries version > 0 but no learner version was announced (UNAVAILABLE)."""


class GroupRejected(InvalidRollout):
    """A piece of a group that cannot be accepted. `expired` → FAILED_PRECONDITION."""

    def __init__(self, field: str, why: str, expired: bool = False):
        super().__init__(field, why)
        self.expired = expired


class SessionSuperseded(Exception):
    """A newer consumer session exists; this one may no longer take batches."""


@dataclasses.dataclass
class _Group:
    group_id: str
    size: int
    members: list             # serialized rollouts (bytes), in arrival order
    nbytes: int = 0
    min_version: int = 0
    max_version: int = 0
    updated: float = 0.0
    producer: str = ""


@dataclasses.dataclass
class Batch:
    batch_id: str
    pieces: list              # serialized GetBatchResponses, without the delivery fields
    num_groups: int
    num_rollouts: int
    nbytes: int               # rollout bytes counted against capacity
    learner_version: int
    delivery_count: int = 1


class _Bounded(collections.OrderedDict):
    """An insertion-ordered dict of string keys that forgets its oldest entries past
    `max_entries` entries or `max_bytes` bytes (key length + `ENTRY_OVERHEAD` per entry)."""

    # CPython's cost of one entry beyond the key's characters: the str object's header, the
    # ordered dict's slot and link node (measured with tracemalloc: ~140 bytes, CPython 3.11).
    ENTRY_OVERHEAD = 200

    def __init__(self, max_entries: int = _REMEMBER, max_bytes: int = REMEMBER_BYTES):
        super().__init__()
        self.max_entries, self.max_bytes, self.nbytes = max_entries, max_bytes, 0

    def add(self, key: str, value=True):
        if key not in self:
            self.nbytes += len(key) + self.ENTRY_OVERHEAD
        self[key] = value
        while self and (len(self) > self.max_entries or self.nbytes > self.max_bytes):
            old, _ = self.popitem(last=False)
            self.nbytes -= len(old) + self.ENTRY_OVERHEAD


class QueueCore:
    def __init__(self, capacity_rollouts: int = 4096, capacity_bytes: int = 1 << 30,
                 max_lag: Optional[int] = None, stale_policy: str = "drop",
                 incomplete_group_timeout_s: float = 600.0, max_concurrent_holds: int = 16,
                 clock: Callable = time.monotonic, max_message_bytes: int = 64 << 20,
                 remember_bytes: int = REMEMBER_BYTES):
        if stale_policy not in STALE_POLICIES:
            raise ValueError(f"stale_policy must be one of {STALE_POLICIES}, got {stale_policy!r}")
        self.capacity_rollouts, self.capacity_bytes = capacity_rollouts, capacity_bytes
        self.max_lag, self.stale_policy = max_lag, stale_policy
        self.incomplete_group_timeout_s = incomplete_group_timeout_s
        self.max_concurrent_holds = max_concurrent_holds
        if max_message_bytes < 2 * MESSAGE_FRAMING_BYTES:
            raise ValueError(f"max_message_bytes must be >= {2 * MESSAGE_FRAMING_BYTES}, got "
                             f"{max_message_bytes}")
        self.max_message_bytes = max_message_bytes
        self.max_rollout_bytes = max_rollout_bytes(max_message_bytes)
        self._piece_bytes = min(PIECE_BYTES, max_message_bytes - _PIECE_HEAD_ROOM)
        self._holding = 0
        self.server_id = uuid.uuid4().hex[:12]
        self._clock = clock
        self._started = clock()
        self._cv = threading.Condition()
        self._closed = False
        self.learner_version: Optional[int] = None
        self._pending: "collections.OrderedDict[str, _Group]" = collections.OrderedDict()
        self._ready: "collections.deque[_Group]" = collections.deque()
        self._outstanding: "collections.OrderedDict[str, Batch]" = collections.OrderedDict()
        self._redeliver: "collections.deque[str]" = collections.deque()
        self._requests, self._closed_groups, self._old_sessions, self.producer_drops = (
            _Bounded(max_bytes=remember_bytes) for _ in range(4))  # producer_drops: id -> n
        self._session: Optional[str] = None
        self._last_get: Optional[tuple[str, str]] = None  # (request_id, batch_id)
        self._seq = itertools.count(1)
        self._held_rollouts = self._held_bytes = 0
        self.counters = collections.Counter()
        self.dropped_groups, self.dropped_rollouts = collections.Counter(), collections.Counter()
        self.lag_histogram = collections.Counter()
        self.max_held_rollouts = self.max_held_bytes = 0

    # ---------------------------------------------------------------- version

    def set_version(self, version: int, max_lag: Optional[int] = None) -> int:
        """The learner's current version. It may go down (restart from an older checkpoint).
        `max_lag`, if given, replaces the staleness policy's allowed lag."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        _check_max_lag(max_lag)
        with self._cv:
            self.learner_version = int(version)
            if max_lag is not None:
                self.max_lag = int(max_lag)
            self._cv.notify_all()
            return self.learner_version

    def announced_version(self) -> Optional[int]:
        return self.learner_version

    # ---------------------------------------------------------------- put

    def put(self, rollouts: Sequence[bytes], infos: Sequence[RolloutInfo],
            request_id: str = "", hold_s: float = 0.0,
            producer_id: str = "") -> tuple[int, bool]:
        """Stores all rollouts or none; returns (accepted, duplicate). `rollouts` are
        serialized `pb.Rollout`s (kept as given, counted by their length), `infos` what
        `codec.validate_rollout` said of them. Groups started by this request are
        `producer_id`'s (their drops are counted for it).

        Raises InvalidRollout (a rollout too large to ever be delivered), GroupRejected (bad
        group membership), NoVersionYet, QueueFull.
        """
        for i, data in enumerate(rollouts):
            if len(data) > self.max_rollout_bytes:
                raise InvalidRollout(
                    f"rollouts[{i}]", f"{len(data)} bytes serialized; a batch can carry at "
                    f"most {self.max_rollout_bytes} (max_message_bytes="
                    f"{self.max_message_bytes} minus {MESSAGE_FRAMING_BYTES} of framing)")
        deadline = self._clock() + max(0.0, hold_s)
        holding = False  # counted in self._holding while this put waits for room
        with self._cv:
            try:
                while True:
                    self._expire_locked()
                    if request_id and request_id in self._requests:
                        self.counters["put_duplicates"] += 1
                        return 0, True
                    need_slots, need_bytes = self._plan_locked(rollouts, infos)  # GroupRejected
                    if self.learner_version is None and any(i.max_version > 0 for i in infos):
                        self.counters["put_refused_no_version"] += 1
                        raise NoVersionYet("no learner version announced yet; rollouts with "
                                           "version > 0 cannot be checked against it")
                    if (self._held_rollouts + need_slots <= self.capacity_rollouts and
                            self._held_bytes + need_bytes <= self.capacity_bytes):
                        break
                    remaining = deadline - self._clock()
                    # Held puts occupy server threads: cap them so the learner's GetBatch
                    # (the only thing that frees room) always finds a thread.
                    if not holding and self._holding < self.max_concurrent_holds:
                        holding = True
                        self._holding += 1
                    if remaining <= 0 or self._closed or not holding:
                        self.counters["put_refused_full"] += 1
                        raise QueueFull(
                            f"queue full: holding {self._held_rollouts}/"
                            f"{self.capacity_rollouts} rollouts, {self._held_bytes}/"
                            f"{self.capacity_bytes} bytes")
                    self._cv.wait(min(remaining, 0.5))
            finally:
                if holding:
                    self._holding -= 1
            self._store_locked(rollouts, infos, producer_id)
            if request_id:
                self._requests.add(request_id)
            self.counters["put_requests"] += 1
            self.counters["put_rollouts"] += len(rollouts)
            self._cv.notify_all()
            return len(rollouts), False

    def _plan_locked(self, rollouts: Sequence[bytes],
                     infos: Sequence[RolloutInfo]) -> tuple[int, int]:
        """Checks group membership; returns (new rollout slots, bytes) the request needs."""
        per_group: dict[str, list[int]] = {}
        for i, info in enumerate(infos):
            per_group.setdefault(info.group_id, []).append(i)
        slots = nbytes = 0
        for gid, idx in per_group.items():
            first = idx[0]
            size = infos[first].group_size
            for i in idx:
                if infos[i].group_size != size:
                    raise GroupRejected(f"rollouts[{i}].group_size",
                                        f"{infos[i].group_size} disagrees with {size} of "
                                        f"rollouts[{first}] in group {gid!r}")
            if gid in self._closed_groups:
                state = self._closed_groups[gid]
                raise GroupRejected(f"rollouts[{first}].group_id",
                                    f"group {gid!r} is already {state}", state == "expired")
            group = self._pending.get(gid)
            have = len(group.members) if group else 0
            if group is not None and group.size != size:
                raise GroupRejected(f"rollouts[{first}].group_size",
                                    f"{size} disagrees with {group.size} of earlier members "
                                    f"of group {gid!r}")
            if have + len(idx) > size:
                raise GroupRejected(f"rollouts[{first}].group_id",
                                    f"group {gid!r} would have {have + len(idx)} members, "
                                    f"group_size is {size}")
            piece = sum(len(rollouts[i]) for i in idx)
            if group is None:
                if size > self.capacity_rollouts:
                    raise GroupRejected(f"rollouts[{first}].group_size",
                                        f"{size} exceeds queue capacity_rollouts="
                                        f"{self.capacity_rollouts}")
                slots += size
                estimate = piece * size // len(idx)
                if estimate > self.capacity_bytes:
                    raise GroupRejected(f"rollouts[{first}]",
                                        f"group {gid!r} (~{estimate} bytes) exceeds queue "
                                        f"capacity_bytes={self.capacity_bytes}")
                # Admit a new group only if its estimated full size fits.
                nbytes += max(piece, estimate)
            else:
                nbytes += piece
        return slots, nbytes

    def _store_locked(self, rollouts, infos, producer_id: str = "") -> None:
        now = self._clock()
        for data, info in zip(rollouts, infos):
            group = self._pending.get(info.group_id)
            if group is None:
                group = _Group(info.group_id, info.group_size, [], 0,
                               info.min_version, info.max_version, producer=producer_id)
                self._pending[info.group_id] = group
                self._held_rollouts += group.size
            group.members.append(data)
            group.nbytes += len(data)
            group.min_version = min(group.min_version, info.min_version)
            group.max_version = max(group.max_version, info.max_version)
            group.updated = now
            self._pending.move_to_end(info.group_id)
            self._held_bytes += len(data)
            if len(group.members) == group.size:
                del self._pending[info.group_id]
                self._closed_groups.add(info.group_id, "complete")
                self._ready.append(group)
        self.max_held_rollouts = max(self.max_held_rollouts, self._held_rollouts)
        self.max_held_bytes = max(self.max_held_bytes, self._held_bytes)

    # ---------------------------------------------------------------- expiry

    def _expire_locked(self) -> None:
        """Drops pending groups that received nothing for `incomplete_group_timeout_s`."""
        cutoff = self._clock() - self.incomplete_group_timeout_s
        while self._pending:
            gid, group = next(iter(self._pending.items()))
            if group.updated > cutoff:
                break
            del self._pending[gid]
            self._closed_groups.add(gid, "expired")
            self._drop_locked(group, "incomplete_timeout")

    def expire(self) -> None:
        with self._cv:
            self._expire_locked()

    def _drop_locked(self, group: _Group, reason: str) -> None:
        self.dropped_groups[reason] += 1
        self.dropped_rollouts[reason] += len(group.members)
        if group.producer:
            self.producer_drops.add(group.producer,
                                    self.producer_drops.get(group.producer, 0) + 1)
        self._release_locked(group.size, group.nbytes)

    def _release_locked(self, slots: int, nbytes: int) -> None:
        self._held_rollouts -= slots
        self._held_bytes -= nbytes
        self._cv.notify_all()

    # ---------------------------------------------------------------- get / ack

    def get_batch(self, num_groups: int, timeout_s: float, session_id: str,
                  request_id: str = "", learner_version: Optional[int] = None,
                  is_active: Callable[[], bool] = lambda: True,
                  max_lag: Optional[int] = None) -> Optional[Batch]:
        """Returns a batch of exactly `num_groups` whole groups, or None after `timeout_s`.
        `learner_version` and `max_lag`, if given, are announced first (as `set_version`).

        At-least-once semantics:
        - A batch stays *outstanding* (held, counted against capacity) until acked.
        - A call with a `session_id` never seen before starts a new consumer session: every
          outstanding batch is queued for redelivery, oldest first, and the new session's
          next calls return those batches (same id, same rollouts, `delivery_count` + 1)
          before any new one. Older sessions are fenced off (SessionSuperseded).
        - A retry of the last call (same session and `request_id`) returns the same batch,
          so a response lost in transit is not skipped.
        """
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        _check_max_lag(max_lag)
        deadline = self._clock() + max(0.0, timeout_s)
        with self._cv:
            self.counters["get_requests"] += 1
            self._switch_session_locked(session_id)
            if learner_version is not None:
                self.learner_version = int(learner_version)
            if max_lag is not None:
                self.max_lag = int(max_lag)
            if request_id and self._last_get and self._last_get[0] == request_id:
                batch = self._outstanding.get(self._last_get[1])
                if batch is not None:
                    if batch.batch_id in self._redeliver:  # (its stream broke: now resent)
                        self._redeliver.remove(batch.batch_id)
                    return batch
            if self._redeliver:
                batch = self._outstanding[self._redeliver.popleft()]
                batch.delivery_count += 1
                self.counters["batches_redelivered"] += 1
                self._last_get = (request_id, batch.batch_id)
                return batch
            while True:
                self._expire_locked()
                self._apply_staleness_locked()
                if len(self._ready) >= num_groups:
                    batch = self._cut_locked(num_groups)
                    self._last_get = (request_id, batch.batch_id)
                    return batch
                remaining = deadline - self._clock()
                if remaining <= 0 or self._closed or not is_active():
                    self.counters["get_empty"] += 1
                    return None
                self._cv.wait(min(remaining, 0.5))
                if self._session != session_id:
                    raise SessionSuperseded(f"session_id: session {session_id} was superseded")

    def _switch_session_locked(self, session_id: str) -> None:
        if not session_id:
            raise ValueError("session_id must be non-empty")
        if session_id == self._session:
            return
        if session_id in self._old_sessions:
            raise SessionSuperseded(f"session_id: session {session_id} was superseded by a newer "
                                    "one")
        if self._session is not None:
            self._old_sessions.add(self._session)
        self._session = session_id
        self._last_get = None
        self._redeliver = collections.deque(self._outstanding)  # insertion = delivery order
        self.counters["sessions"] += 1
        self._cv.notify_all()  # wake the old session's waiters so they see the fence

    def _apply_staleness_locked(self) -> None:
        version = self.learner_version if self.learner_version is not None else 0
        keep = collections.deque()
        for group in self._ready:
            reason = None
            if group.max_version > version:
                reason = "future"
            elif (self.max_lag is not None and self.stale_policy == "drop" and
                  version - group.min_version > self.max_lag):
                reason = "stale"
            if reason is None:
                keep.append(group)
                continue
            self._drop_locked(group, reason)
        self._ready = keep

    def _cut_locked(self, num_groups: int) -> Batch:
        version = self.learner_version if self.learner_version is not None else 0
        batch_id = f"{self.server_id}-{next(self._seq):010d}"
        # Pieces are GetBatchResponses framed by hand around the stored rollout bytes (one
        # copy, by the join). A piece holds rollouts up to `_piece_bytes`; a rollout larger
        # than that goes alone (put refused anything that would not fit the message limit).
        head = pb.GetBatchResponse(batch_id=batch_id, num_groups=num_groups,
                                   learner_version=version).SerializeToString()
        pieces, parts, piece_bytes = [], [], len(head)
        n = nbytes = 0
        for _ in range(num_groups):
            group = self._ready.popleft()
            for data in group.members:
                framed = wire.len_field(_ROLLOUTS_FIELD, len(data))
                if parts and piece_bytes + len(framed) + len(data) > self._piece_bytes:
                    pieces.append(b"".join([head, *parts]))
                    parts, piece_bytes = [], len(head)
                parts += (framed, data)
                piece_bytes += len(framed) + len(data)
            n += len(group.members)
            nbytes += group.nbytes
            lag = version - group.min_version
            self.lag_histogram[lag] += 1
            if self.max_lag is not None and lag > self.max_lag:
                self.counters["stale_kept_groups"] += 1
        pieces.append(b"".join([head, *parts]))
        batch = Batch(batch_id, pieces, num_groups, n, nbytes, version)
        self._outstanding[batch_id] = batch
        self.counters["batches_delivered"] += 1
        self.counters["groups_delivered"] += num_groups
        self.counters["rollouts_delivered"] += n
        return batch

    def unsent(self, batch_id: str) -> None:
        """The stream carrying `batch_id` broke before its last piece went out: the batch is
        delivered again, first, to the session's next `get_batch` (not lost until a new
        session)."""
        with self._cv:
            if batch_id in self._outstanding and batch_id not in self._redeliver:
                self._redeliver.appendleft(batch_id)
                self.counters["batches_unsent"] += 1
                self._cv.notify_all()

    def ack(self, batch_ids: Sequence[str]) -> tuple[int, list[str]]:
        """Forgets acknowledged batches; unknown ids (acked before, other server) are listed."""
        acked, unknown = 0, []
        with self._cv:
            for bid in batch_ids:
                batch = self._outstanding.pop(bid, None)
                if batch is None:
                    unknown.append(bid)
                    continue
                if bid in self._redeliver:
                    self._redeliver.remove(bid)
                self._release_locked(batch.num_rollouts, batch.nbytes)
                acked += 1
            self.counters["batches_acked"] += acked
        return acked, unknown

    # ---------------------------------------------------------------- stats / lifecycle

    def stats(self, producer_id: str = "") -> pb.QueueStats:
        """Counters and state; `producer_dropped_groups` is `producer_id`'s count."""
        with self._cv:
            self._expire_locked()
            c = self.counters
            s = pb.QueueStats(
                server_id=self.server_id,
                learner_version=-1 if self.learner_version is None else self.learner_version,
                capacity_rollouts=self.capacity_rollouts, capacity_bytes=self.capacity_bytes,
                held_rollouts=self._held_rollouts, held_bytes=self._held_bytes,
                max_held_rollouts=self.max_held_rollouts, max_held_bytes=self.max_held_bytes,
                ready_groups=len(self._ready),
                ready_rollouts=sum(len(g.members) for g in self._ready),
                pending_groups=len(self._pending),
                pending_rollouts=sum(len(g.members) for g in self._pending.values()),
                outstanding_batches=len(self._outstanding),
                outstanding_rollouts=sum(b.num_rollouts for b in self._outstanding.values()),
                uptime_s=self._clock() - self._started,
                max_lag=-1 if self.max_lag is None else self.max_lag,
                producer_dropped_groups=self.producer_drops.get(producer_id, 0)
                if producer_id else 0)
            for key in ("put_requests", "put_rollouts", "put_duplicates", "put_refused_full",
                        "put_refused_no_version", "put_invalid", "batches_delivered",
                        "batches_redelivered", "batches_acked", "groups_delivered",
                        "rollouts_delivered", "stale_kept_groups", "sessions", "get_requests",
                        "get_empty"):
                setattr(s, key, c[key])
            s.dropped_groups.update(self.dropped_groups)
            s.dropped_rollouts.update(self.dropped_rollouts)
            s.lag_histogram.update(self.lag_histogram)
            return s

    def remembered_bytes(self) -> int:
        """Bytes (as `_Bounded` counts them) of the ids remembered beyond their groups."""
        with self._cv:
            return sum(t.nbytes for t in (self._requests, self._closed_groups,
                                          self._old_sessions, self.producer_drops))

    def count_invalid(self) -> None:
        with self._cv:
            self.counters["put_invalid"] += 1

    def close(self) -> None:
        """Wakes every waiter; held puts are refused and waiting gets return None."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
