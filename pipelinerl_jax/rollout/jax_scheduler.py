"""The slot scheduler inside `JaxEngine`: one `step()` of continuous batching, and the
per-sample bookkeeping that turns device output into `Completion`s.

One step (a background thread calls it in a loop, or a test calls it):
  1. apply a pending weight update (atomically: the parameter tree is swapped by reference
     between two jitted calls, so no forward pass mixes versions); with
     `kv_policy='recompute'` every in-flight sample's prompt + generated tokens are
     re-prefilled with the new weights (AReaL style), with `'keep'` their KV stays
     (PipelineRL style);
  2. admit queued samples, first come first served, into free slots while the KV budget
     allows: a sample reserves `min(prompt + max_new_tokens, max_seq_len)` tokens of
     `kv_budget_tokens` for its lifetime (conservative reservation, as SGLang's scheduler
     does without retraction). A head-of-queue sample that does not fit blocks the queue, so
     long requests are never starved by short ones. Admitted samples are prefilled together
     (grouped by length, padded to a prompt-length bucket);
  3. one decode chunk: up to `steps_per_sync` decode steps for all slots in one device call,
     ending early, while samples are queued, once `refill_threshold` slots have finished
     (their slots are refilled by the next step's batched prefill).
A sample is one of the `n` samples of a request; each finishes and is returned on its own.

`SlotScheduler` is a mixin of `JaxEngine` and works on the state `JaxEngine.__init__` sets up:
device state (`_params`, `_cache`, `_slots_dev`, compiled `_fns`), host state guarded by `_cv`
(`_queue`, `_slots`, `_reserved`, `_live`, `_outbox`, `_version`, `_pending`, counters).
Device work is serialised by `_step_mutex`, which every caller here holds.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax.rollout.sampling import RowParams
from pipelinerl_jax.types import Completion, GenerationRequest


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
    """Step, admission, prefill and decode of `JaxEngine` (module docstring)."""

    def _apply_pending_update(self) -> None:
        with self._cv:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        self._params, version = pending
        with self._cv:
            self._version = version
            self._counters["updates_applied"] += 1
        if self.config.kv_policy == "recompute":
            running = [s for s in self._slots if s is not None]
            for s in running:
                s.kv_version = version
            self._prefill([(s, self._slots.index(s), s.sequence()) for s in running])
        with self._cv:
            self._cv.notify_all()

    def _step(self) -> int:
        with self._step_mutex:
            t0 = time.perf_counter()
            self._apply_pending_update()
            produced = 0
            if not self._paused:
                produced = self._admit() + self._decode()
            with self._cv:
                for c in (self._counters, self._window):
                    c["busy_s"] += time.perf_counter() - t0
                    c["tokens"] += produced
            return produced

    def _admit(self) -> int:
        produced = 0
        while True:
            batch = []
            with self._cv:
                free = [i for i, s in enumerate(self._slots) if s is None]
                while self._queue and free and \
                        self._reserved + self._queue[0].limit <= self.kv_budget:
                    s = self._queue.popleft()
                    slot = free.pop(0)
                    self._slots[slot] = s
                    self._reserved += s.limit
                    s.start_time, s.start_version = time.time(), self._version
                    s.kv_version = self._version
                    batch.append((s, slot, s.prompt))
            if not batch:
                return produced
            produced += self._prefill(batch)

    def _prefill(self, entries) -> int:
        """Prefills `(sample, slot, token sequence)` entries and records each first token."""
        entries = sorted(entries, key=lambda e: len(e[2]))  # similar lengths share a bucket
        cap = self.batch_buckets[-1]
        for start in range(0, len(entries), cap):
            group = entries[start:start + cap]
            bp = next(b for b in self.batch_buckets if b >= len(group))
            t = next(b for b in self.prefill_buckets if b >= max(len(e[2]) for e in group))
            ids = np.zeros((bp, t), np.int32)
            lengths = np.ones((bp,), np.int32)
            slot_idx = np.full((bp,), self.num_slots, np.int32)  # out of range = padding row
            rows = self._row_params(bp)
            for j, (s, slot, seq) in enumerate(group):
                ids[j, :len(seq)] = seq
                lengths[j], slot_idx[j] = len(seq), slot
                self._fill_row(rows, j, s)
            self._cache, self._slots_dev, out = self._fns.prefill(
                self._params, self._cache, self._slots_dev, ids, lengths, slot_idx,
                RowParams(**rows))
            token, logp, done = jax.device_get(out)
            for j, (s, slot, _) in enumerate(group):
                self._record(s, token[j:j + 1], logp[j:j + 1])
                if done[j]:
                    self._finish(s, self._reason(s))
            self._counters["prefill_calls"] += 1
        return len(entries)

    def _row_params(self, b: int) -> dict:
        return dict(seed=np.zeros((b,), np.uint32), sample_index=np.zeros((b,), np.int32),
                    temperature=np.ones((b,), np.float32), top_p=np.ones((b,), np.float32),
                    top_k=np.zeros((b,), np.int32), limit=np.full((b,), 2, np.int32),
                    stop_ids=np.full((b, self._max_stops), -1, np.int32))

    @staticmethod
    def _fill_row(rows: dict, j: int, s: Sample) -> None:
        p = s.request.params
        rows["seed"][j], rows["sample_index"][j] = s.seed, s.index
        rows["temperature"][j], rows["top_p"][j], rows["top_k"][j] = \
            p.temperature, p.top_p, p.top_k
        rows["limit"][j] = s.limit
        stops = sorted(set(int(x) for x in p.stop_token_ids or ()))
        rows["stop_ids"][j, :len(stops)] = stops

    def _decode(self) -> int:
        running = [i for i, s in enumerate(self._slots) if s is not None]
        if not running:
            return 0
        need = max(self._slots[i].pos for i in running) + self._steps
        cache_len = next((b for b in self.cache_buckets if b >= need), self.max_seq_len)
        with self._cv:
            queued = len(self._queue)
        refill_at = min(queued, self._refill)  # 0 when nothing waits: run the whole chunk
        self._cache, self._slots_dev, out = self._fns.decode(
            self._params, self._cache, self._slots_dev, np.int32(refill_at),
            cache_len=cache_len)
        tokens, logps, emitted, active, n = jax.device_get(out)
        produced = 0
        for i in running:
            k = int(emitted[:n, i].sum())  # a slot emits from the first step until it ends
            s = self._slots[i]
            self._record(s, tokens[:k, i], logps[:k, i])
            produced += k
            if not active[i]:
                self._finish(s, self._reason(s))
        with self._cv:
            occupied = int(emitted[:n].sum())
            for c in (self._counters, self._window):
                c["decode_steps"] += int(n)
                c["slot_steps"] += occupied
                if queued:
                    c["queued_steps"] += int(n)
                    c["queued_slot_steps"] += occupied
        return produced

    def _record(self, s: Sample, tokens, logps) -> None:
        k = len(tokens)
        s.tokens.append(np.asarray(tokens, np.int32))
        s.logps.append(np.asarray(logps, np.float32))
        s.versions.append(np.full((k,), self._version, np.int32))
        s.kv_versions.append(np.full((k,), s.kv_version, np.int32))
        s.n_generated += k

    def _reason(self, s: Sample) -> str:
        last = int(s.tokens[-1][-1])
        return "stop" if last in set(s.request.params.stop_token_ids or ()) else "length"

    def _finish(self, s: Sample, reason: str) -> None:
        """Returns a sample (finished or aborted) and frees its slot and KV reservation."""
        if s.start_version < 0:  # aborted before admission
            s.start_version = s.kv_version = self._version
        def cat(xs, dt):
            return np.concatenate(xs).astype(dt) if xs else np.zeros((0,), dt)
        completion = Completion(
            request_id=s.request.request_id, sample_index=s.index, prompt_ids=s.prompt,
            token_ids=cat(s.tokens, np.int32), logp_behaviour=cat(s.logps, np.float32),
            version=cat(s.versions, np.int32), kv_version=cat(s.kv_versions, np.int32),
            finish_reason=reason, start_version=s.start_version, engine_id=self.engine_id,
            submit_time=s.submit_time, start_time=s.start_time, finish_time=time.time())
        with self._cv:
            if s in self._slots:
                self._slots[self._slots.index(s)] = None
                self._reserved -= s.limit
            rid = s.request.request_id
            self._live[rid] -= 1
            if not self._live[rid]:
                del self._live[rid]
            self._outbox.append(completion)
            self._counters["completed_samples"] += 1
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

    def warmup(self) -> int:
        """Compiles every (prefill batch, prompt length) and cache-length program up front,
        so serving never stalls on a compile. Changes no state; returns the programs run."""
        n = 0
        with self._step_mutex:
            for bp in self.batch_buckets:
                for t in self.prefill_buckets:
                    self._cache, self._slots_dev, out = self._fns.prefill(
                        self._params, self._cache, self._slots_dev, np.zeros((bp, t), np.int32),
                        np.ones((bp,), np.int32), np.full((bp,), self.num_slots, np.int32),
                        RowParams(**self._row_params(bp)))
                    jax.block_until_ready(out)
                    n += 1
            for cache_len in self.cache_buckets:
                # Decode with every slot inactive runs zero steps and leaves the cache as is.
                active = self._slots_dev.active
                idle = self._slots_dev._replace(active=jnp.zeros_like(active))
                self._cache, idle, out = self._fns.decode(
                    self._params, self._cache, idle, np.int32(0), cache_len=cache_len)
                self._slots_dev = idle._replace(active=active)
                jax.block_until_ready(out)
                n += 1
        return n
