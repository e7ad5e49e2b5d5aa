"""Prefix reuse across requests in the paged `JaxEngine` (`engine.prefix_cache`): the full KV
pages of finished samples are kept, keyed by the token ids they hold, so a later request
whose prompt starts with those tokens (the next turn of a multi-turn episode: its prompt is
the previous prompt + completion + the environment's tokens) maps them instead of
prefilling them again, and prefills only the rest over them (the engine's `extend` program).

Structure. A trie with one page per edge, as SGLang's radix cache but page-granular: a node
is one pool page holding positions `[i*C, (i+1)*C)` of some sequence, keyed by (its parent
node, the `C` token ids of that page). Its K/V depend on every token before it, which the
path from the root spells out, so a lookup that walks the new prompt page by page from the
root finds exactly the pages whose K/V that prompt would write. Only full pages written by
a sample are kept (its positions below the pending one); a new request maps at most
`(L - 1) // C` pages of its `L`-token prompt, so at least its last token is prefilled (its
logits give the first sampled token) and no shared page is ever written.

Lifetime. The cache holds one reference on each of its pages (`PageAllocator.retain`), so a
page it maps into a running sample stays while either holds it. Pages only the cache holds
are evicted least recently used first (leaves first: a node's children are useless without
it) whenever the allocator is short (`PageAllocator.reclaimer`), i.e. before any running
sample is preempted and before admission refuses a sample: admission counts them as free
(`PageAllocator.available`), so retention never shrinks the batch the pool admits. A page
held by a running sample is never evictable (a row holds a path from the root, so a node's
ancestors are held whenever it is).

Provenance. A node records `version`, the oldest weight version among the K/V writes of
its path (its sample's `kv_version`: writes only get newer along a sequence, every rewrite
— a 'recompute' re-prefill, a readmission — rewrites the whole sequence, so the oldest write
is position 0's). A request admitted onto a path reports the minimum over the nodes it maps
as its `kv_version`. Under `kv_policy='recompute'` only pages written by the live version
may be reused, and a weight update `clear`s the cache; under 'keep' the pages stay valid
but stale: `match` skips those written more than `engine.prefix_cache_max_lag` versions
before the live one (default 0, so by default reuse never makes a `kv_version` older than
a fresh prefill's; docs/engine.md argues the cap), and the kv_version of whoever reuses
older ones says how stale. Skipped pages stay until LRU eviction takes them.

Host bookkeeping only; the scheduler calls it under its lock.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, List, Optional, Sequence

import numpy as np

from pipelinerl_jax.rollout.page_allocator import PageAllocator


@dataclasses.dataclass(eq=False)
class Node:
    """One retained page (module docstring)."""
    ident: int
    parent: Optional["Node"]
    tokens: tuple  # the page's token ids
    page: int
    version: int  # oldest K/V write version along the path (module docstring)


class PrefixCache:
    """Retained pages of finished samples, keyed by the tokens they hold (module docstring).
    Registers itself as `pages.reclaimer`. Per page, `used` (the LRU clock of the last
    lookup or insert that touched its node) and `children` live in arrays, so finding the
    least recently used evictable leaf is one vectorised pass over the pool."""

    def __init__(self, pages: PageAllocator):
        self._pages = pages
        self._nodes: Dict[tuple, Node] = {}  # (parent ident, page tokens) -> node
        self._by_page: Dict[int, Node] = {}
        self._ids = itertools.count(1)  # ident 0 is the root
        self._clock = itertools.count(1)
        self._used = np.zeros((pages.num_pages,), np.int64)
        self._children = np.zeros((pages.num_pages,), np.int32)
        self.evictions = 0
        pages.reclaimer = self

    def __len__(self) -> int:
        """Pages the cache holds."""
        return len(self._nodes)

    def _key(self, parent: Optional[Node], tokens: Sequence[int]) -> tuple:
        return (parent.ident if parent is not None else 0, tuple(int(t) for t in tokens))

    def match(self, tokens: Sequence[int], max_pages: int,
              min_version: Optional[int] = None) -> List[Node]:
        """The longest path of retained pages spelling out `tokens` page by page, at most
        `max_pages` long, stopping at a node older than `min_version` (when given); marks
        the nodes used."""
        c = self._pages.page_size
        out, parent, now = [], None, next(self._clock)
        for i in range(min(max_pages, len(tokens) // c)):
            node = self._nodes.get(self._key(parent, tokens[i * c:(i + 1) * c]))
            if node is None or (min_version is not None and node.version < min_version):
                break
            self._used[node.page] = now
            out.append(node)
            parent = node
        return out

    def insert(self, tokens: Sequence[int], pages: Sequence[int], version: int) -> int:
        """Retains `pages`, which hold the K/V of `tokens[:len(pages) * C]` in order (a
        finished sample's full pages), written no earlier than `version`. Pages whose path
        is already retained are only marked used; the walk stops where a different page
        holds the same tokens (its descendants' K/V were not computed over it). Returns the
        pages newly retained."""
        c = self._pages.page_size
        parent, now, added = None, next(self._clock), 0
        for i, page in enumerate(pages):
            key = self._key(parent, tokens[i * c:(i + 1) * c])
            node = self._nodes.get(key)
            if node is None:
                if int(page) in self._by_page:  # (cannot happen: a page has one path)
                    break
                node = Node(next(self._ids), parent, key[1], int(page), int(version))
                self._pages.retain(node.page)
                self._nodes[key] = node
                self._by_page[node.page] = node
                if parent is not None:
                    self._children[parent.page] += 1
                added += 1
            elif node.page != int(page):
                break
            self._used[node.page] = now
            parent = node
        return added

    def evictable(self) -> int:
        """Pages only the cache holds (what `evict` can free)."""
        refs, kept = self._pages.refs, self._pages.retained
        return int(((kept > 0) & (refs == kept)).sum())

    def evict(self, n: int) -> int:
        """Frees up to `n` pages only the cache holds, least recently used leaves first;
        returns how many were freed."""
        refs, kept = self._pages.refs, self._pages.retained
        never = np.iinfo(np.int64).max
        freed = 0
        while freed < n:
            leaf = (kept > 0) & (refs == kept) & (self._children == 0)
            if not leaf.any():
                break
            self._drop(self._by_page[int(np.argmin(np.where(leaf, self._used, never)))])
            freed += 1
        self.evictions += freed
        return freed

    def clear(self) -> None:
        """Drops every retained page (pages running samples hold stay theirs)."""
        for node in list(self._nodes.values()):
            self._pages.unretain(node.page)
        self._nodes.clear()
        self._by_page.clear()
        self._children[:] = 0

    def _drop(self, node: Node) -> None:
        del self._nodes[(node.parent.ident if node.parent is not None else 0, node.tokens)]
        del self._by_page[node.page]
        if node.parent is not None:
            self._children[node.parent.page] -= 1
        self._pages.unretain(node.page)


def full_pages_written(n_written: int, page_size: int, held: int) -> int:
    """Full pages among a sample's first `n_written` positions that it holds."""
    return min(int(n_written) // page_size, held)


def min_version(nodes: Sequence[Node]) -> int:
    return int(np.min([n.version for n in nodes]))
