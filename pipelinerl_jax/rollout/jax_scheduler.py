"""The slot scheduler inside `JaxEngine`: one `step()` of continuous batching, and the
per-sample bookkeeping that turns device output into `Completion`s.

One step (a background thread calls it in a loop, or a test calls it):
  1. apply a pending weight update (atomically: the parameter tree is swapped by reference
     between two jitted calls, so no forward pass mixes versions); with
     `kv_policy='recompute'` every in-flight sample's prompt + generated tokens are
     re-prefilled with the new weights (AReaL style), with `'keep'` their KV stays
     (PipelineRL style);
  2. admit queued samples, first come first served, into free slots while the KV budget
     allows. Dense layout: a sample reserves `min(prompt + max_new_tokens, max_seq_len)`
     tokens of `kv_budget_tokens` for its lifetime (conservative reservation, as SGLang's
     scheduler does without retraction). Paged layout (`PageAllocator`): a sample is admitted
     while the free pages cover its prompt and its first decode chunk plus the next chunk of
     every running sample (the reserve), and holds only the pages it has written. Either
     way a head-of-queue sample that does not fit blocks the queue, so long requests are
     never starved by short ones. Admitted samples are prefilled together (grouped by
     length, padded to a prompt-length bucket). Paged, `n > 1`: the samples of a request
     share their prompt's pages and one prefill of it (`prompt_share.py`; admission counts
     the shared pages once). Paged, prefix reuse (`prefix_cache.py`): a sample whose
     sequence starts with pages written already — a finished sample's retained pages (the
     previous turn of a multi-turn episode), or its group's live prompt for a preempted
     sample of a group — maps them and prefills only the rest over them (`extend`);
     retained pages count as free and are evicted before anything is refused or preempted;
  3. one decode chunk: up to `steps_per_sync` decode steps for all slots in one device call,
     ending early, while samples are queued, once `refill_threshold` slots have finished
     (their slots are refilled by the next step's batched prefill). Paged layout: before the
     chunk every running sample gets the pages the chunk can write, oldest first; when the
     pool runs dry the youngest running sample (latest submitted) is preempted: its pages are
     freed, its slot released, and it goes back to the head of the queue with the tokens it
     generated, which its readmission re-prefills (recompute, as vLLM does) — a sample is
     never failed for want of pages.
A sample is one of the `n` samples of a request; each finishes and is returned on its own.

`JaxEngine` owns one `SlotScheduler` and talks to it through its public methods only. The
scheduler owns everything a step touches: the device state (parameters, KV cache, slot
state, the compiled programs), the host state guarded by its condition variable (queue,
slots, KV reservations, live requests, outbox, versions and the pending update, the paused /
closed / failed flags, counters), and the step mutex that serialises device work. The engine
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
from pipelinerl_jax.rollout.page_allocator import PageAllocator
from pipelinerl_jax.rollout.prefix_cache import PrefixCache, full_pages_written, min_version
from pipelinerl_jax.rollout.prompt_share import PromptShare, shares
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
    the initial device state; `shape`: `num_slots`, `max_seq_len`, `kv_budget`, the three
    bucket tuples, `steps` (decode steps per chunk), `refill` (refill threshold),
    `max_stops`, `kv_policy`, `seed` (of unseeded requests' seeds). `pages`: the paged
    layout's allocator (then `cache` holds page pools and `kv_budget` is unused), None for
    the dense layout. `prefix_cache` (paged only): keep finished samples' full pages for
    reuse by later requests whose prompts start with their tokens (`prefix_cache.py`);
    `reuse_max_lag`: how many versions older than the live one reused pages may be (keep).
    """

    def __init__(self, fns, params, cache, slots_dev, *, num_slots: int, max_seq_len: int,
                 kv_budget: int, prefill_buckets: tuple, cache_buckets: tuple,
                 batch_buckets: tuple, steps: int, refill: int, max_stops: int,
                 kv_policy: str, seed: int, version: int, engine_id: str,
                 pages: Optional[PageAllocator] = None, prefix_cache: bool = False,
                 reuse_max_lag: int = 0):
        self.num_slots, self.max_seq_len, self.kv_budget = num_slots, max_seq_len, kv_budget
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
        self._reserved = 0
        self._paused = self._closed = False
        self._error: Optional[str] = None
        self._seed_counter = 0
        self._stats = StatsWindow()
        self._pages = pages
        # paged: the n samples of a request share their prompt's pages (one prefill per group)
        self._share = PromptShare(pages) if pages is not None else None
        # paged: finished samples' full pages, reused by prompts that start with their tokens
        self._retained = PrefixCache(pages) if pages is not None and prefix_cache else None
        self._reuse_max_lag = 0 if kv_policy == "recompute" else int(reuse_max_lag)
        self._submitted = 0
        # paged: decode runs over the first `rows` slots, running samples packed there
        self.row_buckets = (buckets((), 8, num_slots) if pages is not None else (num_slots,))

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
            for s in queued + [self._slots[i] for i in running]:  # (frees their pages)
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
            if self._retained is not None:  # only the live version's K/V may be reused
                with self._cv:
                    self._retained.clear()
            if self._pages is not None:  # the re-prefill writes the pending token's K/V too
                for i in self._by_age():
                    s = self._slots[i]
                    if s is not None:
                        self._grow_or_preempt(i, s.pos + 1)
            running = [s for s in self._slots if s is not None]
            for s in running:
                s.kv_version = version
            self._prefill(self._recompute_entries(running))
            if self._share is not None:
                self._share.restamp(version)
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
                growth = self._running_growth()
                while self._queue and free:
                    s = self._queue[0]
                    shared = self._share is not None and shares(s)
                    # (a preempted sample re-prefills what it generated, its pending token too)
                    seq = s.sequence() if s.n_generated else s.prompt
                    reused, reuse_version = 0, self._version  # positions mapped, their writer
                    if self._pages is None:  # dense: reserve the whole lifetime up front
                        if self._reserved + s.limit > self.kv_budget:
                            break
                        self._reserved += s.limit
                        slot = free.pop(0)
                    elif shared:  # paged, a group's sample: private pages (+ a new prefix)
                        end = self._chunk_end(s, s.pos)  # (pending: the prompt's last token)
                        creating = self._share.live(s.request.request_id) is None
                        if creating:  # a new prefix starts with the retained pages of it
                            reused, reuse_version = self._map_retained(
                                free[0], s.prompt[:-1], s.pos // self._pages.page_size)
                            need = self._pages.missing(free[0], end)
                        else:
                            need = self._share.need(s, end)
                        if need + growth > self._pages.available:
                            if creating:
                                self._pages.release(free[0])
                            break
                        slot = free.pop(0)
                        prefix, created, copy = self._share.admit(
                            s, slot, min(self._version, reuse_version))
                        growth += self._pages.missing(slot, end)
                    else:  # paged: the prompt (and tokens so far) + first chunk + reserve,
                        # less the pages it maps: a retained prefix or its group's prompt
                        reused, reuse_version = self._map_reusable(s, free[0], seq)
                        end = self._chunk_end(s, len(seq))
                        if self._pages.missing(free[0], end) + growth > self._pages.available:
                            self._unmap(s, free[0])
                            break
                        slot = free.pop(0)
                        self._pages.grow(slot, len(seq))
                        self._share.settle(s, self._pages.pages(slot))
                        growth += self._pages.missing(slot, end)
                    self._queue.popleft()
                    self._slots[slot] = s
                    if s.start_version < 0:  # (a preempted sample keeps its first start)
                        s.start_time, s.start_version = time.time(), self._version
                    if shared:  # its oldest K/V is the prefix's, whenever that was written
                        s.kv_version = prefix.version
                        starts.append((s, slot, copy))
                        if created and s.pos > reused:  # the group's one prompt prefill
                            batch.append((None, slot, s.prompt[:-1], reused))  # (no token)
                        self._stats.add(prompt_prefills=int(created and s.pos > 0),
                                        shared_admissions=int(not created),
                                        prefix_cache_hits=int(reused > 0),
                                        reused_tokens=reused)
                        continue
                    # every K/V it attends to is written now, but for the pages it maps
                    s.kv_version = min(self._version, reuse_version)
                    batch.append((s, slot, seq, reused))
                    self._stats.add(prompt_prefills=int(s.n_generated == 0),
                                    prefix_cache_hits=int(reused > 0), reused_tokens=reused)
            if not batch and not starts:
                return produced
            produced += self._prefill(batch)
            self._start_shared(starts)

    def _map_reusable(self, s: Sample, slot: int, seq) -> tuple:  # holds _cv
        """Maps into free `slot` the pages of `seq`'s first positions that some holder has
        written already: its group's shared prompt (a preempted sample of a group whose
        prefix is live) or the longest retained prefix (`prefix_cache.py`), whichever
        covers more, never `seq`'s last token; only pages written at most `reuse_max_lag`
        versions before the live one (under 'recompute': the live version's). Returns
        (positions mapped, the oldest version that wrote them; the live version when none)."""
        if self._pages is None:
            return 0, self._version
        c, limit = self._pages.page_size, (len(seq) - 1) // self._pages.page_size
        oldest = self._version - self._reuse_max_lag
        prefix = self._share.live(s.request.request_id) if s.n_generated else None
        if prefix is not None and prefix.version < oldest:
            prefix = None
        group = min(len(prefix.full), limit) if prefix is not None else 0
        nodes = (self._retained.match(seq, limit, oldest)
                 if self._retained is not None else [])
        if group and group == len(prefix.full) and group >= len(nodes):
            self._share.rejoin(s, slot)
            return group * c, min(prefix.version, self._version)
        return self._hold(slot, nodes)

    def _map_retained(self, slot: int, tokens, max_pages: int) -> tuple:  # holds _cv
        """Maps into free `slot` the longest retained path (at most `max_pages` pages) that
        `tokens` start with, within the version cap; (positions mapped, their oldest
        writer's version, or the live version when none)."""
        if self._retained is None or max_pages < 1:
            return 0, self._version
        return self._hold(slot, self._retained.match(
            tokens, max_pages, self._version - self._reuse_max_lag))

    def _hold(self, slot: int, nodes) -> tuple:  # holds _cv
        if not nodes:
            return 0, self._version
        self._pages.share(slot, [n.page for n in nodes])
        return len(nodes) * self._pages.page_size, min(min_version(nodes), self._version)

    def _unmap(self, s: Sample, slot: int) -> None:  # holds _cv
        """Undoes `_map_reusable` (the sample was not admitted after all)."""
        if self._pages is not None:
            self._pages.release(slot)
            self._share.release(s)

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
        n, none = self.num_slots, self._pages.num_pages
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

    # ------------------------------------------------------------------ pages

    def _chunk_end(self, s: Sample, pending: int) -> int:
        """Positions whose K/V exist after a decode chunk that starts with the pending token
        at `pending` (at least `pending`: a prefill writes everything before it)."""
        return max(pending, min(pending + self._steps, s.limit - 1))

    def _running_growth(self) -> int:  # holds _cv
        """Pages the running samples' next decode chunk can still need."""
        if self._pages is None:
            return 0
        return sum(self._pages.missing(i, self._chunk_end(s, s.pos))
                   for i, s in enumerate(self._slots) if s is not None)

    def _by_age(self) -> list:
        """Occupied slots, oldest sample (first submitted) first."""
        return sorted((i for i, s in enumerate(self._slots) if s is not None),
                      key=lambda i: self._slots[i].order)

    def _grow_or_preempt(self, slot: int, tokens: int) -> bool:
        """Makes `slot` hold pages for `tokens` positions, preempting the youngest running
        samples while the pool is short; False when `slot`'s own sample was preempted."""
        while not self._pages.grow(slot, tokens):
            victim = max(self._by_age(), key=lambda i: self._slots[i].order)
            self._preempt(victim)
            if victim == slot:
                return False
        return True

    def _pack(self, running: list, rows: int) -> list:
        """Moves the running samples of slots >= `rows` into free slots below it (their
        pages stay; slot state and page-table rows move); returns the running slots."""
        holes = [i for i in range(rows) if self._slots[i] is None]
        perm = np.arange(self.num_slots, dtype=np.int32)
        with self._cv:
            for src in [i for i in running if i >= rows]:
                dst = holes.pop(0)
                perm[dst], perm[src] = src, dst
                self._slots[dst], self._slots[src] = self._slots[src], None
                self._pages.swap(src, dst)
                self._stats.totals["slot_moves"] += 1
        self._slots_dev = self._fns.permute(self._slots_dev, perm)
        return [i for i, s in enumerate(self._slots) if s is not None]

    def _preempt(self, slot: int) -> None:
        """Frees `slot`'s pages and slot and puts its sample back at the head of the queue;
        its readmission re-prefills its prompt and the tokens it generated so far."""
        s = self._slots[slot]
        self._pages.release(slot)  # (pages its group shares stay with the other holders)
        if self._share is not None:
            self._share.release(s)
        free = np.zeros((self.num_slots,), bool)
        free[slot] = True
        self._slots_dev = self._fns.release(self._slots_dev, free)
        with self._cv:
            self._slots[slot] = None
            self._queue.appendleft(s)  # youngest preempted first: the oldest ends up first
            self._stats.totals["preemptions"] += 1

    def _recompute_entries(self, running) -> list:
        """The `_prefill` entries of a 'recompute' update's re-prefill of `running`. Paged: a
        page several running samples hold (a group's shared prompt pages, a retained prefix
        two turns mapped) is rewritten by the first of them, whose whole sequence runs as a
        plain prefill; each later holder re-prefills only what follows its leading such
        pages, over them (`extend`), instead of its whole sequence."""
        if self._pages is None:
            return [(s, self._slots.index(s), s.sequence(), 0) for s in running]
        c = self._pages.page_size
        written, entries = set(), []
        for s in running:
            slot = self._slots.index(s)
            pages, seq = self._pages.pages(slot), s.sequence()
            lead = 0
            while lead < len(pages) and pages[lead] in written:
                lead += 1
            start = min(lead * c, (len(seq) - 1) // c * c)  # at least one token runs
            if not start:
                written.update(pages)
            entries.append((s, slot, seq, start))
        return entries

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
            if self._pages is not None:
                tables = np.full((bp, self._pages.max_pages), self._pages.num_pages, np.int32)
                for j, (_, slot, _, _) in enumerate(group):
                    tables[j] = self._pages.tables[slot]
                    if not extend:  # (extend rows write only their private pages)
                        tables[j][np.isin(tables[j], list(written))] = self._pages.num_pages
                        written.update(self._pages.pages(slot))
            if extend:
                self._cache, self._slots_dev, out = self._fns.extend(
                    self._params, self._cache, self._slots_dev, ids, starts, lengths,
                    slot_idx, RowParams(**rows), tables)
            else:
                args = (self._params, self._cache, self._slots_dev, ids, lengths, slot_idx,
                        RowParams(**rows))
                if self._pages is not None:
                    args += (tables,)
                self._cache, self._slots_dev, out = self._fns.prefill(*args)
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
        if self._pages is not None:  # pages for what this chunk can write, oldest first
            for i in self._by_age():
                s = self._slots[i]
                if s is not None:
                    self._grow_or_preempt(i, self._chunk_end(s, s.pos))
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
        if self._pages is None:
            extra, static = (), {}
        else:
            extra, static = (self._pages.tables[:rows].copy(),), {"rows": rows}
        self._cache, self._slots_dev, out = self._fns.decode(
            self._params, self._cache, self._slots_dev, np.int32(refill_at), *extra,
            cache_len=cache_len, **static)
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
                if self._pages is None:
                    self._reserved -= s.limit
                else:
                    self._retain(s, slot)
                    self._pages.release(slot)
                    self._share.release(s)
            rid = s.request.request_id
            self._live[rid] -= 1
            if not self._live[rid]:
                del self._live[rid]
            self._outbox.append(completion)
            self._stats.totals["completed_samples"] += 1
            self._cv.notify_all()

    def _retain(self, s: Sample, slot: int) -> None:  # holds _cv
        """Keeps the full pages `slot` has written (every position before the pending
        token's) in the prefix cache, for later prompts that start with those tokens."""
        if self._retained is None:
            return
        held = self._pages.pages(slot)
        n = full_pages_written(s.pos, self._pages.page_size, len(held))
        if n:
            self._retained.insert(s.sequence()[:n * self._pages.page_size], held[:n],
                                  s.kv_version)

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
                **self._kv_figures(),
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

    def _kv_figures(self) -> dict:  # holds _cv
        """KV reserved and budget in tokens (the paged layout: pages held / in the pool)."""
        if self._pages is None:
            return {"kv_layout": "dense", "kv_tokens_reserved": self._reserved,
                    "kv_budget_tokens": self.kv_budget}
        c = self._pages.page_size
        # (pages only the prefix cache holds count as free: admission may take them)
        free = self._pages.available
        return {"kv_layout": "paged",
                "kv_tokens_reserved": (self._pages.num_pages - free) * c,
                "kv_budget_tokens": self._pages.num_pages * c, "page_size": c,
                "kv_pages_total": self._pages.num_pages,
                "kv_pages_free": free,
                "kv_pages_shared": self._pages.shared_pages,
                "shared_admissions": self._stats.totals["shared_admissions"],
                "cow_page_copies": self._stats.totals["cow_page_copies"],
                # prefix reuse (prefix_cache.py): admissions that mapped written pages (a
                # retained prefix, or a preempted sample's group prompt), the positions
                # mapped instead of prefilled, and the pages the cache keeps
                "prefix_cache_hits": self._stats.totals["prefix_cache_hits"],
                "reused_tokens": self._stats.totals["reused_tokens"],
                "prefix_cache_pages": len(self._retained) if self._retained is not None else 0,
                "prefix_cache_evictions": (self._retained.evictions
                                           if self._retained is not None else 0),
                "slot_moves": self._stats.totals["slot_moves"]}

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
                        RowParams(**self._row_params(bp)), *self._no_pages(bp))
                    jax.block_until_ready(out)
                    n += 1
                    if self._fns.extend is not None:  # (prefill over existing pages)
                        self._cache, self._slots_dev, out = self._fns.extend(
                            self._params, self._cache, self._slots_dev,
                            np.zeros((bp, t), np.int32), np.zeros((bp,), np.int32),
                            np.ones((bp,), np.int32), np.full((bp,), self.num_slots, np.int32),
                            RowParams(**self._row_params(bp)), *self._no_pages(bp))
                        jax.block_until_ready(out)
                        n += 1
            for cache_len in self.cache_buckets:
                for rows in self.row_buckets:
                    # Decode with every slot inactive runs zero steps, leaves the cache as is.
                    static = {} if self._pages is None else {"rows": rows}
                    active = self._slots_dev.active
                    idle = self._slots_dev._replace(active=jnp.zeros_like(active))
                    self._cache, idle, out = self._fns.decode(
                        self._params, self._cache, idle, np.int32(0), *self._no_pages(rows),
                        cache_len=cache_len, **static)
                    self._slots_dev = idle._replace(active=active)
                    jax.block_until_ready(out)
                    n += 1
            # release: aborts, and (paged) preemptions, which a dry pool can need any time
            self._slots_dev = self._fns.release(self._slots_dev,
                                                np.zeros((self.num_slots,), bool))
            n += 1
            if self._pages is not None:  # (packing running samples into the low slots)
                self._slots_dev = self._fns.permute(
                    self._slots_dev, np.arange(self.num_slots, dtype=np.int32))
                n += 1
                self._run_start([])  # (starting samples on a shared prompt: nothing to do)
                n += 1
        return n


    def _no_pages(self, rows: int) -> tuple:
        """The page-table argument of `rows` rows holding no page (none for dense)."""
        if self._pages is None:
            return ()
        return (np.full((rows, self._pages.max_pages), self._pages.num_pages, np.int32),)


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
