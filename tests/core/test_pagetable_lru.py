"""The page table's structures that replaced a dict and an OrderedDict (#11): the key index split
into small dicts and the LRU as a list linked through two columns. No hot-path call rebuilds a
structure that grows with the table; the order and the invariants stay those of the plain model."""

from __future__ import annotations

import random
import re
import sys
import types
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from aiokv import pagetable
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


# -- the inlined copies of _unlink and _link_last ---------------------------------------------------

_MARK = re.compile(r"#\s*LRU (unlink the oldest|unlink|link)\b")


def _marked_copies() -> dict[int, tuple[str, list[str]]]:
    """Line number -> (kind, the copy's statements) of each ``# LRU`` mark in aiokv/pagetable.py."""
    lines = Path(pagetable.__file__).read_text().splitlines()
    copies = {}
    for number, line in enumerate(lines, 1):
        if mark := _MARK.search(line):
            size = 5 if mark.group(1) == "link" else 3
            body = [text.split("#")[0].strip() for text in lines[number - 1 : number - 1 + size]]
            copies[number] = (mark.group(1), body)
    return copies


def test_every_inlined_lru_copy_is_the_methods_text() -> None:
    # acquire, release, reserve (three), commit and _evict_one carry _unlink / _link_last inlined
    # (a call there costs 4-15% per operation): each copy must be the method's own statements.
    copies = _marked_copies()
    unlink = [body for kind, body in copies.values() if kind == "unlink"]
    link = [body for kind, body in copies.values() if kind == "link"]
    oldest = [body for kind, body in copies.values() if kind == "unlink the oldest"]
    assert (len(unlink), len(link), len(oldest)) == (3, 4, 2), copies  # the methods' own, and 7 copies
    assert unlink[0] == ["before, after = prev[page], nxt[page]", "nxt[before] = after", "prev[after] = before"]
    assert all(body == unlink[0] for body in unlink) and all(body == link[0] for body in link), copies
    # Unlinking the oldest page is _unlink with the sentinel for ``before`` (prev[page] is head).
    expected = ["after = nxt[page]"] + [s.replace("before", "head") for s in unlink[0][1:]]
    assert all(body == expected for body in oldest), copies


@contextmanager
def _lines_run(path: str) -> Iterator[set[int]]:
    """Line numbers of ``path`` executed while the block runs."""
    ran: set[int] = set()

    def local(frame: types.FrameType, event: str, arg: object) -> object:
        if event == "line":
            ran.add(frame.f_lineno)
        return local

    def call(frame: types.FrameType, event: str, arg: object) -> object:
        return local if frame.f_code.co_filename == path else None

    sys.settrace(call)
    try:
        yield ran
    finally:
        sys.settrace(None)


@pytest.mark.parametrize("seed", [3, 4])
def test_every_inlined_lru_copy_runs_and_keeps_the_models_order(seed: int) -> None:
    # Random reserve batches (new, READY, RESERVED and repeated keys; evicting inline and through
    # on_evict), commits with and without keep, acquire, retain, release, touch, evict and discard,
    # against an OrderedDict LRU: the table's whole LRU order is the model's after every operation,
    # and every marked copy ran.
    rng = random.Random(seed)
    capacity = 12
    table = PageTable(capacity)
    table.add_usable(range(capacity))
    keys = [bytes([rng.choice((0, 5))]) + rng.randbytes(15) for _ in range(24)]
    lru: OrderedDict[bytes, None] = OrderedDict()  # READY, unreferenced, oldest first
    refs: dict[bytes, int] = {}  # READY keys -> references held
    reserved: dict[bytes, PageHandle] = {}
    held: list[PageHandle] = []
    evicted: list[bytes] = []
    with _lines_run(pagetable.__file__) as ran:
        for step in range(3000):
            op = rng.random()
            if op < 0.3:
                batch = [rng.choice(keys) for _ in range(rng.randint(1, 4))]
                table.on_evict = evicted.append if rng.random() < 0.5 else None
                callback = table.on_evict is not None
                results = table.reserve(batch)
                table.on_evict = None
                # The model: the call holds its READY keys meanwhile; a new key takes a free page,
                # else evicts the oldest; its READY keys go back most recent, its first one last.
                expected: list[ReserveOutcome] = []
                exhausted, evicted_now, calls = False, [], []
                free = capacity - len(refs) - len(reserved)
                lru_model = OrderedDict.fromkeys(lru)
                fresh: set[bytes] = set()
                for key in batch:
                    if key in refs:
                        expected.append(ReserveOutcome.PRESENT)
                        lru_model.pop(key, None)
                        calls.append(key)
                    elif key in reserved or key in fresh:
                        expected.append(ReserveOutcome.PENDING)
                    elif exhausted or (free == 0 and not lru_model):
                        exhausted = True
                        expected.append(ReserveOutcome.EXHAUSTED)
                    else:
                        if free:
                            free -= 1
                        else:
                            oldest = next(iter(lru_model))
                            del lru_model[oldest], refs[oldest]  # a later key of the call may be it
                            evicted_now.append(oldest)
                        fresh.add(key)
                        expected.append(ReserveOutcome.RESERVED)
                assert [r.outcome for r in results] == expected, f"step {step}"
                for key in reversed(dict.fromkeys(calls)):  # (a repeated key is linked once, as its first)
                    if refs[key] == 0:
                        lru_model[key] = None
                lru = lru_model
                assert evicted == (evicted_now if callback else []), f"step {step}"
                evicted.clear()
                assert not any(table.contains(key) for key in evicted_now)
                reserved.update((r.key, r.handle) for r in results if r.handle is not None)
            elif op < 0.45 and reserved:
                key = rng.choice(list(reserved))
                handle = reserved.pop(key)
                if rng.random() < 0.15:
                    table.abort(handle)
                elif rng.random() < 0.3:
                    kept = table.commit(handle, keep=True)
                    assert kept is not None
                    held.append(kept)
                    refs[key] = 1
                else:
                    assert table.commit(handle) is None
                    refs[key] = 0
                    lru[key] = None
            elif op < 0.6:
                key = rng.choice(keys)
                handle = table.acquire(key)
                assert (handle is not None) == (key in refs)
                if handle is not None:
                    held.append(handle)
                    refs[key] += 1
                    lru.pop(key, None)
            elif op < 0.65 and held:
                held.append(table.retain(rng.choice(held)))
                refs[held[-1].key] += 1
            elif op < 0.82 and held:
                handle = held.pop(rng.randrange(len(held)))
                table.release(handle)
                refs[handle.key] -= 1
                if refs[handle.key] == 0:
                    lru[handle.key] = None
            elif op < 0.9:
                key = rng.choice(keys)
                assert table.touch(key) == (key in refs)
                if key in lru:
                    lru.move_to_end(key)
            elif op < 0.95:
                count = rng.randint(0, 2)
                expected_keys = list(lru)[:count]
                assert table.evict(count) == expected_keys
                for key in expected_keys:
                    del lru[key], refs[key]
            else:
                key = rng.choice(keys)
                assert table.discard(key) == (key in lru)
                if key in lru:
                    del lru[key], refs[key]
            assert [table._keys[p % _SHARDS][p] for p in table._lru_pages()] == list(lru), f"step {step}"
    table.check_invariants()
    missed = {n: kind for n, (kind, _) in _marked_copies().items() if n not in ran}
    assert not missed, f"LRU copies never run (line: kind): {missed}"
