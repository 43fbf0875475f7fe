"""Review 203: three loop-wide cancels in a row exhausted ``Cancels.finish`` on a worker's drain.

``Cancels.finish`` (review 202, since removed) ran a teardown step anew when its own task ended
cancelled, three times at most, then raised the cancel. The drain of a closing session was such a
step (a task of its own). An application that cancels every task on SIGTERM (a common graceful-shutdown idiom),
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
import multiprocessing.connection
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
from held_rank import Held
from loop_probes import until_spin, until_thread, waiting_in
from shutdown_helpers import (
    BOUND_S,
    RankChild,
    assert_no_copy_after_reuse,
    new_held,
    rank_child,
    sever_under_held_copy,
)
from test_adv_rev197_farewell_race import MHA, RANK_CONFIG, T
from tp_helpers import CONFIG

from aiokv.pool import PagePool
from aiokv.tp import RankGroup, RankWorker, TPConfig
from aiokv.tp.wire import Hello

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
    child = RankChild(ctrl, address, config, held, waits=("attached", "returned"), sets=("cancel",),
                      commands={"ended": lambda: dict(child.report) if child.events["ended"].wait(BOUND_S) else None})
    events = child.events
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
        worker = RankWorker(address, 0, 1, MHA, child.kv, config)
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

    child.start()
    child.run(first, loop_kind)
    child.finish(pool_name)


@pytest.mark.asyncio
@pytest.mark.parametrize("loop_kind", LOOPS)
async def test_three_loop_wide_cancels_do_not_cut_the_wait_for_the_manager_s_end(
        tmp_path: Path, pool: PagePool, loop_kind: str) -> None:
    held = new_held()
    async with (RankGroup(MHA, 1, pool.name, pool.num_pages, CONFIG, tmp_path / "m") as group,
                rank_child(group, held, _rank_main, os.fspath(group.address), RANK_CONFIG, held, "peer_end",
                           pool.name, loop_kind) as link):
        # The manager's loop blocked from the cancel until A's main coroutine returned.
        assert link.ask_blocking("cancel")
        assert link.ask_blocking("returned"), "A's wait never went through the SIGTERMs"
        report = await link.ask("ended")
        assert report is not None, "asyncio.run did not end"
        assert not report["held"], f"the pool is still mapped after asyncio.run ended: {report['held']}"
        assert not report["threads"], f"threads left after asyncio.run ended: {report['threads']}"
        await until_thread(lambda: group.statistics().held_ranks == 0, "the manager freeing A's rank", 10.0)


@pytest.mark.asyncio
@pytest.mark.parametrize("loop_kind", LOOPS)
async def test_three_loop_wide_cancels_do_not_cut_the_drain_of_a_cancelled_worker(
        tmp_path: Path, pool: PagePool, loop_kind: str) -> None:
    pool.pages[0] = 3.0  # the page the load brings
    held = new_held()
    async with (RankGroup(MHA, 1, pool.name, pool.num_pages, CONFIG, tmp_path / "m") as group,
                rank_child(group, held, _rank_main, os.fspath(group.address), RANK_CONFIG, held, "drain",
                           pool.name, loop_kind) as link):
        await assert_no_copy_after_reuse(group, link, held, list(range(T)), "cancel",
                                         "A's teardown never waited through the SIGTERMs")


@pytest.mark.asyncio
@pytest.mark.parametrize("loop_kind", LOOPS)
async def test_three_loop_wide_cancels_do_not_lose_the_farewell(
        tmp_path: Path, pool: PagePool, loop_kind: str) -> None:
    """The farewell (a connect, in a task of its own) ran anew three times at most: three
    loop-wide cancels of its connect lost it (the manager held the rank while the process lived),
    and the bridge's close after it was skipped too (its copy thread stayed after ``asyncio.run``).
    It now tries again within its one deadline: the fourth connect says the hello."""
    held = new_held()
    async with (RankGroup(MHA, 1, pool.name, pool.num_pages, CONFIG, tmp_path / "m") as group,
                rank_child(group, held, _rank_main, os.fspath(group.address), RANK_CONFIG, held, "farewell",
                           pool.name, loop_kind) as link):
        # The manager holds the rank for this process: its socket cut under a running copy.
        await sever_under_held_copy(group, link, held, list(range(T)))
        assert await link.ask("cancel")
        held.release()
        assert await link.ask("returned"), "A's farewell never went through the SIGTERMs"
        report = await link.ask("ended")
        assert report is not None, "asyncio.run did not end"
        assert not report["held"], f"the pool is still mapped after asyncio.run ended: {report['held']}"
        assert not report["threads"], f"threads left after asyncio.run ended: {report['threads']}"
        # The farewell's hello frees the rank while the process lives on.
        await until_thread(lambda: group.statistics().held_ranks == 0, "the manager freeing A's rank", 10.0)
