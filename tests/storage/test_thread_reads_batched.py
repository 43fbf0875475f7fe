"""The threads backend's reads hand the loop fewer GIL releases and wake-ups (helper-136).

Each GIL release on a disk hit's path can cost a switch interval (5 ms) beside an engine thread
running Python. Before, a worker's read woke the loop once per page (``call_soon_threadsafe``: a
self-pipe write) and asked the kernel for the file's flags (``F_GETFL``) before setting them;
now outcomes ending before the loop drained the first share one wake-up, and the flags the file
was opened with are known. Counted, not timed.
"""

from __future__ import annotations

import asyncio
import fcntl
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from disk_helpers import assert_clean, config, fill, key_of, payload, reserve

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.backends import ThreadPageIO

PAGES = 6


@pytest_asyncio.fixture
async def thread_tier(disk_dir: Path, layout: KVLayout, pool: PagePool) -> AsyncIterator[DiskTier]:
    tier = DiskTier(config(disk_dir, DiskBackend.THREADS, queue_depth=PAGES, threads=2), layout, pool)
    await tier.start()
    try:
        yield tier
    finally:
        await tier.aclose()


async def _stored(tier: DiskTier, pool: PagePool, count: int) -> list[torch.Tensor]:
    datas = []
    for i in range(count):
        h = fill(pool, key_of(i), i)
        datas.append(payload(pool, h).clone())
        assert await tier.write(key_of(i), h)
        pool.table.release(h)
    return datas


@pytest.mark.asyncio
async def test_reads_ending_while_the_loop_is_held_wake_it_once(thread_tier: DiskTier, pool: PagePool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    tier = thread_tier
    io = tier.backend
    assert isinstance(io, ThreadPageIO)
    datas = await _stored(tier, pool, PAGES)
    loop = asyncio.get_running_loop()

    # Workers wait at a gate until every read was handed to them; then the loop thread is held
    # (a bounded wait on an event, not a sleep) until every read has ended.
    gate, ended = threading.Event(), threading.Event()
    started = finished = 0
    real_load: Callable[..., int] = io._load

    def gated_load(*args: object) -> int:
        nonlocal finished
        assert gate.wait(10)
        try:
            return real_load(*args)
        finally:
            finished += 1  # (under the GIL) posted to the loop right after this returns
            if finished == PAGES:
                ended.set()

    real_start = io.start_load

    def counting_start(*args: object) -> None:
        nonlocal started
        started += 1
        real_start(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(io, "_load", gated_load)
    monkeypatch.setattr(io, "start_load", counting_start)
    wakes: list[str] = []
    real_threadsafe = loop.call_soon_threadsafe

    def spy(callback: Callable[..., object], *args: object, context: object = None) -> asyncio.Handle:
        if threading.current_thread().name.startswith("aiokv-disk"):
            wakes.append(getattr(callback, "__qualname__", repr(callback)))
        return real_threadsafe(callback, *args, context=context)  # type: ignore[arg-type]

    monkeypatch.setattr(loop, "call_soon_threadsafe", spy)
    handles = [reserve(pool, key_of(100 + i)) for i in range(PAGES)]
    try:
        batch = asyncio.ensure_future(tier.read_many([key_of(i) for i in range(PAGES)], handles))
        for _ in range(1000):
            if started == PAGES:
                break
            await asyncio.sleep(0)  # a turn: the slots' I/O starts in turns of its own
        assert started == PAGES
        gate.set()
        assert ended.wait(10)  # the loop thread held: nothing is drained meanwhile
        assert await batch == [True] * PAGES
        for handle, data in zip(handles, datas, strict=True):
            assert torch.equal(payload(pool, handle), data)
        # Before: one wake-up per page (6); now the reads that ended meanwhile share one. Each of
        # the 2 workers may post its last outcome after a drain began (the count is taken before
        # the post): at most one more wake-up each.
        assert 1 <= len(wakes) <= 3, wakes
    finally:
        for handle in handles:
            pool.table.abort(handle)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_read_sets_its_file_flags_without_asking_for_them(thread_tier: DiskTier, pool: PagePool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    tier = thread_tier
    await _stored(tier, pool, 2)
    calls: list[int] = []
    real_fcntl = fcntl.fcntl

    def counting(fd: int, cmd: int, arg: int = 0) -> int:
        if threading.current_thread().name.startswith("aiokv-disk"):
            calls.append(cmd)
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", counting)
    for i in range(2):
        into = reserve(pool, key_of(200 + i))
        try:
            assert await tier.read(key_of(i), into)
        finally:
            pool.table.abort(into)
    # One F_SETFL a page file (O_NONBLOCK off, O_DIRECT on); before, an F_GETFL each as well.
    assert calls == [fcntl.F_SETFL] * 2
    assert_clean(pool)
