"""The offload hot path of the page table: ``reserve`` and ``commit`` run once per page of every offload
on the event loop, so they call no Python-level helper per page beyond the handle they hand out.

Counted, not timed: the number of Python function calls is exact on any machine, where a time bound
on a shared 2-vCPU VM is noise.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from aiokv.pagetable import PageHandle, PageTable, Reservation, ReserveOutcome

BATCH = 256
FRAME = {"__exit__", "python_calls"}
"""The measuring context manager's own frames."""


@contextmanager
def python_calls() -> Iterator[list[str]]:
    """Names of the Python-level functions called (at any depth) while the block runs."""
    calls: list[str] = []

    def profile(frame: types.FrameType, event: str, arg: object) -> None:
        if event == "call":
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)


def _keys(first: int, count: int) -> list[bytes]:
    return [i.to_bytes(16, "little") for i in range(first, first + count)]


def _full_table() -> PageTable:
    """A table whose every page is READY and unreferenced: each new key evicts one."""
    table = PageTable(4 * BATCH)
    table.add_usable(range(4 * BATCH))
    for r in table.reserve(_keys(0, 4 * BATCH)):
        assert r.handle is not None
        table.commit(r.handle)
    return table


def test_reserve_with_evictions_calls_nothing_per_page_but_the_handle() -> None:
    # Regression: each page went through _allocate, _evict_one, _free_page and a frozen dataclass's
    # __init__ (0.7 us alone, object.__setattr__ per field): 5 Python calls per page.
    table = _full_table()
    keys = _keys(10_000, BATCH)
    with python_calls() as calls:
        reservations = table.reserve(keys)
    assert calls.count("__init__") == BATCH  # PageHandle's
    assert set(calls) <= {"reserve", "__init__"} | FRAME, f"helpers called: {sorted(set(calls))}"
    assert [r.outcome for r in reservations] == [ReserveOutcome.RESERVED] * BATCH
    assert table.statistics().evictions == BATCH
    table.check_invariants()


def test_commit_calls_no_helper_on_its_fast_path() -> None:
    table = _full_table()
    handles = [r.handle for r in table.reserve(_keys(10_000, BATCH)) if r.handle is not None]
    with python_calls() as calls:
        for handle in handles[: BATCH // 2]:
            table.commit(handle)
        kept = [table.commit(handle, keep=True) for handle in handles[BATCH // 2 :]]
    assert calls.count("__init__") == BATCH // 2  # the kept references
    assert set(calls) <= {"commit", "__init__", "<listcomp>"} | FRAME, f"helpers called: {sorted(set(calls))}"
    for handle in kept:
        assert handle is not None
        table.release(handle)
    table.check_invariants()


def test_on_evict_still_sees_every_evicted_key() -> None:
    table = _full_table()
    evicted: list[bytes] = []
    table.on_evict = evicted.append
    table.reserve(_keys(10_000, 3))
    assert evicted == _keys(0, 3)  # least recently used first
    table.check_invariants()


def test_a_stale_handle_is_still_refused_by_commit() -> None:
    table = _full_table()
    (r,) = table.reserve(_keys(10_000, 1))
    assert r.handle is not None
    table.abort(r.handle)
    from aiokv.pagetable import StaleHandleError

    with pytest.raises(StaleHandleError, match="already released"):
        table.commit(r.handle)
    forged = PageHandle(r.handle.page, r.handle.generation + 1, r.handle.key)
    with pytest.raises(StaleHandleError, match="recycled"):
        table.commit(forged)


def test_reservation_keeps_its_named_immutable_fields() -> None:
    table = _full_table()
    (r,) = table.reserve(_keys(10_000, 1))
    assert isinstance(r, Reservation)
    assert (r.key, r.outcome) == (_keys(10_000, 1)[0], ReserveOutcome.RESERVED)
    assert isinstance(r.handle, PageHandle)
    setter: Callable[[], None] = lambda: setattr(r, "outcome", ReserveOutcome.PRESENT)  # noqa: E731
    with pytest.raises(AttributeError):
        setter()
    assert not dataclasses.is_dataclass(r)
    assert Reservation(b"k" * 16, ReserveOutcome.PENDING).handle is None  # the default stays
