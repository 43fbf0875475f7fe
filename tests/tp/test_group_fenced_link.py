"""A rank whose link broke while it still owed a report is fenced (half-closed: its copies may still
run). It must count as not attached from then on: the next submit failed in the middle of sending
(``write()`` after ``write_eof()`` raised ``RuntimeError``) with the spec already at the healthy
rank, and ``TPCache.load`` raised out to the engine with that rank copying into slots the engine
took back, leaking the pages' references. Now the submit fails ``NOT_ATTACHED`` before anything is
sent, and a load through the cache is a counted miss.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from test_group import FAST, LAYOUT, PAGES, FakeRank, T
from tp_helpers import key, new_pool, reserve

from aiokv import CacheConfig
from aiokv.pool import PagePool
from aiokv.tp import Direction, RankGroup, RankStatus, TPCache
from aiokv.tp.wire import FrameKind, frame


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[PagePool]:
    pool = await new_pool(PAGES, 16)
    yield pool
    pool.table.check_invariants()
    await pool.aclose()


async def _break_link(group: RankGroup, rank: FakeRank) -> None:
    """A malformed frame from the rank: the group ends the link (fencing it while it owes)."""
    fenced = group.statistics().fenced
    changed = asyncio.ensure_future(group.wait_change())
    rank.writer.write(frame(FrameKind.HELLO, b"junk"))
    await asyncio.wait_for(changed, 10)
    assert group.statistics().fenced == fenced + 1


@pytest.mark.asyncio
async def test_a_fenced_rank_gets_no_new_spec_and_nothing_is_sent(pool: PagePool, tmp_path: Path) -> None:
    async with RankGroup(LAYOUT, 2, pool.name, pool.num_pages, FAST, tmp_path / "mgr") as group:
        ranks = [await FakeRank.connect(group, r) for r in range(2)]
        try:
            await group.wait_attached()
            handles = reserve(pool, [key(i) for i in range(2)])
            owed = group.submit_nowait(group.spec(Direction.LOAD, [handles[0].page], torch.arange(T)))
            for r in ranks:
                assert (await r.next_spec()).job_id == owed.id
            ranks[0].report(owed.id)  # rank 1 still owes it: its copy may be running
            await _break_link(group, ranks[1])
            assert group.attached == frozenset({0}) and not group.all_attached
            later = group.submit_nowait(group.spec(Direction.LOAD, [handles[1].page], torch.arange(T, 2 * T)))
            outcome = await asyncio.wait_for(later, 10)
            assert not outcome.ok
            assert {f.status for f in outcome.failures} == {RankStatus.NOT_ATTACHED}
            # Nothing of it reached the healthy rank.
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(ranks[0].next_spec(), 0.3)
            assert not owed.done()  # still owed by the fenced rank, until its connection ends
            await ranks[1].close()
            assert not (await asyncio.wait_for(owed, 10)).ok
            for h in handles:
                pool.table.abort(h)
        finally:
            for r in ranks:  # a fenced rank that never ends would hold the close (by design)
                await r.close()


@pytest.mark.asyncio
async def test_a_load_after_a_fence_is_a_counted_miss_and_leaks_nothing(tmp_path: Path) -> None:
    # A disk tier of its own (the shared default directory held the pages after a first run, so the
    # write-behind below ran only then).
    config = CacheConfig(cpu_bytes=16 * LAYOUT.for_tp(2).page_bytes, namespace="fenced", disk_dir=tmp_path / "disk")
    async with TPCache(config, LAYOUT, tp_size=2, num_slots=64, tp_config=FAST, directory=tmp_path / "s") as cache:
        ranks = [await FakeRank.connect(cache.group, r) for r in range(2)]
        await cache.wait_ranks()
        hold = [False]
        specs: list[list[int]] = [[], []]
        got_spec = asyncio.Event()

        async def serve(r: int) -> None:
            while True:
                try:
                    spec = await ranks[r].next_spec()
                except (asyncio.IncompleteReadError, ConnectionError, AssertionError):
                    return
                specs[r].append(spec.job_id)
                got_spec.set()
                if not (r == 1 and hold[0]):
                    ranks[r].report(spec.job_id)

        servers = [asyncio.ensure_future(serve(r)) for r in range(2)]
        try:
            tokens = list(range(4 * T))
            assert (await cache.offload(tokens, torch.arange(4 * T))).stored == 4
            hold[0] = True  # rank 1 will owe what comes next
            before = len(specs[1])
            first = asyncio.ensure_future(cache.load(await cache.match(tokens[:T]), torch.arange(T)))
            while len(specs[1]) == before:  # until the held load's spec reached rank 1
                got_spec.clear()
                await asyncio.wait_for(got_spec.wait(), 10)
            await _break_link(cache.group, ranks[1])
            sent = len(specs[0])

            result = await cache.load(await cache.match(tokens), torch.arange(8, 8 + 4 * T))  # raised before
            assert result.tokens == 0  # a miss
            await asyncio.sleep(0.05)
            assert len(specs[0]) == sent  # nothing went to the healthy rank
            assert cache.stats().errors["copy_failed"] == 1  # counted

            await ranks[1].close()  # the fenced rank ends: what it owed fails
            assert (await asyncio.wait_for(first, 10)).tokens == 0
            # The offload's pages are queued for disk: the write-behind holds a reference on each
            # until its write ends (review 141), which flush() waits for.
            await cache.flush()
            assert cache.manager.pool.table.statistics().referenced == 0  # no reference leaked
        finally:
            for s in servers:
                s.cancel()
            for r in ranks:  # a fenced rank that never ends would hold the close (by design)
                await r.close()
