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
import bisect
import enum
import operator
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from aiokv.keys import PageKey


class PageState(enum.Enum):
    """State of one pool page."""

    FREE = "free"
    RESERVED = "reserved"
    READY = "ready"


# Codes of the per-page state column (a bytearray); _STATES maps a code back to the enum.
_FREE, _RESERVED, _READY = 0, 1, 2
_STATES = (PageState.FREE, PageState.RESERVED, PageState.READY)


class StaleHandleError(ValueError, RuntimeError):
    """A page handle (or a :class:`~aiokv.results.Match`) was used after release, or its page was
    recycled: a caller mistake, so a ``ValueError`` as every other; also a ``RuntimeError``, as it
    was first, so that ``except RuntimeError`` keeps working."""


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


class Reservation(NamedTuple):
    """Outcome for one key; ``handle`` is set for RESERVED only.

    Immutable, with named fields. A named tuple rather than a frozen dataclass: ``reserve`` makes one
    per page of every offload, and a frozen dataclass's ``__init__`` cost 0.7 µs each (its
    ``object.__setattr__`` per field), a third of the whole per-page bookkeeping.
    """

    key: PageKey
    outcome: ReserveOutcome
    handle: PageHandle | None = None


_SHARDS = 256
"""Dicts the key index (and the page -> key map) are split into. A dict rebuilds its whole hash
table once its free slots run out, and under churn (a page freed for each one stored) that is every
few hundred thousand inserts: 262K keys in one dict took 5-35 ms each time, a loop stall. A 256th
of it is a rebuild of ~1K keys (~4K for a 1M-page pool). Keys are digests: their first byte, which
picks the dict, is uniform."""
_MASK = _SHARDS - 1

_new_reservation = tuple.__new__  # Reservation without its Python-level __new__ (the hot loop's own)
_RESERVED_OUTCOME, _PRESENT_OUTCOME = ReserveOutcome.RESERVED, ReserveOutcome.PRESENT
_PENDING_OUTCOME, _EXHAUSTED_OUTCOME = ReserveOutcome.PENDING, ReserveOutcome.EXHAUSTED


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


class PageTable:
    """Bookkeeping for ``capacity`` pages; pages become usable through :meth:`add_usable`.

    Per-page state lives in flat columns indexed by page id (memoryviews of zeroed numpy arrays for
    states, reference counts, generations and the LRU's links; the keys of pages in use in dicts
    split by key), not in one Python object per page: building a table allocates a few zeroed
    regions whatever its size (nothing is written until a page is used), and a large table adds
    nothing for the cyclic GC to walk. (One object per page made a 262,144-page table trigger GC
    passes that stalled the event loop ~100 ms.) Scalar access to a memoryview costs about what an
    attribute of a slotted object did; counts over all pages use numpy views. No structure is ever
    rebuilt whole on the hot path: the LRU is a linked list through two columns, and the dicts are
    small (see ``_SHARDS``). Keys are ``bytes`` (16-byte page digests).
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        # Columns over calloc'd numpy memory: allocating them touches nothing (the kernel hands out
        # zero pages on first use), where bytearray/array('q') * n/[None] * n filled every byte
        # holding the GIL: 4-8 ms for 262,144 pages in a fresh process, a loop stall although the
        # table is built in a worker thread. Memoryviews give scalar access as fast as array's.
        self._state: memoryview = np.zeros(capacity, np.uint8).data  # _FREE/_RESERVED/_READY
        self._refs: memoryview = np.zeros(capacity, np.int64).data
        self._generation: memoryview = np.zeros(capacity, np.int64).data
        self._usable_mask = np.zeros(capacity, np.uint8)  # 1 once add_usable handed the page over
        self._waiters: dict[int, asyncio.Future[bool]] = {}  # RESERVED pages someone awaits
        # Free pages: a stack of pages freed after use (taken first, last freed first), then pages
        # never used, as runs [start, stop) of consecutive ids (one per chunk, so adding a chunk
        # costs nothing that grows with the table), highest first so the lowest is taken first: the
        # first chunks prepared, which are also the first registered for CUDA and io_uring.
        self._recycled: array[int] = array("q")
        self._fresh_starts: array[int] = array("q")
        self._fresh_stops: array[int] = array("q")
        self._fresh = 0
        self._usable = 0
        # key -> page and page -> key of every page not FREE, by key[0] and by page & _MASK.
        self._index: list[dict[PageKey, int]] = [{} for _ in range(_SHARDS)]
        self._keys: list[dict[int, PageKey]] = [{} for _ in range(_SHARDS)]
        # The LRU: READY pages with refs == 0, exactly, oldest first. A doubly linked list through
        # the columns _prev/_next, node `capacity` its sentinel (an OrderedDict's hash table was
        # rebuilt under churn like any dict's, 5-35 ms at 262K pages). Membership is the state and
        # the reference count, so a page off the list keeps stale links nobody reads.
        self._head = capacity
        self._prev: memoryview = np.zeros(capacity + 1, np.int64).data
        self._next: memoryview = np.zeros(capacity + 1, np.int64).data
        self._prev[capacity] = self._next[capacity] = capacity
        self._evictions = 0
        self._exhausted = 0
        self._commits = 0
        self._aborts = 0
        self._reclaimable: asyncio.Future[None] | None = None  # woken when a page may be taken
        self.on_evict: Callable[[PageKey], None] | None = None
        """Called with each evicted key (the cache uses it for statistics and disk admission)."""

    # -- capacity -------------------------------------------------------------------------------

    def add_usable(self, pages: Iterable[int]) -> None:
        """Hand pages (of a prepared chunk) to the allocator.

        Raises ``ValueError``, changing nothing, when a page is out of range or already usable.
        Vectorised: a chunk of thousands of small pages costs the loop well under a millisecond.
        """
        if isinstance(pages, range):
            new = np.arange(pages.start, pages.stop, pages.step, dtype=np.int64)
        else:
            new = np.fromiter(pages, dtype=np.int64)
        if new.size == 0:
            return
        new.sort()
        if new[0] < 0 or new[-1] >= self.capacity:
            bad = new[0] if new[0] < 0 else new[-1]
            raise ValueError(f"page {bad} out of range [0, {self.capacity})")
        usable = self._usable_mask
        if usable[new].any() or (new[1:] == new[:-1]).any():
            raise ValueError("a page was handed over twice")
        usable[new] = 1
        # Runs of consecutive ids (a chunk is one). Pages are never handed over twice, so runs are
        # disjoint and none can straddle another: ordering them by start orders every page.
        cuts = np.flatnonzero(np.diff(new) != 1) + 1
        starts = new[np.concatenate(([0], cuts))].tolist()
        stops = (new[np.concatenate((cuts - 1, [new.size - 1]))] + 1).tolist()
        for start, stop in zip(starts, stops, strict=True):
            at = bisect.bisect_left(self._fresh_starts, -start, key=operator.neg)
            self._fresh_starts.insert(at, start)
            self._fresh_stops.insert(at, stop)
        self._fresh += int(new.size)
        self._usable += int(new.size)
        self._wake_reclaimable()

    # -- lookups (plain functions: they cannot block) ------------------------------------------

    def state_of(self, key: PageKey) -> PageState:
        """FREE when the key is unknown, else the state of its page."""
        page = self._index[key[0]].get(key)
        return PageState.FREE if page is None else _STATES[self._state[page]]

    def contains(self, key: PageKey) -> bool:
        """True when ``key`` is READY."""
        page = self._index[key[0]].get(key)
        return page is not None and self._state[page] == _READY

    def acquire(self, key: PageKey) -> PageHandle | None:
        """A reference on the READY page of ``key`` (refreshing its LRU position), or None."""
        page = self._index[key[0]].get(key)
        if page is None or self._state[page] != _READY:
            return None
        refs = self._refs[page]
        if refs == 0:  # off the LRU (unlinked inline: once per page of every match)
            prev, nxt = self._prev, self._next
            before, after = prev[page], nxt[page]  # LRU unlink (inlined _unlink)
            nxt[before] = after
            prev[after] = before
        self._refs[page] = refs + 1
        return PageHandle(page, self._generation[page], key)

    def touch(self, key: PageKey) -> bool:
        """Mark the READY page of ``key`` most recently used; False when it is not READY."""
        page = self._index[key[0]].get(key)
        if page is None or self._state[page] != _READY:
            return False
        if self._refs[page] == 0:
            self._unlink(page)
            self._link_last(page)
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
        if handle._released:
            raise StaleHandleError(f"{handle!r} was already released")
        page = handle.page
        key = handle.key
        if self._generation[page] != handle.generation or self._index[key[0]].get(key) != page:
            raise StaleHandleError(f"{handle!r} refers to a recycled page")
        return page

    def pages_of(self, handles: Iterable[PageHandle]) -> list[int]:
        """:meth:`check` of each handle, in one call (a load launches 64 pages at once)."""
        generation, index = self._generation, self._index
        pages = []
        for handle in handles:
            if handle._released:
                raise StaleHandleError(f"{handle!r} was already released")
            page = handle.page
            key = handle.key
            if generation[page] != handle.generation or index[key[0]].get(key) != page:
                raise StaleHandleError(f"{handle!r} refers to a recycled page")
            pages.append(page)
        return pages

    def release(self, handle: PageHandle) -> None:
        """Give back one reference. A RESERVED page's reserver must commit or abort instead."""
        page = self.check(handle)
        if self._state[page] == _RESERVED:
            raise StaleHandleError(f"{handle!r} is a reservation: commit or abort it")
        handle._released = True
        refs = self._refs[page] - 1
        self._refs[page] = refs
        if refs == 0:  # onto the LRU, most recent (inline: once per page of every load)
            prev, nxt, head = self._prev, self._next, self._head
            last = prev[head]  # LRU link (inlined _link_last)
            nxt[last] = page
            prev[page] = last
            nxt[page] = head
            prev[head] = page
            if self._reclaimable is not None:
                self._wake_reclaimable()

    def release_all(self, handles: Iterable[PageHandle], *, skip_released: bool = False) -> None:
        """:meth:`release` of each handle in turn, the same checks and outcome (one that raises
        leaves the earlier ones released), in one call: a load gives back 64 pages at once, and
        the loop paid a call, a check and the reclaim wake-up per page. ``skip_released``: a
        handle released already (earlier in ``handles`` too) is passed over instead of raising."""
        state, refs, generation, index = self._state, self._refs, self._generation, self._index
        prev, nxt, head = self._prev, self._next, self._head
        onto_lru = False
        try:
            for handle in handles:
                if handle._released:
                    if skip_released:
                        continue
                    raise StaleHandleError(f"{handle!r} was already released")
                page = handle.page
                key = handle.key
                if generation[page] != handle.generation or index[key[0]].get(key) != page:
                    raise StaleHandleError(f"{handle!r} refers to a recycled page")
                if state[page] == _RESERVED:
                    raise StaleHandleError(f"{handle!r} is a reservation: commit or abort it")
                handle._released = True
                count = refs[page] - 1
                refs[page] = count
                if count == 0:  # onto the LRU, most recent (inlined _link_last)
                    last = prev[head]
                    nxt[last] = page
                    prev[page] = last
                    nxt[page] = head
                    prev[head] = page
                    onto_lru = True
        finally:
            if onto_lru and self._reclaimable is not None:
                self._wake_reclaimable()

    def retain(self, handle: PageHandle) -> PageHandle:
        """A second, independent reference on the page of a live handle."""
        page = self.check(handle)
        if self._state[page] != _READY:
            raise StaleHandleError(f"{handle!r} is a reservation: commit it before sharing it")
        self._refs[page] += 1  # a live reference: the page is off the LRU already
        return PageHandle(page, self._generation[page], handle.key)

    # -- two-phase writes ---------------------------------------------------------------------

    def reserve(self, keys: Sequence[PageKey]) -> list[Reservation]:
        """Reserve a page for each key not already READY or RESERVED, evicting LRU pages as needed.

        Returns one :class:`Reservation` per key, in order. Once one key is EXHAUSTED, every later
        key that would need a new page is EXHAUSTED too (a prefix stays a prefix). READY pages of
        ``keys`` become the most recently used, and are never evicted to make room for the later
        keys of the same call (that would drop a prefix to store its continuation). Raises
        ``TypeError``/``IndexError`` for a key that is not non-empty ``bytes``, with this call's
        reservations undone (its evictions stay done).
        """
        out: list[Reservation] = []
        exhausted = False
        # READY pages of this call: held by a reference meanwhile (off the LRU, as the caller's own
        # would be, also for an on_evict callback that looks), given back below.
        present: list[int] = []
        # Locals, and the allocation, eviction and list paths inlined: this loop runs once per page
        # of every offload, on the event loop (a 256-page batch is one synchronous step).
        index, page_keys, state, recycled = self._index, self._keys, self._state, self._recycled
        refs, generation, prev, nxt, head = self._refs, self._generation, self._prev, self._next, self._head
        fresh_starts, fresh_stops = self._fresh_starts, self._fresh_stops
        append, new, mask = out.append, _new_reservation, _MASK
        try:
            for key in keys:
                shard = index[key[0]]
                page = shard.get(key)
                if page is not None:
                    if state[page] == _READY:
                        count = refs[page]
                        if count == 0:
                            before, after = prev[page], nxt[page]  # LRU unlink (inlined _unlink)
                            nxt[before] = after
                            prev[after] = before
                        refs[page] = count + 1
                        present.append(page)
                        append(new(Reservation, (key, _PRESENT_OUTCOME, None)))
                    else:
                        append(new(Reservation, (key, _PENDING_OUTCOME, None)))
                    continue
                if exhausted:
                    self._exhausted += 1
                    append(new(Reservation, (key, _EXHAUSTED_OUTCOME, None)))
                    continue
                if recycled:
                    page = recycled.pop()
                elif fresh_starts:
                    page = fresh_starts[-1]
                    if page + 1 == fresh_stops[-1]:
                        fresh_starts.pop()
                        fresh_stops.pop()
                    else:
                        fresh_starts[-1] = page + 1
                    self._fresh -= 1
                elif (page := nxt[head]) != head and self.on_evict is None:
                    # Evict the least recently used page straight into this reservation (_free_page
                    # without the trip through the recycled stack; its page -> key entry is
                    # overwritten below).
                    after = nxt[page]  # LRU unlink the oldest (inlined _unlink)
                    nxt[head] = after
                    prev[after] = head
                    old = page_keys[page & mask][page]
                    del index[old[0]][old]
                    generation[page] += 1
                    self._evictions += 1
                elif page != head:
                    page = self._allocate()  # evicts through _evict_one, which calls on_evict
                    assert page is not None  # the LRU was not empty
                else:
                    exhausted = True
                    self._exhausted += 1
                    append(new(Reservation, (key, _EXHAUSTED_OUTCOME, None)))
                    continue
                state[page] = _RESERVED
                refs[page] = 1
                shard[key] = page
                page_keys[page & mask][page] = key
                append(new(Reservation, (key, _RESERVED_OUTCOME, PageHandle(page, generation[page], key))))
        except BaseException:
            # A bad key (not bytes, empty): undo this call's reservations (evictions stay done).
            for reservation in out:
                if reservation.handle is not None:
                    self.abort(reservation.handle)
            raise
        finally:
            # Back as most recently used, the call's first page last: a later eviction takes the
            # deepest page of the prefix first, which keeps the rest of the prefix matchable.
            for page in reversed(present) if present else ():
                count = refs[page] - 1
                refs[page] = count
                if count == 0:
                    last = prev[head]  # LRU link (inlined _link_last)
                    nxt[last] = page
                    prev[page] = last
                    nxt[page] = head
                    prev[head] = page
        return out

    def commit(self, handle: PageHandle, *, keep: bool = False) -> PageHandle | None:
        """RESERVED -> READY; wakes waiters with True. With ``keep`` returns a reference to hold."""
        # check() and _reserved_page() inlined: once per page of every offload.
        page = handle.page
        key = handle.key
        if (
            handle._released
            or self._generation[page] != handle.generation
            or self._index[key[0]].get(key) != page
            or self._state[page] != _RESERVED
        ):
            self._reserved_page(handle)  # raises the precise StaleHandleError
        handle._released = True
        self._state[page] = _READY
        self._commits += 1
        if self._waiters:
            self._wake(page, True)
        if keep:
            return PageHandle(page, self._generation[page], key)
        refs = self._refs[page] - 1
        self._refs[page] = refs
        if refs == 0:  # onto the LRU, most recent (linked inline: once per page of every offload)
            prev, nxt, head = self._prev, self._next, self._head
            last = prev[head]  # LRU link (inlined _link_last)
            nxt[last] = page
            prev[page] = last
            nxt[page] = head
            prev[head] = page
            if self._reclaimable is not None:
                self._wake_reclaimable()
        return None

    def abort(self, handle: PageHandle) -> None:
        """RESERVED -> FREE; wakes waiters with False (the key is missing)."""
        page = self._reserved_page(handle)
        handle._released = True
        self._aborts += 1
        self._free_page(page, handle.key)
        self._wake(page, False)
        self._wake_reclaimable()

    def wait_reclaimable(self) -> asyncio.Future[None]:
        """A future resolved once a page may have become free or evictable (a reference dropped, a
        reservation aborted, a chunk became usable). Another caller may take it first: reserve again
        and see. The wait is in place when this returns, not at the first await: a page given back
        between a caller's look for room and its await still wakes it (a coroutine registered it
        only at its task's first step, missed such a release and slept to the caller's bound).
        Cancelling the returned future never disturbs other waiters."""
        if self._reclaimable is None or self._reclaimable.done():
            self._reclaimable = asyncio.get_running_loop().create_future()
        return asyncio.shield(self._reclaimable)

    def _wake_reclaimable(self) -> None:
        waiter, self._reclaimable = self._reclaimable, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait_committed(self, key: PageKey) -> bool:
        """Wait until the RESERVED page of ``key`` is committed (True) or aborted (False).

        Returns at once with whether it is READY when it is not RESERVED. Cancelling the waiter
        never disturbs other waiters or the page.
        """
        page = self._index[key[0]].get(key)
        if page is None:
            return False
        state = self._state[page]
        if state != _RESERVED:
            return state == _READY
        waiter = self._waiters.get(page)
        if waiter is None:
            waiter = self._waiters[page] = asyncio.get_running_loop().create_future()
        return await asyncio.shield(waiter)

    def _reserved_page(self, handle: PageHandle) -> int:
        page = self.check(handle)
        if self._state[page] != _RESERVED:
            raise StaleHandleError(f"{handle!r} is not a reservation")
        return page

    def _wake(self, page: int, value: bool) -> None:
        waiter = self._waiters.pop(page, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(value)

    # -- eviction -------------------------------------------------------------------------------

    def has_room(self) -> bool:
        """Whether :meth:`reserve` of one new key would get a page now (a free one, or an
        unreferenced READY page to evict)."""
        return bool(self._recycled) or bool(self._fresh_starts) or self._next[self._head] != self._head

    def evict(self, count: int) -> list[PageKey]:
        """Evict up to ``count`` least recently used unreferenced READY pages; returns their keys."""
        keys: list[PageKey] = []
        while len(keys) < count and (key := self._evict_one()) is not None:
            keys.append(key)
        return keys

    def _evict_one(self) -> PageKey | None:
        """Free the least recently used evictable page (onto the recycled stack); its key, or None."""
        prev, nxt, head = self._prev, self._next, self._head
        page = nxt[head]
        if page == head:
            return None
        after = nxt[page]  # LRU unlink the oldest (inlined _unlink)
        nxt[head] = after
        prev[after] = head
        key = self._keys[page & _MASK][page]
        self._free_page(page, key)
        self._evictions += 1
        if self.on_evict is not None:
            self.on_evict(key)
        return key

    def discard(self, key: PageKey) -> bool:
        """Drop an unreferenced READY page (e.g. its content was found bad); False if it could not be."""
        page = self._index[key[0]].get(key)
        if page is None or self._state[page] != _READY or self._refs[page] != 0:
            return False
        self._unlink(page)
        self._free_page(page, key)
        return True

    def _unlink(self, page: int) -> None:
        """Take ``page`` off the LRU (it must be on it).

        This and :meth:`_link_last` are inlined where they run once per page (acquire, release,
        reserve, commit, _evict_one): the calls cost 4-15% per operation there (single inserts,
        lookups, evictions on a full 262K-page table, thread CPU time). Each copy's first line is
        marked ``# LRU``; test_pagetable_lru checks every copy's text and runs it against a model."""
        prev, nxt = self._prev, self._next
        before, after = prev[page], nxt[page]  # LRU unlink
        nxt[before] = after
        prev[after] = before

    def _link_last(self, page: int) -> None:
        """Put ``page`` on the LRU as its most recently used page (it must be off it)."""
        prev, nxt, head = self._prev, self._next, self._head
        last = prev[head]  # LRU link
        nxt[last] = page
        prev[page] = last
        nxt[page] = head
        prev[head] = page

    def _lru_pages(self) -> Iterator[int]:
        """The LRU's pages, oldest first (a walk over the list: for tests and introspection)."""
        nxt, head = self._next, self._head
        page = nxt[head]
        while page != head:
            yield page
            page = nxt[page]

    def _allocate(self) -> int | None:
        if self._recycled:
            return self._recycled.pop()
        starts = self._fresh_starts
        if starts:
            page = starts[-1]
            if page + 1 == self._fresh_stops[-1]:
                starts.pop()
                self._fresh_stops.pop()
            else:
                starts[-1] = page + 1
            self._fresh -= 1
            return page
        if self._evict_one() is not None:
            return self._recycled.pop()
        return None

    def _free_page(self, page: int, key: PageKey) -> None:
        """Page ``page``, which holds ``key``, becomes FREE (on the recycled stack)."""
        del self._index[key[0]][key]
        del self._keys[page & _MASK][page]
        self._state[page] = _FREE
        self._refs[page] = 0
        self._generation[page] += 1
        self._recycled.append(page)

    # -- introspection --------------------------------------------------------------------------

    def statistics(self) -> PageTableStatistics:
        """Counts by state and lifetime counters (vectorised: ~0.2 ms for 262K pages, where a loop
        over per-page objects took ~200 ms)."""
        state = np.frombuffer(self._state, dtype=np.uint8)
        ready = state == _READY
        referenced = np.count_nonzero(ready & (np.frombuffer(self._refs, dtype=np.int64) > 0))
        ready_count = int(np.count_nonzero(ready))
        return PageTableStatistics(
            capacity=self.capacity,
            usable=self._usable,
            free=len(self._recycled) + self._fresh,
            reserved=int(np.count_nonzero(state == _RESERVED)),
            ready=ready_count,
            referenced=int(referenced),
            evictable=ready_count - int(referenced),  # the LRU's pages, exactly (an invariant)
            evictions=self._evictions,
            exhausted=self._exhausted,
            commits=self._commits,
            aborts=self._aborts,
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant (used by tests)."""
        state = np.frombuffer(self._state, dtype=np.uint8)
        refs = np.frombuffer(self._refs, dtype=np.int64)
        usable = self._usable_mask.astype(bool)
        starts = np.frombuffer(self._fresh_starts, dtype=np.int64)
        stops = np.frombuffer(self._fresh_stops, dtype=np.int64)
        assert starts.size == stops.size and (starts < stops).all(), "an empty or inverted run of unused pages"
        assert (stops[1:] <= starts[:-1]).all(), "runs of unused pages overlap or are out of order"
        fresh = np.concatenate(
            [np.arange(a, b, dtype=np.int64) for a, b in zip(starts, stops, strict=True)] + [starts[:0]]
        )
        assert fresh.size == self._fresh, "count of unused pages wrong"
        free = np.concatenate((np.frombuffer(self._recycled, dtype=np.int64), fresh))
        del starts, stops  # views pin the arrays' buffers
        assert ((state == _FREE) | (state == _RESERVED) | (state == _READY)).all(), "unknown state"
        ordered = np.sort(free)  # (np.unique imports numpy.ma on first use: a stall where it runs)
        assert not (ordered[1:] == ordered[:-1]).any(), "a page is on the free list twice"
        assert usable[free].all(), "a page not handed over is on the free list"
        assert (state[free] == _FREE).all(), "a page on the free list is in use"
        assert not (state[~usable] != _FREE).any(), "a page not handed over is in use"
        assert int(usable.sum()) == self._usable, "usable count wrong"
        assert (refs >= 0).all(), "negative refs"
        free_pages = np.flatnonzero(state == _FREE)
        assert not refs[free_pages].any(), "a free page has refs"
        index = {key: page for shard in self._index for key, page in shard.items()}
        assert len(index) == sum(map(len, self._index)), "a key in two index shards"
        assert all(key[0] == n for n, shard in enumerate(self._index) for key in shard), "a key in the wrong shard"
        keys = {page: key for key, page in index.items()}
        assert len(keys) == len(index), "two keys on one page"
        page_keys = {page: key for shard in self._keys for page, key in shard.items()}
        wrong = [page for n, shard in enumerate(self._keys) for page in shard if page & _MASK != n]
        assert not wrong, f"pages in the wrong shard: {wrong}"
        assert page_keys == keys, "the page -> key map differs from the index"
        assert not any(p in keys for p in free_pages.tolist()), "a free page has a key"
        assert (refs[state == _RESERVED] >= 1).all(), "a reserved page lacks the reserver's ref"
        # The LRU: a well-linked list from the sentinel, both ways, visiting each page once.
        prev, nxt, head = self._prev, self._next, self._head
        assert 0 <= nxt[head] <= head and 0 <= prev[head] <= head, "the sentinel's links are out of range"
        lru: list[int] = []
        page = nxt[head]
        while page != head:
            assert len(lru) < self.capacity, "the LRU has a cycle"
            assert 0 <= page < self.capacity, f"an LRU link out of range: {page}"
            assert nxt[prev[page]] == page, f"the LRU's links disagree at page {page}"
            lru.append(page)
            page = nxt[page]
        assert prev[head] == (lru[-1] if lru else head), "the LRU's last link is wrong"
        assert len(set(lru)) == len(lru), "a page twice on the LRU"
        in_lru = np.zeros(self.capacity, dtype=bool)
        in_lru[np.asarray(lru, dtype=np.int64)] = True
        evictable = (state == _READY) & (refs == 0)
        assert (in_lru == evictable).all(), "LRU membership differs from READY pages without refs"
        for page in np.flatnonzero(state != _FREE).tolist():
            assert page in keys, f"index broken at {page}"
        assert len(index) == int(np.count_nonzero(state != _FREE)), "stale index"
        assert all(state[p] == _RESERVED for p in self._waiters), "a waiter on a page not RESERVED"
        assert free.size + len(index) == self._usable, "pages lost or invented"
