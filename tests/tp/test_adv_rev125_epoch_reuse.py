"""Review 125: an engine's announcement (``RankWorker.begin_stream(stream_id, epoch)``) of a stream
of an earlier manager must never become the mark of a later manager's stream with the same id.

Stream ids restart at 1 in each ``RankGroup``; the announcement's epoch is what tells them apart.
``RankGroup(epoch=...)`` was public, so two groups could share an epoch (one restarted with the
same epoch, over the same pool or a new one). A step carrying an old group's id that reaches the
rank's engine after its worker re-attached to the new group was recorded as a mark of the *new*
group's stream of that id, before that stream began: the new stream's copies were then ordered
after a point that misses the engine's work queued between the stale announcement and
``start_load`` (on a GPU, a copy into slots the engine still read or wrote). Now every group draws
its own epoch (``draw_epoch``); the tests force a collision by patching it, to hold the workers'
own defence, and run once with drawn epochs. CPU ranks record no event: each mark is
a stand-in naming who recorded it, and the test checks which one the new stream's copy gets.

Real pieces: a real socket per group, a ``RankWorkerThread`` (its own thread and loop) that really
detaches from the first group and re-attaches to the second.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tp_helpers import CONFIG, new_pool

from aiokv import KVLayout
from aiokv.pool import PagePool
from aiokv.tp import Direction, RankExecutor, RankGroup, RankStatus, RankWorkerThread
from aiokv.tp.endpoint import SOCKET_NAME
from aiokv.tp.executor import Announced
from aiokv.tp.group import draw_epoch

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
EPOCH = 0x5EED_125
BOUND_S = 30.0


@dataclass(frozen=True)
class StandIn:
    seq: int
    stream: int
    by: str  # "frame" or "engine"


class Spy:
    """Marks are stand-ins; every ``_after`` lookup of a LOAD spec is logged as (stream, mark)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.after: list[tuple[int, Any]] = []
        self._now = threading.local()
        seq = itertools.count(1)
        begin, announce, after = RankExecutor.begin_stream, RankExecutor.announce_stream, RankExecutor._after
        spy = self

        def spy_begin(self: RankExecutor, stream: int) -> None:
            spy._now.v = (stream, "frame")
            begin(self, stream)

        def spy_announce(self: RankExecutor, stream: int) -> Announced:
            spy._now.v = (stream, "engine")
            return announce(self, stream)

        def stand_in(self: RankExecutor) -> object:
            stream, by = spy._now.v
            return StandIn(next(seq), stream, by)

        def spy_after(self: RankExecutor, spec: Any) -> Any:
            got = after(self, spec)
            spy.after.append((spec.stream, got))
            return got

        monkeypatch.setattr(RankExecutor, "begin_stream", spy_begin)
        monkeypatch.setattr(RankExecutor, "announce_stream", spy_announce)
        monkeypatch.setattr(RankExecutor, "_record_mark", stand_in)
        monkeypatch.setattr(RankExecutor, "_after", spy_after)


async def _until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(BOUND_S):
        while not check():  # noqa: ASYNC110 (a counter of the worker's thread)
            await asyncio.sleep(0.005)


async def _load(group: RankGroup, stream: int) -> None:
    job = await group.submit(group.spec(Direction.LOAD, [0], torch.arange(T), stream=stream))
    async with asyncio.timeout(BOUND_S):
        outcome = await job
    assert outcome.ok, outcome


async def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pools: list[PagePool],
               collide: bool = True) -> tuple[Spy, Any, bool]:
    spy = Spy(monkeypatch)
    if collide:
        monkeypatch.setattr("aiokv.tp.group.draw_epoch", lambda: EPOCH)
    kv = torch.zeros(LAYOUT.num_layers, 64, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    directory = tmp_path / "mgr"
    first, second = pools[0], pools[-1]
    with RankWorkerThread(directory / SOCKET_NAME, 0, 1, LAYOUT, kv, CONFIG) as thread:
        async with RankGroup(LAYOUT, 1, first.name, first.num_pages, CONFIG, directory) as old:
            epoch = old.epoch
            assert thread.worker.address == old.address
            async with asyncio.timeout(BOUND_S):
                await old.wait_attached()
            streams = [old.begin_stream() for _ in range(3)]
            assert streams == [1, 2, 3]
            for stream in streams:
                await _load(old, stream)
        # The old group is gone; a step of it carrying stream 2 is still in the engine's queue.
        async with RankGroup(LAYOUT, 1, second.name, second.num_pages, CONFIG, directory) as new:
            assert (new.epoch == epoch) is collide
            async with asyncio.timeout(BOUND_S):
                await new.wait_attached()
            await _until(lambda: thread.worker.statistics().sessions == 2)
            stale = thread.begin_stream(2, epoch)  # the old group's stream 2, announced late
            # The new group begins its own streams 1 and 2, much later than that announcement.
            assert [new.begin_stream(), new.begin_stream()] == [1, 2]
            await _load(new, 2)
            stats = await asyncio.to_thread(thread.statistics)
    return spy, stats, stale


@pytest.mark.asyncio
@pytest.mark.parametrize("collide", [True, False], ids=["forced-collision", "drawn"])
@pytest.mark.parametrize("same_pool", [True, False], ids=["same-pool", "new-pool"])
async def test_a_stale_announcement_never_marks_a_later_group_s_stream_of_the_same_epoch_and_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, same_pool: bool, collide: bool
) -> None:
    pools = [await new_pool(LAYOUT, 8)] + ([] if same_pool else [await new_pool(LAYOUT, 8)])
    try:
        spy, stats, stale = await _run(tmp_path, monkeypatch, pools, collide)
    finally:
        for pool in pools:
            await pool.aclose()
    assert stale is False, "an old group's stream was recorded as a mark of the new session"
    # The new group's stream 2 is ordered after the mark its frame recorded, never the stale one.
    (stream, mark), = spy.after[-1:]
    assert stream == 2 and isinstance(mark, StandIn), spy.after
    assert (mark.stream, mark.by) == (2, "frame"), f"the new stream 2 follows a stale mark: {mark}"
    assert stats.stream_marks_announced == 0 and stats.stream_announces_ignored == 1, stats
    assert set(stats.reports) == {RankStatus.OK}, stats


@pytest.mark.asyncio
async def test_hostile_announcements_from_an_engine_thread_raise_in_that_thread_and_hold_bounded_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # numpy ints and bools, None, floats, ids outside u64: TypeError/ValueError in the calling
    # thread, nothing on the worker's loop; thousands of valid-looking ids (inside the window,
    # never begun) keep at most TPConfig.stream_marks marks; the worker serves on, and the stream
    # begun after all that still gets its frame's mark (its id was announced only before it began
    # by a junk burst that the frame's mark does not follow: it is above the window then).
    import numpy as np

    spy = Spy(monkeypatch)
    monkeypatch.setattr("aiokv.tp.group.draw_epoch", lambda: EPOCH)
    pool = await new_pool(LAYOUT, 8)
    kv = torch.zeros(LAYOUT.num_layers, 64, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    directory = tmp_path / "mgr"
    calls = 0
    try:
        with RankWorkerThread(directory / SOCKET_NAME, 0, 1, LAYOUT, kv, CONFIG) as thread:
            async with RankGroup(LAYOUT, 1, pool.name, pool.num_pages, CONFIG, directory) as group:
                async with asyncio.timeout(BOUND_S):
                    await group.wait_attached()

                def hostile() -> int:
                    n = 0
                    for bad in (np.int64(1), np.uint64(1), np.bool_(True), True, None, 1.0, float("nan"), "1"):
                        with pytest.raises(TypeError):
                            thread.begin_stream(bad, EPOCH)  # type: ignore[arg-type]
                        with pytest.raises(TypeError):
                            thread.begin_stream(1, bad)  # type: ignore[arg-type]
                    for bad_id in (-1, 2**64, 2**200, -(2**200)):
                        with pytest.raises(ValueError, match="stream_id must be in"):
                            thread.begin_stream(bad_id, EPOCH)
                    for stream_id in range(1000, 6000):  # far past the window: refused
                        thread.begin_stream(stream_id, EPOCH)
                        n += 1
                    for stream_id in range(2, 2 + 3 * CONFIG.stream_marks):  # in and past the window
                        thread.begin_stream(stream_id, EPOCH)
                        n += 1
                    return n

                calls = await asyncio.to_thread(hostile)
                executor = thread.worker._executor
                assert executor is not None
                assert len(executor._marks) <= CONFIG.stream_marks
                stats = await asyncio.to_thread(thread.statistics)
                assert stats.stream_marks_announced == CONFIG.stream_marks - 1, stats  # ids 2..256: the window
                counted = stats.stream_marks_announced + stats.stream_announces_held + stats.stream_announces_ignored
                assert counted == calls, (stats, calls)
                assert group.begin_stream() == 1  # never announced: the frame marks it
                await _load(group, 1)
                assert spy.after[-1] == (1, StandIn(spy.after[-1][1].seq, 1, "frame")), spy.after[-1]
                stats = await asyncio.to_thread(thread.statistics)
                assert (stats.link_errors, set(stats.reports)) == (0, {RankStatus.OK}), stats
    finally:
        await pool.aclose()


def test_every_group_draws_its_own_epoch_and_the_caller_cannot_choose_one() -> None:
    epochs = {RankGroup(LAYOUT, 1, "/aiokv-never-started", 4).epoch for _ in range(64)}
    assert len(epochs) == 64 and all(0 < e < 2**63 + 1 for e in epochs)
    assert all(0 < draw_epoch() <= 2**63 for _ in range(1000))
    with pytest.raises(TypeError):
        RankGroup(LAYOUT, 1, "/aiokv-never-started", 4, epoch=EPOCH)  # type: ignore[call-arg]
