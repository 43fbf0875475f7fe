"""Review 203: three loop-wide cancels in a row exhausted ``Cancels.finish`` on a worker's drain.

``Cancels.finish`` (review 202) runs a teardown step anew when its own task ends cancelled, at most
``RUNS`` = 3 times, then raises the cancel. The drain of a closing session was such a step (a task
of its own). An application that cancels every task on SIGTERM (a common graceful-shutdown idiom),
signalled twice, and then ``asyncio.run`` ending, cancel every task left three times: the drain's
third task ended cancelled, ``finish`` raised, the session skipped the rest of its teardown
(no CLOSED, the pool left mapped) and let go of the rank's per-process entry while the copy still
ran. A second worker of the rank in the process then said hello: the manager took it for the end
of the copies, failed the load, the engine reused the slots and the copy landed there (wrong KV).

The wait for the manager's end of the link after CLOSED was such a step too: cut so, the session
skipped the executor's close (the pool left mapped in the process for good) and the note that the
manager may hold the rank.

A real rank process (tp_size 1): worker A on the main thread's ``asyncio.run``, its ``run()``
cancelled by the engine while the step is held (``drain``: a held copy; ``peer_end``: the manager's
loop blocked by the test); then two real SIGTERMs (the handler cancels every task but the main
one), each landing once the step waits afresh, then the main coroutine returns. ``drain``: worker B
(thread runner) starts then; the oracle is the rank's KV bytes after the engine reused the slots.
``peer_end``: after ``asyncio.run`` the child reports its mappings of the pool (``/proc/self/maps``,
``/proc/self/fd``) and its aiokv threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing.connection
import os
import signal
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
import uvloop
from child_procs import end_child, fork_context
from held_rank import Held, _hold
from loop_probes import until_spin, until_thread, waiting_in
from test_adv_rev197_farewell_race import MHA, RANK_CONFIG, SLOTS, T, _sever
from test_adv_rev202_loop_shutdown_teardown import _segment_held
from tp_helpers import CONFIG

from aiokv.pool import PagePool
from aiokv.tp import Direction, RankGroup, RankWorker, RankWorkerThread, TPConfig
from aiokv.tp.wire import Hello

BOUND_S = 60.0
LOOPS = ["asyncio", "uvloop"]  # the rank's loop: asyncio.run or uvloop.run (the same shutdown: every task cancelled)
SIGNALS = 2  # SIGTERMs before the main coroutine returns (asyncio.run's own pass makes the third)


def _awaited_step(task: asyncio.Task[Any] | None) -> object:
    """What ``task`` awaits in ``Cancels.outlast`` (its ``future``), or None."""
    coro: Any = task.get_coro() if task is not None else None
    while coro is not None:
        code = getattr(coro, "cr_code", None)
        if code is not None and code.co_name == "outlast" and coro.cr_frame is not None:
            return coro.cr_frame.f_locals.get("future")
        coro = getattr(coro, "cr_await", None)
    return None


def _rank_main(ctrl: multiprocessing.connection.Connection, address: str, config: TPConfig, held: Held,
               step: str, pool_name: str, loop_kind: str) -> None:
    torch.set_num_threads(1)
    _hold(held)
    kv = torch.zeros(MHA.num_layers, SLOTS, MHA.rows, MHA.head_dim, dtype=MHA.dtype)
    events = {name: threading.Event() for name in ("attached", "cancel", "returned", "ended", "end")}
    report: dict[str, Any] = {}
    farewell_began = threading.Event()
    attempts = [0]  # of the farewell's connect
    if step == "farewell":
        say_farewell = RankWorker._say_farewell

        async def held_farewell(self: RankWorker, hello: Hello) -> None:
            attempts[0] += 1
            farewell_began.set()
            if attempts[0] <= SIGNALS + 1:
                await asyncio.Event().wait()  # a slow connect, until a loop-wide cancel cuts it
            await say_farewell(self, hello)

        RankWorker._say_farewell = held_farewell  # type: ignore[method-assign]

    async def first() -> None:
        loop = asyncio.get_running_loop()
        main = asyncio.current_task()
        cancelled: set[asyncio.Future[Any]] = set()
        passes = [0]

        def cancel_all() -> None:  # the application's SIGTERM handler: cancel every task but main
            for task in asyncio.all_tasks(loop):
                if task is not main:
                    cancelled.add(task)
                    task.cancel()
            passes[0] += 1

        loop.add_signal_handler(signal.SIGTERM, cancel_all)
        worker = RankWorker(address, 0, 1, MHA, kv, config)
        run = loop.create_task(worker.run())
        await worker.wait_attached()
        events["attached"].set()
        await asyncio.to_thread(events["cancel"].wait, BOUND_S)
        run.cancel()  # the engine cancels the worker's run: the session's teardown reaches the step
        if step == "drain":  # its held copy
            await until_spin(lambda: worker._epoch is None, "A's teardown", BOUND_S)
        elif step == "farewell":  # owed: the test cut A's socket under its copy, then let the copy go
            assert await asyncio.to_thread(farewell_began.wait, BOUND_S), "A's farewell never began"
        else:  # CLOSED is out; the manager's loop is blocked by the test
            await until_spin(lambda: any(waiting_in(t, "wait_peer_end") for t in asyncio.all_tasks()),
                             "A's wait for the manager's end", BOUND_S)

        step_name = step

        def waits_afresh() -> bool:
            if step_name == "farewell":  # a connect of the farewell began after the last pass
                return attempts[0] == passes[0] + 1
            # The session waits for a step no pass has cancelled yet (before the fix: the drain's
            # task of its own, made anew by Cancels.finish after the last pass).
            step = _awaited_step(worker._session_task)
            return step is not None and not step.done() and step not in cancelled  # type: ignore[attr-defined]

        for sent in range(1, SIGNALS + 1):
            await until_spin(waits_afresh, f"A's {step} waiting afresh", BOUND_S)
            os.kill(os.getpid(), signal.SIGTERM)
            await until_spin(lambda: passes[0] == sent, "the SIGTERM handler", BOUND_S)  # noqa: B023
        await until_spin(waits_afresh, f"A's {step} waiting afresh", BOUND_S)
        assert step != "drain" or not held.finished_copies(), "A's copy ended before the test let it"
        # Return: asyncio.run cancels every task left, the third pass.
        events["returned"].set()

    def control() -> None:
        second: RankWorkerThread | None = None
        try:
            while True:
                command = ctrl.recv()
                reply: Any
                if command in ("attached", "returned"):
                    reply = events[command].wait(BOUND_S)
                elif command == "cancel":
                    events["cancel"].set()
                    reply = True
                elif command == "sever":
                    reply = _sever(address, set())
                elif command == "second":
                    second = RankWorkerThread(address, 0, 1, MHA, kv, config)
                    second.start()
                    reply = "started"
                elif command == "ended":
                    reply = dict(report) if events["ended"].wait(BOUND_S) else None
                elif command == "dump":
                    reply = kv.numpy().copy()
                elif isinstance(command, tuple) and command[0] == "write":
                    _, at, value = command
                    kv[:, at] = value
                    reply = "written"
                else:
                    break
                ctrl.send(reply)
        finally:
            if second is not None:
                with contextlib.suppress(Exception):
                    second.close(BOUND_S)
            events["end"].set()

    threading.Thread(target=control, daemon=True).start()
    ctrl.send(("started", os.getpid()))
    with contextlib.suppress(asyncio.CancelledError):
        if loop_kind == "uvloop":
            uvloop.run(first())
        else:
            asyncio.run(first())
    report["held"] = _segment_held(pool_name)
    report["threads"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("aiokv-"))
    events["ended"].set()
    events["end"].wait(BOUND_S * 4)


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[PagePool]:
    layout = MHA.for_tp(1)
    pool = PagePool.create(layout, 4 * layout.page_bytes, register_cuda=False)
    await pool.wait_ready()
    yield pool
    await pool.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("loop_kind", LOOPS)
async def test_three_loop_wide_cancels_do_not_cut_the_wait_for_the_manager_s_end(
        tmp_path: Path, pool: PagePool, loop_kind: str) -> None:
    ctx = fork_context()
    held = Held(ctx.Semaphore(0), ctx.Semaphore(0), ctx.Value("q", 0))
    async with RankGroup(MHA, 1, pool.name, pool.num_pages, CONFIG, tmp_path / "m") as group:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_rank_main, args=(child, os.fspath(group.address), RANK_CONFIG, held, "peer_end",
                                                    pool.name, loop_kind), daemon=True)
        proc.start()
        child.close()

        def ask_blocking(command: object) -> Any:
            """On this loop's thread: the manager's loop reads nothing meanwhile."""
            parent.send(command)
            assert parent.poll(BOUND_S), f"no reply to {command!r}"
            return parent.recv()

        try:
            async with asyncio.timeout(BOUND_S * 2):
                assert (await asyncio.to_thread(parent.recv))[0] == "started"
                parent.send("attached")
                assert await asyncio.to_thread(parent.recv)
                await group.wait_attached()
            # The manager's loop blocked from the cancel until A's main coroutine returned.
            assert ask_blocking("cancel")
            assert ask_blocking("returned"), "A's wait never went through the SIGTERMs"
            parent.send("ended")
            async with asyncio.timeout(BOUND_S + 5.0):
                report = await asyncio.to_thread(parent.recv)
            assert report is not None, "asyncio.run did not end"
            assert not report["held"], f"the pool is still mapped after asyncio.run ended: {report['held']}"
            assert not report["threads"], f"threads left after asyncio.run ended: {report['threads']}"
            await until_thread(lambda: group.statistics().held_ranks == 0, "the manager freeing A's rank", 10.0)
        finally:
            with contextlib.suppress(Exception):
                parent.send("end")
            end_child(proc, 30)


@pytest.mark.asyncio
@pytest.mark.parametrize("loop_kind", LOOPS)
async def test_three_loop_wide_cancels_do_not_cut_the_drain_of_a_cancelled_worker(
        tmp_path: Path, pool: PagePool, loop_kind: str) -> None:
    pool.pages[0] = 3.0  # the page the load brings
    ctx = fork_context()
    held = Held(ctx.Semaphore(0), ctx.Semaphore(0), ctx.Value("q", 0))
    slots = list(range(T))
    async with RankGroup(MHA, 1, pool.name, pool.num_pages, CONFIG, tmp_path / "m") as group:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_rank_main, args=(child, os.fspath(group.address), RANK_CONFIG, held, "drain",
                                                    pool.name, loop_kind), daemon=True)
        proc.start()
        child.close()

        async def ask(command: object) -> Any:
            parent.send(command)
            async with asyncio.timeout(BOUND_S):
                return await asyncio.to_thread(parent.recv)

        try:
            async with asyncio.timeout(BOUND_S * 2):
                assert (await asyncio.to_thread(parent.recv))[0] == "started"
                assert await ask("attached")
                await group.wait_attached()
            load = group.submit_nowait(group.spec(Direction.LOAD, [0], torch.tensor(slots)))
            assert await asyncio.to_thread(held.entered.acquire, True, BOUND_S), "A's copy never began"
            assert await ask("cancel")
            assert await ask("returned"), "A's teardown never waited through the SIGTERMs"
            assert await ask("second") == "started"
            # A's copy still runs: no worker of this process may end the manager's view of it.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5.0):
                    await asyncio.shield(load.wait())
            reused = load.done()
            if reused:  # the engine takes the slots back at once: its own KV goes there
                assert await ask(("write", slots, -7.0)) == "written"
            held.release()
            async with asyncio.timeout(BOUND_S):
                outcome = await load.wait()
            await until_thread(lambda: held.finished_copies() == 1, "A's copy", BOUND_S)
            if not reused:
                assert await ask(("write", slots, -7.0)) == "written"
            kv = torch.from_numpy(await ask("dump"))
            assert bool((kv[:, slots] == -7.0).all()), (
                f"the load ended ({outcome}) while A's copy ran (reused: {reused}); the copy landed after "
                "the engine reused the slots")
        finally:
            held.release(8)
            with contextlib.suppress(Exception):
                parent.send("end")
            end_child(proc, 30)


@pytest.mark.asyncio
@pytest.mark.parametrize("loop_kind", LOOPS)
async def test_three_loop_wide_cancels_do_not_lose_the_farewell(
        tmp_path: Path, pool: PagePool, loop_kind: str) -> None:
    """The farewell (a connect, in a task of its own) ran anew ``RUNS`` times at most: three
    loop-wide cancels of its connect lost it (the manager held the rank while the process lived),
    and the bridge's close after it was skipped too (its copy thread stayed after ``asyncio.run``).
    It now tries again within its one deadline: the fourth connect says the hello."""
    ctx = fork_context()
    held = Held(ctx.Semaphore(0), ctx.Semaphore(0), ctx.Value("q", 0))
    async with RankGroup(MHA, 1, pool.name, pool.num_pages, CONFIG, tmp_path / "m") as group:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_rank_main, args=(child, os.fspath(group.address), RANK_CONFIG, held, "farewell",
                                                    pool.name, loop_kind), daemon=True)
        proc.start()
        child.close()

        async def ask(command: object) -> Any:
            parent.send(command)
            async with asyncio.timeout(BOUND_S + 5.0):
                return await asyncio.to_thread(parent.recv)

        try:
            async with asyncio.timeout(BOUND_S * 2):
                assert (await asyncio.to_thread(parent.recv))[0] == "started"
                assert await ask("attached")
                await group.wait_attached()
            # The manager holds the rank for this process: its socket cut under a running copy.
            group.submit_nowait(group.spec(Direction.LOAD, [0], torch.tensor(list(range(T)))))
            assert await asyncio.to_thread(held.entered.acquire, True, BOUND_S), "A's copy never began"
            assert await ask("sever") == 1
            await until_thread(lambda: group.statistics().held_ranks == 1, "A's rank held", BOUND_S)
            assert await ask("cancel")
            held.release()
            assert await ask("returned"), "A's farewell never went through the SIGTERMs"
            report = await ask("ended")
            assert report is not None, "asyncio.run did not end"
            assert not report["held"], f"the pool is still mapped after asyncio.run ended: {report['held']}"
            assert not report["threads"], f"threads left after asyncio.run ended: {report['threads']}"
            # The farewell's hello frees the rank while the process lives on.
            await until_thread(lambda: group.statistics().held_ranks == 0, "the manager freeing A's rank", 10.0)
        finally:
            held.release(8)
            with contextlib.suppress(Exception):
                parent.send("end")
            end_child(proc, 30)
