"""Review 201: a loop's shutdown (``asyncio.run`` ending) cancelled a closing session's drain.

A worker's ``run()`` cancelled drains its session's copies before it lets go of the rank's
per-process entry (no hello of this process may reach the manager while one of its copies runs).
The drain waits in a task of its own (``Cancels.outlast``); ``asyncio.run`` ending with that task
pending cancels every task left, that one too: the drain ended at once with the copy still running
on the copy thread, the rest of the teardown was skipped and the entry let go. A second worker of
the rank in the process (a thread runner started meanwhile) then said hello: the manager took it
for the end of the copies, the load failed, the engine reused its slots, and the copy landed in
them (wrong KV).

A real rank process (tp_size 1): worker A's loop is the main thread's ``asyncio.run``; its copy is
held, its ``run()`` cancelled, and the main coroutine returns while the session drains. Worker B
(thread runner) starts then. The oracle is on the rank's KV bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing.connection
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from child_procs import end_child, fork_context
from held_rank import Held, _hold
from loop_probes import until_spin, until_thread
from test_adv_rev197_farewell_race import MHA, RANK_CONFIG, SLOTS, T
from tp_helpers import CONFIG

from aiokv.pool import PagePool
from aiokv.tp import Direction, RankGroup, RankWorker, RankWorkerThread, TPConfig

BOUND_S = 60.0


def _rank_main(ctrl: multiprocessing.connection.Connection, address: str, config: TPConfig, held: Held) -> None:
    torch.set_num_threads(1)
    _hold(held)
    kv = torch.zeros(MHA.num_layers, SLOTS, MHA.rows, MHA.head_dim, dtype=MHA.dtype)
    events = {name: threading.Event() for name in ("attached", "cancel", "returned", "end")}

    async def first() -> None:
        worker = RankWorker(address, 0, 1, MHA, kv, config)
        run = asyncio.get_running_loop().create_task(worker.run())
        await worker.wait_attached()
        events["attached"].set()
        await asyncio.to_thread(events["cancel"].wait, BOUND_S)
        run.cancel()
        # The session's teardown began (its drain waits in a task of its own): return, and
        # asyncio.run cancels every task left.
        await until_spin(lambda: worker._epoch is None, "A's teardown", BOUND_S)
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
                elif command == "second":
                    second = RankWorkerThread(address, 0, 1, MHA, kv, config)
                    second.start()
                    reply = "started"
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
        asyncio.run(first())
    events["end"].wait(BOUND_S * 4)


@pytest.mark.asyncio
async def test_a_loop_s_shutdown_does_not_cut_the_drain_of_a_cancelled_worker(
        tmp_path: Path, pool: PagePool) -> None:
    pool.pages[0] = 3.0  # the page the load brings
    ctx = fork_context()
    held = Held(ctx.Semaphore(0), ctx.Semaphore(0), ctx.Value("q", 0))
    slots = list(range(T))
    async with RankGroup(MHA, 1, pool.name, pool.num_pages, CONFIG, tmp_path / "m") as group:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_rank_main, args=(child, os.fspath(group.address), RANK_CONFIG, held), daemon=True)
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
            assert await ask("returned"), "A's teardown never began"
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
