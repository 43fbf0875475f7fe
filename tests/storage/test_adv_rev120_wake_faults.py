"""Reads whose next pages start, hash and go out inside the ring's wake-up (#14), under real faults:
corrupt payloads, a truncated file and a file removed behind the tier's back, with the per-turn
inline hash budget at one page (the rest go to a checksum thread made slow). Every page is verified
(hashed once, inline at a wake-up's end or in the thread), a cancelled batch returns only once
nothing reads or writes its pages (a page hashed after its cancelled caller overwrote it would be
refused as corrupt: a good file lost), and nothing hangs."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from cancel_points import most_attempts, pause
from disk_helpers import assert_clean, config, key_of, payload, reserve, spin, stored_page

from aiokv.layout import KVLayout
from aiokv.pagetable import PageHandle
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage import checksum as checksum_module

URING = [DiskBackend.URING_FIXED, DiskBackend.URING]
PAGES = 16
DENSE = 300
"""Cancel sweeps: attempts counted in loop turns, then growing sleeps (cancel_points.pause)."""
CORRUPT = (3, 7, 12)
TRUNCATED = 9
REMOVED = 5


class HashSpy:
    """Counts the payload hashes by thread; the checksum thread's take ``delay_s`` more each."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.inline = 0
        self.threaded = 0
        self.loop_thread = threading.get_ident()
        self.real = checksum_module.payload_checksum

    def __call__(self, view: memoryview) -> int:
        if threading.get_ident() == self.loop_thread:
            self.inline += 1
        else:
            time.sleep(self.delay_s)  # a slow (descheduled) checksum thread
            self.threaded += 1
        value: int = self.real(view)
        return value


@pytest.fixture(params=URING, ids=[b.value for b in URING])
def backend(request: pytest.FixtureRequest) -> DiskBackend:
    value = request.param
    assert isinstance(value, DiskBackend)
    return value


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch, layout: KVLayout) -> HashSpy:
    # One page's hash a turn inline (a wake-up's end or a queued batch), the rest in the thread.
    monkeypatch.setattr(checksum_module, "INLINE_WRITE_BYTES_PER_TURN", layout.page_bytes)
    hashes = HashSpy(0.002)
    monkeypatch.setattr(checksum_module, "payload_checksum", hashes)
    return hashes


@pytest_asyncio.fixture
async def tier(tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
               spy: HashSpy) -> AsyncIterator[DiskTier]:
    t = DiskTier(config(tmp_path / "d", backend, queue_depth=2), layout, pool)
    await t.start()
    try:
        yield t
    finally:
        await t.aclose()


def damage(tier: DiskTier, layout: KVLayout) -> None:
    for i in CORRUPT:
        path = str(tier.files.path(key_of(i)))
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - layout.page_bytes + 17 * i)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))
    truncated = str(tier.files.path(key_of(TRUNCATED)))
    os.truncate(truncated, os.path.getsize(truncated) - 4096)
    os.unlink(tier.files.path(key_of(REMOVED)))


def expected() -> list[bool]:
    return [i not in CORRUPT and i not in (TRUNCATED, REMOVED) for i in range(PAGES)]


def reserve_all(pool: PagePool, first: int) -> list[PageHandle]:
    return [reserve(pool, key_of(first + i, tag=9)) for i in range(PAGES)]


@pytest.mark.asyncio
async def test_every_page_is_verified_once_wherever_it_is_hashed(tier: DiskTier, pool: PagePool,
                                                                  layout: KVLayout, spy: HashSpy) -> None:
    want = [await stored_page(tier, pool, i) for i in range(PAGES)]
    damage(tier, layout)
    spy.inline = spy.threaded = 0
    into = reserve_all(pool, 1000)
    oks = await asyncio.wait_for(tier.read_many([key_of(i) for i in range(PAGES)], into), 30)
    assert oks == expected()
    for i, h in enumerate(into):
        if oks[i]:
            assert torch.equal(payload(pool, h), want[i])
        pool.table.abort(h)
    # Every page read whole was hashed exactly once (the truncated and removed ones never were).
    assert spy.inline + spy.threaded == PAGES - 2, (spy.inline, spy.threaded)
    assert spy.inline >= 1 and spy.threaded >= 1  # both ways were taken
    stats = tier.statistics()
    assert (stats.hits, stats.in_flight) == (PAGES - 5, 0)
    assert stats.corrupt == len(CORRUPT) + 1  # the flipped payloads and the truncated file
    for i in range(PAGES):
        assert tier.contains(key_of(i)) == expected()[i]
    await tier.aclose()
    assert_clean(pool)


@pytest.mark.asyncio
async def test_cancel_at_every_step_with_faults_and_a_slow_checksum_thread(tier: DiskTier, pool: PagePool,
                                                                            layout: KVLayout, spy: HashSpy) -> None:
    want = [await stored_page(tier, pool, i) for i in range(PAGES)]
    damage(tier, layout)
    keys = [key_of(i) for i in range(PAGES)]
    step = 0
    cancelled = 0
    while True:
        assert step < most_attempts(DENSE), "the batch never completed"
        handles = reserve_all(pool, 2000 + 20 * step)
        task = asyncio.create_task(tier.read_many(keys, handles))
        await pause(step, DENSE)
        task.cancel()
        try:
            oks = await asyncio.wait_for(asyncio.shield(task), 30)
        except asyncio.CancelledError:
            cancelled += 1
            # Returned: nothing may read or write these pages any more (overwritten at once).
            fill_with = bytes([step % 251]) * layout.page_bytes
            for h in handles:
                pool.memory.page_view(pool.table.check(h))[:] = fill_with
            await tier.flush()
            await spin(20)
            assert tier.statistics().in_flight == 0
            for h in handles:
                assert bytes(pool.memory.page_view(pool.table.check(h))) == fill_with
                pool.table.abort(h)
            assert tier._index.readers == {}
            step += 1
            continue
        assert oks == expected()
        for i, h in enumerate(handles):
            if oks[i]:
                assert torch.equal(payload(pool, h), want[i])
            pool.table.abort(h)
        break
    assert cancelled >= 1
    # No good file was refused: a hash of a page its cancelled caller had overwritten would have.
    for i in range(PAGES):
        if expected()[i]:
            assert tier.contains(key_of(i)), i
    await tier.aclose()
    assert tier.statistics().in_flight == 0
    assert_clean(pool)
