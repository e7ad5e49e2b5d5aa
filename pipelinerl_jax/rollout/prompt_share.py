"""Shared group prompts of the paged `JaxEngine`: the `n` samples of one request hold their
prompt's KV pages together, and the prompt is prefilled once per group.

What is shared. A request's prompt of `L` tokens is split into its *prefix*, the first
`L - 1` tokens, and its last token. The prefix is prefilled once (one prefill row, no token
sampled) into the pages of the first sample admitted (the group's *creator*). Every sample
of the group then starts decoding with the prompt's last token as its pending token at
position `L - 1`: its first decode step writes that position's K/V and samples its own first
token, with its own seed row, exactly where a per-sample prefill would have sampled it.

Pages. The prefix's *full* pages (positions `[0, C * ((L - 1) // C))`) are shared: each
sample's table points at them and the allocator counts the holders. The prefix's last,
partial page (when `(L - 1) % C != 0`) is copy-on-write: the first decode step of every
sample writes position `L - 1` into it, so each sample holds its own copy, made when it is
admitted (the creator keeps the page the prefill wrote; a sibling copies a current holder's
partial page: its positions below `L - 1` are the prompt's, never rewritten by decode, and
the positions at or after `L - 1` the copier overwrites before it can attend to them).
Pages past the prefix are the sample's own. A prompt of one token has an empty prefix.

Lifetime. A `Prefix` lives while a sample holds it; the last holder's release (finish,
abort, preemption) ends it and the allocator frees its full pages. A sibling admitted while
the prefix lives needs only its private pages (admission counts the shared pages once); one
admitted after it ended prefills a new prefix. A sample preempted after it generated tokens
leaves the prefix; readmitted while the prefix lives, it `rejoin`s it: it maps the full pages
again and re-prefills only the rest of its sequence over them (the engine's `extend`
program), its own partial page included (then `settle` records that page as a copy source
like any member's). One preempted before its first decode joins its group again like any
sibling.

Provenance. A prefix records the version that wrote it; a sample admitted onto it reports
that version as its `kv_version` (under `kv_policy='keep'` a sibling admitted after an
update keeps reading the older prefix, and says so). Under 'recompute' an update re-prefills
every running sample: one holder of a prefix its whole sequence (rewriting the shared
pages), the others only what follows them, over them; then `restamp` gives every prefix the
new version.

Host bookkeeping only (the scheduler holds its lock while calling it, and runs the prefill
and the copies on device); the page reference counts live in `PageAllocator`.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from pipelinerl_jax.rollout.page_allocator import PageAllocator, pages_for


@dataclasses.dataclass(eq=False)
class Prefix:
    """One request's shared prompt prefix (module docstring)."""
    request_id: str
    tokens: int  # L - 1: the positions the prefix holds
    full: list  # pages wholly inside the prefix, held by every member
    version: int  # the version whose forward pass wrote the prefix's K/V
    members: dict = dataclasses.field(default_factory=dict)  # sample -> its partial page


def shares(sample) -> bool:
    """Whether `sample` (a queued `jax_scheduler.Sample`) starts on its group's shared prefix:
    one of n > 1 samples, not yet holding generated tokens."""
    return int(sample.request.params.n) > 1 and sample.n_generated == 0


class PromptShare:
    """The live prefixes of one engine and which sample holds which (module docstring)."""

    def __init__(self, pages: PageAllocator):
        self._pages = pages
        self._by_request: Dict[str, Prefix] = {}
        self._of: Dict[object, Prefix] = {}

    def __len__(self) -> int:
        return len(self._by_request)

    def prefix_of(self, sample) -> Optional[Prefix]:
        return self._of.get(sample)

    def live(self, request_id: str) -> Optional[Prefix]:
        """The live prefix of request `request_id`, if any."""
        return self._by_request.get(request_id)

    def rejoin(self, sample, row: int) -> Prefix:
        """Makes batch row `row`, which holds nothing, hold the full pages of `sample`'s live
        group prefix again (a preempted sample readmitted; it prefills the rest itself) and
        counts it a member; `settle` records its partial page once it holds one."""
        prefix = self._by_request[sample.request.request_id]
        self._pages.share(row, prefix.full)
        prefix.members[sample] = None
        self._of[sample] = prefix
        return prefix

    def settle(self, sample, pages) -> None:
        """After `rejoin` and its growth to `pages`: the member's partial prefix page (its
        own, holding the prompt's positions there once its prefill ran) becomes a copy
        source for later siblings."""
        prefix = self._of.get(sample)
        if prefix is not None and prefix.members.get(sample) is None \
                and prefix.tokens % self._pages.page_size:
            prefix.members[sample] = pages[len(prefix.full)]

    def need(self, sample, tokens: int) -> int:
        """Free pages admitting `sample` with pages for its first `tokens` positions takes:
        all of them for a new prefix, all but the shared full pages onto a live one."""
        total = min(pages_for(tokens, self._pages.page_size), self._pages.max_pages)
        live = self._by_request.get(sample.request.request_id)
        return total - (len(live.full) if live is not None else 0)

    def admit(self, sample, row: int, version: int) -> Tuple[Prefix, bool, Optional[tuple]]:
        """Makes batch row `row` hold `sample`'s prefix pages (the caller checked `need`).
        Returns (its prefix, whether it was created now — then the caller prefills the
        prefix through `row`'s table, (source page, destination page) of the copy of the
        partial page to make, or None)."""
        c = self._pages.page_size
        pre = len(sample.prompt) - 1
        n_full, partial = pre // c, pre % c != 0
        rid = sample.request.request_id
        prefix = self._by_request.get(rid)
        copy = None
        if prefix is None:
            if not self._pages.grow(row, pre):
                raise RuntimeError("admit: too few free pages (need() was not checked)")
            prefix = Prefix(rid, pre, self._pages.pages(row)[:n_full], version)
            self._by_request[rid] = prefix
            created = True
        else:
            self._pages.share(row, prefix.full)
            if not self._pages.grow(row, pre):
                raise RuntimeError("admit: too few free pages (need() was not checked)")
            if partial:  # any member's partial page holds the prompt's part of it
                source = next(p for p in prefix.members.values() if p is not None)
                copy = (source, self._pages.pages(row)[n_full])
            created = False
        prefix.members[sample] = self._pages.pages(row)[n_full] if partial else None
        self._of[sample] = prefix
        return prefix, created, copy

    def release(self, sample) -> None:
        """`sample` no longer holds its prefix (its row's pages were released); the prefix
        ends with its last member."""
        prefix = self._of.pop(sample, None)
        if prefix is None:
            return
        del prefix.members[sample]
        if not prefix.members:
            del self._by_request[prefix.request_id]

    def restamp(self, version: int) -> None:
        """Every live prefix was rewritten by `version` (a 'recompute' re-prefill)."""
        for prefix in self._by_request.values():
            prefix.version = version
