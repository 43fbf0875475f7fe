"""Review 123 of a0549c3: a KeyboardInterrupt (a real SIGINT, raised by Python's handler in the loop
thread) at the points of the ring's and the checksums' hot paths that a0549c3 left open. Python
raises a signal's exception at its next check for pending signals: after a C call returns (a clock
read, a syscall) and at a function's first line. Each scenario runs on a loop of its own; the next
run of the loop must end every request and hash exactly once, and leave nothing counted.

The points are chosen with a profile hook that raises the signal for real at the ``call`` (the
function's entry, before its first line) or ``c_call`` event of the place named."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
import types
from collections.abc import Callable

import pytest
from interrupt_helpers import idle_turns, open_engine, page_views, private_loop, run

from aiokv.storage import checksum as checksum_module
from aiokv.storage import uring as uring_module
from aiokv.storage.checksum import Checksums
from aiokv.storage.pagefile import payload_checksum
from aiokv.storage.uring import OP_NOP, sqe

PAGE = 16 << 10


def interrupt_at(event: str, name: str, caller: str | None = None) -> list[bool]:
    """A real SIGINT raised once at the ``event`` (``call``: the entry of the Python function
    ``name``; ``c_call``: a call of the C function ``name`` from the function ``caller``); returns
    the list that is emptied when it fired."""
    armed = [True]

    def hook(frame: types.FrameType, what: str, arg: object) -> None:
        if not armed or what != event:
            return
        if what == "call" and frame.f_code.co_name != name:
            return
        if what == "c_call" and (getattr(arg, "__name__", None) != name or frame.f_code.co_name != caller):
            return
        armed.clear()
        sys.setprofile(None)
        signal.raise_signal(signal.SIGINT)  # Python's handler raises KeyboardInterrupt here

    sys.setprofile(hook)
    return armed


def test_an_interrupt_at_the_clock_read_after_io_uring_enter_leaves_nothing_prepared(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel took the SQE; the signal came in the call and was raised at the next call, the
    # submit's clock read, outside a0549c3's guard. Before: the SQE stayed counted as prepared and
    # the loop entered the kernel with nothing to submit every turn for ever (a busy loop).
    real_enter = uring_module.io_uring_enter
    state: list[str] = []

    def entering(fd: int, to_submit: int) -> int:
        taken = real_enter(fd, to_submit)
        if to_submit and not state:
            state.append("entered")
        return taken

    def perf_counter() -> float:
        if state == ["entered"]:
            state.append("raised")
            signal.raise_signal(signal.SIGINT)
        return time.perf_counter()

    monkeypatch.setattr(uring_module, "io_uring_enter", entering)
    monkeypatch.setattr(uring_module, "time", types.SimpleNamespace(perf_counter=perf_counter))
    with private_loop() as loop:
        engine = run(loop, open_engine())

        async def first() -> int:
            return await engine.nop()

        task = loop.create_task(first())
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(task)
        assert state == ["entered", "raised"]
        assert run(loop, asyncio.shield(task)) == 0
        submits = engine.submits
        run(loop, idle_turns(20))
        assert engine.submits == submits, "the loop enters the kernel with nothing to submit"
        assert engine._prepared == 0 and not engine._chains
        run(loop, engine.aclose())


@pytest.mark.parametrize("path", ["turn-call", "wake-up-call"])
def test_a_hash_batch_interrupted_at_its_entry_runs_in_the_next_turn(path: str) -> None:
    # The batch (Checksums._hash_inline) is a turn call of the ring's submission, or a call at a
    # wake-up's end (a read's completion started the hash). Before: a0549c3 counted it as run; its
    # flag stayed set and no page was hashed inline ever again (every later read and write hung).
    with private_loop() as loop, page_views(2, PAGE) as views:
        engine = run(loop, open_engine())
        checksums = Checksums(inline_bytes=PAGE, threads=1, start=False)  # no thread: all inline
        checksums.in_next_turn = engine.call_next_turn
        got: list[tuple[int, int | BaseException]] = []

        async def scenario() -> None:
            if path == "turn-call":
                checksums.start(views[0], lambda value: got.append((0, value)))
                engine.nop()  # a submission this turn: the batch runs in it
            else:
                started: asyncio.Future[None] = loop.create_future()

                def completed(_results: list[int]) -> None:  # in the wake-up: hashed at its end
                    checksums.start(views[0], lambda value: got.append((0, value)))
                    started.set_result(None)

                engine.submit([sqe(OP_NOP)], None, completed)
                await started
            await idle_turns()

        armed = interrupt_at("call", "_hash_inline")
        task = loop.create_task(scenario())
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(task)
        assert not armed
        run(loop, asyncio.shield(task))
        run(loop, idle_turns())
        checksums.start(views[1], lambda value: got.append((1, value)))
        run(loop, idle_turns())
        assert got == [(0, payload_checksum(views[0])), (1, payload_checksum(views[1]))]
        assert not checksums._batch_scheduled and not checksums._inline_jobs
        run(loop, engine.aclose())
        checksums.close_nowait()


def test_a_hash_batch_interrupted_before_a_page_goes_to_the_thread_keeps_that_page(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Over the turn's budget a page goes to the thread; the interrupt came at the loop lookup just
    # before the put, once the page was counted handed on. Before: that page was never hashed.
    with private_loop() as loop, page_views(2, PAGE) as views:
        checksums = Checksums(inline_bytes=PAGE, threads=1, start=False)  # the thread's queue stays
        checksums._turn_budget = PAGE  # one page inline per batch, the second to the thread
        # Not the batch's time bound: past it (the first hash on a loaded H200 host) the second
        # page waits for the next turn's batch and is hashed inline there, never reaching the put.
        monkeypatch.setattr(checksum_module, "DELIVER_TURN_S", 60.0)
        got: list[int | BaseException] = []

        async def scenario() -> None:
            for view in views:
                checksums.start(view, got.append)
            await idle_turns()

        armed = interrupt_at("c_call", "get_running_loop", caller="_hash_inline")
        task = loop.create_task(scenario())
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(task)
        assert not armed
        run(loop, asyncio.shield(task))
        run(loop, idle_turns())
        queued = checksums._jobs.qsize()
        assert len(got) + queued == 2, f"a page lost: {len(got)} hashed inline, {queued} queued"
        assert got == [payload_checksum(views[0])] and queued == 1
        checksums.close_nowait()


def test_an_interrupt_in_a_delivered_hash_callback_delivers_the_rest_next_turn() -> None:
    # The thread's results reach the loop in batches (Checksums._deliver); a signal raised in one
    # page's callback. Before: the results after it were dropped (those pages' reads never ended).
    with private_loop() as loop:
        checksums = Checksums(threads=1, start=False)
        got: list[tuple[int, int | BaseException]] = []
        armed = [True]

        def done_for(i: int) -> Callable[[int | BaseException], None]:
            def done(value: int | BaseException) -> None:
                got.append((i, value))
                if armed:
                    armed.clear()
                    signal.raise_signal(signal.SIGINT)
            return done

        async def scenario() -> None:
            with checksums._lock:  # three results of the thread, announced by one wake-up
                checksums._results.extend((done_for(i), i) for i in range(3))
                checksums._wake_pending = True
            loop.call_soon(checksums._deliver)
            await idle_turns()

        task = loop.create_task(scenario())
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(task)
        run(loop, asyncio.shield(task))
        run(loop, idle_turns())
        assert got == [(0, 0), (1, 1), (2, 2)], "a result dropped or delivered twice"
        assert not checksums._results and not checksums._wake_pending
        checksums.close_nowait()


def test_a_wake_up_interrupted_before_its_drain_drains_in_the_next_turn() -> None:
    # The eventfd was read, then the signal was raised at the drain's clock read, before its guard.
    # Before: no wake-up came for the CQE already posted; with nothing else in flight the NOP's
    # caller and aclose waited for ever.
    with private_loop() as loop:
        engine = run(loop, open_engine())

        async def first() -> int:
            return await engine.nop()

        armed = interrupt_at("c_call", "perf_counter", caller="_drain")
        task = loop.create_task(first())
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(task)
        assert not armed
        assert run(loop, asyncio.shield(task)) == 0
        run(loop, idle_turns())
        assert not engine._inflight and engine._rings.cq_head.value == engine._rings.cq_tail.value
        run(loop, engine.aclose())
