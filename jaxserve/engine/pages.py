"""The page pool: reference-counted KV pages with a prefix cache. Host side: no jax here."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def page_hashes(token_ids: Sequence[int], page_size: int, count: int, known: Sequence[int] = ()) -> list[int]:
    """Hash chain of the first `count` full pages: each hash covers the whole prefix up to its page. `known`:
    the chain's first hashes, already computed over the same tokens (only the pages after them are hashed)."""
    hashes = list(known[:count])
    h = hashes[-1] if hashes else 0
    for i in range(len(hashes), count):
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

    With `shards` > 1 the pool is split into that many blocks of consecutive page ids, one per
    device of the sequence axis, and a request's i-th page comes from block i % shards: every row's
    pages are striped over the devices, which attend to their own stripe (jaxserve.parallel).
    A cached prefix page keeps its index, so sharing keeps the stripes.
    """

    def __init__(self, num_pages: int, page_size: int, shards: int = 1) -> None:
        assert num_pages % shards == 0, (num_pages, shards)
        self.num_pages = num_pages
        self.page_size = page_size
        self.shards = shards
        self.refs = [0] * num_pages
        per_shard = num_pages // shards
        self._free = [list(range((s + 1) * per_shard - 1, s * per_shard - 1, -1)) for s in range(shards)]
        self._evictable: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(shards)]
        self._page_of: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}

    def _shard(self, page: int) -> int:
        return page * self.shards // self.num_pages

    @property
    def num_available(self) -> int:
        """Pages that `allocate` can hand out: free ones plus cached ones nobody uses."""
        return sum(len(f) for f in self._free) + sum(len(e) for e in self._evictable)

    def allocate(self, index: int = 0) -> int | None:
        """A page for a request's `index`-th page (which picks the shard), or None if that shard is full."""
        free, evictable = self._free[index % self.shards], self._evictable[index % self.shards]
        if free:
            page = free.pop()
        elif evictable:
            page, _ = evictable.popitem(last=False)
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
                self._evictable[self._shard(page)][page] = None
            else:
                self._free[self._shard(page)].append(page)

    def lookup(self, page_hash: int) -> int | None:
        """Takes a reference to the cached page with this prefix hash, if there is one."""
        page = self._page_of.get(page_hash)
        if page is None:
            return None
        if self.refs[page] == 0:
            del self._evictable[self._shard(page)][page]
        self.refs[page] += 1
        return page

    def cached_prefix(self, page_hashes: Sequence[int]) -> int:
        """How many of these prefix hashes, from the first, have a cached page (nothing is taken)."""
        return next((i for i, h in enumerate(page_hashes) if h not in self._page_of), len(page_hashes))

    def register(self, page: int, page_hash: int) -> None:
        """Makes a full page findable by `lookup`; a prefix already cached keeps its first page."""
        if page_hash not in self._page_of and page not in self._hash_of:
            self._page_of[page_hash] = page
            self._hash_of[page] = page_hash

    def check(self) -> None:
        """Asserts the pool's invariants (for tests)."""
        free_list = [p for f in self._free for p in f]
        free, evictable = set(free_list), {p for e in self._evictable for p in e}
        assert len(free) == len(free_list), "a page is free twice"
        assert not free & evictable
        assert all(self._shard(p) == s for s, f in enumerate(self._free) for p in f), "a page is free in another shard"
        for page in range(self.num_pages):
            assert self.refs[page] >= 0
            if self.refs[page] == 0:
                assert page in free or page in evictable, f"page {page} leaked"
            else:
                assert page not in free and page not in evictable
        assert evictable <= set(self._hash_of)
        assert all(self._page_of[h] == p for p, h in self._hash_of.items())
