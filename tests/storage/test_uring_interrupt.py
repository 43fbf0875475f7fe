"""A KeyboardInterrupt (a real SIGINT, raised by Python's own handler in the loop thread) out of the
ring's submission path or a wake-up's calls, or out of an inline hash batch, stops the loop; the
loop's next run (``aclose``, the caller's cleanup) must find nothing forgotten: the SQEs prepared
go out, the calls after the interrupted one run, the pages of the batch get their checksums, and
nothing is left counted as prepared (the loop would enter the kernel with nothing every turn).

Each scenario runs on a loop of its own: the interrupt leaves ``run_until_complete`` as it would
leave ``asyncio.run`` in an application."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from interrupt_helpers import idle_turns, interrupt, open_engine, page_views, private_loop, run, wait

from aiokv.storage import checksum as checksum_module
from aiokv.storage import uring as uring_module
from aiokv.storage.checksum import Checksums
from aiokv.storage.pagefile import payload_checksum
from aiokv.storage.uring import OP_NOP, TURNS, UringEngine, sqe

PAGE = 64 << 10


def assert_idle(engine: UringEngine) -> None:
    assert engine._prepared == 0 and not engine._chains, "SQEs left counted as prepared"
    assert not engine._submit_scheduled and not engine._turn_calls


def test_a_turn_call_interrupted_leaves_the_calls_after_it_and_the_submission() -> None:
    # Before: the submission callback's flag stayed set with nothing queued; the NOP was never
    # submitted, no turn call ran again (the tier's hash batches are turn calls), aclose hung.
    with private_loop() as loop:
        engine = run(loop, open_engine())
        after: list[str] = []

        async def scenario() -> int:
            nop = engine.nop()
            engine.call_next_turn(interrupt)
            engine.call_next_turn(lambda: after.append("next"))
            return await nop

        task = loop.create_task(scenario())
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(task)
        assert not task.done()
        assert run(loop, wait(task)) == 0
        assert after == ["next"]
        run(loop, idle_turns())
        assert_idle(engine)
        run(loop, engine.aclose())


@pytest.mark.parametrize("took", [True, False], ids=["after-the-kernel-took-them", "before-it-did"])
def test_an_interrupt_as_io_uring_enter_returns(took: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # The signal comes while the loop is in the kernel (a submit may block there for ms) and is
    # raised as the call returns. Before: taken, the SQE stayed counted as prepared and the loop
    # entered the kernel with nothing to submit every turn; not taken, its chain was forgotten and
    # the next NOP's SQE never went out (that caller and aclose hung).
    real = uring_module.io_uring_enter
    armed = [True]

    def entering(fd: int, to_submit: int) -> int:
        if armed and to_submit:
            armed.clear()
            if took:
                real(fd, to_submit)
            interrupt()
        return real(fd, to_submit)

    monkeypatch.setattr(uring_module, "io_uring_enter", entering)
    with private_loop() as loop:
        engine = run(loop, open_engine())

        async def first() -> int:
            return await engine.nop()

        task = loop.create_task(first())
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(task)
        assert not armed

        async def then() -> tuple[int, int]:
            second = await engine.nop()
            return await task, second

        assert run(loop, then()) == (0, 0)
        submits = engine.submits
        run(loop, idle_turns())
        assert engine.submits == submits, "the loop enters the kernel with nothing to submit"
        assert_idle(engine)
        run(loop, engine.aclose())


def test_a_wake_up_call_interrupted_leaves_the_calls_after_it() -> None:
    # Before: the calls asked for at the wake-up's end after the interrupted one were dropped (an
    # inline hash batch among them: its pages' reads never ended).
    with private_loop() as loop:
        engine = run(loop, open_engine())
        after: list[str] = []

        async def scenario() -> None:
            completed: asyncio.Future[None] = loop.create_future()

            def done(_results: list[int]) -> None:
                assert TURNS.call_after_wake(interrupt)
                assert TURNS.call_after_wake(lambda: after.append("after"))
                completed.set_result(None)

            engine.submit([sqe(OP_NOP)], None, done)
            await completed

        task = loop.create_task(scenario())
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(task)
        assert not TURNS.waking and not TURNS.after_wake
        run(loop, wait(task))
        run(loop, idle_turns())
        assert after == ["after"]
        assert_idle(engine)
        run(loop, engine.aclose())


@pytest.mark.parametrize("where", ["hash", "callback"])
def test_an_inline_hash_batch_interrupted_hashes_the_rest_next_turn(
        where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The signal comes while a page is hashed (the GIL is released then) or in a page's callback.
    # Before: the pages after it in the batch were forgotten (their reads and writes never ended).
    armed = [True]
    real = checksum_module.payload_checksum

    def hashing(view: memoryview) -> int:
        value = real(view)
        if where == "hash" and armed:
            armed.clear()
            interrupt()
        return value

    monkeypatch.setattr(checksum_module, "payload_checksum", hashing)
    got: dict[int, list[int | BaseException]] = {0: [], 1: [], 2: []}

    def done_for(i: int) -> Callable[[int | BaseException], None]:
        def done(value: int | BaseException) -> None:
            got[i].append(value)
            if where == "callback" and armed:
                armed.clear()
                interrupt()
        return done

    with private_loop() as loop, page_views(3, PAGE) as views:
        checksums = Checksums(inline_bytes=PAGE, threads=1, start=False)  # no thread: all inline
        checksums._turn_budget = 3 * PAGE

        async def scenario() -> None:
            for i, view in enumerate(views):
                checksums.start(view, done_for(i))
            await idle_turns()

        task = loop.create_task(scenario())
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(task)
        assert not armed
        run(loop, wait(task))
        assert got == {i: [payload_checksum(views[i])] for i in range(3)}, "a page's checksum lost or doubled"
        assert checksums._jobs.qsize() == 0 and not checksums._inline_jobs
        checksums.close_nowait()
