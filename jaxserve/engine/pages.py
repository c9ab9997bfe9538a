"""The page pool: reference-counted KV pages with a prefix cache. Host side: no jax here."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def page_hashes(token_ids: Sequence[int], page_size: int, count: int) -> list[int]:
    """Hash chain of the first `count` full pages: each hash covers the whole prefix up to its page."""
    hashes, h = [], 0
    for i in range(count):
        h = hash((h, tuple(token_ids[i * page_size:(i + 1) * page_size])))
        hashes.append(h)
    return hashes


class PageAllocator:
    """`num_pages` pages of `page_size` tokens, shared by reference count.

    A full page can be registered under the hash of its token prefix; later requests with the same
    prefix take a reference instead of recomputing it. A registered page whose last user lets go
    stays cached (evictable, least recently used first) until its memory is needed.

    Only full pages are ever registered, and a request writes only at or after its computed
    length, so a shared page is never written: sharing needs no copy-on-write.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._page_of: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}

    @property
    def num_available(self) -> int:
        """Pages that `allocate` can hand out: free ones plus cached ones nobody uses."""
        return len(self._free) + len(self._evictable)

    def allocate(self) -> int | None:
        if self._free:
            page = self._free.pop()
        elif self._evictable:
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._hash_of.pop(page)]
        else:
            return None
        self.refs[page] = 1
        return page

    def release(self, page: int) -> None:
        assert self.refs[page] > 0, f"page {page} released with no reference"
        self.refs[page] -= 1
        if self.refs[page] == 0:
            if page in self._hash_of:
                self._evictable[page] = None
            else:
                self._free.append(page)

    def lookup(self, page_hash: int) -> int | None:
        """Takes a reference to the cached page with this prefix hash, if there is one."""
        page = self._page_of.get(page_hash)
        if page is None:
            return None
        if self.refs[page] == 0:
            del self._evictable[page]
        self.refs[page] += 1
        return page

    def register(self, page: int, page_hash: int) -> None:
        """Makes a full page findable by `lookup`; a prefix already cached keeps its first page."""
        if page_hash not in self._page_of and page not in self._hash_of:
            self._page_of[page_hash] = page
            self._hash_of[page] = page_hash

    def check(self) -> None:
        """Asserts the pool's invariants (for tests)."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a page is free twice"
        assert not free & evictable
        for page in range(self.num_pages):
            assert self.refs[page] >= 0
            if self.refs[page] == 0:
                assert page in free or page in evictable, f"page {page} leaked"
            else:
                assert page not in free and page not in evictable
        assert evictable <= set(self._hash_of)
        assert all(self._page_of[h] == p for p, h in self._hash_of.items())
