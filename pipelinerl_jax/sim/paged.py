"""KV-limited admission of one engine, chunk by chunk: a paged pool or a token reservation.

`EnginePool` (engines.py) gives every engine a fixed number of slots, set in sim_config.py from
the KV capacity over the tokens one sequence holds (`rollout.kv_budget`). This module is the
finer model those slot counts are checked against: one engine doing continuous batching in
decode chunks, with the admission rules of `JaxEngine` (rollout/jax_scheduler.py), driven by
a list of (prompt length, new tokens) requests all queued at step 0. It works in decode-step
space (no time), so what it predicts — active sequences per decode step, admissions,
preemptions, pages in use — compares one to one with the engine's `stats()` after each step.

Both admission rules serve the queue first come, first served; a head that does not fit
blocks it, and at most `max_slots` sequences run.
  reserve  (dense layout) a sequence reserves its whole lifetime, `limit` = min(prompt + new
           tokens, max_seq_len) tokens of `budget_tokens`, until it ends.
  paged    a pool of `num_pages` pages of `page_size` tokens; a sequence holds the pages of
           the positions written so far. Admission takes the head while the free pages
           cover its prompt (for a preempted one, prompt + generated) and its first decode
           chunk, on top of the pages every running sequence's next chunk can still need
           (the reserve). Before each chunk the running sequences, oldest first, take the
           pages that chunk can write (`steps_per_sync` positions past the pending token);
           when the pool runs dry the youngest running sequence is preempted: its pages are
           freed and it goes back to the head of the queue keeping its tokens, and its
           readmission re-prefills prompt + generated (vLLM's recompute).
A chunk runs up to `steps_per_sync` steps and, while sequences are queued, stops once
`min(queued, refill_threshold)` sequences have finished in it (their slots refill at the
next admission). A prefill samples one token; a sequence whose prompt + 1 reaches its limit
ends there.

`paged_concurrency` is the closed form sim_config.py turns into slots for `EnginePool`
(`rollout.kv_budget='paged'`): the mean active sequences of a fed paged engine, from the pool
tokens a sequence holds over its stay in whole chunks (`paged_tokens_per_sequence`). docs/sim.md
"Paged KV cache" derives it; tests/sim/test_sim_paged.py and scripts/sim_paged_agreement.py
check it against this model and the engine.
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` positions (0 for none)."""
    return -(-max(int(tokens), 0) // page_size)


def paged_tokens_per_sequence(prompts, decode_steps, page_size: int, steps_per_sync: int,
                              chunk: float | None = None) -> float:
    """Pool tokens per active sequence under paged admission with a kept-full queue: the
    pool's token-steps a sequence holds over its stay, divided by the steps it decodes.

    A sequence of prompt P decoding D steps is admitted at a chunk boundary and stays until
    the end of the chunk it finishes in: k = ceil(D / ĉ) chunks of ĉ steps (ĉ = `chunk`,
    the mean chunk length; `steps_per_sync` = c when chunks run whole). In its j-th chunk it
    holds the pages of min(P + j·ĉ + c, P + D) positions (its cache plus the chunk it may
    write, up to its last position), plus on average (page_size - 1) / 2 unused in its last
    page. Summed over its stay, times ĉ, over D; averaged over the lengths (`prompts`,
    `decode_steps`: samples, or a scalar prompt). With ĉ -> 1, c -> 0 and pages of one token
    this is `'expected'`'s prompt + E[D²]/(2E[D]) (docs/sim.md "Paged KV cache")."""
    d = np.maximum(np.asarray(decode_steps, np.float64), 1.0)
    p = np.broadcast_to(np.asarray(prompts, np.float64), d.shape)
    c = float(steps_per_sync)
    chunk = c if chunk is None else float(chunk)
    r = (page_size - 1) / 2.0
    k = np.ceil(d / chunk)  # chunks of its stay
    grow = np.clip(np.ceil((d - c) / chunk), 0, k)  # chunks before it reaches its last position
    held = grow * (p + c + r) + chunk * grow * (grow - 1) / 2 + (k - grow) * (p + d + r)
    return float(chunk * held.sum() / d.sum())


def paged_concurrency(pool_tokens: float, prompts, decode_steps, *, page_size: int,
                      steps_per_sync: int, refill_threshold: int, max_slots: int) -> float:
    """Mean active sequences of a fed paged engine: pool / `paged_tokens_per_sequence`, at
    most `max_slots`. While sequences wait, a chunk also ends once `refill_threshold` have
    finished in it: with N active, about refill · E[D] / N steps, which feeds back into N
    (shorter chunks free finished sequences' pages sooner); solved by damped iteration.
    `refill_threshold` 0: chunks run whole."""
    c = float(steps_per_sync)
    mean_d = float(np.mean(np.maximum(np.asarray(decode_steps, np.float64), 1.0)))
    chunk, n = c, 0.0
    for _ in range(200):
        n = min(float(max_slots),
                pool_tokens / paged_tokens_per_sequence(prompts, decode_steps, page_size,
                                                        steps_per_sync, chunk))
        target = c if refill_threshold <= 0 else \
            min(c, max(1.0, refill_threshold * mean_d / max(n, 1e-9)))
        if abs(target - chunk) < 1e-6:
            break
        chunk = 0.5 * (chunk + target)
    return n


@dataclasses.dataclass
class _Seq:
    prompt: int
    limit: int  # total length (prompt + generated) at which it ends
    order: int  # queue order (preemption takes the youngest = largest)
    n_gen: int = 0
    pages: int = 0  # pages held (paged rule)

    @property
    def pos(self) -> int:  # position of the pending (last sampled) token
        return self.prompt + self.n_gen - 1


@dataclasses.dataclass
class ChunkTrace:
    """One record per decode chunk (a step with no decode leaves none), as the engine's
    `stats()` after each `step()` reports them."""
    steps: np.ndarray  # decode steps the chunk ran
    active: np.ndarray  # mean active sequences over its steps (slot-steps / steps)
    admitted: np.ndarray  # admissions in the step before it (readmissions included)
    preempted: np.ndarray  # preemptions in that step
    used_tokens: np.ndarray  # KV tokens held (pages x page size, or reserved) after it
    queued: np.ndarray  # whether sequences waited while it ran (the fed steady state)
    completed: int = 0

    def per_step(self) -> np.ndarray:
        """The chunk means laid out over decode steps (what the figure plots)."""
        return np.repeat(self.active, self.steps)

    def summary(self) -> dict:
        """Mean and p50 (decode-step weighted) of the chunk means, over the whole run and
        over the chunks that ran while sequences were queued; steps; preemptions."""
        q = self.queued
        return {"mean_active": _mean(self.active, self.steps),
                "p50_active": weighted_median(self.active, self.steps),
                "mean_active_while_queued": _mean(self.active[q], self.steps[q]),
                "p50_active_while_queued": weighted_median(self.active[q], self.steps[q]),
                "decode_steps": int(self.steps.sum()),
                "preemptions": int(self.preempted.sum())}


def _mean(values, weights) -> float:
    return float(np.dot(values, weights) / weights.sum()) if weights.size else 0.0


def weighted_median(values, weights) -> float:
    """The value below which half the total weight lies (arrays; 0.0 when empty)."""
    if not weights.size:
        return 0.0
    order = np.argsort(values)
    cum = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cum, 0.5 * cum[-1])])


def _trace(rec, completed) -> ChunkTrace:
    return ChunkTrace(np.asarray(rec["steps"], int), np.asarray(rec["active"], float),
                      np.asarray(rec["admitted"], int), np.asarray(rec["preempted"], int),
                      np.asarray(rec["used"], int), np.asarray(rec["queued"], bool), completed)


class ChunkedEngine:
    """One engine under the `paged` or `reserve` admission rule (module docstring)."""

    def __init__(self, prompts, new_tokens, *, rule: str, max_slots: int, max_seq_len: int,
                 steps_per_sync: int, refill_threshold: int = 0, num_pages: int = 0,
                 page_size: int = 16, budget_tokens: int = 0):
        if rule not in ("paged", "reserve"):
            raise ValueError(f"rule must be 'paged' or 'reserve', got {rule!r}")
        prompts, new_tokens = np.asarray(prompts, int), np.asarray(new_tokens, int)
        if prompts.shape != new_tokens.shape or np.any(prompts < 1) or np.any(new_tokens < 1):
            raise ValueError("need equal-length prompts and new_tokens, all >= 1")
        self.rule, self.max_slots, self.steps = rule, int(max_slots), int(steps_per_sync)
        self.refill = int(refill_threshold) or max(1, self.max_slots // 8)
        self.page_size, self.max_pages = int(page_size), pages_for(max_seq_len, page_size)
        self.free_pages, self.budget, self.reserved = int(num_pages), int(budget_tokens), 0
        self.num_pages = int(num_pages)
        limits = np.minimum(prompts + new_tokens, max_seq_len)
        self.queue = collections.deque(_Seq(int(p), int(n), i)
                                       for i, (p, n) in enumerate(zip(prompts, limits)))
        if rule == "paged" and any(s.limit - 1 > self.num_pages * self.page_size
                                   for s in self.queue):
            raise ValueError("a request needs more KV than the whole pool")
        if rule == "reserve" and any(s.limit > self.budget for s in self.queue):
            raise ValueError("a request needs more KV than budget_tokens")
        self.running: list = []
        self.completed = 0
        self._admitted = self._preempted = 0

    # -- pages ------------------------------------------------------------------------
    def _chunk_end(self, s: _Seq, pending: int) -> int:
        """Positions written after a chunk that starts with the pending token at `pending`."""
        return max(pending, min(pending + self.steps, s.limit - 1))

    def _missing(self, s: _Seq, tokens: int) -> int:
        return max(0, min(pages_for(tokens, self.page_size), self.max_pages) - s.pages)

    def _grow(self, s: _Seq, tokens: int) -> bool:
        need = self._missing(s, tokens)
        if need > self.free_pages:
            return False
        self.free_pages -= need
        s.pages += need
        return True

    def _release(self, s: _Seq) -> None:
        self.running.remove(s)
        if self.rule == "paged":
            self.free_pages += s.pages
            s.pages = 0
        else:
            self.reserved -= s.limit

    def _preempt(self, s: _Seq) -> None:
        self._release(s)
        self.queue.appendleft(s)
        self._preempted += 1

    # -- one engine step: admit + prefill, then one decode chunk --------------------------
    def _admit(self) -> None:
        while True:
            batch = []
            growth = sum(self._missing(s, self._chunk_end(s, s.pos)) for s in self.running) \
                if self.rule == "paged" else 0
            while self.queue and len(self.running) < self.max_slots:
                s = self.queue[0]
                if self.rule == "reserve":
                    if self.reserved + s.limit > self.budget:
                        break
                    self.reserved += s.limit
                else:
                    length = s.prompt + s.n_gen
                    end = self._chunk_end(s, length)
                    if pages_for(end, self.page_size) + growth > self.free_pages:
                        break
                    self._grow(s, length)
                    growth += self._missing(s, end)
                self.queue.popleft()
                self.running.append(s)
                batch.append(s)
            if not batch:
                return
            self._admitted += len(batch)
            for s in batch:  # the prefill samples one token
                s.n_gen += 1
                if s.prompt + s.n_gen >= s.limit:
                    self._finish(s)

    def _finish(self, s: _Seq) -> None:
        self._release(s)
        self.completed += 1

    def _decode(self):
        """Returns (steps run, slot-steps, whether sequences were queued) of one chunk."""
        if self.rule == "paged":
            for s in sorted(self.running, key=lambda s: s.order):
                if s not in self.running:
                    continue  # preempted for an older sequence's pages
                while not self._grow(s, self._chunk_end(s, s.pos)):
                    victim = max(self.running, key=lambda v: v.order)
                    self._preempt(victim)
                    if victim is s:
                        break
        if not self.running:
            return 0, 0, len(self.queue)
        refill_at = min(len(self.queue), self.refill)
        # decode steps each sequence still needs: it ends at the step that samples
        # position limit - 1, i.e. after limit - 1 - pos steps
        left = np.array([s.limit - 1 - s.pos for s in self.running])
        n = min(self.steps, int(left.max()))
        if refill_at > 0:
            done_by = np.sort(left)  # done_by[k-1]: the step by which k have finished
            if refill_at <= left.size:
                n = min(n, int(done_by[refill_at - 1]))
        slot_steps = int(np.minimum(left, n).sum())
        for s, d in zip(list(self.running), left):
            s.n_gen += min(int(d), n)
            if d <= n:
                self._finish(s)
        return n, slot_steps, refill_at > 0

    def used_tokens(self) -> int:
        if self.rule == "paged":
            return (self.num_pages - self.free_pages) * self.page_size
        return self.reserved

    def run(self) -> ChunkTrace:
        """Steps until every request has completed; returns the chunk trace."""
        rec = collections.defaultdict(list)
        for _ in range(10_000_000):
            if not (self.queue or self.running):
                break
            self._admit()
            n, slot_steps, queued = self._decode()
            if n:  # (admissions and preemptions of a step without decode count in the next)
                rec["steps"].append(n)
                rec["active"].append(slot_steps / n)
                rec["admitted"].append(self._admitted)
                rec["preempted"].append(self._preempted)
                rec["used"].append(self.used_tokens())
                rec["queued"].append(queued)
                self._admitted = self._preempted = 0
            elif not self.running and self.queue:  # pragma: no cover - guarded in __init__
                raise RuntimeError("the queue head can never be admitted")
        return _trace(rec, self.completed)


def record_engine(engine, n_requests: int) -> ChunkTrace:
    """Steps a real engine (`JaxEngine`: `step()`, `get_completions()`, `stats()`) whose
    `n_requests` single-sample requests are queued, until all complete; records per decode
    chunk what `ChunkedEngine.run` predicts. Call `engine.stats()` once before submitting
    (it opens a fresh stats window)."""
    rec = collections.defaultdict(list)
    done, prev = 0, engine.stats()
    while done < n_requests:
        engine.step()
        done += len(engine.get_completions())
        s = engine.stats()
        if s["window_decode_steps"]:
            rec["steps"].append(s["window_decode_steps"])
            rec["active"].append(s["slot_occupancy"] * s["num_slots"])
            # running after = running before + admitted - completed - preempted
            rec["admitted"].append(s["active_slots"] - prev["active_slots"]
                                   + s["completed_samples"] - prev["completed_samples"]
                                   + s["preemptions"] - prev["preemptions"])
            rec["preempted"].append(s["preemptions"] - prev["preemptions"])
            rec["used"].append(s["kv_tokens_reserved"])
            rec["queued"].append(s["occupancy_while_queued"] > 0)
            prev = s
    return _trace(rec, done)
