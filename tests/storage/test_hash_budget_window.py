"""The inline hash budget's charge from one batch to the next (``checksum.INLINE_HASH_WINDOW_S``):
a queued batch's bytes count against the ring wake-up that follows it in the same turn (one turn
hashes at most the budget, the lag bound the budget exists for), and less and less against a
wake-up later (none after a window): asyncio counts no turns, so time ends the charge."""

from __future__ import annotations

import asyncio
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from interrupt_helpers import page_views

from aiokv.storage import checksum as checksum_module
from aiokv.storage.checksum import Checksums
from aiokv.storage.uring import OP_NOP, TURNS, UringEngine, sqe

PAGE = 64 << 10


@pytest.fixture
def views() -> Iterator[list[memoryview]]:
    with page_views(4, PAGE, fill=False) as pages:
        yield pages


@pytest.mark.asyncio
async def test_a_queued_batch_and_a_wake_up_in_one_turn_hash_at_most_the_budget(
        views: list[memoryview], monkeypatch: pytest.MonkeyPatch) -> None:
    # A caller's turn starts two pages (the whole budget), and the ring's eventfd is ready for the
    # turn their batch runs in: the wake-up after it, in that turn, starts a third page. The turn
    # must not hash three (the batch's charge expiring too early would let it).
    loop = asyncio.get_running_loop()
    selector: Any = loop._selector  # type: ignore[attr-defined]
    polls = 0
    poll = selector.select

    def counted(timeout: float | None = None) -> Any:
        nonlocal polls
        polls += 1
        return poll(timeout)

    monkeypatch.setattr(selector, "select", counted)
    checksums = Checksums(inline_bytes=PAGE, threads=1, start=False)  # no thread runs: its jobs stay queued
    checksums._turn_budget = 2 * PAGE
    checksums._window_s = 60.0  # only the turn's bound is under test here: no expiry on a loaded machine
    # Nor the batch's time bound: on a loaded host (an H200's, load 55 on 16 cores) hashing the
    # first page took past it and the second went to the next turn, breaking the premise.
    monkeypatch.setattr(checksum_module, "DELIVER_TURN_S", 60.0)
    engine = UringEngine.open(8)
    hashed_in: list[int] = []
    woken_in: list[int] = []
    read_started: asyncio.Future[None] = loop.create_future()

    def written(_value: int | BaseException) -> None:
        hashed_in.append(polls)

    def completed(_results: list[int]) -> None:
        woken_in.append(polls)
        checksums.start(views[2], lambda _value: hashed_in.append(polls))
        read_started.set_result(None)

    try:
        engine.submit([sqe(OP_NOP)], None, completed)
        await asyncio.sleep(0)  # its submission ran ahead of this step: the NOP's CQE is posted
        checksums.start(views[0], written, writing=True)
        checksums.start(views[1], written, writing=True)
        await asyncio.wait({read_started}, timeout=2)
        assert woken_in and hashed_in[:2] == [woken_in[0]] * 2, "not one turn: the test's premise broke"
        for _ in range(3):  # the wake-up's batch (if it hashed the page, it would be here)
            await asyncio.sleep(0)
        assert len(hashed_in) == 2 and checksums._jobs.qsize() == 1, "one turn hashed more than the budget"
    finally:
        checksums.close_nowait()
        await engine.aclose()


class Clock:
    """``checksum.time`` for one test: ``perf_counter`` as set, the rest the real module."""

    def __init__(self) -> None:
        self.now = 100.0
        self.module = types.SimpleNamespace(perf_counter=lambda: self.now, thread_time=time.thread_time)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    saved = (TURNS.stamp, TURNS.waking, TURNS.deadline, TURNS.after_wake)
    TURNS.after_wake = []
    fake = Clock()
    monkeypatch.setattr(checksum_module, "time", fake.module)
    try:
        yield fake
    finally:
        TURNS.stamp, TURNS.waking, TURNS.deadline, TURNS.after_wake = saved


def wake_up(start: Callable[[], None]) -> None:
    """A simulated ring wake-up (as the ring marks it in ``TURNS``) that starts pages, then its end."""
    TURNS.stamp += 1
    TURNS.waking = True
    TURNS.deadline = float("inf")
    try:
        start()
        calls, TURNS.after_wake = TURNS.after_wake, []
        for fn in calls:
            fn()
    finally:
        TURNS.waking = False
        TURNS.stamp += 1


@pytest.mark.asyncio
async def test_a_queued_batchs_charge_expires_linearly_over_the_window(
        views: list[memoryview], clock: Clock) -> None:
    queued: list[Callable[[], None]] = []
    checksums = Checksums(inline_bytes=PAGE, threads=1, start=False)
    checksums._turn_budget = 2 * PAGE
    checksums.in_next_turn = queued.append
    window = checksums._window_s
    got: list[int | BaseException] = []

    def two_pages() -> None:
        checksums.start(views[2], got.append)
        checksums.start(views[3], got.append)

    try:
        for since, inline, to_thread in ((0.0, 0, 2), (0.6, 1, 1), (1.0, 2, 0)):
            clock.now += 10.0
            checksums.start(views[0], got.append, writing=True)  # a caller's turn: the whole budget
            checksums.start(views[1], got.append, writing=True)
            queued.pop()()
            assert len(got) == 2 and checksums._jobs.qsize() == 0
            clock.now += since * window
            wake_up(two_pages)  # the budget left: 0 in the same instant, 0.8 pages at 0.6 window, all after it
            assert not queued
            assert len(got) == 2 + inline and checksums._jobs.qsize() == to_thread, f"{since} window later"
            got.clear()
            while not checksums._jobs.empty():
                checksums._jobs.get_nowait()
    finally:
        checksums.close_nowait()
