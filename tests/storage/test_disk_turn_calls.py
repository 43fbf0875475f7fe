"""The I/O slots' per-turn start budget is reset from the ring's submission callback (#14).

Before, every turn that started a page scheduled a loop callback of its own (``IOSlots._next_turn``)
beside the ring's submission callback that the page's SQEs scheduled anyway; and a turn whose budget
was spent passed every free slot through the hand-off, reading the clock once per free slot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_helpers import BACKENDS, assert_clean, config, fill, key_of, payload, ready_pool, reserve, small_layout

from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage import jobs as jobs_module
from aiokv.storage.jobs import IOSlots, Job, WriteJob
from aiokv.storage.uring import OP_NOP, UringEngine, sqe

PAGES = 12


class RecordingLoop(asyncio.SelectorEventLoop):
    """Records the name of every callback scheduled with ``call_soon``."""

    def __init__(self) -> None:
        super().__init__()
        self.scheduled: list[str] = []

    def call_soon(self, callback: Callable[..., object], *args: Any,
                  context: Any = None) -> asyncio.Handle:
        self.scheduled.append(getattr(callback, "__qualname__", repr(callback)))
        return super().call_soon(callback, *args, context=context)


@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
def test_a_turn_that_starts_pages_schedules_no_callback_of_its_own(tmp_path: Path, backend: DiskBackend,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # A budget of 0: one start per turn, so every turn of the round trip resets the budget.
    monkeypatch.setattr(jobs_module, "START_TURN_S", 0.0)
    layout = small_layout()
    loop = RecordingLoop()

    async def scenario() -> None:
        with ready_pool(layout, 2 * PAGES) as pool:
            async with DiskTier(config(tmp_path / "d", backend, queue_depth=4), layout, pool) as tier:
                held = [fill(pool, key_of(i), i) for i in range(PAGES)]
                want = [payload(pool, h) for h in held]
                loop.scheduled.clear()
                writes = await asyncio.gather(*(tier.write(key_of(i), h) for i, h in enumerate(held)))
                assert writes == [True] * PAGES
                for h in held:
                    pool.table.release(h)
                pool.table.evict(pool.num_pages)
                into = [reserve(pool, key_of(i)) for i in range(PAGES)]
                assert await asyncio.gather(*(tier.read(key_of(i), h) for i, h in enumerate(into))) == [True] * PAGES
                for i, h in enumerate(into):
                    assert torch.equal(payload(pool, h), want[i])
                    pool.table.abort(h)
                turns = loop.scheduled.count("IOSlots._next_turn")
                if backend is DiskBackend.THREADS:
                    assert turns > 0  # no ring: a callback of its own, as before
                else:
                    assert turns == 0, loop.scheduled
                assert tier._io_slots.in_use == 0 and tier._io_slots.waiting == 0
            assert_clean(pool)

    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()


def test_the_reset_goes_through_the_given_hook_once_per_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    # A budget no preemption spends: three starts took more than 0.3 ms on a host running 16 test
    # workers, and the budget held two of them back (what is tested is the hook, not the budget).
    monkeypatch.setattr(jobs_module, "START_TURN_S", 60.0)
    asked: list[Callable[[], None]] = []
    slots = IOSlots(4, asked.append)
    got: list[int] = []
    for _ in range(3):
        slots.take(Job(), lambda _job, slot: got.append(slot))
    assert len(got) == 3 and len(asked) == 1  # the first start opened the budget and asked once
    asked.pop()()  # the next turn: the budget is fresh, nothing asked until a start opens it
    assert not asked
    slots.take(Job(), lambda _job, slot: got.append(slot))
    assert len(got) == 4 and len(asked) == 1


def test_a_spent_budget_reads_the_clock_per_start_not_per_free_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobs_module, "START_TURN_S", 0.0)  # one start per turn
    reads = [0]
    real = time.perf_counter

    class Clock:
        @staticmethod
        def perf_counter() -> float:
            reads[0] += 1
            return real()

    monkeypatch.setattr(jobs_module, "time", Clock)
    count = 32
    turns: list[Callable[[], None]] = []
    slots = IOSlots(count, turns.append)
    holders = [Job() for _ in range(count)]
    for holder in holders:
        slots.take(holder, lambda _job, _slot: None)
        turns.pop()()  # each holder in a turn of its own (budget 0)
    started: list[Job] = []
    waiters = [Job() for _ in range(2 * count)]
    for job in waiters:
        slots.take(job, lambda job, _slot: started.append(job))
    reads[0] = 0
    for holder in holders:
        slots.give_back(holder)  # all free in one turn: one waiter starts, the rest in later turns
    assert len(started) == 1
    while turns:
        turns.pop()()
    assert started == waiters[:count]  # FIFO, one slot each
    # A turn reads the clock to open its budget and once more to find it spent; before, once per
    # free slot as well (31 here).
    assert reads[0] <= 3 * len(started), reads[0]
    for job in waiters:
        slots.give_back(job)
        while turns:
            turns.pop()()
    assert started == waiters and slots.in_use == 0


@pytest.mark.asyncio
async def test_engine_runs_turn_calls_in_the_submission_callback() -> None:
    engine = UringEngine.open(8)
    try:
        loop = asyncio.get_running_loop()
        ran: list[str] = []
        done: list[list[int]] = []
        both = asyncio.Event()

        def completed(results: list[int]) -> None:
            done.append(results)
            if len(done) == 2:
                both.set()

        def turn() -> None:
            ran.append("turn")
            # SQEs prepared here go out in this very submission.
            engine.submit([sqe(OP_NOP)], None, completed)

        engine.submit([sqe(OP_NOP)], None, completed)
        engine.call_next_turn(turn)
        engine.call_next_turn(lambda: ran.append("second"))
        submits = engine.submits
        assert not ran
        await asyncio.sleep(0)
        assert ran == ["turn", "second"]
        assert engine.submits == submits + 1  # both chains in one io_uring_enter
        await both.wait()
        assert done == [[0], [0]]
        # Nothing prepared: the call still runs in the next turn, and asking again from inside it
        # runs it in the turn after (not the same one).
        order: list[int] = []

        def again() -> None:
            order.append(len(order))
            if len(order) < 3:
                engine.call_next_turn(again)

        engine.call_next_turn(again)
        for expected in (1, 2, 3):
            await asyncio.sleep(0)
            assert len(order) == expected
        assert loop.is_running()
    finally:
        await engine.aclose()


@pytest.mark.asyncio
async def test_a_turn_call_that_raises_is_logged_and_the_submission_goes_out(caplog: pytest.LogCaptureFixture) -> None:
    engine = UringEngine.open(8)
    try:
        done: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()

        def broken() -> None:
            raise RuntimeError("a bug")

        engine.call_next_turn(broken)
        engine.submit([sqe(OP_NOP)], None, done.set_result)
        with caplog.at_level(logging.ERROR, logger="aiokv.storage.uring"):
            assert await done == [0]
        assert "turn callback failed" in caplog.text
    finally:
        await engine.aclose()


@pytest.mark.asyncio
async def test_reads_keep_their_share_and_order_with_the_budget_spent(monkeypatch: pytest.MonkeyPatch) -> None:
    # Writes at their limit never take the read's share, and a read queued behind the budget
    # starts before later writes (FIFO across both queues), turn by turn.
    monkeypatch.setattr(jobs_module, "START_TURN_S", 0.0)
    turns: list[Callable[[], None]] = []
    slots = IOSlots(8, turns.append)
    order: list[str] = []

    def start(name: str) -> Callable[[Job, int], None]:
        return lambda _job, _slot: order.append(name)

    writes = [WriteJob(key_of(i), None, None) for i in range(12)]
    reads = [Job() for _ in range(3)]
    for i, w in enumerate(writes[:6]):
        slots.take(w, start(f"w{i}"))
    slots.take(reads[0], start("r0"))
    for i, w in enumerate(writes[6:], 6):
        slots.take(w, start(f"w{i}"))
    slots.take(reads[1], start("r1"))
    slots.take(reads[2], start("r2"))
    while turns:
        turns.pop()()
    # One start per turn, in order; writes stop at their limit, the last slot is the reads' share.
    assert slots.writes_in_use == slots.write_limit == 7
    assert order == ["w0", "w1", "w2", "w3", "w4", "w5", "r0", "w6"], order
    assert slots.in_use == 8
    slots.give_back(reads[0])  # the reads' share comes back: the next read takes it, not a write
    assert order[-1] == "r1"
    while turns:
        turns.pop()()
    slots.give_back(writes[0])  # a write's slot: the oldest waiter (w7 before r2) takes it
    assert order[-1] == "w7"
    assert slots.leave(writes[8]) and not slots.leave(writes[8])  # cancelled while queued: out
    while slots.in_use or slots.waiting:
        for job in [*writes, *reads]:
            slots.give_back(job)
        while turns:
            turns.pop()()
    assert "w8" not in order and len(order) == len(writes) + len(reads) - 1
