"""`DiskTier.read_many` / `read_many_into`: one future per batch of page reads (#14), with every
page's guarantees of `read`: verified bytes, misses and corrupt files counted, I/O faults counted
and the file kept, cancellation that waits until nothing writes into any page of the batch, caller
mistakes refused before anything changes (every backend)."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
from pathlib import Path

import pytest
import torch
from cancel_points import most_attempts, pause
from disk_helpers import assert_clean, config, fill, gated, key_of, payload, reserve, spin, stored_page

from aiokv.layout import KVLayout
from aiokv.pagetable import PageHandle, PageState
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskStatistics, DiskTier, ErrorKind
from aiokv.storage.backends import IOOp
from aiokv.storage.pagefile import HEADER_BYTES

SENTINEL = 0x5A
DENSE = 300
"""Cancel sweeps: attempts counted in loop turns, then growing sleeps (cancel_points.pause)."""


def _reserve_all(pool: PagePool, first: int, count: int) -> list[PageHandle]:
    return [reserve(pool, key_of(first + i, tag=7)) for i in range(count)]


def _abort_all(pool: PagePool, handles: list[PageHandle]) -> None:
    for h in handles:
        pool.table.abort(h)


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) - 4096)


def _exists(path: str) -> bool:
    return os.path.exists(path)


def _same_counts(a: DiskStatistics, b: DiskStatistics) -> bool:
    return (a.reads, a.hits, a.misses, a.corrupt, a.in_flight, a.pages) == (
        b.reads, b.hits, b.misses, b.corrupt, b.in_flight, b.pages)


@pytest.mark.asyncio
async def test_pages_read_bit_exact_in_order(tier: DiskTier, pool: PagePool) -> None:
    """More pages than I/O slots (8): all verified, each in its own page, in the batch's order."""
    want = [await stored_page(tier, pool, i) for i in range(20)]
    order = list(range(19, -1, -1))  # not the order they were written in
    handles = _reserve_all(pool, 100, len(order))
    oks = await tier.read_many([key_of(i) for i in order], handles)
    assert oks == [True] * len(order)
    for i, h in zip(order, handles, strict=True):
        assert torch.equal(payload(pool, h), want[i])
    _abort_all(pool, handles)
    stats = tier.statistics()
    assert (stats.hits, stats.misses, stats.corrupt, stats.in_flight) == (20, 0, 0, 0)
    assert tier._index.readers == {}  # every read let go of its file
    assert await tier.read_many([], []) == []
    assert_clean(pool)


@pytest.mark.asyncio
async def test_hits_misses_and_corrupt_files_in_one_batch(tier: DiskTier, pool: PagePool, layout: KVLayout) -> None:
    """A batch of good pages, absent keys and files corrupted on disk (payload byte, header field,
    truncated): each page's outcome is its own; corrupt files are counted and deleted."""
    want = {i: await stored_page(tier, pool, i) for i in range(8)}
    paths = {i: tier.files.path(key_of(i)) for i in (1, 4, 6)}
    _flip(paths[1], HEADER_BYTES + layout.payload_bytes - 1)
    _flip(paths[4], 60)  # the payload-length field
    _truncate(paths[6])
    keys = [0, 1, 50, 2, 4, 51, 6, 7, 3, 5]  # 50, 51: never stored
    handles = _reserve_all(pool, 200, len(keys))
    oks = await tier.read_many([key_of(i) for i in keys], handles)
    assert oks == [i in want and i not in paths for i in keys]
    for i, h, ok in zip(keys, handles, oks, strict=True):
        if ok:
            assert torch.equal(payload(pool, h), want[i])
    _abort_all(pool, handles)
    stats = tier.statistics()
    assert (stats.hits, stats.misses, stats.corrupt) == (5, 5, 3)
    assert sum(stats.errors.values()) == 0
    for i in paths:
        assert not tier.contains(key_of(i))
    await tier.aclose()  # waits for the unlinks
    for path in paths.values():
        assert not _exists(path)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_an_injected_io_error_fails_one_page_and_keeps_its_file(tier: DiskTier, pool: PagePool) -> None:
    """EIO on one page's read (injected into the real request: on io_uring a READ of fd -1 that
    breaks its chain): that page is a counted fault, the others verify, the file stays."""
    want = [await stored_page(tier, pool, i) for i in range(6)]
    tier.backend.faults.inject(IOOp.READ, errno.EIO)
    handles = _reserve_all(pool, 300, 6)
    oks = await tier.read_many([key_of(i) for i in range(6)], handles)
    assert oks.count(False) == 1
    failed = oks.index(False)
    for i, h in enumerate(handles):
        if i != failed:
            assert torch.equal(payload(pool, h), want[i])
    _abort_all(pool, handles)
    stats = tier.statistics()
    assert (stats.errors[ErrorKind.EIO], stats.corrupt, stats.pages) == (1, 0, 6)
    again = _reserve_all(pool, 400, 1)
    assert await tier.read_many([key_of(failed)], again) == [True]  # transient: the file was kept
    assert torch.equal(payload(pool, again[0]), want[failed])
    _abort_all(pool, again)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_cancel_waits_for_io_in_flight_then_nothing_writes(tier: DiskTier, pool: PagePool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled while its loads are held in flight (and more pages wait for slots): the call
    returns only once those loads ended; after that no byte lands in any of the batch's pages."""
    for i in range(12):
        await stored_page(tier, pool, i)
    gate, entered = asyncio.Event(), asyncio.Event()
    monkeypatch.setattr(tier.backend, "start_load", gated(tier.backend.start_load, gate, entered))
    handles = _reserve_all(pool, 500, 12)  # 12 pages, 8 slots: 4 wait for a slot
    task = asyncio.create_task(tier.read_many([key_of(i) for i in range(12)], handles))
    try:
        await entered.wait()
        await spin(3)
        task.cancel()
        await spin(5)
        assert not task.done()  # loads into the batch's pages are still in flight
    finally:
        gate.set()  # a failed test must not leave the tier's close waiting for held loads
    with pytest.raises(asyncio.CancelledError):
        await task
    for h in handles:  # the caller reuses the pages at once: nothing may write into them now
        pool.memory.page_view(pool.table.check(h))[:] = bytes([SENTINEL]) * pool.layout.page_bytes
    await tier.aclose()  # every job and completion of the tier ended
    for h in handles:
        assert bytes(pool.memory.page_view(pool.table.check(h))) == bytes([SENTINEL]) * pool.layout.page_bytes
    _abort_all(pool, handles)
    assert tier.statistics().in_flight == 0
    assert tier._index.readers == {}
    assert_clean(pool)


@pytest.mark.asyncio
async def test_cancel_at_every_step(tier: DiskTier, pool: PagePool) -> None:
    """Cancel after 0, 1, 2, ... loop iterations until a batch completes uncancelled: each
    cancelled call leaves its pages untouched from its return on (they are overwritten at once
    and checked once the tier is idle), no reader or job leaks, and a completed batch is exact."""
    want = [await stored_page(tier, pool, i) for i in range(12)]
    keys = [key_of(i) for i in range(12)] + [key_of(99)]  # one miss too
    cancelled = 0
    step = 0
    while True:
        assert step < most_attempts(DENSE), "the batch never completed"
        handles = _reserve_all(pool, 1000 + 20 * step, len(keys))
        task = asyncio.create_task(tier.read_many(keys, handles))
        # Every step up to DENSE turns, then ever longer sleeps: the threads backend's reads run on
        # other threads, which a loaded host may not schedule within 500 turns (the test failed so
        # on 2 busy cores), and a loop spinning through turns starves them of the GIL.
        await pause(step, DENSE)
        task.cancel()
        try:
            oks = await task
        except asyncio.CancelledError:
            cancelled += 1
            fill_with = bytes([step % 251]) * pool.layout.page_bytes
            for h in handles:
                pool.memory.page_view(pool.table.check(h))[:] = fill_with
            await tier.flush()
            await spin(20)  # completions, checksum deliveries and unlinks of this step land
            assert tier.statistics().in_flight == 0
            for h in handles:
                assert bytes(pool.memory.page_view(pool.table.check(h))) == fill_with
            _abort_all(pool, handles)
            assert tier._index.readers == {}
            step += 1
            continue
        assert oks == [True] * 12 + [False]
        for i in range(12):
            assert torch.equal(payload(pool, handles[i]), want[i])
        _abort_all(pool, handles)
        break
    assert cancelled >= 1
    await tier.aclose()
    assert tier.statistics().in_flight == 0
    assert_clean(pool)


@pytest.mark.asyncio
async def test_caller_mistakes_raise_before_anything_changes(tier: DiskTier, pool: PagePool) -> None:
    for i in range(3):
        await stored_page(tier, pool, i)
    handles = _reserve_all(pool, 600, 3)
    keys = [key_of(i) for i in range(3)]
    ready = fill(pool, key_of(700), 7)
    before = tier.statistics()
    cases: list[tuple[type[Exception], str, object, object]] = [
        (ValueError, "same key twice", [keys[0], keys[1], keys[0]], handles),
        (ValueError, "2 keys for 3 handles", keys[:2], handles),
        (ValueError, "same pool page twice", keys, [handles[0], handles[1], handles[0]]),
        (TypeError, "keys must be a sequence", keys[0], handles[:1]),  # a single key
        (TypeError, "keys must be a sequence", iter(keys), handles),
        (TypeError, "handles must be a sequence", keys, handles[0]),
        (TypeError, "key must be bytes", [keys[0], "x" * 16, keys[2]], handles),
        (ValueError, "key must be 16 bytes", [keys[0], b"short", keys[2]], handles),
        (TypeError, "handle must be a PageHandle", keys, [handles[0], object(), handles[2]]),
        (ValueError, "not a reservation", keys, [handles[0], ready, handles[2]]),  # READY
    ]
    for error, match, ks, hs in cases:
        with pytest.raises(error, match=match):
            await tier.read_many(ks, hs)  # type: ignore[arg-type]
        assert _same_counts(tier.statistics(), before)
        assert tier._index.readers == {}
        for h in handles:
            assert pool.table.state_of(h.key) is PageState.RESERVED
    stale = reserve(pool, key_of(701))
    pool.table.abort(stale)
    with pytest.raises(ValueError, match="already released"):
        await tier.read_many(keys, [handles[0], handles[1], stale])
    assert _same_counts(tier.statistics(), before)
    assert await tier.read_many(keys, handles) == [True] * 3  # the same batch, right, still works
    _abort_all(pool, handles)
    pool.table.release(ready)
    assert_clean(pool)


async def _refused_buffers(tier: DiskTier, pb: int) -> None:
    """Overlapping, read-only, wrong-sized and non-memoryview buffers: refused, nothing changed
    (not even the count of unaligned buffers). In memory of their own: a raised error's traceback
    keeps the views alive a while."""
    other = memoryview(bytearray(3 * pb))
    before = tier.statistics()
    for error, bufs in [(ValueError, [other[0:pb], other[pb // 2:pb // 2 + pb]]),  # overlap
                        (ValueError, [other[pb:2 * pb], other[pb:2 * pb]]),  # the same buffer twice
                        (TypeError, [other[0:pb], memoryview(bytes(pb))]),  # read-only
                        (ValueError, [other[0:pb], other[pb:2 * pb - 8]]),  # wrong size
                        (TypeError, [other[0:pb], bytearray(pb)])]:
        with pytest.raises(error):
            await tier.read_many_into([key_of(0), key_of(1)], bufs)  # type: ignore[arg-type]
        after = tier.statistics()
        assert _same_counts(after, before)
        assert after.buffered_fallbacks == before.buffered_fallbacks


@pytest.mark.asyncio
async def test_read_many_into_callers_buffers(tier: DiskTier, pool: PagePool, layout: KVLayout) -> None:
    """Into a caller's mmap, aligned and unaligned pages: bit-exact, and the tier holds no view of
    the mapping once the call returned (it can be closed); bad buffers refused first."""
    want = [await stored_page(tier, pool, i) for i in range(4)]
    pb = layout.page_bytes
    region = mmap.mmap(-1, 6 * pb)
    try:
        view = memoryview(region)
        buffers = [view[0:pb], view[pb:2 * pb], view[2 * pb + 512:3 * pb + 512], view[4 * pb:5 * pb]]
        await _refused_buffers(tier, pb)
        oks = await tier.read_many_into([key_of(i) for i in (3, 2, 1, 0)], buffers)
        assert oks == [True] * 4
        for i, buf in zip((3, 2, 1, 0), buffers, strict=True):
            got = torch.frombuffer(bytearray(buf[: layout.payload_bytes]), dtype=torch.uint8)
            assert torch.equal(got, want[i])
        for buf in buffers:
            buf.release()
        view.release()
    finally:
        region.close()  # raises BufferError if the tier still held a view of it
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_closing_tier_misses_every_page(disk_dir: Path, backend: DiskBackend, layout: KVLayout,
                                               pool: PagePool) -> None:
    tier = DiskTier(config(disk_dir, backend), layout, pool)
    await tier.start()
    await stored_page(tier, pool, 1)
    handles = _reserve_all(pool, 800, 2)
    closing = asyncio.create_task(tier.aclose())
    await spin(1)
    assert await tier.read_many([key_of(1), key_of(2)], handles) == [False, False]
    await closing
    assert tier.statistics().misses == 2
    _abort_all(pool, handles)
    with pytest.raises(RuntimeError):
        await DiskTier(config(disk_dir / "other", backend), layout, pool).read_many([], [])
    assert_clean(pool)
