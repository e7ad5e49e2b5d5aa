"""Host-side bookkeeping of the paged KV cache: which pool pages are free, which each sequence
holds, how many sequences hold each page, and the page-table rows the device programs read
(`models/paged_attention.py`).

Pages are reference counted: the `n` samples of one request hold their prompt's full pages
together (`share`), and a page goes back to the free list when its last holder releases it
(`release`), so freeing one sample never frees a page a sibling still reads. A holder need not
be a row: the prefix cache (`prefix_cache.py`) `retain`s the pages of finished samples it keeps,
and the allocator asks it (its `reclaimer`) to give back pages only it holds before a `grow`
fails, so retained pages never cost a running or an admitted sample a page (`available`
counts them as free).

Pure Python/NumPy, no device work, so the scheduler's admission and preemption decisions
are cheap and deterministic (the free list is a stack: a freed page is the next one handed
out, whatever the thread timing).
"""
from __future__ import annotations

from typing import Dict, Hashable, List, Sequence

import numpy as np


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` positions (0 for none)."""
    return -(-max(int(tokens), 0) // page_size)


class PageAllocator:
    """`num_pages` pages of `page_size` tokens; an owner (a batch row) holds a list of pages,
    its table row lists them in order and pads with `num_pages` (out of range: the device
    drops writes there and masks reads). A sequence never holds more than `max_pages`.
    `refs[p]` is how many rows hold page `p` (0: free)."""

    def __init__(self, num_pages: int, page_size: int, num_rows: int, max_pages: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, "
                             f"{page_size}")
        self.num_pages, self.page_size, self.max_pages = num_pages, page_size, max_pages
        self._free: List[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self._held: Dict[Hashable, List[int]] = {}
        self.refs = np.zeros((num_pages,), np.int32)
        self.retained = np.zeros((num_pages,), np.int32)  # holds that are not rows' (cache)
        self.tables = np.full((num_rows, max_pages), num_pages, np.int32)
        # `evictable() -> int` pages only it holds and `evict(n)` giving n of them back
        self.reclaimer = None

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def available(self) -> int:
        """Free pages plus the pages only the reclaimer holds (it gives them back on demand)."""
        return len(self._free) + (self.reclaimer.evictable() if self.reclaimer else 0)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def shared_pages(self) -> int:
        """Pages more than one row holds."""
        return int((self.refs > 1).sum())

    def held(self, row: int) -> int:
        return len(self._held.get(row, ()))

    def missing(self, row: int, tokens: int) -> int:
        """Pages `row` still needs to hold `tokens` positions."""
        return max(0, min(pages_for(tokens, self.page_size), self.max_pages) - self.held(row))

    def grow(self, row: int, tokens: int) -> bool:
        """Makes `row` hold pages for its first `tokens` positions (fresh pages, held by
        `row` alone); False (and nothing allocated) when too few pages are free."""
        need = self.missing(row, tokens)
        if need > len(self._free) and self.reclaimer is not None:
            self.reclaimer.evict(need - len(self._free))
        if need > len(self._free):
            return False
        pages = self._held.setdefault(row, [])
        for _ in range(need):
            page = self._free.pop()
            self.refs[page] = 1
            self.tables[row, len(pages)] = page
            pages.append(page)
        return True

    def share(self, row: int, pages: Sequence[int]) -> None:
        """Makes `row`, which holds nothing, hold `pages` (held by other rows already) as its
        first table entries; each page's count goes up by one."""
        if self.held(row):
            raise ValueError(f"row {row} already holds {self.held(row)} pages")
        pages = [int(p) for p in pages]
        if any(self.refs[p] < 1 for p in pages):
            raise ValueError(f"share: pages {pages} include a free page")
        if pages:
            self._held[row] = list(pages)
            self.tables[row, :len(pages)] = pages
            self.refs[pages] += 1

    def retain(self, page: int) -> None:
        """One more hold on `page` (held already) that is not a row's (the prefix cache)."""
        if self.refs[page] < 1:
            raise ValueError(f"retain: page {page} is free")
        self.refs[page] += 1
        self.retained[page] += 1

    def unretain(self, page: int) -> bool:
        """Drops one `retain` hold on `page`; True when that freed it."""
        if self.retained[page] < 1:
            raise ValueError(f"unretain: page {page} is not retained")
        self.retained[page] -= 1
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self._free.append(int(page))
            return True
        return False

    def pages(self, row: int) -> List[int]:
        """The pages `row` holds, in table order."""
        return list(self._held.get(row, ()))

    def swap(self, a: int, b: int) -> None:
        """Exchanges what rows `a` and `b` hold (a sample moved to another batch row)."""
        held_a, held_b = self._held.pop(a, None), self._held.pop(b, None)
        if held_a is not None:
            self._held[b] = held_a
        if held_b is not None:
            self._held[a] = held_b
        self.tables[[a, b]] = self.tables[[b, a]]

    def release(self, row: int) -> int:
        """Drops `row`'s hold on every page it holds; pages no other row holds go back to
        the free list. Returns how many were freed."""
        pages = self._held.pop(row, [])
        self.tables[row] = self.num_pages
        freed = []
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                freed.append(page)
        self._free.extend(reversed(freed))
        return len(freed)
