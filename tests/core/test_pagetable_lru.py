"""The page table's structures that replaced a dict and an OrderedDict (#11): the key index split
into small dicts and the LRU as a list linked through two columns. No hot-path call rebuilds a
structure that grows with the table; the order and the invariants stay those of the plain model."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from aiokv.pagetable import _SHARDS, PageHandle, PageTable, ReserveOutcome


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _full(capacity: int) -> PageTable:
    table = PageTable(capacity)
    table.add_usable(range(capacity))
    for r in table.reserve([_key(i) for i in range(capacity)]):
        assert r.handle is not None
        table.commit(r.handle)
    return table


def _largest_dict(table: PageTable) -> int:
    return max(max(map(len, table._index)), max(map(len, table._keys)))


def test_no_dict_of_the_table_grows_with_it() -> None:
    # Regression (#11): one dict of every key (and an OrderedDict of every evictable page) rebuilt
    # its whole hash table every few hundred thousand inserts under churn: 5-35 ms at 262K pages.
    # A dict of the table holds about capacity / 256 entries now, whatever the churn.
    capacity = 1 << 15
    table = _full(capacity)
    worst = _largest_dict(table)
    for first in range(capacity, 4 * capacity, 256):  # each batch evicts 256 pages
        for r in table.reserve([_key(i) for i in range(first, first + 256)]):
            assert r.handle is not None
            table.commit(r.handle)
        worst = max(worst, _largest_dict(table))
    assert worst <= 2 * capacity // _SHARDS, f"a dict of {worst} entries for {capacity} pages"
    assert table.statistics().evictions == 3 * capacity
    table.check_invariants()


@pytest.mark.parametrize("callback", [False, True], ids=["inline-eviction", "on-evict"])
def test_random_operations_evict_in_the_models_lru_order(callback: bool) -> None:
    # Keys that share a first byte (one index dict) and keys that do not; acquire, release, touch,
    # discard and reserve (with evictions) in random order against an OrderedDict LRU. Without an
    # on_evict callback reserve evicts inline; with one, through _evict_one.
    rng = random.Random(11)
    capacity = 64
    table = PageTable(capacity)
    table.add_usable(range(capacity))
    keys = [bytes([rng.choice((0, 1, 2, 7))]) + rng.randbytes(15) for _ in range(300)]
    lru: OrderedDict[bytes, None] = OrderedDict()  # READY, unreferenced, oldest first
    held: list[PageHandle] = []
    evicted: list[bytes] = []
    if callback:
        table.on_evict = evicted.append
    for step in range(6000):
        op = rng.random()
        key = rng.choice(keys)
        if op < 0.45:
            results = table.reserve([key])
            if results[0].outcome is ReserveOutcome.RESERVED:
                handle = results[0].handle
                assert handle is not None
                table.commit(handle)
                lru[key] = None
            elif results[0].outcome is ReserveOutcome.PRESENT and key in lru:
                lru.move_to_end(key)
        elif op < 0.65 and (handle := table.acquire(key)) is not None:
            lru.pop(key, None)
            held.append(handle)
        elif op < 0.85 and held:
            handle = held.pop(rng.randrange(len(held)))
            table.release(handle)
            if not any(h.key == handle.key for h in held):
                lru[handle.key] = None
        elif op < 0.95:
            if table.touch(key) and key in lru:
                lru.move_to_end(key)
        elif table.discard(key):
            del lru[key]
        if not callback:
            evicted = [k for k in lru if not table.contains(k)]  # (in the model's order)
        for gone in evicted:  # evictions take the model's oldest, in order
            oldest = next(iter(lru))
            assert gone == oldest, f"step {step}: evicted {gone.hex()}, the model's oldest is {oldest.hex()}"
            del lru[oldest]
        evicted.clear()
        if step % 500 == 0:
            table.check_invariants()
            assert [table._keys[p % _SHARDS][p] for p in table._lru_pages()] == list(lru)
    table.check_invariants()


def test_an_on_evict_callback_that_acquires_a_page_of_the_same_call_is_safe() -> None:
    # The call's READY pages are held by a reference while it runs, so a callback that takes the
    # same page finds it off the LRU, as the table's own invariant says.
    table = _full(4)
    grabbed: list[PageHandle] = []

    def on_evict(key: bytes) -> None:
        if not grabbed:
            handle = table.acquire(_key(1))
            assert handle is not None
            grabbed.append(handle)

    table.on_evict = on_evict
    results = table.reserve([_key(1), _key(100)])  # key 1 is READY; key 100 evicts key 0
    assert [r.outcome for r in results] == [ReserveOutcome.PRESENT, ReserveOutcome.RESERVED]
    table.check_invariants()
    assert results[1].handle is not None
    table.commit(results[1].handle)
    assert table.evict(4) == [_key(2), _key(3), _key(100)]  # key 1 is referenced by the callback
    table.release(grabbed[0])
    assert table.evict(4) == [_key(1)]
    table.check_invariants()


@pytest.mark.parametrize("bad", [5, b"", "text"])
def test_a_bad_key_undoes_the_calls_reservations(bad: object) -> None:
    table = _full(4)
    before = table.statistics()
    with pytest.raises((TypeError, IndexError)):
        table.reserve([_key(2), _key(50), bad])  # type: ignore[list-item]
    table.check_invariants()
    after = table.statistics()
    assert (after.reserved, after.ready + after.free) == (0, 4)
    assert after.evictable == after.ready  # key 2 back on the LRU, nothing left referenced
    assert not table.contains(_key(50)) and table.contains(_key(2))
    assert after.evictions == before.evictions + 1  # the eviction for key 50 stays done


def test_the_invariant_check_finds_a_broken_lru() -> None:
    table = _full(8)
    table.check_invariants()
    page = table._next[table._head]
    table._prev[table._next[page]] = table._head  # a back link skips the oldest page
    with pytest.raises(AssertionError, match="links disagree"):
        table.check_invariants()
    table = _full(8)
    table._next[3] = 2  # a cycle
    with pytest.raises(AssertionError, match=r"cycle|disagree"):
        table.check_invariants()
    table = _full(8)
    handle = table.acquire(_key(5))
    assert handle is not None
    table._refs[handle.page] = 0  # unreferenced yet off the list
    with pytest.raises(AssertionError, match="membership"):
        table.check_invariants()
