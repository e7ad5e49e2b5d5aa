"""The KV memory of `JaxEngine`: one interface, a dense and a paged implementation, each owning
its state; the scheduler (`jax_scheduler.py`) schedules and asks this part what fits.

    admit(s, slot, version)   hold what queued sample `s` needs to start in free `slot`, or
                              None when it does not fit now (head-of-line: the queue waits);
                              returns how it starts (`Admission`: a prefill row, or a start
                              on its group's shared prompt, and the oldest K/V it will read)
    grow(slot, tokens)        make `slot` hold its first `tokens` positions; False: the
                              memory is short (the scheduler preempts `victim(...)` and retries)
    victim(slots)             whom to preempt: the youngest running sample (latest submitted)
    release(s, slot, retain)  free what `slot` holds; `retain`: keep its written prefix for
                              later prompts that start with it (a finished sample's)
    share a prompt / retain a prefix: inside `admit` and `release` of the paged part
                              (`prompt_share.py`, `prefix_cache.py`), invisible to the caller

Dense (`DenseKV`): every slot owns `max_seq_len` positions of a dense cache; a sample
reserves `min(prompt + max_new_tokens, max_seq_len)` tokens of `kv_budget_tokens` for its
lifetime (conservative reservation, as SGLang's scheduler does without retraction), so it
never grows and is never preempted.

Paged (`PagedKV`): a pool of pages (`page_allocator.py`); a sample is admitted while the free
pages cover its prompt and its first decode chunk plus the next chunk of every running
sample (the reserve), and holds only the pages it has written. The `n` samples of a request
share their prompt's pages and one prefill of it (`prompt_share.py`; admission counts the
shared pages once). A sample whose sequence starts with pages written already — a finished
sample's retained pages (the previous turn of a multi-turn episode), or its group's live
prompt for a preempted sample of a group — maps them and prefills only the rest over them
(`extend`); retained pages count as free and are evicted before anything is refused or
preempted. Decode runs over the first `rows` slots (a row bucket), running samples packed
there (`move`).

Host bookkeeping only: the scheduler calls every method under its lock, and the device
programs read what this part decides (page tables).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from pipelinerl_jax.rollout.page_allocator import PageAllocator
from pipelinerl_jax.rollout.prefix_cache import PrefixCache, full_pages_written, min_version
from pipelinerl_jax.rollout.prompt_share import PromptShare, shares


def chunk_end(s, pending: int, steps: int) -> int:
    """Positions of sample `s` whose K/V exist after a decode chunk of `steps` that starts
    with its pending token at `pending` (at least `pending`: a prefill writes all before)."""
    return max(pending, min(pending + steps, s.limit - 1))


@dataclasses.dataclass
class Admission:
    """How an admitted sample starts. `prefill`: a `(sample, slot, tokens, start)` prefill
    row (`sample` None: its group's shared prompt, no token sampled); `start`: `(sample,
    slot, page copy or None)`, it starts on its group's shared prompt; `kv_version`: the
    oldest version among the K/V it will attend to; `stats`: counters to add."""
    kv_version: int
    prefill: Optional[tuple] = None
    start: Optional[tuple] = None
    stats: dict = dataclasses.field(default_factory=dict)


class KVMemory:
    """The interface (module docstring). `row_buckets`: the decode row counts the memory
    serves (the dense cache: every slot, always); `paged`: whether the device cache is a page
    pool (its programs take page tables)."""
    paged = False
    row_buckets: tuple = ()

    def open_round(self, running: Sequence) -> None:
        """Starts an admission round with `running` = `[(slot, sample), ...]` occupied."""

    def admit(self, s, slot: int, version: int) -> Optional[Admission]:
        raise NotImplementedError

    def grow(self, slot: int, tokens: int) -> bool:
        raise NotImplementedError

    @staticmethod
    def victim(slots: Sequence) -> int:
        """The slot of the youngest running sample (latest submitted) in `slots`."""
        return max((i for i, s in enumerate(slots) if s is not None),
                   key=lambda i: slots[i].order)

    def release(self, s, slot: int, retain: bool) -> None:
        raise NotImplementedError

    def move(self, src: int, dst: int) -> None:
        """Slot `src`'s sample now runs in slot `dst` (free)."""
        raise NotImplementedError

    def invalidate(self) -> None:
        """A weight update made every retained K/V unusable ('recompute')."""

    def restamp(self, version: int) -> None:
        """Every running sample's K/V was rewritten by `version` ('recompute')."""

    def recompute_entries(self, running: Sequence, slots: Sequence) -> list:
        """The prefill rows of a 'recompute' update's re-prefill of `running`."""
        return [(s, slots.index(s), s.sequence(), 0) for s in running]

    def tables(self, slots: Sequence[int], rows: int, extend: bool = False,
               written: Optional[set] = None) -> tuple:
        """The page-table argument of a call over `rows` rows of which the first hold
        `slots` (none for dense)."""
        return ()

    def figures(self, totals: dict) -> dict:
        raise NotImplementedError


class DenseKV(KVMemory):
    """Lifetime reservations of a dense cache (module docstring)."""

    def __init__(self, num_slots: int, budget: int):
        self.budget, self.reserved = budget, 0
        self.row_buckets = (num_slots,)

    def admit(self, s, slot, version):
        if self.reserved + s.limit > self.budget:
            return None
        self.reserved += s.limit
        seq = s.sequence() if s.n_generated else s.prompt
        return Admission(version, prefill=(s, slot, seq, 0),
                         stats={"prompt_prefills": int(s.n_generated == 0)})

    def grow(self, slot, tokens):
        return True  # (the slot's reservation covers its whole life)

    def release(self, s, slot, retain):
        self.reserved -= s.limit

    def figures(self, totals):
        return {"kv_layout": "dense", "kv_tokens_reserved": self.reserved,
                "kv_budget_tokens": self.budget}


class PagedKV(KVMemory):
    """Pages of a pool, shared prompts and retained prefixes (module docstring). `steps`:
    decode steps per chunk (the reserve admission keeps); `prefix_cache`: keep finished
    samples' full pages; `reuse_max_lag`: how many versions older than the live one reused
    pages may be (0 under 'recompute'); `rows`: the decode row buckets."""
    paged = True

    def __init__(self, pages: PageAllocator, steps: int, prefix_cache: bool,
                 reuse_max_lag: int, rows: tuple):
        self.pages, self._steps = pages, steps
        self.share = PromptShare(pages)  # a group's samples share their prompt's pages
        self.retained = PrefixCache(pages) if prefix_cache else None
        self._reuse_max_lag = reuse_max_lag
        self._growth = 0  # pages the running samples' next chunk can need, this round
        self.row_buckets = rows

    @property
    def num_pages(self) -> int:
        return self.pages.num_pages

    def open_round(self, running):
        self._growth = sum(self.pages.missing(i, chunk_end(s, s.pos, self._steps))
                           for i, s in running)

    def admit(self, s, slot, version):
        pages, steps = self.pages, self._steps
        # (a preempted sample re-prefills what it generated, its pending token too)
        seq = s.sequence() if s.n_generated else s.prompt
        reused, reuse_version = 0, version  # positions mapped, their writer
        if not shares(s):  # the prompt (and tokens so far) + first chunk + reserve, less
            # the pages it maps: a retained prefix or its group's prompt
            reused, reuse_version = self._map_reusable(s, slot, seq, version)
            end = chunk_end(s, len(seq), steps)
            if pages.missing(slot, end) + self._growth > pages.available:
                pages.release(slot)
                self.share.release(s)
                return None
            pages.grow(slot, len(seq))
            self.share.settle(s, pages.pages(slot))
            self._growth += pages.missing(slot, end)
            return Admission(min(version, reuse_version), prefill=(s, slot, seq, reused),
                             stats={"prompt_prefills": int(s.n_generated == 0),
                                    "prefix_cache_hits": int(reused > 0),
                                    "reused_tokens": reused})
        # a group's sample: its private pages (+ a new prefix, which may start with
        # retained pages of it)
        end = chunk_end(s, s.pos, steps)  # (pending: the prompt's last token)
        creating = self.share.live(s.request.request_id) is None
        if creating:
            reused, reuse_version = self._map_retained(slot, s.prompt[:-1],
                                                       s.pos // pages.page_size, version)
            need = pages.missing(slot, end)
        else:
            need = self.share.need(s, end)
        if need + self._growth > pages.available:
            if creating:
                pages.release(slot)
            return None
        prefix, created, copy = self.share.admit(s, slot, min(version, reuse_version))
        self._growth += pages.missing(slot, end)
        prefill = None
        if created and s.pos > reused:  # the group's one prompt prefill (no token)
            prefill = (None, slot, s.prompt[:-1], reused)
        # its oldest K/V is the prefix's, whenever that was written
        return Admission(prefix.version, prefill=prefill, start=(s, slot, copy),
                         stats={"prompt_prefills": int(created and s.pos > 0),
                                "shared_admissions": int(not created),
                                "prefix_cache_hits": int(reused > 0),
                                "reused_tokens": reused})

    def _map_reusable(self, s, slot: int, seq, version: int) -> tuple:
        """Maps into free `slot` the pages of `seq`'s first positions that some holder has
        written already: its group's shared prompt (a preempted sample of a group whose
        prefix is live) or the longest retained prefix (`prefix_cache.py`), whichever
        covers more, never `seq`'s last token; only pages written at most `reuse_max_lag`
        versions before `version` (the live one). Returns (positions mapped, the oldest
        version that wrote them; `version` when none)."""
        c, limit = self.pages.page_size, (len(seq) - 1) // self.pages.page_size
        oldest = version - self._reuse_max_lag
        prefix = self.share.live(s.request.request_id) if s.n_generated else None
        if prefix is not None and prefix.version < oldest:
            prefix = None
        group = min(len(prefix.full), limit) if prefix is not None else 0
        nodes = self.retained.match(seq, limit, oldest) if self.retained is not None else []
        if group and group == len(prefix.full) and group >= len(nodes):
            self.share.rejoin(s, slot)
            return group * c, min(prefix.version, version)
        return self._hold(slot, nodes, version)

    def _map_retained(self, slot: int, tokens, max_pages: int, version: int) -> tuple:
        """Maps into free `slot` the longest retained path (at most `max_pages` pages) that
        `tokens` start with, within the version cap; (positions mapped, their oldest
        writer's version, or `version` when none)."""
        if self.retained is None or max_pages < 1:
            return 0, version
        return self._hold(slot, self.retained.match(tokens, max_pages,
                                                    version - self._reuse_max_lag), version)

    def _hold(self, slot: int, nodes, version: int) -> tuple:
        if not nodes:
            return 0, version
        self.pages.share(slot, [n.page for n in nodes])
        return len(nodes) * self.pages.page_size, min(min_version(nodes), version)

    def grow(self, slot, tokens):
        return self.pages.grow(slot, tokens)

    def release(self, s, slot, retain):
        if retain and self.retained is not None:  # its full written pages (every position
            held = self.pages.pages(slot)  # before the pending token's), for later prompts
            n = full_pages_written(s.pos, self.pages.page_size, len(held))
            if n:
                self.retained.insert(s.sequence()[:n * self.pages.page_size], held[:n],
                                     s.kv_version)
        self.pages.release(slot)  # (pages its group shares stay with the other holders)
        self.share.release(s)

    def move(self, src, dst):
        self.pages.swap(src, dst)

    def invalidate(self):
        if self.retained is not None:  # only the live version's K/V may be reused
            self.retained.clear()

    def restamp(self, version):
        self.share.restamp(version)

    def recompute_entries(self, running, slots):
        """A page several running samples hold (a group's shared prompt pages, a retained
        prefix two turns mapped) is rewritten by the first of them, whose whole sequence
        runs as a plain prefill; each later holder re-prefills only what follows its
        leading such pages, over them (`extend`), instead of its whole sequence."""
        c = self.pages.page_size
        written, entries = set(), []
        for s in running:
            slot = slots.index(s)
            held, seq = self.pages.pages(slot), s.sequence()
            lead = 0
            while lead < len(held) and held[lead] in written:
                lead += 1
            start = min(lead * c, (len(seq) - 1) // c * c)  # at least one token runs
            if not start:
                written.update(held)
            entries.append((s, slot, seq, start))
        return entries

    def tables(self, slots, rows, extend=False, written=None):
        """Page tables of `rows` rows, the first `len(slots)` those of `slots` (the rest
        hold no page). With `written` (a plain prefill call's pages written so far), a page
        some earlier row writes is dropped from later rows' tables: one row writes it."""
        tables = np.full((rows, self.pages.max_pages), self.pages.num_pages, np.int32)
        for j, slot in enumerate(slots):
            tables[j] = self.pages.tables[slot]
            if written is not None and not extend:  # (extend rows write only their own)
                tables[j][np.isin(tables[j], list(written))] = self.pages.num_pages
                written.update(self.pages.pages(slot))
        return (tables,)

    def figures(self, totals):
        """KV reserved and budget in tokens: pages held / in the pool; pages only the
        prefix cache holds count as free (admission may take them)."""
        c, free = self.pages.page_size, self.pages.available
        return {"kv_layout": "paged",
                "kv_tokens_reserved": (self.pages.num_pages - free) * c,
                "kv_budget_tokens": self.pages.num_pages * c, "page_size": c,
                "kv_pages_total": self.pages.num_pages,
                "kv_pages_free": free,
                "kv_pages_shared": self.pages.shared_pages,
                "shared_admissions": totals["shared_admissions"],
                "cow_page_copies": totals["cow_page_copies"],
                # prefix reuse (prefix_cache.py): admissions that mapped written pages (a
                # retained prefix, or a preempted sample's group prompt), the positions
                # mapped instead of prefilled, and the pages the cache keeps
                "prefix_cache_hits": totals["prefix_cache_hits"],
                "reused_tokens": totals["reused_tokens"],
                "prefix_cache_pages": len(self.retained) if self.retained is not None else 0,
                "prefix_cache_evictions": (self.retained.evictions
                                           if self.retained is not None else 0),
                "slot_moves": totals["slot_moves"]}
