"""The slot scheduler inside `JaxEngine`: one `step()` of continuous batching, and the
per-sample bookkeeping that turns device output into `Completion`s.

One step (a background thread calls it in a loop, or a test calls it):
  1. apply a pending weight update (atomically: the parameter tree is swapped by reference
     between two jitted calls, so no forward pass mixes versions); with
     `kv_policy='recompute'` every in-flight sample's prompt + generated tokens are
     re-prefilled with the new weights (AReaL style), with `'keep'` their KV stays
     (PipelineRL style);
  2. admit queued samples, first come first served, into free slots while the KV memory
     (`kv_memory.py`, dense or paged) says each fits; a head-of-queue sample that does not
     fit blocks the queue, so long requests are never starved by short ones. Admitted
     samples are prefilled together (grouped by length, padded to a prompt-length bucket),
     or, the samples of a group on a shared prompt, started on it (`start`);
  3. one decode chunk: up to `steps_per_sync` decode steps for all slots in one device call,
     ending early, while samples are queued, once `refill_threshold` slots have finished
     (their slots are refilled by the next step's batched prefill). Before the chunk every
     running sample grows its KV to what the chunk can write, oldest first; when the memory
     is short the KV memory's victim (the youngest running sample) is preempted: its KV is
     freed, its slot released, and it goes back to the head of the queue with the tokens it
     generated, which its readmission re-prefills (recompute, as vLLM does) — a sample is
     never failed for want of memory (the dense memory reserves a whole lifetime at
     admission and never runs short).
A sample is one of the `n` samples of a request; each finishes and is returned on its own.

`JaxEngine` owns one `SlotScheduler` and talks to it through its public methods only. The
scheduler owns everything a step touches: the device state (parameters, KV cache, slot
state, the compiled programs), the host state guarded by its condition variable (queue,
slots, the KV memory's bookkeeping, live requests, outbox, versions and the pending update,
the paused / closed / failed flags, counters), and the step mutex that serialises device
work. The engine
keeps what comes before and after: request validation, turning weights into a parameter
state, the loop thread, and the public API.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import AbstractSet, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax.rollout.engine import (EngineClosedError, RequestError,
                                           check_version_order, completion_from_chunks,
                                           has_ready, take_ready)
from pipelinerl_jax.rollout.engine_stats import StatsWindow, window_rates
from pipelinerl_jax.rollout.kv_memory import KVMemory, chunk_end
from pipelinerl_jax.rollout.sampling import RowParams
from pipelinerl_jax.records import Completion, GenerationRequest


def buckets(given: Sequence[int], smallest: int, top: int) -> tuple:
    """`given`, or powers of two from `smallest`; always ending at `top`."""
    out = sorted(given) if given else [b for b in (smallest << i for i in range(32)) if b < top]
    return tuple(out if out and out[-1] == top else [*out, top])


@dataclasses.dataclass(eq=False)
class Sample:
    """One of the `n` samples of a request, from queue to completion."""
    request: GenerationRequest
    index: int  # sample index within the request
    prompt: np.ndarray
    seed: int
    limit: int  # total length (prompt + generated) at which the sample ends
    submit_time: float
    start_time: float = 0.0
    start_version: int = -1
    kv_version: int = -1  # oldest version among the KV writes of this sample
    order: int = 0  # submission order on this engine (preemption takes the youngest)
    tokens: list = dataclasses.field(default_factory=list)
    logps: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)
    kv_versions: list = dataclasses.field(default_factory=list)
    n_generated: int = 0

    @property
    def pos(self) -> int:  # position of the pending (last sampled) token
        return len(self.prompt) + self.n_generated - 1

    def sequence(self) -> np.ndarray:
        return np.concatenate([self.prompt, *self.tokens]).astype(np.int32)



class SlotScheduler:
    """Step, admission, prefill and decode of `JaxEngine`, and the state they work on
    (module docstring). Every public method is thread-safe.

    `fns`: the compiled programs (`engine_steps.step_fns`); `params`, `cache`, `slots_dev`:
    the initial device state; `kv`: the KV memory (`kv_memory.py`: dense or paged, `cache`
    is its device side); `num_slots`, `max_seq_len`, the three bucket tuples, `steps`
    (decode steps per chunk), `refill` (refill threshold), `max_stops`, `kv_policy`, `seed`
    (of unseeded requests' seeds).
    """

    def __init__(self, fns, params, cache, slots_dev, kv: KVMemory, *, num_slots: int,
                 max_seq_len: int, prefill_buckets: tuple, cache_buckets: tuple,
                 batch_buckets: tuple, steps: int, refill: int, max_stops: int,
                 kv_policy: str, seed: int, version: int, engine_id: str):
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        self.prefill_buckets, self.cache_buckets = prefill_buckets, cache_buckets
        self.batch_buckets = batch_buckets
        self.engine_id = engine_id
        self._steps, self._refill, self._max_stops = steps, refill, max_stops
        self._kv_policy, self._seed = kv_policy, seed
        # device state (touched only under _step_mutex)
        self._fns, self._params, self._cache, self._slots_dev = fns, params, cache, slots_dev
        # host state (guarded by _cv; device work is serialised by _step_mutex)
        self._cv = threading.Condition(threading.Lock())
        self._step_mutex = threading.Lock()
        self._queue: collections.deque = collections.deque()
        self._slots: List[Optional[Sample]] = [None] * num_slots
        self._outbox: collections.deque = collections.deque()
        self._live: Dict[str, int] = {}  # request id -> samples not yet returned
        self._version = int(version)
        self._newest_version = int(version)  # newest version accepted (live or pending)
        self._pending = None  # (params, version) waiting for the next step boundary
        self._kv = kv  # what each sample's K/V holds: admission, growth, release
        self._paused = self._closed = False
        self._error: Optional[str] = None
        self._seed_counter = 0
        self._stats = StatsWindow()
        self._submitted = 0
        # decode runs over the first `rows` slots (paged: running samples packed there)
        self.row_buckets = kv.row_buckets

    # ------------------------------------------------------------------ state

    @property
    def version(self) -> int:
        """The version the next forward pass uses."""
        return self._version

    @property
    def params(self):
        """The live parameter state (what the next forward pass uses)."""
        return self._params

    @property
    def closed(self) -> bool:
        return self._closed

    def stopped(self) -> Optional[str]:
        """Why no more work will be done (the loop's error, or 'closed'); None if it will."""
        with self._cv:
            return self._error or ("closed" if self._closed else None)

    def status(self) -> dict:
        """`{version, paused, closed, error}`, read together."""
        with self._cv:
            return {"version": self._version, "paused": self._paused,
                    "closed": self._closed, "error": self._error}

    # ------------------------------------------------------------------ requests

    def enqueue(self, checked: Sequence[tuple]) -> None:
        """Queues validated `(request, prompt, limit)` entries as one arrival (all or
        nothing); draws the seeds of requests that give none, in order."""
        now = time.time()
        with self._cv:
            if self._closed or self._error:
                raise EngineClosedError(f"engine {self.engine_id} is closed "
                                        f"({self._error or 'close() was called'})")
            for request, _, _ in checked:
                if request.request_id in self._live:
                    raise RequestError(f"request {request.request_id!r}: request_id is "
                                       "already in flight on this engine")
            for request, prompt, limit in checked:
                p = request.params
                if p.seed is None:
                    seed = int(np.random.default_rng([self._seed, self._seed_counter])
                               .integers(2**32))
                    self._seed_counter += 1
                else:
                    seed = int(p.seed) % 2**32
                for i in range(int(p.n)):
                    self._queue.append(Sample(request, i, prompt, seed, limit, now,
                                              order=self._submitted))
                    self._submitted += 1
                self._live[request.request_id] = int(p.n)
            self._cv.notify_all()

    def take(self, timeout: Optional[float] = 0.0, max_items: Optional[int] = None,
             request_ids: Optional[AbstractSet[str]] = None) -> List[Completion]:
        """Finished samples (of `request_ids` only, when given), waiting up to `timeout`
        (None: until one is ready) unless the scheduler stopped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while not has_ready(self._outbox, request_ids):
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or self._closed or self._error:
                    break
                self._cv.wait(left)
            return take_ready(self._outbox, request_ids, max_items)

    def abort(self, request_id: str) -> int:
        """Ends a request's queued and running samples with 'abort'; returns how many."""
        with self._step_mutex:
            with self._cv:
                queued = [s for s in self._queue if s.request.request_id == request_id]
                for s in queued:
                    self._queue.remove(s)
            running = [i for i, s in enumerate(self._slots)
                       if s is not None and s.request.request_id == request_id]
            if running:
                free = np.zeros((self.num_slots,), bool)
                free[running] = True
                self._slots_dev = self._fns.release(self._slots_dev, free)
            for s in queued + [self._slots[i] for i in running]:  # (frees their KV)
                self._finish(s, "abort")
            return len(queued) + len(running)

    # ------------------------------------------------------------------ weights

    def check_newer(self, version: int, allow_older: bool = False) -> None:
        """Raises unless `version` may be installed (the scheduler is open and, unless
        `allow_older`, `version` exceeds every version accepted so far)."""
        with self._cv:
            self._check_newer(version, allow_older)

    def _check_newer(self, version: int, allow_older: bool) -> None:  # holds _cv
        if self._closed:
            raise EngineClosedError(f"engine {self.engine_id} is closed")
        check_version_order(version, self._newest_version, self._version, allow_older)

    def stage_update(self, params, version: int, allow_older: bool = False) -> None:
        """Makes `params` the pending update, applied at the next step boundary (a pending
        one not yet applied is replaced)."""
        with self._cv:
            self._check_newer(version, allow_older)
            self._pending = (params, version)
            self._newest_version = version
            self._cv.notify_all()

    def apply_update_now(self) -> None:
        """Applies the pending update without waiting for a step (engines without a loop)."""
        with self._step_mutex:
            self._apply_pending_update()

    def wait_live(self, version: int, allow_older: bool, timeout: Optional[float]) -> None:
        """Blocks until `version` is live; `TimeoutError` / `EngineClosedError` otherwise."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            def live():  # (an older version on purpose is live when it is *the* version)
                return self._version == version if allow_older else self._version >= version

            while not live() and self._error is None and not self._closed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"update_weights: version {version} not live after "
                                       f"{timeout}s (engine at {self._version})")
                self._cv.wait(left)
            if not live():
                raise EngineClosedError(f"engine stopped before version {version} went "
                                        f"live: {self._error or 'closed'}")

    def _apply_pending_update(self) -> None:
        with self._cv:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        self._params, version = pending
        with self._cv:
            self._version = version
            self._stats.add(updates_applied=1)
        if self._kv_policy == "recompute":
            with self._cv:
                self._kv.invalidate()
            for i in self._by_age():  # the re-prefill writes the pending token's K/V too
                s = self._slots[i]
                if s is not None:
                    self._grow_or_preempt(i, s.pos + 1)
            running = [s for s in self._slots if s is not None]
            for s in running:
                s.kv_version = version
            with self._cv:
                entries = self._kv.recompute_entries(running, self._slots)
            self._prefill(entries)
            with self._cv:
                self._kv.restamp(version)
        with self._cv:
            self._cv.notify_all()

    # ------------------------------------------------------------------ the loop

    def wait_for_work(self) -> bool:
        """Blocks until a step has something to do; False once closed (the loop ends)."""
        with self._cv:
            while not self._closed and self._pending is None and (
                    self._paused or not (self._queue or any(self._slots))):
                self._cv.wait()
            return not self._closed

    def step(self) -> int:
        """One scheduling iteration; returns the number of tokens sampled."""
        with self._step_mutex:
            t0 = time.perf_counter()
            self._apply_pending_update()
            produced = 0
            if not self._paused:
                produced = self._admit() + self._decode()
            with self._cv:
                self._stats.add(busy_s=time.perf_counter() - t0, tokens=produced)
            return produced

    def pause(self) -> None:
        """Stops stepping; returns once the step in progress (if any) has ended."""
        with self._cv:
            self._paused = True
        with self._step_mutex:
            pass

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def close(self) -> bool:
        """Marks the scheduler closed and wakes every waiter; False if it already was."""
        with self._cv:
            if self._closed:
                return False
            self._closed = True
            self._cv.notify_all()
            return True

    def fail(self, error: str) -> None:
        """The loop died: records why, wakes every waiter, returns every sample as 'abort'."""
        with self._cv:
            self._error = error
            self._cv.notify_all()
        self._abort_all()

    def abort_all(self) -> None:
        """Returns every queued and running sample with finish reason 'abort'."""
        with self._step_mutex:
            self._abort_all()

    def _admit(self) -> int:
        produced = 0
        while True:
            batch, starts = [], []  # prefill rows; samples starting on a shared prefix
            with self._cv:
                free = [i for i, s in enumerate(self._slots) if s is None]
                self._kv.open_round([(i, s) for i, s in enumerate(self._slots)
                                     if s is not None])
                while self._queue and free:
                    s = self._queue[0]
                    admission = self._kv.admit(s, free[0], self._version)
                    if admission is None:  # head-of-line: the queue waits for memory
                        break
                    slot = free.pop(0)
                    self._queue.popleft()
                    self._slots[slot] = s
                    if s.start_version < 0:  # (a preempted sample keeps its first start)
                        s.start_time, s.start_version = time.time(), self._version
                    s.kv_version = admission.kv_version
                    if admission.prefill is not None:
                        batch.append(admission.prefill)
                    if admission.start is not None:
                        starts.append(admission.start)
                    self._stats.add(**admission.stats)
            if not batch and not starts:
                return produced
            produced += self._prefill(batch)
            self._start_shared(starts)

    def _start_shared(self, starts) -> None:
        """Starts `(sample, slot, page copy or None)` entries on their group's prefix (its
        prefill, if new, ran first): copy-on-write copies of the partial prompt page, and
        each slot's pending token, the prompt's last, at position `len(prompt) - 1`."""
        if not starts:
            return
        self._run_start(starts)
        with self._cv:
            self._stats.add(cow_page_copies=sum(c is not None for _, _, c in starts))

    def _run_start(self, starts) -> None:
        """The device `start` program over `starts` (empty: every row a no-op, as warmup
        compiles it): page copies (rows without one copy to the out-of-range page, dropped),
        slot state and pending token of each starting sample."""
        n, none = self.num_slots, self._kv.num_pages
        src, dst = np.zeros((n,), np.int32), np.full((n,), none, np.int32)
        slot_idx = np.full((n,), n, np.int32)
        token, pos = np.zeros((n,), np.int32), np.zeros((n,), np.int32)
        rows = self._row_params(n)
        for j, (s, slot, copy) in enumerate(starts):
            if copy is not None:
                src[j], dst[j] = copy
            slot_idx[j], token[j], pos[j] = slot, s.prompt[-1], s.pos
            _fill_row(rows, j, s)
        self._cache, self._slots_dev = self._fns.start(
            self._cache, self._slots_dev, src, dst, slot_idx, token, pos, RowParams(**rows))

    # ------------------------------------------------------------------ KV growth

    def _by_age(self) -> list:
        """Occupied slots, oldest sample (first submitted) first."""
        return sorted((i for i, s in enumerate(self._slots) if s is not None),
                      key=lambda i: self._slots[i].order)

    def _grow_or_preempt(self, slot: int, tokens: int) -> bool:
        """Makes `slot` hold KV for `tokens` positions, preempting the KV memory's victims
        (the youngest running samples) while it is short; False when `slot`'s own sample
        was preempted."""
        while True:
            with self._cv:
                if self._kv.grow(slot, tokens):
                    return True
                victim = self._kv.victim(self._slots)
            self._preempt(victim)
            if victim == slot:
                return False

    def _pack(self, running: list, rows: int) -> list:
        """Moves the running samples of slots >= `rows` into free slots below it (their
        KV stays; slot state and page-table rows move); returns the running slots."""
        holes = [i for i in range(rows) if self._slots[i] is None]
        perm = np.arange(self.num_slots, dtype=np.int32)
        with self._cv:
            for src in [i for i in running if i >= rows]:
                dst = holes.pop(0)
                perm[dst], perm[src] = src, dst
                self._slots[dst], self._slots[src] = self._slots[src], None
                self._kv.move(src, dst)
                self._stats.totals["slot_moves"] += 1
        self._slots_dev = self._fns.permute(self._slots_dev, perm)
        return [i for i, s in enumerate(self._slots) if s is not None]

    def _preempt(self, slot: int) -> None:
        """Frees `slot`'s KV and slot and puts its sample back at the head of the queue;
        its readmission re-prefills its prompt and the tokens it generated so far."""
        s = self._slots[slot]
        free = np.zeros((self.num_slots,), bool)
        free[slot] = True
        self._slots_dev = self._fns.release(self._slots_dev, free)
        with self._cv:
            self._kv.release(s, slot, retain=False)
            self._slots[slot] = None
            self._queue.appendleft(s)  # youngest preempted first: the oldest ends up first
            self._stats.totals["preemptions"] += 1

    def _prefill(self, entries) -> int:
        """Prefills `(sample, slot, token sequence, start)` entries and records each first
        token; returns the tokens sampled. `start > 0` (paged): the slot's pages hold the
        K/V of `sequence[:start]` already (mapped, never written here) and only the rest
        runs, over them (`extend`). Paged: a `None` sample is a group's prompt prefix,
        written through `slot`'s table with no token sampled; a page several rows of a
        plain prefill hold is written by the first of them only."""
        plain = [e for e in entries if not e[3]]
        over = [e for e in entries if e[3]]
        return self._prefill_rows(plain, False) + self._prefill_rows(over, True)

    def _prefill_rows(self, entries, extend: bool) -> int:
        entries = sorted(entries, key=lambda e: len(e[2]) - e[3])  # similar lengths batch
        cap = self.batch_buckets[-1]
        written = set()  # pages some row of this call writes already
        produced = 0
        for first in range(0, len(entries), cap):
            group = entries[first:first + cap]
            bp = next(b for b in self.batch_buckets if b >= len(group))
            t = next(b for b in self.prefill_buckets
                     if b >= max(len(e[2]) - e[3] for e in group))
            ids = np.zeros((bp, t), np.int32)
            lengths = np.ones((bp,), np.int32)
            starts = np.zeros((bp,), np.int32)
            slot_idx = np.full((bp,), self.num_slots, np.int32)  # out of range = padding row
            rows = self._row_params(bp)
            for j, (s, slot, seq, start) in enumerate(group):
                ids[j, :len(seq) - start] = seq[start:]
                lengths[j], starts[j] = len(seq) - start, start
                if s is not None:
                    slot_idx[j] = slot
                    _fill_row(rows, j, s)
            with self._cv:
                tables = self._kv.tables([e[1] for e in group], bp, extend, written)
            if extend:
                self._cache, self._slots_dev, out = self._fns.extend(
                    self._params, self._cache, self._slots_dev, ids, starts, lengths,
                    slot_idx, RowParams(**rows), *tables)
            else:
                self._cache, self._slots_dev, out = self._fns.prefill(
                    self._params, self._cache, self._slots_dev, ids, lengths, slot_idx,
                    RowParams(**rows), *tables)
            token, logp, done = jax.device_get(out)
            for j, (s, slot, _, _) in enumerate(group):
                if s is None:
                    continue
                self._record(s, token[j:j + 1], logp[j:j + 1])
                produced += 1
                if done[j]:
                    self._finish(s, _reason(s))
            with self._cv:
                self._stats.add(prefill_calls=1, prefill_tokens=int(lengths[:len(group)].sum()))
        return produced

    def _row_params(self, b: int) -> dict:
        return dict(seed=np.zeros((b,), np.uint32), sample_index=np.zeros((b,), np.int32),
                    temperature=np.ones((b,), np.float32), top_p=np.ones((b,), np.float32),
                    top_k=np.zeros((b,), np.int32), limit=np.full((b,), 2, np.int32),
                    stop_ids=np.full((b, self._max_stops), -1, np.int32))

    def _decode(self) -> int:
        for i in self._by_age():  # KV for what this chunk can write, oldest first
            s = self._slots[i]
            if s is not None:
                self._grow_or_preempt(i, chunk_end(s, s.pos, self._steps))
        running = [i for i, s in enumerate(self._slots) if s is not None]
        if not running:
            return 0
        rows = next(b for b in self.row_buckets if b >= len(running))
        if running[-1] >= rows:
            running = self._pack(running, rows)
        need = max(self._slots[i].pos for i in running) + self._steps
        cache_len = next((b for b in self.cache_buckets if b >= need), self.max_seq_len)
        with self._cv:
            queued = len(self._queue)
        refill_at = min(queued, self._refill)  # 0 when nothing waits: run the whole chunk
        with self._cv:
            tables = self._kv.tables(range(rows), rows)
        self._cache, self._slots_dev, out = self._fns.decode(
            self._params, self._cache, self._slots_dev, np.int32(refill_at), *tables,
            cache_len=cache_len, rows=rows)
        tokens, logps, emitted, active, n = jax.device_get(out)
        produced = 0
        for i in running:
            k = int(emitted[:n, i].sum())  # a slot emits from the first step until it ends
            s = self._slots[i]
            self._record(s, tokens[:k, i], logps[:k, i])
            produced += k
            if not active[i]:
                self._finish(s, _reason(s))
        with self._cv:
            occupied = int(emitted[:n].sum())
            self._stats.add(decode_steps=int(n), slot_steps=occupied)
            if queued:
                self._stats.add(queued_steps=int(n), queued_slot_steps=occupied)
        return produced

    def _record(self, s: Sample, tokens, logps) -> None:
        k = len(tokens)
        s.tokens.append(np.asarray(tokens, np.int32))
        s.logps.append(np.asarray(logps, np.float32))
        s.versions.append(np.full((k,), self._version, np.int32))
        s.kv_versions.append(np.full((k,), s.kv_version, np.int32))
        s.n_generated += k

    def _finish(self, s: Sample, reason: str) -> None:
        """Returns a sample (finished or aborted) and frees its slot and KV reservation."""
        if s.start_version < 0:  # aborted before admission
            s.start_version = s.kv_version = self._version
        completion = completion_from_chunks(
            s.request, s.index, s.prompt, s.tokens, s.logps, s.versions, s.kv_versions,
            finish_reason=reason, start_version=s.start_version, engine_id=self.engine_id,
            submit_time=s.submit_time, start_time=s.start_time)
        with self._cv:
            if s in self._slots:
                slot = self._slots.index(s)
                self._slots[slot] = None
                self._kv.release(s, slot, retain=True)
            rid = s.request.request_id
            self._live[rid] -= 1
            if not self._live[rid]:
                del self._live[rid]
            self._outbox.append(completion)
            self._stats.totals["completed_samples"] += 1
            self._cv.notify_all()

    def _abort_all(self) -> None:
        with self._cv:
            queued = list(self._queue)
            self._queue.clear()
        running = [s for s in self._slots if s is not None]
        for s in queued + running:
            self._finish(s, "abort")
        if running:
            try:
                self._slots_dev = self._fns.release(self._slots_dev,
                                                    np.ones((self.num_slots,), bool))
            except Exception:  # noqa: BLE001 - the device may be what failed
                pass

    # ------------------------------------------------------------------ reports

    def stats(self) -> dict:
        """The engine's load figures (`JaxEngine.stats`)."""
        now = time.perf_counter()
        with self._cv:
            w, span = self._stats.roll(now)
            c = self._stats.totals
            running = [s for s in self._slots if s is not None]
            return {
                "engine_id": self.engine_id,
                "version": self._version,
                "num_slots": self.num_slots,
                "active_slots": len(running),
                "queued_samples": len(self._queue),
                "queued_requests": len({s.request.request_id for s in self._queue}),
                "kv_tokens_in_use": sum(s.pos + 1 for s in running),
                **self._kv.figures(self._stats.totals),
                # averages over the window since the previous stats() call
                **window_rates(w, span),
                "slot_occupancy": w["slot_steps"] / max(w["decode_steps"] * self.num_slots, 1),
                "occupancy_while_queued": (w["queued_slot_steps"]
                                           / max(w["queued_steps"] * self.num_slots, 1)),
                "window_decode_steps": w["decode_steps"],
                # totals since the engine started
                "decode_steps": c["decode_steps"],
                "generated_tokens": c["tokens"],
                "completed_samples": c["completed_samples"],
                "prefill_calls": c["prefill_calls"],
                "prefill_tokens": c["prefill_tokens"],
                # prompts prefilled for their first token: one per sample, or one per group
                # where a group's samples share their prompt (paged)
                "prompt_prefills": c["prompt_prefills"],
                "updates_applied": c["updates_applied"],
                "preemptions": c["preemptions"],
                "compiled_programs": sum(f._cache_size() for f in (
                    self._fns.prefill, self._fns.decode, self._fns.release,
                    self._fns.permute, self._fns.start) if f is not None) + (
                    self._fns.extend._cache_size() if self._fns.extend is not None else 0),
            }

    def warmup(self) -> int:
        """Compiles every (prefill batch, prompt length) and cache-length program up front,
        so serving never stalls on a compile. Changes no state; returns the programs run."""
        n = 0
        with self._step_mutex:
            for bp in self.batch_buckets:
                for t in self.prefill_buckets:
                    self._cache, self._slots_dev, out = self._fns.prefill(
                        self._params, self._cache, self._slots_dev,
                        np.zeros((bp, t), np.int32),
                        np.ones((bp,), np.int32), np.full((bp,), self.num_slots, np.int32),
                        RowParams(**self._row_params(bp)), *self._kv.tables((), bp))
                    jax.block_until_ready(out)
                    n += 1
                    if self._fns.extend is not None:  # (prefill over existing pages)
                        self._cache, self._slots_dev, out = self._fns.extend(
                            self._params, self._cache, self._slots_dev,
                            np.zeros((bp, t), np.int32), np.zeros((bp,), np.int32),
                            np.ones((bp,), np.int32), np.full((bp,), self.num_slots, np.int32),
                            RowParams(**self._row_params(bp)), *self._kv.tables((), bp))
                        jax.block_until_ready(out)
                        n += 1
            for cache_len in self.cache_buckets:
                for rows in self.row_buckets:
                    # Decode with every slot inactive runs zero steps, leaves the cache as is.
                    active = self._slots_dev.active
                    idle = self._slots_dev._replace(active=jnp.zeros_like(active))
                    self._cache, idle, out = self._fns.decode(
                        self._params, self._cache, idle, np.int32(0),
                        *self._kv.tables((), rows), cache_len=cache_len, rows=rows)
                    self._slots_dev = idle._replace(active=active)
                    jax.block_until_ready(out)
                    n += 1
            # release: aborts, and (paged) preemptions, which a dry pool can need any time
            self._slots_dev = self._fns.release(self._slots_dev,
                                                np.zeros((self.num_slots,), bool))
            n += 1
            if self._kv.paged:  # (packing running samples into the low slots)
                self._slots_dev = self._fns.permute(
                    self._slots_dev, np.arange(self.num_slots, dtype=np.int32))
                n += 1
                self._run_start([])  # (starting samples on a shared prompt: nothing to do)
                n += 1
        return n


def _fill_row(rows: dict, j: int, s: Sample) -> None:
    p = s.request.params
    rows["seed"][j], rows["sample_index"][j] = s.seed, s.index
    rows["temperature"][j], rows["top_p"][j], rows["top_k"][j] = \
        p.temperature, p.top_p, p.top_k
    rows["limit"][j] = s.limit
    stops = sorted(set(int(x) for x in p.stop_token_ids or ()))
    rows["stop_ids"][j, :len(stops)] = stops


def _reason(s: Sample) -> str:
    last = int(s.tokens[-1][-1])
    return "stop" if last in set(s.request.params.stop_token_ids or ()) else "length"
