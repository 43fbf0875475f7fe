"""A call's copies go only to the rank processes attached when the call was admitted.

Regression (adversarial repro, wrong KV): with ``TPConfig(max_jobs=1)`` rank 1 kept job X in flight,
so offload Y's spec was held for room; rank 0, which held Y's KV, was killed and restarted with a
fresh buffer and attached again; the held spec was then sent to the *new* rank 0 process, which
copied its own buffer: Y was stored (``stored=4``) and a later load served those bytes as Y's KV.
A held load was sent the same way, writing the old process's KV into the slots of the new one
(they belong to its new engine state).

Now each attach of a rank starts a new session (``RankGroup.sessions()``); ``TPCache`` admits each
call with the sessions of that moment and every spec of the call carries them (held, a later
round or launch group, a stream's loader): a spec whose target rank is in another session when it
is sent fails (RANK_LOST) before any rank is sent anything. The ranks are real spawned processes
(even ranks: thread runner, odd: async runner); ``held_rank`` holds rank 1's copies so the specs
behind them wait at a known point; rank 0 is SIGKILLed and restarted with zeros.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from held_rank import HeldRanks, held_rank_main
from tp_helpers import CONFIG, SLOTS, RankProcesses, full_kv, new_pool, rank_kv

from aiokv import CacheConfig, KVLayout
from aiokv.tp import Direction, RankGroup, RankStatus, TPCache
from aiokv.tp.transfers import GroupTransfers, TransferFailedError

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
RANK_CONFIG = dataclasses.replace(CONFIG, inline_copy_bytes=0)
START_S = 120.0


class RestartableRanks(HeldRanks):
    """:class:`HeldRanks` whose ranks in :attr:`fresh` start with a zeroed buffer and unheld copies:
    a restarted process that never computed the old KV."""

    fresh: set[int]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fresh = set()

    def start(self, rank: int) -> None:
        if rank not in self.fresh:
            super().start(rank)
            return
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=held_rank_main,
            args=(child, self.address, rank, self.tp_size, self.layout, self.seed, self.slots, False,
                  rank % 2 == 0, self.config, None),
            daemon=True,
        )
        proc.start()
        child.close()
        self.procs[rank], self.ctrl[rank] = proc, parent


def _cache(tmp_path: Path) -> TPCache:
    config = CacheConfig(cpu_bytes=32 * LAYOUT.page_bytes, disk=None, namespace="tp-sessions",
                         pool_chunk_bytes=4 * LAYOUT.page_bytes, launch_pages=1, launch_turn_s=0)
    return TPCache(config, LAYOUT, tp_size=2, num_slots=SLOTS, tp_config=dataclasses.replace(CONFIG, max_jobs=1),
                   directory=tmp_path / "sock")


def _tokens(first: int, pages: int) -> list[int]:
    return list(range(first, first + pages * T))


async def _until(condition: Callable[[], bool], what: str) -> None:
    """Let the loop run until ``condition`` holds (reports arrive through the loop's callbacks)."""
    for _ in range(12000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


async def _entered(ranks: HeldRanks, copies: int = 1) -> None:
    for _ in range(copies):
        assert await asyncio.to_thread(ranks.held[1].entered.acquire, True, 60), "rank 1's copy never began"


async def _restart_rank0(ranks: RestartableRanks, group: RankGroup) -> None:
    """SIGKILL rank 0 and start a fresh one (zeros); return once the new one attached (the old
    one's end may reach the manager after the process was reaped: wait for a new session)."""
    gone = group.statistics().disconnects + 1
    ranks.kill(0)
    assert await ranks.reap(0) is not None
    ranks.fresh.add(0)
    ranks.start(0)
    async with asyncio.timeout(START_S):
        while group.statistics().disconnects < gone or 0 not in group.attached:
            await group.wait_change()


async def _specs(ranks: RankProcesses, rank: int) -> int:
    return int((await ranks.ask(rank, "stats")).specs)


def _errors(cache: TPCache) -> dict[str, int]:
    errors = cache.stats().errors
    return {kind: errors.get(kind, 0) for kind in ("copy_failed", "load_shortened")}


def _assert_released(cache: TPCache) -> None:
    stats = cache.stats()
    assert stats.pool_reserved == 0 and stats.pool_referenced == 0, "references leaked"
    cache.pool.table.check_invariants()
    group = cache.group_statistics()
    assert group.waiting == 0 and group.jobs.held == 0 and group.jobs.in_flight == 0


@pytest.mark.asyncio
async def test_an_offload_held_for_room_across_a_rank_restart_is_dropped(tmp_path: Path) -> None:
    # The repro's sequence. Old code: Y stored 2 pages of the new rank 0's zeros.
    cache = _cache(tmp_path)
    await cache.start()
    ranks = RestartableRanks(Path(cache.address), LAYOUT, 2, seed=41, held=frozenset({1}), config=RANK_CONFIG)
    held = ranks.held[1]
    try:
        ranks.start_all()
        async with asyncio.timeout(START_S):
            await cache.wait_ranks()
        group = cache.group
        before = group.sessions()
        tx = asyncio.create_task(cache.offload(_tokens(30000, 1), torch.arange(T)))
        await _entered(ranks)  # rank 1 holds X: the only room stays taken
        y_tokens = _tokens(31000, 2)
        ty = asyncio.create_task(cache.offload(y_tokens, torch.arange(T, 3 * T)))
        await _until(lambda: group.statistics().waiting == 2, "Y's two specs wait for room")
        await _until(lambda: group.jobs.owing_ranks() == {1}, "rank 0 reported X")
        await _restart_rank0(ranks, group)
        after = group.sessions()
        assert after[0] != before[0] and after[1] == before[1]
        held.release(4)
        async with asyncio.timeout(60):
            x, y = await tx, await ty
        assert x.stored == 1  # rank 0 copied X before it died; rank 1 then finished it
        assert (y.stored, y.dropped) == (0, 2), f"Y was stored from the restarted rank 0's buffer: {y}"
        match = await cache.match(y_tokens)
        assert match.pool_pages == 0, "a page of Y copied from the new rank 0 is served"
        match.release()
        assert _errors(cache) == {"copy_failed": 1, "load_shortened": 0}
        jobs = cache.group_statistics().jobs
        assert jobs.rank_failures.get(RankStatus.RANK_LOST) == 2 and jobs.failed == 2
        # Nothing of Y reached either rank: it failed before it was sent.
        assert await _specs(ranks, 0) == 0
        assert await _specs(ranks, 1) == 1  # X
        # The cache keeps serving: a call admitted now goes to the new rank 0.
        held.release()
        assert (await cache.offload(_tokens(32000, 1), torch.arange(T))).stored == 1
        assert await _specs(ranks, 0) == 1
        _assert_released(cache)
    finally:
        held.release(16)
        await cache.aclose()
        await ranks.kill_all()


@pytest.mark.asyncio
@pytest.mark.parametrize("call", ["load", "start_load"])
async def test_a_load_held_for_room_across_a_rank_restart_writes_nothing(tmp_path: Path, call: str) -> None:
    # Old code: the held load's specs went to the new rank 0 and wrote the old KV into its slots.
    pages = 2
    tokens, source, target = _tokens(33000, pages), torch.arange(pages * T), torch.arange(40, 40 + pages * T)
    cache = _cache(tmp_path)
    await cache.start()
    ranks = RestartableRanks(Path(cache.address), LAYOUT, 2, seed=42, held=frozenset({1}), config=RANK_CONFIG)
    held = ranks.held[1]
    try:
        ranks.start_all()
        async with asyncio.timeout(START_S):
            await cache.wait_ranks()
        group = cache.group
        held.release(pages)
        assert (await cache.offload(tokens, source)).stored == pages
        await _entered(ranks, pages)
        tx = asyncio.create_task(cache.offload(_tokens(34000, 1), torch.arange(80, 80 + T)))
        await _entered(ranks)  # rank 1 holds X
        match = await cache.match(tokens)
        assert match.pool_pages == pages
        loading: asyncio.Future[Any]
        if call == "load":
            loading = asyncio.create_task(cache.load(match, target))
        else:
            loading = asyncio.ensure_future(cache.start_load(match, target).finish())
        await _until(lambda: group.statistics().waiting == pages, "the load's specs wait for room")
        await _until(lambda: group.jobs.owing_ranks() == {1}, "rank 0 reported X")
        await _restart_rank0(ranks, group)
        held.release(4)
        async with asyncio.timeout(60):
            await tx
            loaded = await loading
        got = loaded.tokens if call == "load" else loaded.loaded_tokens
        assert got == 0, f"a load admitted for the old rank 0 loaded {got} tokens"
        new0 = await ranks.dump(0)
        assert not new0.any(), "the load wrote into the restarted rank 0's slots"
        assert await _specs(ranks, 0) == 0
        rank1 = await ranks.dump(1)
        assert torch.equal(rank1, rank_kv(full_kv(LAYOUT, 42), LAYOUT, 1, 2)), "rank 1's slots were written"
        jobs = cache.group_statistics().jobs
        assert jobs.rank_failures.get(RankStatus.RANK_LOST) == pages
        assert _errors(cache) == {"copy_failed": 1, "load_shortened": 1}
        _assert_released(cache)
        # A load admitted now is served to the new process, bit-exact from the pool.
        held.release(pages)
        again = await cache.load(await cache.match(tokens), target)
        assert again.tokens == pages * T
        new0 = await ranks.dump(0)
        assert torch.equal(new0[:, target], rank_kv(full_kv(LAYOUT, 42), LAYOUT, 0, 2)[:, source])
    finally:
        held.release(16)
        await cache.aclose()
        await ranks.kill_all()


@pytest.mark.asyncio
async def test_later_copies_of_an_admitted_call_never_reach_a_restarted_rank(tmp_path: Path) -> None:
    # A later round or launch group of one call, sent at once (room free), after rank 0 restarted:
    # the path of offload rounds after a wait for room and of a stream's loader task.
    pool = await new_pool(LAYOUT.for_tp(2), 16)
    group = RankGroup(LAYOUT, 2, pool.name, pool.num_pages, CONFIG, tmp_path / "g")
    await group.start()
    ranks = RestartableRanks(group.address, LAYOUT, 2, seed=43, held=frozenset())
    transfers = GroupTransfers(group)
    try:
        ranks.start_all()
        async with asyncio.timeout(START_S):
            await group.wait_attached()
        with transfers.admitted() as sessions:
            assert sessions == group.sessions() and all(sessions)
            await transfers.offload(torch.arange(T), [0]).future  # round 1: both ranks copy
            await _restart_rank0(ranks, group)
            with pytest.raises(TransferFailedError) as failed:
                await transfers.offload(torch.arange(T, 2 * T), [1]).future  # round 2
            assert [(f.rank, f.status) for f in failed.value.outcome.failures] == [(0, RankStatus.RANK_LOST)]

            async def loader() -> None:  # a task created in the call (a stream's loader) keeps it
                await transfers.load([0], torch.arange(40, 40 + T), 0).future

            with pytest.raises(TransferFailedError):
                await asyncio.create_task(loader())
            # An explicit capture of the old sessions fails the same way at the group.
            job = group.submit_nowait(group.spec(Direction.LOAD, [0], torch.arange(40, 40 + T)), sessions)
            assert [f.status for f in job.outcome().failures] == [RankStatus.RANK_LOST]
        assert await _specs(ranks, 0) == 0, "a copy of the old call reached the new rank 0"
        assert await _specs(ranks, 1) == 1
        # A call admitted now reaches the new process: page 0 (the old rank 0's heads) lands there.
        await transfers.load([0], torch.arange(40, 40 + T), 0).future
        new0 = await ranks.dump(0)
        assert torch.equal(new0[:, 40 : 40 + T], rank_kv(full_kv(LAYOUT, 43), LAYOUT, 0, 2)[:, :T])
        with pytest.raises(ValueError, match="sessions"):
            group.submit_nowait(group.spec(Direction.LOAD, [0], torch.arange(T)), (1,))
        assert group.jobs.in_flight == 0
    finally:
        await group.aclose()
        await ranks.kill_all()
        await pool.aclose()
