"""The wake-up turn counter (``uring.TURNS``) is per thread: two rings on one loop (two tiers, as
TP ranks sharing a loop would have) and two loops taking turns on one thread (a manager's loop and
a rank's, run one after the other) share it. Their budgets and the work asked for at a wake-up's
end must stay correct across them: every page read exact, every corrupt page refused, nothing left
asked for, nothing in flight."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
from disk_helpers import assert_clean, config, fill, key_of, payload, ready_pool, reserve, small_layout

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.uring import TURNS

PAGES = 10
BAD = 4


async def stored(tier: DiskTier, pool: PagePool, tag: int) -> list[torch.Tensor]:
    want = []
    for i in range(PAGES):
        h = fill(pool, key_of(i, tag), 100 * tag + i)
        want.append(payload(pool, h).clone())
        assert await tier.write(key_of(i, tag), h)
        pool.table.release(h)
    flip(str(tier.files.path(key_of(BAD, tag))))
    return want


def flip(path: str) -> None:
    """One payload byte of the page file at ``path`` flipped: its read must be refused."""
    fd = os.open(path, os.O_RDWR)
    try:
        at = os.fstat(fd).st_size - 100
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 1]), at)
    finally:
        os.close(fd)


async def read_all(tier: DiskTier, pool: PagePool, tag: int, want: list[torch.Tensor], round_: int) -> None:
    into = [reserve(pool, key_of(1000 + 50 * round_ + i, tag)) for i in range(PAGES)]
    oks = await asyncio.wait_for(tier.read_many([key_of(i, tag) for i in range(PAGES)], into), 30)
    assert oks == [i != BAD for i in range(PAGES)], round_  # the bad page: refused, then a miss
    for i, h in enumerate(into):
        if oks[i]:
            assert torch.equal(payload(pool, h), want[i])
        pool.table.abort(h)


def check_idle(tier: DiskTier, tag: int) -> None:
    stats = tier.statistics()
    assert stats.in_flight == 0 and stats.corrupt == 1
    assert not tier.contains(key_of(BAD, tag))
    assert not TURNS.waking and not TURNS.after_wake


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", [DiskBackend.URING_FIXED, DiskBackend.URING], ids=["fixed", "plain"])
async def test_two_rings_on_one_loop(tmp_path: Path, backend: DiskBackend, layout: KVLayout) -> None:
    with ready_pool(layout, 4 * PAGES + 8) as pool:
        async with DiskTier(config(tmp_path / "a", backend, queue_depth=2), layout, pool) as a, \
                DiskTier(config(tmp_path / "b", backend, queue_depth=3), layout, pool) as b:
            want_a, want_b = await stored(a, pool, 1), await stored(b, pool, 2)
            for round_ in range(3):  # both streaming at once: their completions share the loop's turns
                await asyncio.gather(read_all(a, pool, 1, want_a, round_), read_all(b, pool, 2, want_b, round_))
            check_idle(a, 1)
            check_idle(b, 2)
        assert_clean(pool)


@pytest.mark.parametrize("backend", [DiskBackend.URING_FIXED, DiskBackend.URING], ids=["fixed", "plain"])
def test_two_loops_taking_turns_on_one_thread(tmp_path: Path, backend: DiskBackend) -> None:
    layout = small_layout()
    loops = [asyncio.new_event_loop(), asyncio.new_event_loop()]
    try:
        with ready_pool(layout, 2 * PAGES + 4) as pool_a, ready_pool(layout, 2 * PAGES + 4) as pool_b:
            pools = [pool_a, pool_b]
            tiers = [DiskTier(config(tmp_path / f"t{n}", backend, queue_depth=2), layout, pools[n]) for n in range(2)]
            wants: list[list[torch.Tensor]] = []
            for n in range(2):
                loops[n].run_until_complete(tiers[n].start())
                wants.append(loops[n].run_until_complete(stored(tiers[n], pools[n], n + 1)))
            for round_ in range(4):  # one loop's batch, then the other's, on this one thread
                for n in range(2):
                    loops[n].run_until_complete(read_all(tiers[n], pools[n], n + 1, wants[n], round_))
            for n in range(2):
                check_idle(tiers[n], n + 1)
                loops[n].run_until_complete(tiers[n].aclose())
                assert_clean(pools[n])
    finally:
        for loop in loops:
            loop.close()
