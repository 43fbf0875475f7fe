"""`TPCache.aclose` while a rank is still copying: no call returns while a rank moves its bytes.

Regression: past ``close_timeout_s`` the group failed every job in flight (GROUP_CLOSED) while a
live rank was still copying. A ``load``/``offload`` (cancelled or not) then returned, and the
engine reused slots the rank was still writing (LOAD) or reading (OFFLOAD); the pool was freed
under the rank's mapping; and the rank, once it saw the manager go, still ran every spec queued
on its copy thread into slots whose job had been reported failed.

Now the close fences the ranks that still owe reports (they run nothing new: queued copies are
withdrawn, the copy running ends and is reported) and waits for their reports or their end.

The ranks are real spawned processes with real workers; rank 1's copy is held inside its mover
(``held_rank``) until the test lets it run, so the close meets it at a known point.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from held_rank import HeldRanks
from tp_helpers import CONFIG, SLOTS, RankProcesses, full_kv, rank_kv

from aiokv import CacheConfig, KVLayout
from aiokv.tp import RankStatus, TPCache
from aiokv.tp import group as group_module

MHA = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = MHA.page_tokens
CLOSE_S = 0.2
"""The group's close_timeout_s: short, so the close reaches a held copy at once."""
RANK_CONFIG = dataclasses.replace(CONFIG, inline_copy_bytes=0)
"""Ranks' settings: every CPU copy of the async runner (rank 1) goes through its copy thread, so a
second spec queues behind a held one."""


def _cache(tmp_path: Path) -> TPCache:
    config = CacheConfig(cpu_bytes=16 * MHA.page_bytes, disk=None, namespace="tp-fence",
                         pool_chunk_bytes=4 * MHA.page_bytes)
    tp_config = dataclasses.replace(CONFIG, close_timeout_s=CLOSE_S)
    return TPCache(config, MHA, tp_size=2, num_slots=SLOTS, tp_config=tp_config, directory=tmp_path / "sock")


class _Seen(logging.Handler):
    """Sets an asyncio event when the group logs a message containing ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.DEBUG)
        self.text = text
        self.loop = asyncio.get_running_loop()
        self.event = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.loop.call_soon_threadsafe(self.event.set)


async def _acquire(semaphore: Any) -> None:
    assert await asyncio.to_thread(semaphore.acquire, True, 60), "the rank's copy never began"


async def _wait_specs(ranks: HeldRanks, rank: int, count: int) -> None:
    """Until rank ``rank``'s worker received ``count`` specs (round trips to the rank, bounded)."""
    for _ in range(2000):
        if (await ranks.ask(rank, "stats")).specs >= count:
            return
    raise AssertionError(f"rank {rank} never received {count} specs")


@pytest.mark.asyncio
@pytest.mark.parametrize("cancelled", [False, True], ids=["returning", "cancelled"])
@pytest.mark.parametrize("direction", ["load", "offload"])
async def test_close_waits_for_a_rank_still_copying(tmp_path: Path, direction: str, cancelled: bool) -> None:
    seen = _Seen("fencing")
    logging.getLogger(group_module.__name__).addHandler(seen)
    cache = _cache(tmp_path)
    await cache.start()
    ranks = HeldRanks(Path(cache.address), MHA, 2, seed=5, held=frozenset({1}), config=RANK_CONFIG)
    held = ranks.held[1]
    closing: asyncio.Task[None] | None = None
    try:
        ranks.start_all()
        await cache.wait_ranks()
        tokens = list(range(3000, 3000 + 2 * T))
        source, target = torch.arange(2 * T), torch.arange(40, 40 + 2 * T)
        if direction == "load":
            held.release()  # the offload that fills the pool runs freely
            assert (await cache.offload(tokens, source)).stored == 2
            await _acquire(held.entered)
            call: asyncio.Task[Any] = asyncio.create_task(cache.load(await cache.match(tokens), target))
        else:
            call = asyncio.create_task(cache.offload(tokens, source))
        await _acquire(held.entered)  # rank 1's copy has begun and waits on the gate
        copies_before = held.finished_copies()
        finished_at: list[int] = []
        call.add_done_callback(lambda _: finished_at.append(held.finished_copies()))
        if cancelled:
            call.cancel()
        closing = asyncio.create_task(cache.aclose())
        waiting = asyncio.create_task(seen.event.wait())
        async with asyncio.timeout(60):
            await asyncio.wait({call, waiting}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        # Old code: the close failed the job after CLOSE_S and the call ended with the copy held.
        assert not call.done(), "the call ended while rank 1 was still copying"
        assert not cache._manager.pool.closed, "the pool was freed under a rank still copying"
        assert not closing.done()
        held.release()
        async with asyncio.timeout(60):
            await asyncio.wait({call, closing})
        assert finished_at == [copies_before + 1], "the call ended before rank 1's copy did"
        if cancelled:
            assert call.cancelled()
        elif direction == "load":
            # Rank 1's copy ended and was reported: the load is whole and every rank holds its heads.
            assert call.result().tokens == 2 * T
            full = full_kv(MHA, 5)
            for rank in range(2):
                got = await ranks.dump(rank)
                assert torch.equal(got[:, target], rank_kv(full, MHA, rank, 2)[:, source])
        else:
            call.result()  # ended normally (whatever it could commit before the close)
        await closing
        assert cache._manager.pool.closed
    finally:
        logging.getLogger(group_module.__name__).removeHandler(seen)
        held.release(8)  # never leave a rank held when the test fails
        if closing is None:
            closing = asyncio.create_task(cache.aclose())
        await closing
        await ranks.kill_all()


@pytest.mark.asyncio
async def test_a_fenced_rank_runs_no_queued_copy_into_the_slots(tmp_path: Path) -> None:
    # Rank 1 (async runner, copy thread) holds load A's copy; load B's spec waits behind it on the
    # copy thread. The close fences rank 1: B never runs there and its load reports a miss, so the
    # engine may reuse B's slots at once; A's copy ends and is reported.
    cache = _cache(tmp_path)
    await cache.start()
    ranks = HeldRanks(Path(cache.address), MHA, 2, seed=6, held=frozenset({1}), config=RANK_CONFIG)
    held = ranks.held[1]
    closing: asyncio.Task[None] | None = None
    try:
        ranks.start_all()
        await cache.wait_ranks()
        tokens = list(range(4000, 4000 + 2 * T))
        source, slots_a, slots_b = torch.arange(2 * T), torch.arange(40, 40 + 2 * T), torch.arange(60, 60 + 2 * T)
        held.release()
        assert (await cache.offload(tokens, source)).stored == 2
        await _acquire(held.entered)
        specs = (await ranks.ask(1, "stats")).specs
        load_a = asyncio.create_task(cache.load(await cache.match(tokens), slots_a))
        await _acquire(held.entered)
        load_b = asyncio.create_task(cache.load(await cache.match(tokens), slots_b))
        await _wait_specs(ranks, 1, specs + 2)  # B is on rank 1's copy thread, behind A
        closing = asyncio.create_task(cache.aclose())
        async with asyncio.timeout(60):
            await load_b  # withdrawn on rank 1: it ends while A's copy is still held
        assert load_b.result().tokens == 0, "B counted as loaded with rank 1's heads never copied"
        assert not load_a.done()
        held.release()
        async with asyncio.timeout(60):
            assert (await load_a).tokens == 2 * T
            await closing
        full = full_kv(MHA, 6)
        got = await ranks.dump(1)
        mine = rank_kv(full, MHA, 1, 2)
        assert torch.equal(got[:, slots_a], mine[:, source])
        assert torch.equal(got[:, slots_b], mine[:, slots_b]), "a copy ran into B's slots after B ended"
        assert held.finished_copies() == 2  # the pool fill and A: B never ran
    finally:
        held.release(8)
        if closing is None:
            closing = asyncio.create_task(cache.aclose())
        await closing
        await ranks.kill_all()


@pytest.mark.asyncio
async def test_close_with_idle_ranks_is_not_held(tmp_path: Path) -> None:
    # Nothing in flight: the close neither waits CLOSE_S nor fences; connected ranks are let go.
    seen = _Seen("fencing")
    logging.getLogger(group_module.__name__).addHandler(seen)
    cache = _cache(tmp_path)
    await cache.start()
    ranks = HeldRanks(Path(cache.address), MHA, 2, seed=7, held=frozenset())
    try:
        ranks.start_all()
        await cache.wait_ranks()
        await cache.aclose()
        assert not seen.event.is_set()
        stats = cache.group_statistics()
        assert stats.jobs.in_flight == 0 and stats.fenced == 0
    finally:
        logging.getLogger(group_module.__name__).removeHandler(seen)
        await cache.aclose()
        await ranks.kill_all()



@pytest.mark.asyncio
@pytest.mark.parametrize("direction", ["load", "offload"])
async def test_a_cancelled_call_raises_only_once_the_rank_copy_is_over(tmp_path: Path, direction: str) -> None:
    # No close: the call is cancelled while rank 1's copy (into or out of its slots) is held; the
    # CancelledError comes only after that copy ended (the engine may reuse the slots at once).
    cache = _cache(tmp_path)
    await cache.start()
    ranks = HeldRanks(Path(cache.address), MHA, 2, seed=9, held=frozenset({1}), config=RANK_CONFIG)
    held = ranks.held[1]
    try:
        ranks.start_all()
        await cache.wait_ranks()
        tokens = list(range(5000, 5000 + 2 * T))
        source, target = torch.arange(2 * T), torch.arange(50, 50 + 2 * T)
        if direction == "load":
            held.release()
            assert (await cache.offload(tokens, source)).stored == 2
            await _acquire(held.entered)
            call: asyncio.Task[Any] = asyncio.create_task(cache.load(await cache.match(tokens), target))
        else:
            call = asyncio.create_task(cache.offload(tokens, source))
        await _acquire(held.entered)
        before = held.finished_copies()
        finished_at: list[int] = []
        call.add_done_callback(lambda _: finished_at.append(held.finished_copies()))
        call.cancel()
        for _ in range(20):  # loop turns: a call that did not wait for the rank would end here
            await asyncio.sleep(0)
        assert not call.done()
        held.release()
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(60):
                await call
        assert finished_at == [before + 1], "CancelledError while rank 1 still copied"
        assert cache.group.jobs.in_flight == 0
    finally:
        held.release(8)
        await cache.aclose()
        await ranks.kill_all()


LAYERED = KVLayout.mha(4, 4, 8, torch.float16, page_tokens=4)


@pytest.mark.asyncio
async def test_a_fenced_rank_stops_a_layered_load_between_layers(tmp_path: Path) -> None:
    # Rank 1 (async runner: the copy runs on its copy thread) has landed layer 0 of a layered load
    # when the close fences it; it copies the layer it is in and no further one, reports the part
    # failed (WORKER_CLOSING), and only then ends its connection.
    config = CacheConfig(cpu_bytes=16 * LAYERED.page_bytes, disk=None, namespace="tp-fence",
                         pool_chunk_bytes=4 * LAYERED.page_bytes)
    cache = TPCache(config, LAYERED, tp_size=2, num_slots=SLOTS, directory=tmp_path / "sock",
                    tp_config=dataclasses.replace(CONFIG, close_timeout_s=CLOSE_S))
    await cache.start()
    ranks = RankProcesses(Path(cache.address), LAYERED, 2, seed=8, fill=True, gated=True, config=RANK_CONFIG)
    closing: asyncio.Task[None] | None = None
    try:
        ranks.start_all()
        await cache.wait_ranks()
        tokens = list(range(6000, 6000 + 2 * T))
        source, target = torch.arange(2 * T), torch.arange(60, 60 + 2 * T)
        assert (await cache.offload(tokens, source)).stored == 2  # gathers are not gated
        before = await ranks.dump(1)
        stream = cache.start_load(await cache.match(tokens), target, layered=True)
        await stream.launched()
        for gate in ranks.gates.values():
            gate.release()
        assert await stream.wait_layer(0) is True
        closing = asyncio.create_task(cache.aclose())
        for _ in range(2000):  # round trips to rank 1 (bounded) until its session took the fence
            if not (await ranks.ask(1, "stats")).attached:
                break
        else:
            raise AssertionError("rank 1 was never fenced")
        # Rank 0 (thread runner) copies on its own loop: it sees the fence only once its copy is
        # over; let it finish. Rank 1 gets one more layer.
        for _ in range(LAYERED.num_layers - 1):
            ranks.gates[0].release()
        ranks.gates[1].release()
        async with asyncio.timeout(60):
            result = await stream.finish()
            await closing
        assert result.loaded_tokens == 0  # rank 1's heads are missing from layers 2-3
        failures = cache.group_statistics().jobs.rank_failures
        assert failures == {RankStatus.WORKER_CLOSING: 1}, failures
        full = full_kv(LAYERED, 8)
        got, want = await ranks.dump(1), rank_kv(full, LAYERED, 1, 2)
        assert torch.equal(got[:2, target], want[:2, source])  # the layers it copied
        assert torch.equal(got[2:, target], before[2:, target]), "a fenced rank copied a later layer"
    finally:
        for gate in ranks.gates.values():
            for _ in range(4 * LAYERED.num_layers):
                gate.release()
        if closing is None:
            closing = asyncio.create_task(cache.aclose())
        await closing
        await ranks.kill_all()
