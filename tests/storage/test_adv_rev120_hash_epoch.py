"""The inline hash budget of a queued batch (a caller's turn: writes being hashed) was charged to
"the next wake-up", whenever that came: a ring wake-up turns later, in a turn that hashed nothing
yet, still started with the queued batch's bytes spent and sent its reads' pages to the checksum
thread (a hand-off per page, and the thread's latency, for nothing). The counter only knows
wake-ups, not turns (asyncio counts none), and a callback per turn to end the charge costs what #14
removed: the charge now expires with time instead (``checksum.INLINE_HASH_WINDOW_S``: all of it in
the same turn, none a window later). Found by review 120 (strict xfail), fixed by helper-121."""

from __future__ import annotations

import asyncio
import mmap

import pytest

from aiokv.storage.checksum import Checksums
from aiokv.storage.uring import OP_NOP, UringEngine, sqe


@pytest.mark.asyncio
async def test_a_wake_up_turns_after_a_queued_batch_has_the_whole_budget() -> None:
    page = 64 << 10
    data = mmap.mmap(-1, 3 * page)
    whole = memoryview(data)
    views = [whole[i * page : (i + 1) * page] for i in range(3)]
    checksums = Checksums(inline_bytes=page, threads=1, start=False)  # no thread runs: its jobs stay queued
    checksums._turn_budget = 2 * page
    engine = UringEngine.open(8)
    loop = asyncio.get_running_loop()
    got: list[int | BaseException] = []
    read_hashed: asyncio.Future[None] = loop.create_future()
    try:
        checksums.start(views[0], got.append, writing=True)  # a caller's turn: two pages queued
        checksums.start(views[1], got.append, writing=True)
        for _ in range(10):  # the queued batch (the whole budget), then turns without a wake-up
            await asyncio.sleep(0)
        assert len(got) == 2 and checksums._jobs.qsize() == 0
        await asyncio.sleep(checksums._window_s)  # and a window of time: the charge has expired

        def completed(_results: list[int]) -> None:  # a read's completion, turns later
            checksums.start(views[2], lambda value: (got.append(value), read_hashed.set_result(None)))

        engine.submit([sqe(OP_NOP)], None, completed)
        await asyncio.wait({read_hashed}, timeout=2)
        assert checksums._jobs.qsize() == 0, "the read's page went to the thread: the budget was charged turns ago"
        assert len(got) == 3
    finally:
        checksums.close_nowait()
        await engine.aclose()
        for view in views:
            view.release()
        whole.release()
        data.close()
