"""Real rank processes (spawn), each with its own CPU KV buffer holding its head slice.

The test is the manager: it owns the pool and its page table, reserves pages, submits specs
through a RankGroup and commits a page only when the job succeeded on every rank.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from tp_helpers import CONFIG, RankProcesses, expected_page, full_kv, key, new_pool, rank_kv, reserve

from aiokv.layout import KVLayout
from aiokv.pagetable import PageHandle
from aiokv.pool import PagePool
from aiokv.tp import Direction, Job, RankGroup, RankStatus

START_S = 120.0
"""Bound on spawning rank processes and their first attach (torch import on a loaded machine)."""

CASES = {
    "mha-tp2": (KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4), 2),
    "mha-tp4": (KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4), 4),
    "mha-replicated-tp4": (KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4), 4),
    "mla-tp2": (KVLayout.mla(2, 16, torch.float16, page_tokens=4), 2),
}


def commit_when_done(pool: PagePool, handles: list[PageHandle], job: Job) -> None:
    """The manager's one idiom: pages are settled when the job is done, whether or not anyone awaits it."""

    def done(job: Job) -> None:
        for handle in handles:
            if job.outcome().ok:
                pool.table.commit(handle)
            else:
                pool.table.abort(handle)

    job.add_done_callback(done)


@pytest_asyncio.fixture
async def spawned() -> AsyncIterator[list[RankProcesses]]:
    groups: list[RankProcesses] = []
    yield groups
    for procs in groups:
        await procs.kill_all()  # whatever a failed test left running


def assert_clean(pool: PagePool, group: RankGroup) -> None:
    assert group.jobs.in_flight == 0, "jobs leaked"
    pool.table.check_invariants()
    assert pool.table.statistics().reserved == 0, "reservations leaked"


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(CASES))
async def test_offload_from_every_rank_then_fresh_ranks_load_their_heads(
    case: str, tmp_path: Path, spawned: list[RankProcesses]
) -> None:
    layout, tp = CASES[case]
    T = layout.page_tokens
    full = full_kv(layout, seed=7)
    slots = torch.randperm(full.shape[1], generator=torch.Generator().manual_seed(11))[: 4 * T]
    pool = await new_pool(layout.for_tp(tp), 16)
    try:
        async with RankGroup(layout, tp, pool.name, pool.num_pages, CONFIG, tmp_path / "m") as group:
            writers = RankProcesses(group.address, layout, tp, seed=7, fill=True)
            spawned.append(writers)
            writers.start_all()
            async with asyncio.timeout(START_S):
                await group.wait_attached()
            pool.pages.view(torch.uint8).fill_(0xA5)  # a rank that writes nothing leaves this pattern
            handles = reserve(pool, [key(i) for i in range(4)])
            pages = [h.page for h in handles]
            job = group.submit_nowait(group.spec(Direction.OFFLOAD, pages, slots))
            commit_when_done(pool, handles, job)
            assert (await job).ok
            assert job.ranks == group.writers  # MLA and replicas: one writer per row
            for i, page in enumerate(pages):
                want = expected_page(full, slots[i * T : (i + 1) * T].tolist(), pool.layout)
                assert torch.equal(pool.pages[page], want), f"page {i} is not the full-head reference"
            await writers.stop_all()

            readers = RankProcesses(group.address, layout, tp, seed=7, fill=False)
            spawned.append(readers)
            readers.start_all()
            async with asyncio.timeout(START_S):
                await group.wait_attached()
            refs = [pool.table.acquire(key(i)) for i in range(4)]
            target = torch.arange(full.shape[1] - 1, full.shape[1] - 4 * T, -1)  # other slots, descending
            job = group.submit_nowait(group.spec(Direction.LOAD, pages, target, skip_first=1))
            outcome = await job
            for ref in refs:
                assert ref is not None
                pool.table.release(ref)
            assert outcome.ok and job.ranks == frozenset(range(tp))
            for rank in range(tp):
                got = await readers.dump(rank)
                want = rank_kv(full, layout, rank, tp)
                assert torch.equal(got[:, target], want[:, slots[1:]]), f"rank {rank} is not bit-exact on its heads"
                rest = torch.ones(got.shape[1], dtype=torch.bool)
                rest[target] = False
                assert not got[:, rest].any(), f"rank {rank} got bytes in slots it was not asked to load"
            await readers.stop_all()
            assert_clean(pool, group)
    finally:
        await pool.aclose()


KILL_LAYOUT = KVLayout.mha(4, 4, 64, torch.float16, page_tokens=16)
KILL_SLOTS = 512
ROUNDS = 20


@pytest.mark.slow
@pytest.mark.asyncio
async def test_sigkill_at_random_moments_never_commits_a_wrong_byte(
    tmp_path: Path, spawned: list[RankProcesses]
) -> None:
    layout, tp, T = KILL_LAYOUT, 2, KILL_LAYOUT.page_tokens
    rng = random.Random(20240611)
    full = full_kv(layout, seed=3, slots=KILL_SLOTS)
    expected: dict[bytes, torch.Tensor] = {}
    failed_parts = 0
    pool = await new_pool(layout.for_tp(tp), 96)
    try:
        async with RankGroup(layout, tp, pool.name, pool.num_pages, CONFIG, tmp_path / "k") as group:
            procs = RankProcesses(group.address, layout, tp, seed=3, fill=True, slots=KILL_SLOTS)
            spawned.append(procs)
            procs.start_all()
            for round_ in range(ROUNDS):
                async with asyncio.timeout(START_S):
                    await group.wait_attached()
                jobs: list[Job] = []
                job_slots: list[list[int]] = []
                job_keys: list[list[bytes]] = []
                for j in range(6):
                    keys = [key(round_ * 100 + j * 2 + p) for p in range(2)]
                    job_keys.append(keys)
                    handles = reserve(pool, keys)
                    chosen = rng.sample(range(KILL_SLOTS), 2 * T)
                    job = group.submit_nowait(group.spec(Direction.OFFLOAD, [h.page for h in handles], chosen))
                    commit_when_done(pool, handles, job)
                    jobs.append(job)
                    job_slots.append(chosen)
                # A random moment: after k of the round's jobs completed, then a few more loop turns.
                k = rng.randrange(0, len(jobs))
                if k:
                    await _wait_done(jobs, k)
                for _ in range(rng.randrange(0, 4)):
                    await asyncio.sleep(0)  # a loop turn, not a timed wait
                victim = rng.randrange(tp)
                procs.kill(victim)
                killed_at = asyncio.get_running_loop().time()
                async with asyncio.timeout(60):  # the group notices the death (EOF) promptly
                    while victim in group.attached:
                        await group.wait_change()
                async with asyncio.timeout(60):  # never a hang
                    outcomes = [await job for job in jobs]
                took = asyncio.get_running_loop().time() - killed_at
                assert took < 20, f"jobs of a killed rank took {took:.1f} s to fail"
                for outcome, chosen, keys in zip(outcomes, job_slots, job_keys, strict=True):
                    wrong = [f for f in outcome.failures if (f.rank, f.status) != (victim, RankStatus.RANK_LOST)]
                    assert not wrong, f"round {round_}: only the killed rank {victim} may fail: {wrong}"
                    failed_parts += len(outcome.failures)
                    if outcome.ok:
                        for p, k in enumerate(keys):
                            expected[k] = expected_page(full, chosen[p * T : (p + 1) * T], pool.layout)
                _verify(pool, expected)
                assert await procs.reap(victim) == -9
                procs.start(victim)
            async with asyncio.timeout(START_S):
                await group.wait_attached()
            _verify(pool, expected)
            await procs.stop_all()
            assert failed_parts > 0, "no kill ever hit a job in flight: the test proves nothing"
            assert_clean(pool, group)
    finally:
        await pool.aclose()


async def _wait_done(jobs: list[Job], count: int) -> None:
    """Wait until ``count`` of ``jobs`` are done (an event set by their done-callbacks)."""
    reached = asyncio.Event()

    def check(_: Job) -> None:
        if sum(job.done() for job in jobs) >= count:
            reached.set()

    for job in jobs:
        job.add_done_callback(check)
    await reached.wait()


def _verify(pool: PagePool, expected: dict[bytes, torch.Tensor]) -> None:
    """Every page the harness committed (and the pool still holds) has exactly the reference bytes."""
    for k in list(expected):
        handle = pool.table.acquire(k)
        if handle is None:
            del expected[k]  # evicted to make room: nothing to check any more
            continue
        try:
            assert torch.equal(pool.tensor(handle), expected[k]), "a committed page holds a wrong byte"
        finally:
            pool.table.release(handle)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_live_workers_reattach_to_a_restarted_manager(tmp_path: Path, spawned: list[RankProcesses]) -> None:
    layout, tp = CASES["mha-tp2"]
    T = layout.page_tokens
    full = full_kv(layout, seed=5)
    directory = tmp_path / "mgr"
    first_pool = await new_pool(layout.for_tp(tp), 8)
    try:
        async with RankGroup(layout, tp, first_pool.name, first_pool.num_pages, CONFIG, directory) as first:
            procs = RankProcesses(first.address, layout, tp, seed=5, fill=True)
            spawned.append(procs)
            procs.start_all()
            async with asyncio.timeout(START_S):
                await first.wait_attached()
            assert (await first.submit_nowait(first.spec(Direction.OFFLOAD, [1], range(T)))).ok
            assert torch.equal(first_pool.pages[1], expected_page(full, range(T), first_pool.layout))
            assert_clean(first_pool, first)
    finally:
        await first_pool.aclose()
    second_pool = await new_pool(layout.for_tp(tp), 8)
    try:
        async with RankGroup(layout, tp, second_pool.name, second_pool.num_pages, CONFIG, directory) as second:
            async with asyncio.timeout(START_S):
                await second.wait_attached()
            job = second.submit_nowait(second.spec(Direction.OFFLOAD, [6], range(2 * T, 3 * T)))
            assert (await job).ok
            assert torch.equal(second_pool.pages[6], expected_page(full, range(2 * T, 3 * T), second_pool.layout))
            for rank in range(tp):
                stats = await procs.ask(rank, "stats")
                assert stats.sessions == 2 and stats.epoch == second.epoch
                assert await procs.ask(rank, "maps") == {second_pool.name}, "the old pool is still mapped"
            await procs.stop_all()
            assert_clean(second_pool, second)
    finally:
        await second_pool.aclose()
