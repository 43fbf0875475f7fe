"""Review 202: a loop's shutdown (``asyncio.run`` ending) cut the steps of a worker's teardown.

Review 201 ran the drain and the executor's close again when their own task (``Cancels.outlast``)
ended cancelled: ``asyncio.run`` ending cancels every task left. The other steps were still cut:

- the wait for the manager's end of the link (after CLOSED): the session raised at once, the
  executor's close was skipped and the pool stayed mapped in the process;
- the unmap inside the executor's close (a ``to_thread`` task): the task ended cancelled while the
  thread unmapped, every later close raised that cancel at once, and the worker's teardown ran the
  close again for ever: ``asyncio.run`` never ended;
- the reclaim after the unmap (a ``to_thread`` task): the session raised before it noted that the
  manager may hold the rank (its socket cut): no farewell, the rank held while the process lived;
- the farewell hello itself: cut, so the rank stayed held, and the bridge's copy thread was left.

A real rank process (tp_size 1), worker A on the main thread's ``asyncio.run``; its ``run()`` is
cancelled and the main coroutine returns while the step is in progress (held by the test: the
manager's loop blocked, or a gate the step's thread or coroutine waits on). After ``asyncio.run``
the child reports its mappings (``/proc/self/maps``, ``/proc/self/fd``) and threads; the manager's
statistics tell whether it still holds the rank; the rank's KV bytes are the oracle for the copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing.connection
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from child_procs import end_child, fork_context
from held_rank import Held, _hold
from loop_probes import until_spin, until_thread, waiting_in
from test_adv_rev197_farewell_race import MHA, RANK_CONFIG, SLOTS, T, _sever
from tp_helpers import CONFIG

from aiokv.pool import PagePool
from aiokv.tp import Direction, RankGroup, RankWorker, TPConfig
from aiokv.tp import worker as worker_module
from aiokv.tp.executor import RankExecutor
from aiokv.tp.wire import Hello

BOUND_S = 60.0
ENDED_S = 20.0  # asyncio.run's end after the step is let go (a teardown that spins never gets there)
STEPS = ["peer_end", "peer_end_never", "unmap", "reclaim", "farewell"]
NEVER_S = 2.0  # handshake_timeout_s of the peer_end_never case: the manager never ends the link


def _segment_held(name: str) -> list[str]:
    """This process's mappings and descriptors of segment ``name``."""
    base = name.lstrip("/")
    with open("/proc/self/maps") as maps:
        found = [line.strip() for line in maps if base in line]
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if base in target:
                found.append(f"fd {fd} -> {target}")
    return found


def _hold_step(step: str, entered: threading.Event, gate: threading.Event) -> None:
    """Hold ``step`` (the first time it runs) until ``gate``: ``entered`` is set once it waits."""
    if step == "unmap":
        teardown = RankExecutor._teardown

        def held_teardown(self: RankExecutor) -> None:  # on the loop's default executor
            entered.set()
            gate.wait(BOUND_S)
            teardown(self)

        RankExecutor._teardown = held_teardown  # type: ignore[method-assign]
    elif step == "reclaim":
        reclaim_left = worker_module._reclaim_left

        def held_reclaim(pool_name: str) -> None:
            entered.set()
            gate.wait(BOUND_S)
            reclaim_left(pool_name)

        worker_module._reclaim_left = held_reclaim
    elif step == "farewell":
        say_farewell = RankWorker._say_farewell

        async def held_farewell(self: RankWorker, hello: Hello) -> None:
            # A slow connect: the farewell's task waits here, not yet said.
            if not entered.is_set():
                entered.set()
                await asyncio.to_thread(gate.wait, BOUND_S)
            await say_farewell(self, hello)

        RankWorker._say_farewell = held_farewell  # type: ignore[method-assign]


def _rank_main(ctrl: multiprocessing.connection.Connection, address: str, config: TPConfig, held: Held,
               step: str, pool_name: str) -> None:
    torch.set_num_threads(1)
    _hold(held)
    kv = torch.zeros(MHA.num_layers, SLOTS, MHA.rows, MHA.head_dim, dtype=MHA.dtype)
    events = {name: threading.Event() for name in ("attached", "go", "returned", "ended", "end")}
    entered, gate = threading.Event(), threading.Event()
    _hold_step(step, entered, gate)
    report: dict[str, Any] = {}
    returned_at: list[float] = []

    async def first() -> None:
        worker = RankWorker(address, 0, 1, MHA, kv, config)
        run = asyncio.get_running_loop().create_task(worker.run())
        await worker.wait_attached()
        events["attached"].set()
        await asyncio.to_thread(events["go"].wait, BOUND_S)
        run.cancel()
        if step.startswith("peer_end"):
            # CLOSED is out; the manager's loop is blocked by the test: the wait goes on.
            await until_spin(lambda: any(waiting_in(t, "wait_peer_end") for t in asyncio.all_tasks()),
                             "A's wait for the manager's end", BOUND_S)
        else:
            assert await asyncio.to_thread(entered.wait, BOUND_S), f"A's {step} never began"
        # Return: asyncio.run cancels every task left, the step's own among them.
        returned_at.append(time.monotonic())
        events["returned"].set()

    def control() -> None:
        try:
            while True:
                command = ctrl.recv()
                reply: Any
                if command in ("attached", "returned"):
                    reply = events[command].wait(BOUND_S)
                elif command == "go":
                    events["go"].set()
                    reply = True
                elif command == "sever":
                    reply = _sever(address, set())
                elif command == "ended":
                    gate.set()  # the held step goes on: asyncio.run may end now
                    reply = dict(report) if events["ended"].wait(ENDED_S) else None
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
            gate.set()
            events["end"].set()

    threading.Thread(target=control, daemon=True).start()
    ctrl.send(("started", os.getpid()))
    with contextlib.suppress(asyncio.CancelledError):
        asyncio.run(first())
    report["after_return_s"] = time.monotonic() - returned_at[0] if returned_at else None
    report["held"] = _segment_held(pool_name)
    report["threads"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("aiokv-"))
    events["ended"].set()
    events["end"].wait(BOUND_S * 4)


@pytest.mark.asyncio
@pytest.mark.parametrize("step", STEPS)
async def test_a_loop_s_shutdown_does_not_cut_a_step_of_a_cancelled_worker_s_teardown(
        tmp_path: Path, pool: PagePool, step: str) -> None:
    pool.pages[0] = 3.0  # the page the load brings
    ctx = fork_context()
    held = Held(ctx.Semaphore(0), ctx.Semaphore(0), ctx.Value("q", 0))
    slots = list(range(T))
    async with RankGroup(MHA, 1, pool.name, pool.num_pages, CONFIG, tmp_path / "m") as group:
        parent, child = ctx.Pipe()
        config = RANK_CONFIG
        if step == "peer_end_never":
            config = dataclasses.replace(RANK_CONFIG, handshake_timeout_s=NEVER_S)
        proc = ctx.Process(target=_rank_main, args=(child, os.fspath(group.address), config, held, step,
                                                    pool.name), daemon=True)
        proc.start()
        child.close()

        async def ask(command: object, bound_s: float = BOUND_S) -> Any:
            parent.send(command)
            async with asyncio.timeout(bound_s + 5.0):
                return await asyncio.to_thread(parent.recv)

        def ask_blocking(command: object) -> Any:
            """On this loop's thread: the manager's loop reads nothing meanwhile."""
            parent.send(command)
            assert parent.poll(BOUND_S), f"no reply to {command!r}"
            return parent.recv()

        load = None
        try:
            async with asyncio.timeout(BOUND_S * 2):
                assert (await asyncio.to_thread(parent.recv))[0] == "started"
                assert await ask("attached")
                await group.wait_attached()
            if step in ("reclaim", "farewell"):
                # The manager holds the rank for this process: its socket cut under a running copy.
                load = group.submit_nowait(group.spec(Direction.LOAD, [0], torch.tensor(slots)))
                assert await asyncio.to_thread(held.entered.acquire, True, BOUND_S), "A's copy never began"
                assert await ask("sever") == 1
                await until_thread(lambda: group.statistics().held_ranks == 1, "A's rank held", BOUND_S)
                assert await ask("go")
                held.release()
                assert await ask("returned"), f"A's {step} never began"
            elif step.startswith("peer_end"):
                # The manager's loop blocked from the cancel until A's main coroutine returned
                # (peer_end_never: until asyncio.run ended there; the wait is bounded all the same).
                assert ask_blocking("go")
                assert ask_blocking("returned"), "A never waited for the manager's end"
            else:
                assert await ask("go")
                assert await ask("returned"), f"A's {step} never began"
            report = ask_blocking("ended") if step == "peer_end_never" else await ask("ended", ENDED_S)
            assert report is not None, f"asyncio.run did not end within {ENDED_S} s of A's {step} let go"
            if step == "peer_end_never":
                # One deadline for the wait's every run, then the farewell (a connect, not a reply).
                assert report["after_return_s"] < NEVER_S + 5.0, report["after_return_s"]
            assert not report["held"], f"the pool is still mapped after asyncio.run ended: {report['held']}"
            assert not report["threads"], f"threads left after asyncio.run ended: {report['threads']}"
            # The manager frees the rank: CLOSED read, or the farewell hello.
            await until_thread(lambda: group.statistics().held_ranks == 0, "the manager freeing A's rank", 10.0)
            if load is not None:
                async with asyncio.timeout(BOUND_S):
                    await load.wait()
                assert held.finished_copies() == 1
                # The engine reuses the slots: no copy of A may land there any more.
                assert await ask(("write", slots, -7.0)) == "written"
                kv = torch.from_numpy(await ask("dump"))
                assert bool((kv[:, slots] == -7.0).all()), "a copy landed after the engine reused the slots"
        finally:
            held.release(8)
            with contextlib.suppress(Exception):
                parent.send("end")
            end_child(proc, 30)
