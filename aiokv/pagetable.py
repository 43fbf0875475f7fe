"""The page table: key -> page, per-page state, reference counts, LRU of evictable pages.

Pure synchronous bookkeeping owned by one event loop (no locks, no awaits except in
:meth:`PageTable.wait_committed`). Lifetime of a page::

    FREE --reserve--> RESERVED --commit--> READY --evict--> FREE
                          \\--abort--> FREE

A RESERVED page carries one reference, the reserver's. A page with references, or RESERVED, is
never evicted. Every :class:`PageHandle` is one reference; it is single-use (release twice, or use
after release, raises :class:`StaleHandleError`) and carries the page's generation, which changes
whenever the page is freed, so a handle can never reach recycled memory.
"""

from __future__ import annotations

import asyncio
import enum
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from aiokv.keys import PageKey


class PageState(enum.Enum):
    """State of one pool page."""

    FREE = "free"
    RESERVED = "reserved"
    READY = "ready"


class StaleHandleError(RuntimeError):
    """A page handle was used after release, or its page was recycled."""


class PageHandle:
    """One reference on one page. Obtain from :meth:`PageTable.acquire` or a reservation."""

    __slots__ = ("_released", "generation", "key", "page")

    def __init__(self, page: int, generation: int, key: PageKey) -> None:
        self.page = page
        self.generation = generation
        self.key = key
        self._released = False

    @property
    def released(self) -> bool:
        """True once this reference was given back."""
        return self._released

    def __repr__(self) -> str:
        state = "released" if self._released else "live"
        return f"PageHandle(page={self.page}, gen={self.generation}, key={self.key.hex()[:12]}, {state})"


class ReserveOutcome(enum.Enum):
    """Result of reserving one key (see :meth:`PageTable.reserve`)."""

    RESERVED = "reserved"
    """A new page is RESERVED for the caller, who must commit or abort it."""
    PRESENT = "present"
    """The key is READY already: nothing to copy."""
    PENDING = "pending"
    """Another caller is writing the key; await :meth:`PageTable.wait_committed`."""
    EXHAUSTED = "exhausted"
    """No free page and nothing evictable: the pool is full of referenced/reserved pages."""


@dataclass(frozen=True)
class Reservation:
    """Outcome for one key; ``handle`` is set for RESERVED only."""

    key: PageKey
    outcome: ReserveOutcome
    handle: PageHandle | None = None


@dataclass(frozen=True)
class PageTableStatistics:
    """Counts of pages by state, plus lifetime counters."""

    capacity: int
    usable: int
    free: int
    reserved: int
    ready: int
    referenced: int
    evictable: int
    evictions: int
    exhausted: int
    commits: int
    aborts: int


class _Page:
    __slots__ = ("generation", "key", "refs", "state", "waiter")

    def __init__(self) -> None:
        self.state = PageState.FREE
        self.key: PageKey | None = None
        self.refs = 0
        self.generation = 0
        self.waiter: asyncio.Future[bool] | None = None


class PageTable:
    """Bookkeeping for ``capacity`` pages; pages become usable through :meth:`add_usable`."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._pages = [_Page() for _ in range(capacity)]
        self._free: list[int] = []
        self._usable = 0
        self._index: dict[PageKey, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # READY, refs == 0; oldest first
        self._evictions = 0
        self._exhausted = 0
        self._commits = 0
        self._aborts = 0
        self._reclaimable: asyncio.Future[None] | None = None  # woken when a page may be taken
        self.on_evict: Callable[[PageKey], None] | None = None
        """Called with each evicted key (the cache uses it for statistics and disk admission)."""

    # -- capacity -------------------------------------------------------------------------------

    def add_usable(self, pages: Iterable[int]) -> None:
        """Hand pages (of a prepared chunk) to the allocator."""
        for page in pages:
            if not 0 <= page < self.capacity:
                raise ValueError(f"page {page} out of range")
            self._free.append(page)
            self._usable += 1
        # Low page ids first: they are the first chunks prepared.
        self._free.sort(reverse=True)
        self._wake_reclaimable()

    # -- lookups (plain functions: they cannot block) ------------------------------------------

    def state_of(self, key: PageKey) -> PageState:
        """FREE when the key is unknown, else the state of its page."""
        page = self._index.get(key)
        return PageState.FREE if page is None else self._pages[page].state

    def contains(self, key: PageKey) -> bool:
        """True when ``key`` is READY."""
        return self.state_of(key) is PageState.READY

    def acquire(self, key: PageKey) -> PageHandle | None:
        """A reference on the READY page of ``key`` (refreshing its LRU position), or None."""
        page = self._index.get(key)
        if page is None:
            return None
        entry = self._pages[page]
        if entry.state is not PageState.READY:
            return None
        entry.refs += 1
        self._lru.pop(page, None)
        return PageHandle(page, entry.generation, key)

    def touch(self, key: PageKey) -> bool:
        """Mark the READY page of ``key`` most recently used; False when it is not READY."""
        page = self._index.get(key)
        if page is None or self._pages[page].state is not PageState.READY:
            return False
        if page in self._lru:
            self._lru.move_to_end(page)
        return True

    def acquire_prefix(self, keys: Sequence[PageKey]) -> list[PageHandle]:
        """References on the longest prefix of ``keys`` that is READY."""
        handles: list[PageHandle] = []
        for key in keys:
            handle = self.acquire(key)
            if handle is None:
                break
            handles.append(handle)
        return handles

    def check(self, handle: PageHandle) -> int:
        """The page id of a live handle; raises :class:`StaleHandleError` otherwise."""
        if handle.released:
            raise StaleHandleError(f"{handle!r} was already released")
        entry = self._pages[handle.page]
        if entry.generation != handle.generation or entry.key != handle.key:
            raise StaleHandleError(f"{handle!r} refers to a recycled page")
        return handle.page

    def release(self, handle: PageHandle) -> None:
        """Give back one reference. A RESERVED page's reserver must commit or abort instead."""
        page = self.check(handle)
        entry = self._pages[page]
        if entry.state is PageState.RESERVED:
            raise StaleHandleError(f"{handle!r} is a reservation: commit or abort it")
        handle._released = True
        entry.refs -= 1
        if entry.refs == 0:
            self._lru[page] = None
            self._wake_reclaimable()

    def retain(self, handle: PageHandle) -> PageHandle:
        """A second, independent reference on the page of a live handle."""
        page = self.check(handle)
        entry = self._pages[page]
        if entry.state is not PageState.READY:
            raise StaleHandleError(f"{handle!r} is a reservation: commit it before sharing it")
        entry.refs += 1
        self._lru.pop(page, None)
        return PageHandle(page, entry.generation, handle.key)

    # -- two-phase writes ---------------------------------------------------------------------

    def reserve(self, keys: Sequence[PageKey]) -> list[Reservation]:
        """Reserve a page for each key not already READY or RESERVED, evicting LRU pages as needed.

        Returns one :class:`Reservation` per key, in order. Once one key is EXHAUSTED, every later
        key that would need a new page is EXHAUSTED too (a prefix stays a prefix). READY pages of
        ``keys`` become the most recently used, and are never evicted to make room for the later
        keys of the same call (that would drop a prefix to store its continuation).
        """
        out: list[Reservation] = []
        exhausted = False
        present: list[int] = []  # READY, unreferenced pages of this call: out of the LRU meanwhile
        for key in keys:
            page = self._index.get(key)
            if page is not None:
                state = self._pages[page].state
                outcome = ReserveOutcome.PRESENT if state is PageState.READY else ReserveOutcome.PENDING
                if page in self._lru:
                    del self._lru[page]
                    present.append(page)
                out.append(Reservation(key, outcome))
                continue
            if exhausted or (page := self._allocate()) is None:
                exhausted = True
                self._exhausted += 1
                out.append(Reservation(key, ReserveOutcome.EXHAUSTED))
                continue
            entry = self._pages[page]
            entry.state = PageState.RESERVED
            entry.key = key
            entry.refs = 1
            self._index[key] = page
            out.append(Reservation(key, ReserveOutcome.RESERVED, PageHandle(page, entry.generation, key)))
        # Back as most recently used, the call's first page last: a later eviction takes the
        # deepest page of the prefix first, which keeps the rest of the prefix matchable.
        for page in reversed(present):
            self._lru[page] = None
        return out

    def commit(self, handle: PageHandle, *, keep: bool = False) -> PageHandle | None:
        """RESERVED -> READY; wakes waiters with True. With ``keep`` returns a reference to hold."""
        entry = self._reserved_entry(handle)
        handle._released = True
        entry.state = PageState.READY
        self._commits += 1
        self._wake(entry, True)
        if keep:
            return PageHandle(handle.page, entry.generation, handle.key)
        entry.refs -= 1
        if entry.refs == 0:
            self._lru[handle.page] = None
            self._wake_reclaimable()
        return None

    def abort(self, handle: PageHandle) -> None:
        """RESERVED -> FREE; wakes waiters with False (the key is missing)."""
        entry = self._reserved_entry(handle)
        handle._released = True
        self._aborts += 1
        self._free_page(handle.page)
        self._free.append(handle.page)
        self._wake(entry, False)
        self._wake_reclaimable()

    async def wait_reclaimable(self) -> None:
        """Wait until a page may have become free or evictable (a reference dropped, a reservation
        aborted, a chunk became usable). Another caller may take it first: reserve again and see.
        Cancelling the waiter never disturbs other waiters."""
        if self._reclaimable is None or self._reclaimable.done():
            self._reclaimable = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._reclaimable)

    def _wake_reclaimable(self) -> None:
        waiter, self._reclaimable = self._reclaimable, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait_committed(self, key: PageKey) -> bool:
        """Wait until the RESERVED page of ``key`` is committed (True) or aborted (False).

        Returns at once with whether it is READY when it is not RESERVED. Cancelling the waiter
        never disturbs other waiters or the page.
        """
        page = self._index.get(key)
        if page is None:
            return False
        entry = self._pages[page]
        if entry.state is not PageState.RESERVED:
            return entry.state is PageState.READY
        if entry.waiter is None:
            entry.waiter = asyncio.get_running_loop().create_future()
        return await asyncio.shield(entry.waiter)

    def _reserved_entry(self, handle: PageHandle) -> _Page:
        page = self.check(handle)
        entry = self._pages[page]
        if entry.state is not PageState.RESERVED:
            raise StaleHandleError(f"{handle!r} is not a reservation")
        return entry

    @staticmethod
    def _wake(entry: _Page, value: bool) -> None:
        waiter, entry.waiter = entry.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(value)

    # -- eviction -------------------------------------------------------------------------------

    def evict(self, count: int) -> list[PageKey]:
        """Evict up to ``count`` least recently used unreferenced READY pages; returns their keys."""
        keys: list[PageKey] = []
        while len(keys) < count and self._lru:
            page, _ = self._lru.popitem(last=False)
            key = self._pages[page].key
            assert key is not None
            keys.append(key)
            self._free_page(page)
            self._free.append(page)
            self._evictions += 1
            if self.on_evict is not None:
                self.on_evict(key)
        return keys

    def discard(self, key: PageKey) -> bool:
        """Drop an unreferenced READY page (e.g. its content was found bad); False if it could not be."""
        page = self._index.get(key)
        if page is None or page not in self._lru:
            return False
        del self._lru[page]
        self._free_page(page)
        self._free.append(page)
        return True

    def _allocate(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self.evict(1):
            return self._free.pop()
        return None

    def _free_page(self, page: int) -> None:
        entry = self._pages[page]
        if entry.key is not None:
            self._index.pop(entry.key, None)
        entry.state = PageState.FREE
        entry.key = None
        entry.refs = 0
        entry.generation += 1

    # -- introspection --------------------------------------------------------------------------

    def statistics(self) -> PageTableStatistics:
        """Counts by state and lifetime counters."""
        reserved = ready = referenced = 0
        for entry in self._pages:
            if entry.state is PageState.RESERVED:
                reserved += 1
            elif entry.state is PageState.READY:
                ready += 1
                referenced += entry.refs > 0
        return PageTableStatistics(
            capacity=self.capacity,
            usable=self._usable,
            free=len(self._free),
            reserved=reserved,
            ready=ready,
            referenced=referenced,
            evictable=len(self._lru),
            evictions=self._evictions,
            exhausted=self._exhausted,
            commits=self._commits,
            aborts=self._aborts,
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant (used by tests)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        for page, entry in enumerate(self._pages):
            if entry.state is PageState.FREE:
                assert entry.key is None and entry.refs == 0, f"free page {page} has a key or refs"
                assert page not in self._lru, f"free page {page} in LRU"
            else:
                assert page not in free, f"{entry.state} page {page} on the free list"
                assert entry.key is not None and self._index.get(entry.key) == page, f"index broken at {page}"
                assert entry.refs >= 0, f"negative refs on page {page}"
                if entry.state is PageState.RESERVED:
                    assert entry.refs >= 1, f"reserved page {page} without the reserver's ref"
                    assert page not in self._lru, f"reserved page {page} in LRU"
                else:
                    assert (entry.refs == 0) == (page in self._lru), f"LRU membership wrong at {page}"
        assert len(self._index) == sum(e.state is not PageState.FREE for e in self._pages), "stale index"
        assert len(free) + len(self._index) == self._usable, "pages lost or invented"
