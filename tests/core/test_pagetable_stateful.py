"""Random sequences of page-table operations keep every invariant (hypothesis state machine)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from aiokv.pagetable import PageHandle, PageState, PageTable, ReserveOutcome, StaleHandleError

KEYS = [i.to_bytes(16, "little") for i in range(12)]


class PageTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = PageTable(5)
        self.table.add_usable(range(5))
        self.reserved: dict[bytes, PageHandle] = {}
        self.refs: list[PageHandle] = []
        self.ready: set[bytes] = set()  # model: keys that must be READY (referenced ones can't vanish)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    def reserve(self, keys: list[bytes]) -> None:
        before_ready = {k for k in KEYS if self.table.contains(k)}
        results = self.table.reserve(keys)
        seen_exhausted = False
        for res in results:
            if res.outcome is ReserveOutcome.RESERVED:
                assert not seen_exhausted
                assert res.handle is not None
                self.reserved[res.key] = res.handle
            elif res.outcome is ReserveOutcome.PRESENT:
                assert res.key in before_ready
            elif res.outcome is ReserveOutcome.PENDING:
                assert res.key in self.reserved
            else:
                seen_exhausted = True
        # Referenced pages survived any eviction the reservation did.
        for handle in self.refs:
            assert self.table.contains(handle.key)

    @precondition(lambda self: bool(self.reserved))
    @rule(data=st.data(), keep=st.booleans())
    def commit(self, data: st.DataObject, keep: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.reserved)))
        kept = self.table.commit(self.reserved.pop(key), keep=keep)
        if keep:
            assert kept is not None
            self.refs.append(kept)

    @precondition(lambda self: bool(self.reserved))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.reserved)))
        self.table.abort(self.reserved.pop(key))
        assert self.table.state_of(key) is PageState.FREE

    @rule(key=st.sampled_from(KEYS))
    def acquire(self, key: bytes) -> None:
        handle = self.table.acquire(key)
        assert (handle is not None) == (self.table.state_of(key) is PageState.READY)
        if handle is not None:
            self.refs.append(handle)

    @precondition(lambda self: bool(self.refs))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        handle = self.refs.pop(data.draw(st.integers(0, len(self.refs) - 1)))
        self.table.release(handle)
        try:
            self.table.release(handle)
        except StaleHandleError:
            pass
        else:
            raise AssertionError("double release was accepted")

    @rule(count=st.integers(0, 3))
    def evict(self, count: int) -> None:
        evicted = self.table.evict(count)
        held = {h.key for h in self.refs} | set(self.reserved)
        assert held.isdisjoint(evicted)

    @invariant()
    def consistent(self) -> None:
        self.table.check_invariants()
        stats = self.table.statistics()
        assert stats.reserved == len(self.reserved)
        assert stats.free + stats.reserved + stats.ready == 5
        assert stats.referenced == len({h.page for h in self.refs})


PageTableMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPageTable = PageTableMachine.TestCase
