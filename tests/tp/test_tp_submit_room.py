"""Transfers beyond ``TPConfig.max_jobs`` jobs in flight wait for room instead of failing.

Regression: ``GroupTransfers`` sent each launch group with ``RankGroup.submit_nowait``; past
``max_jobs`` jobs in flight the copy failed at once (``asyncio.QueueFull``, counted
``copy_failed``): an offload dropped its pages, a load was cut short, and a layered stream's copy
was left out of ``layered_load()`` (the ranks' ``wait_layer`` then returned True for slots nothing
had loaded). ``RankGroup.submit`` waited, but a close did not end its wait (only a job ending did),
and a ``submit_nowait`` could overtake it (specs must reach the ranks in job-id order).

Now a spec past the bound is held by the group and sent, in order, as room frees; a cancelled call
withdraws its held specs (never sent); the close withdraws them at once (``pages_withdrawn``, not
a fault). The ranks are real spawned processes with real workers (even ranks: thread runner, odd:
async runner); ``held_rank`` holds rank 1's copies until the test lets them run, so the jobs in
flight stay there and the specs behind them wait at a known point.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from held_rank import Held, HeldRanks
from tp_helpers import CONFIG, SLOTS, RankProcesses, full_kv, new_pool, rank_kv

from aiokv import CacheConfig, KVLayout
from aiokv.tp import Direction, Job, RankGroup, TPCache, TPConfig
from aiokv.tp.transfers import GroupTransfers
from aiokv.transfers import CopyWithdrawn

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
MAX_JOBS = 2
RANK_CONFIG = dataclasses.replace(CONFIG, inline_copy_bytes=0)
"""Ranks' settings: every CPU copy of the async runner (rank 1) goes through its copy thread, so the
specs behind a held copy queue there (and are counted received) while it is held."""
START_S = 120.0


def _cache(tmp_path: Path, max_jobs: int = MAX_JOBS, launch_pages: int = 1) -> TPCache:
    config = CacheConfig(cpu_bytes=32 * LAYOUT.page_bytes, disk=None, namespace="tp-room",
                         pool_chunk_bytes=4 * LAYOUT.page_bytes, launch_pages=launch_pages, launch_turn_s=0)
    return TPCache(config, LAYOUT, tp_size=2, num_slots=SLOTS, tp_config=dataclasses.replace(CONFIG, max_jobs=max_jobs),
                   directory=tmp_path / "sock")


def _tokens(first: int, pages: int) -> list[int]:
    return list(range(first, first + pages * T))


async def _until(condition: Callable[[], bool], what: str) -> None:
    """Let the loop run until ``condition`` holds (the launches and the pump take loop turns)."""
    for _ in range(20000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


async def _entered(held: Held, copies: int = 1) -> None:
    for _ in range(copies):
        assert await asyncio.to_thread(held.entered.acquire, True, 60), "the rank's copy never began"


async def _specs(ranks: RankProcesses) -> list[int]:
    return [(await ranks.ask(rank, "stats")).specs for rank in range(ranks.tp_size)]


def _faults(cache: TPCache) -> dict[str, int]:
    errors = cache.stats().errors
    return {kind: errors.get(kind, 0) for kind in ("copy_failed", "load_shortened")}


def _assert_released(cache: TPCache) -> None:
    stats = cache.stats()
    assert stats.pool_reserved == 0 and stats.pool_referenced == 0, "references leaked"
    cache.pool.table.check_invariants()
    group = cache.group_statistics()
    assert group.waiting == 0 and group.jobs.held == 0 and group.jobs.in_flight == 0


@pytest.mark.asyncio
async def test_offload_and_load_beyond_max_jobs_wait_for_room_bit_exact(tmp_path: Path) -> None:
    # 12 pages, one a launch group: 12 jobs against room for 2. Old code: 10 copies failed at once.
    pages, skip = 12, 3
    tokens, source, target = _tokens(20000, pages), torch.arange(pages * T), torch.arange(48, 48 + pages * T - skip)
    async with _cache(tmp_path) as cache:
        writers = RankProcesses(Path(cache.address), LAYOUT, 2, seed=31, fill=True)
        writers.start_all()
        try:
            async with asyncio.timeout(START_S):
                await cache.wait_ranks()
            result = await cache.offload(tokens, source)
            assert (result.stored, result.dropped) == (pages, 0)
        finally:
            await writers.stop_all()
        readers = RankProcesses(Path(cache.address), LAYOUT, 2, seed=31, fill=False)
        readers.start_all()
        try:
            async with asyncio.timeout(START_S):
                await cache.wait_ranks()
            match = await cache.match(tokens)
            assert match.pool_pages == pages
            loaded = await cache.load(match, target, from_token=skip)
            assert loaded.tokens == pages * T
            full = full_kv(LAYOUT, 31)
            for rank in range(2):
                got = await readers.dump(rank)
                assert torch.equal(got[:, target], rank_kv(full, LAYOUT, rank, 2)[:, source[skip:]])
                untouched = torch.ones(SLOTS, dtype=torch.bool)
                untouched[target] = False
                assert not got[:, untouched].any(), f"rank {rank} wrote slots outside the load"
        finally:
            await readers.stop_all()
        assert _faults(cache) == {"copy_failed": 0, "load_shortened": 0}
        jobs = cache.group_statistics().jobs
        assert jobs.succeeded == 2 * pages and jobs.failed == 0 and jobs.withdrawn == 0
        assert jobs.queued > 0, "no spec waited for room: the test did not go beyond max_jobs"
        _assert_released(cache)


@pytest.mark.asyncio
async def test_a_layered_stream_held_for_room_is_waited_for_by_the_ranks(tmp_path: Path) -> None:
    # Room for one job: stream A's layered copy (gated layer by layer on both ranks) holds it, so
    # stream B's copy waits. B's job id is in B.layered_load() before it is sent; each rank's
    # engine waits for it (a placeholder) and reads B's slots only once B's layers landed there.
    layers = LAYOUT.num_layers
    tokens = _tokens(21000, 3)
    source = torch.arange(3 * T)
    slots_a, slots_b = torch.arange(20, 20 + 3 * T), torch.arange(50, 50 + 3 * T)
    async with _cache(tmp_path, max_jobs=1) as cache:
        ranks = RankProcesses(Path(cache.address), LAYOUT, 2, seed=32, fill=True, gated=True)
        ranks.start_all()
        try:
            async with asyncio.timeout(START_S):
                await cache.wait_ranks()
            assert (await cache.offload(tokens, source)).stored == 3
            queued = cache.group_statistics().jobs.queued
            stream_a = cache.start_load(await cache.match(tokens), slots_a, layered=True)
            await stream_a.launched()
            stream_b = cache.start_load(await cache.match(tokens), slots_b, layered=True)
            await stream_b.launched()
            load_b = stream_b.layered_load()
            assert len(load_b.jobs) == 1, "B's copy was left out of layered_load(): its layers are not waited for"
            assert cache.group_statistics().waiting == 1  # B's spec: held behind A
            for rank in range(2):
                ranks.send(rank, ("layers", load_b, slots_b))
            for gate in ranks.gates.values():
                for _ in range(layers):  # A's layers land; then B is sent and lands as well
                    gate.release()
            assert (await stream_a.finish()).tokens == 3 * T
            for gate in ranks.gates.values():
                for _ in range(layers):
                    gate.release()
            assert (await stream_b.finish()).tokens == 3 * T
            full = full_kv(LAYOUT, 32)
            for rank in range(2):
                want = rank_kv(full, LAYOUT, rank, 2)[:, source]
                for layer, (ok, raw) in enumerate(await ranks.reply(rank)):
                    # What rank `rank`'s engine saw right after its wait for B's layer `layer`.
                    assert ok is True
                    assert torch.equal(ranks.tensor(raw), want[layer]), f"rank {rank} read B's layer {layer} early"
        finally:
            for gate in ranks.gates.values():
                for _ in range(4 * layers):
                    gate.release()
            await ranks.kill_all()
        assert _faults(cache) == {"copy_failed": 0, "load_shortened": 0}
        assert cache.group_statistics().jobs.queued == queued + 1
        _assert_released(cache)


@pytest.mark.asyncio
@pytest.mark.parametrize("direction", ["offload", "load"])
async def test_a_call_cancelled_while_waiting_for_room_sends_nothing_more(tmp_path: Path, direction: str) -> None:
    # 6 jobs, room for 2: rank 1 holds the first copy, 4 specs wait in the group. Cancelled, the
    # call withdraws them (never sent) and returns once the 2 sent copies ended on every rank.
    pages = 6
    tokens, source, target = _tokens(22000, pages), torch.arange(pages * T), torch.arange(40, 40 + pages * T)
    cache = _cache(tmp_path)
    await cache.start()
    ranks = HeldRanks(Path(cache.address), LAYOUT, 2, seed=33, held=frozenset({1}), config=RANK_CONFIG)
    held = ranks.held[1]
    try:
        ranks.start_all()
        async with asyncio.timeout(START_S):
            await cache.wait_ranks()
        call: asyncio.Task[Any]
        if direction == "load":
            held.release(pages)  # the offload that fills the pool runs freely
            assert (await cache.offload(tokens, source)).stored == pages
            await _entered(held, pages)
            call = asyncio.create_task(cache.load(await cache.match(tokens), target))
        else:
            call = asyncio.create_task(cache.offload(tokens, source))
        await _entered(held)  # rank 1's first copy of the call began and waits on the gate
        group = cache.group
        await _until(lambda: group.statistics().waiting == pages - MAX_JOBS, "the specs past max_jobs wait")
        sent_before = group.statistics().jobs.submitted - (pages - MAX_JOBS)
        call.cancel()
        await _until(lambda: group.statistics().jobs.withdrawn == pages - MAX_JOBS, "the waiting specs withdrawn")
        assert group.statistics().waiting == 0
        assert not call.done(), "the call ended while rank 1 still copied"
        held.release(MAX_JOBS)
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(60):
                await call
        assert group.jobs.in_flight == 0, "the cancelled call returned with a copy still running"
        # A barrier on every connection: one more offload. Had a withdrawn spec been sent, a rank
        # would have received it before this one.
        held.release()
        assert (await cache.offload(_tokens(23000, 1), torch.arange(60, 60 + T))).stored == 1
        specs = await _specs(ranks)
        assert specs == [sent_before + 1] * 2, f"a withdrawn spec reached a rank: {specs}"
        assert _faults(cache) == {"copy_failed": 0, "load_shortened": 0}
        _assert_released(cache)
        if direction == "offload":
            match = await cache.match(tokens)
            assert match.pool_pages == 0, "an aborted page of the cancelled offload is served"
            match.release()
    finally:
        held.release(16)
        await cache.aclose()
        await ranks.kill_all()


@pytest.mark.asyncio
@pytest.mark.parametrize("direction", ["offload", "load"])
async def test_close_withdraws_specs_waiting_for_room_at_once(tmp_path: Path, direction: str) -> None:
    pages = 6
    tokens, source, target = _tokens(24000, pages), torch.arange(pages * T), torch.arange(40, 40 + pages * T)
    cache = _cache(tmp_path)
    await cache.start()
    ranks = HeldRanks(Path(cache.address), LAYOUT, 2, seed=34, held=frozenset({1}), config=RANK_CONFIG)
    held = ranks.held[1]
    closing: asyncio.Task[None] | None = None
    try:
        ranks.start_all()
        async with asyncio.timeout(START_S):
            await cache.wait_ranks()
        call: asyncio.Task[Any]
        if direction == "load":
            held.release(pages)
            assert (await cache.offload(tokens, source)).stored == pages
            await _entered(held, pages)
            call = asyncio.create_task(cache.load(await cache.match(tokens), target))
        else:
            call = asyncio.create_task(cache.offload(tokens, source))
        await _entered(held)
        group = cache.group
        await _until(lambda: group.statistics().waiting == pages - MAX_JOBS, "the specs past max_jobs wait")
        closing = asyncio.create_task(cache.aclose())
        # The close withdraws the waiting specs while rank 1 still holds its copy: it does not
        # wait for room (old code: they had failed at launch; RankGroup.submit waited for a job).
        await _until(lambda: group.statistics().jobs.withdrawn == pages - MAX_JOBS, "the close withdrew them")
        assert group.statistics().waiting == 0 and not call.done() and not closing.done()
        held.release(MAX_JOBS)
        async with asyncio.timeout(60):
            result = await call
            await closing
        if direction == "load":
            assert result.tokens == MAX_JOBS * T  # the prefix the sent copies loaded
        else:
            assert (result.stored, result.dropped) == (MAX_JOBS, pages - MAX_JOBS)
        assert cache.group_statistics().jobs.failed == 0
        assert _faults(cache) == {"copy_failed": 0, "load_shortened": 0}
        assert cache.stats().pages_withdrawn == pages - MAX_JOBS
    finally:
        held.release(16)
        if closing is None:
            closing = asyncio.create_task(cache.aclose())
        await closing
        await ranks.kill_all()


@pytest.mark.asyncio
async def test_group_submissions_wait_in_turn_and_the_close_ends_the_wait(tmp_path: Path) -> None:
    # RankGroup directly, room for one job. Rank 1 holds each copy until released.
    pool = await new_pool(LAYOUT.for_tp(2), 16)
    group = RankGroup(LAYOUT, 2, pool.name, pool.num_pages, TPConfig(max_jobs=1), tmp_path / "g")
    await group.start()
    ranks = HeldRanks(group.address, LAYOUT, 2, seed=35, held=frozenset({1}), config=RANK_CONFIG)
    held = ranks.held[1]
    closing: asyncio.Task[None] | None = None
    try:
        ranks.start_all()
        async with asyncio.timeout(START_S):
            await group.wait_attached()
        job_a = group.submit_nowait(group.spec(Direction.OFFLOAD, [0], range(T)))
        await _entered(held)
        task_b = asyncio.create_task(group.submit(group.spec(Direction.OFFLOAD, [1], range(T))))
        task_c = asyncio.create_task(group.submit(group.spec(Direction.OFFLOAD, [2], range(T))))
        await _until(lambda: group.statistics().waiting == 2, "B and C wait")
        overtaking: list[object] = []
        loop = asyncio.get_running_loop()

        def a_ended(_: Job) -> None:
            # Room is free now, but B and C wait ahead: a spec sent now would overtake them.
            try:
                overtaking.append(group.submit_nowait(group.spec(Direction.OFFLOAD, [3], range(T))))
            except asyncio.QueueFull as exc:
                overtaking.append(exc)
            # B is given its turn next; cancelled before it takes it, it passes the turn to C.
            loop.call_soon(task_b.cancel)

        job_a.add_done_callback(a_ended)
        held.release()
        async with asyncio.timeout(60):
            assert (await job_a).ok
            with pytest.raises(asyncio.CancelledError):
                await task_b
            job_c = await task_c
        assert len(overtaking) == 1 and isinstance(overtaking[0], asyncio.QueueFull), overtaking
        await _entered(held)  # C runs on rank 1 (held): the room stays taken
        task_e = asyncio.create_task(group.submit(group.spec(Direction.OFFLOAD, [4], range(T))))
        copy = GroupTransfers(group).load([0], torch.arange(T), 0)
        await _until(lambda: group.statistics().waiting == 2, "E and the load wait")
        closing = asyncio.create_task(group.aclose())
        # The close ends both waits at once, while C still holds the only room.
        done, _ = await asyncio.wait({task_e}, timeout=30)
        assert done, "the close did not end submit()'s wait"
        assert task_e.result().outcome().withdrawn and not task_e.result().outcome().ok
        with pytest.raises(CopyWithdrawn):
            async with asyncio.timeout(30):
                await copy.future
        assert not job_c.done() and not closing.done()
        held.release()
        async with asyncio.timeout(60):
            assert (await job_c).ok
            await closing
        jobs = group.statistics().jobs
        assert (jobs.succeeded, jobs.failed, jobs.withdrawn, jobs.held) == (2, 0, 2, 0)
        assert group.statistics().waiting == 0
        # Only A and C reached the ranks: B (cancelled), the overtaking spec, E and the load never did.
        assert await _specs(ranks) == [2, 2]
    finally:
        held.release(16)
        if closing is None:
            closing = asyncio.create_task(group.aclose())
        await closing
        await ranks.kill_all()
        await pool.aclose()
