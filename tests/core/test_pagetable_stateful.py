"""Random sequences of page-table operations keep every invariant and agree with a plain model.

The table keeps its per-page state in flat columns (no object per page); the model here is the
obvious version with one record per page, and the state machine checks that both hand out the same
pages, evict the same keys in the same order, wake the same waiters with the same values and report
the same statistics.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aiokv.pagetable import PageHandle, PageState, PageTable, ReserveOutcome, StaleHandleError

KEYS = [i.to_bytes(16, "little") for i in range(12)]
CAPACITY = 8
CHUNKS: list[Iterable[int]] = [range(0, 2), [2], range(3, 6), [7, 6]]
"""Every page once; the pool hands over ranges, other callers any iterable, in any order."""


@dataclass
class _Record:
    state: PageState = PageState.FREE
    key: bytes | None = None
    refs: int = 0


class Model:
    """What the table must do, written the plain way: one record per page."""

    def __init__(self) -> None:
        self.pages = [_Record() for _ in range(CAPACITY)]
        self.generation = [0] * CAPACITY  # bumped whenever a page is freed
        self.index: dict[bytes, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.recycled: list[int] = []  # freed after use: last freed is taken first
        self.fresh: set[int] = set()  # never used: the lowest is taken first
        self.usable = 0
        self.counts = {"evictions": 0, "exhausted": 0, "commits": 0, "aborts": 0}

    def add(self, pages: Iterable[int]) -> None:
        for page in pages:
            self.fresh.add(page)
            self.usable += 1

    def _free(self, page: int) -> None:
        record = self.pages[page]
        assert record.key is not None
        del self.index[record.key]
        self.pages[page] = _Record()
        self.generation[page] += 1
        self.recycled.append(page)

    def evict(self, count: int) -> list[bytes]:
        keys: list[bytes] = []
        while len(keys) < count and self.lru:
            page, _ = self.lru.popitem(last=False)
            key = self.pages[page].key
            assert key is not None
            keys.append(key)
            self._free(page)
            self.counts["evictions"] += 1
        return keys

    def _allocate(self) -> int | None:
        if self.recycled:
            return self.recycled.pop()
        if self.fresh:
            page = min(self.fresh)
            self.fresh.remove(page)
            return page
        if self.evict(1):
            return self.recycled.pop()
        return None

    def reserve(self, keys: list[bytes]) -> list[tuple[ReserveOutcome, int | None]]:
        out: list[tuple[ReserveOutcome, int | None]] = []
        present = []
        exhausted = False
        for key in keys:
            page = self.index.get(key)
            if page is not None:
                ready = self.pages[page].state is PageState.READY
                out.append((ReserveOutcome.PRESENT if ready else ReserveOutcome.PENDING, None))
                if page in self.lru:
                    del self.lru[page]
                    present.append(page)
                continue
            page = None if exhausted else self._allocate()
            if page is None:
                exhausted = True
                self.counts["exhausted"] += 1
                out.append((ReserveOutcome.EXHAUSTED, None))
                continue
            self.pages[page] = _Record(PageState.RESERVED, key, 1)
            self.index[key] = page
            out.append((ReserveOutcome.RESERVED, page))
        for page in reversed(present):
            self.lru[page] = None
        return out

    def unref(self, page: int) -> None:
        record = self.pages[page]
        record.refs -= 1
        if record.refs == 0:
            self.lru[page] = None

    def ref(self, page: int) -> None:
        self.pages[page].refs += 1
        self.lru.pop(page, None)

    def state_of(self, key: bytes) -> PageState:
        page = self.index.get(key)
        return PageState.FREE if page is None else self.pages[page].state


class PageTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = PageTable(CAPACITY)
        self.model = Model()
        self.chunks = list(CHUNKS)
        self.loop = asyncio.new_event_loop()
        self.reserved: dict[bytes, PageHandle] = {}
        self.refs: list[PageHandle] = []
        self.stale: list[PageHandle] = []  # released or recycled: every use must raise
        self.waiters: list[tuple[bytes, asyncio.Task[bool]]] = []

    def teardown(self) -> None:
        for _, task in self.waiters:
            task.cancel()
        self.loop.run_until_complete(asyncio.sleep(0))
        self.loop.close()

    def _turns(self) -> None:
        for _ in range(3):
            self.loop.run_until_complete(asyncio.sleep(0))

    # -- capacity -------------------------------------------------------------------------------

    @initialize(data=st.data())
    def first_chunks(self, data: st.DataObject) -> None:
        for _ in range(data.draw(st.integers(1, len(self.chunks)))):
            self.add_chunk(data)

    @precondition(lambda self: bool(self.chunks))
    @rule(data=st.data())
    def add_chunk(self, data: st.DataObject) -> None:
        chunk = self.chunks.pop(data.draw(st.integers(0, len(self.chunks) - 1)))
        self.table.add_usable(chunk)
        self.model.add(chunk)

    @rule(page=st.integers(-2, CAPACITY + 1))
    def add_again_or_out_of_range(self, page: int) -> None:
        pending = {p for chunk in self.chunks for p in chunk}
        if page in pending:
            return
        before = self.table.statistics()
        with pytest.raises(ValueError, match=r"out of range|handed over twice"):
            self.table.add_usable([page])
        assert self.table.statistics() == before, "a refused hand-over changed the table"

    # -- two-phase writes -----------------------------------------------------------------------

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    def reserve(self, keys: list[bytes]) -> None:
        expected = self.model.reserve(keys)
        results = self.table.reserve(keys)
        got = [(r.outcome, r.handle.page if r.handle else None) for r in results]
        assert got == expected
        assert [r.key for r in results] == keys
        for res in results:
            if res.outcome is ReserveOutcome.RESERVED:
                assert res.handle is not None
                self.reserved[res.key] = res.handle
        # Referenced pages survived any eviction the reservation did.
        for handle in self.refs:
            assert self.table.contains(handle.key)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    def offload(self, keys: list[bytes]) -> None:
        """Reserve, then commit what was reserved at once (the common path; fills the LRU)."""
        self.reserve(keys)
        for key in keys:
            if key in self.reserved:
                self._commit(key, keep=False)

    @precondition(lambda self: bool(self.reserved))
    @rule(data=st.data(), keep=st.booleans())
    def commit(self, data: st.DataObject, keep: bool) -> None:
        self._commit(data.draw(st.sampled_from(sorted(self.reserved))), keep)

    def _commit(self, key: bytes, keep: bool) -> None:
        handle = self.reserved.pop(key)
        kept = self.table.commit(handle, keep=keep)
        self.stale.append(handle)
        self.model.pages[handle.page].state = PageState.READY
        self.model.counts["commits"] += 1
        if keep:
            assert kept is not None and kept.page == handle.page
            self.refs.append(kept)
        else:
            assert kept is None
            self.model.unref(handle.page)
        self._check_woken(key, True)

    @precondition(lambda self: bool(self.reserved))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.reserved)))
        handle = self.reserved.pop(key)
        self.table.abort(handle)
        self.stale.append(handle)
        self.model._free(handle.page)
        self.model.counts["aborts"] += 1
        assert self.table.state_of(key) is PageState.FREE
        self._check_woken(key, False)

    # -- waiters --------------------------------------------------------------------------------

    @rule(key=st.sampled_from(KEYS))
    def wait_committed(self, key: bytes) -> None:
        task = self.loop.create_task(self.table.wait_committed(key))
        self._turns()
        state = self.model.state_of(key)
        if state is PageState.RESERVED:
            assert not task.done(), "a waiter on a reserved page returned early"
            self.waiters.append((key, task))
        else:
            assert task.done() and task.result() is (state is PageState.READY)

    @precondition(lambda self: bool(self.waiters))
    @rule(data=st.data())
    def cancel_waiter(self, data: st.DataObject) -> None:
        _, task = self.waiters.pop(data.draw(st.integers(0, len(self.waiters) - 1)))
        task.cancel()
        self._turns()
        assert task.cancelled()

    def _check_woken(self, key: bytes, value: bool) -> None:
        self._turns()
        woken = [task for k, task in self.waiters if k == key]
        self.waiters = [(k, task) for k, task in self.waiters if k != key]
        assert all(task.done() and task.result() is value for task in woken)
        assert not any(task.done() for _, task in self.waiters), "a waiter on another key woke"

    # -- references -----------------------------------------------------------------------------

    @rule(key=st.sampled_from(KEYS))
    def acquire(self, key: bytes) -> None:
        handle = self.table.acquire(key)
        assert (handle is not None) == (self.model.state_of(key) is PageState.READY)
        if handle is not None:
            self.model.ref(handle.page)
            self.refs.append(handle)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4, unique=True))
    def acquire_prefix(self, keys: list[bytes]) -> None:
        handles = self.table.acquire_prefix(keys)
        ready = 0
        while ready < len(keys) and self.model.state_of(keys[ready]) is PageState.READY:
            ready += 1
        assert [h.key for h in handles] == keys[:ready]
        for handle in handles:
            self.model.ref(handle.page)
        self.refs.extend(handles)

    @precondition(lambda self: bool(self.refs))
    @rule(data=st.data())
    def retain(self, data: st.DataObject) -> None:
        handle = self.refs[data.draw(st.integers(0, len(self.refs) - 1))]
        second = self.table.retain(handle)
        assert (second.page, second.generation, second.key) == (handle.page, handle.generation, handle.key)
        self.model.ref(handle.page)
        self.refs.append(second)

    @precondition(lambda self: bool(self.refs))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        handle = self.refs.pop(data.draw(st.integers(0, len(self.refs) - 1)))
        self.table.release(handle)
        self.model.unref(handle.page)
        self.stale.append(handle)

    @precondition(lambda self: bool(self.stale))
    @rule(data=st.data())
    def use_stale_handle(self, data: st.DataObject) -> None:
        handle = self.stale[data.draw(st.integers(0, len(self.stale) - 1))]
        before = self.table.statistics()
        for use in (self.table.check, self.table.release, self.table.commit, self.table.abort, self.table.retain):
            with pytest.raises(StaleHandleError):
                use(handle)
        assert self.table.statistics() == before
        # The same fields in a handle not marked released: only the generation tells whether the
        # page was freed since (it is often taken again by the same key).
        forged = PageHandle(handle.page, handle.generation, handle.key)
        if self.model.generation[handle.page] != handle.generation:
            with pytest.raises(StaleHandleError):
                self.table.check(forged)
        else:
            assert self.table.check(forged) == handle.page

    @precondition(lambda self: bool(self.reserved))
    @rule(data=st.data())
    def release_a_reservation(self, data: st.DataObject) -> None:
        handle = self.reserved[data.draw(st.sampled_from(sorted(self.reserved)))]
        with pytest.raises(StaleHandleError):
            self.table.release(handle)
        with pytest.raises(StaleHandleError):
            self.table.retain(handle)
        assert self.table.check(handle) == handle.page  # still live

    # -- LRU ------------------------------------------------------------------------------------

    @rule(key=st.sampled_from(KEYS))
    def touch(self, key: bytes) -> None:
        ready = self.model.state_of(key) is PageState.READY
        assert self.table.touch(key) is ready
        page = self.model.index.get(key)
        if ready and page is not None and page in self.model.lru:
            self.model.lru.move_to_end(page)

    @rule(count=st.integers(0, 3))
    def evict(self, count: int) -> None:
        evicted: list[bytes] = []
        self.table.on_evict = evicted.append
        keys = self.table.evict(count)
        self.table.on_evict = None
        assert keys == evicted == self.model.evict(count)
        held = {h.key for h in self.refs} | set(self.reserved)
        assert held.isdisjoint(keys)

    @rule(key=st.sampled_from(KEYS))
    def discard(self, key: bytes) -> None:
        page = self.model.index.get(key)
        can = page is not None and page in self.model.lru
        assert self.table.discard(key) is can
        if can:
            assert page is not None
            del self.model.lru[page]
            self.model._free(page)

    # -- agreement ------------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        self.table.check_invariants()
        model = self.model
        for key in KEYS:
            assert self.table.state_of(key) is model.state_of(key)
            assert self.table.contains(key) is (model.state_of(key) is PageState.READY)
        stats = self.table.statistics()
        states = [r.state for r in model.pages]
        assert stats.capacity == CAPACITY
        assert stats.usable == model.usable
        assert stats.free == len(model.recycled) + len(model.fresh)
        assert stats.reserved == states.count(PageState.RESERVED) == len(self.reserved)
        assert stats.ready == states.count(PageState.READY)
        assert stats.referenced == sum(r.state is PageState.READY and r.refs > 0 for r in model.pages)
        assert stats.referenced == len({h.page for h in self.refs})
        assert stats.evictable == len(model.lru)
        assert stats.free + stats.reserved + stats.ready == model.usable
        counts = {name: getattr(stats, name) for name in model.counts}
        assert counts == model.counts


PageTableMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPageTable = PageTableMachine.TestCase
