"""Review 201: a farewell skipped for a second worker of the rank that never said its hello.

A closing worker A whose last session was cut owes the manager one more hello (its farewell, review
196). It holds the per-process entry of the rank for that hello (review 197) and skipped it when
another worker B of the rank in this process held the entry: B's own hello would tell the manager.
B had claimed the entry but not yet said hello (its connect a loop turn from done) when its run()
was cancelled: no hello of this process came, and the manager held A's rank, and its jobs, for as
long as the process lived (a hang of the job and of the group's close).

A real rank process (tp_size 1): A (async runner, on the engine's loop) has a copy held when its
socket is shut down for real, then is closed; A's loop blocks between its session's end and its
farewell. B (an async runner on a thread's loop of its own) claims the entry, connects, and is
cancelled at once; its loop blocks there. A's farewell then finds B in a session. Both loops go on.
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
from test_adv_rev197_farewell_race import MHA, RANK_CONFIG, SLOTS, T, _sever
from tp_helpers import CONFIG

from aiokv.pool import PagePool
from aiokv.tp import Direction, RankGroup, RankWorker, TPConfig

BOUND_S = 60.0


def _rank_main(ctrl: multiprocessing.connection.Connection, address: str, config: TPConfig, held: Held) -> None:
    torch.set_num_threads(1)
    _hold(held)
    kv = torch.zeros(MHA.num_layers, SLOTS, MHA.rows, MHA.head_dim, dtype=MHA.dtype)
    events = {name: threading.Event() for name in
              ("a started", "a between", "unblock a", "a closed", "b claimed", "unblock b", "b done")}
    b_outcome: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        worker = RankWorker(address, 0, 1, MHA, kv, config)

        async def close_a() -> None:
            async def watch() -> None:
                # Each loop turn: once A's session is over (its entry let go), the engine's loop
                # blocks, before the farewell's first step (a task of its own, a later turn).
                await until_spin(lambda: worker._session_task is None, "A's session over", BOUND_S)
                events["a between"].set()
                events["unblock a"].wait(BOUND_S)

            watcher = loop.create_task(watch())
            closer = loop.create_task(worker.aclose())
            await asyncio.sleep(0)
            events["a started"].set()
            await closer
            events["a closed"].set()
            watcher.cancel()

        def b_main() -> None:
            async def b() -> None:
                second = RankWorker(address, 0, 1, MHA, kv, config)
                run = asyncio.get_running_loop().create_task(second.run())
                # The turn B claimed the entry (its session's first step: the socket connected,
                # the hello a few turns away): its run() is cancelled, and its loop blocks.
                await until_spin(lambda: second._claimant is not None, "B's claim", BOUND_S)
                run.cancel()
                events["b claimed"].set()
                events["unblock b"].wait(BOUND_S)
                try:
                    await run
                    b_outcome.append("ended")
                except asyncio.CancelledError:
                    b_outcome.append("cancelled")
                except BaseException as exc:
                    b_outcome.append(repr(exc))

            try:
                asyncio.run(b())
            finally:
                events["b done"].set()

        def control() -> None:
            try:
                while True:
                    command = ctrl.recv()
                    reply: Any
                    if command == "close a":
                        asyncio.run_coroutine_threadsafe(close_a(), loop)
                        reply = events["a started"].wait(BOUND_S)
                    elif command == "sever":
                        reply = _sever(address, set())
                    elif command == "b":
                        threading.Thread(target=b_main, daemon=True).start()
                        reply = events["b claimed"].wait(BOUND_S)
                    elif command == "b done":
                        reply = events["b done"].wait(BOUND_S) and b_outcome
                    elif isinstance(command, str) and command in events:
                        if command.startswith("unblock"):
                            events[command].set()
                            reply = True
                        else:
                            reply = events[command].wait(BOUND_S)
                    else:
                        break
                    ctrl.send(reply)
            finally:
                events["unblock a"].set()
                events["unblock b"].set()
                loop.call_soon_threadsafe(done.set)

        done = asyncio.Event()
        async with worker:
            ctrl.send(("started", os.getpid()))
            threading.Thread(target=control, daemon=True).start()
            await done.wait()

    asyncio.run(main())


@pytest.mark.asyncio
async def test_a_farewell_skipped_for_a_worker_cancelled_before_its_hello_is_said_by_it(
        tmp_path: Path, pool: PagePool) -> None:
    ctx = fork_context()
    held = Held(ctx.Semaphore(0), ctx.Semaphore(0), ctx.Value("q", 0))
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
                await group.wait_attached()
            load = group.submit_nowait(group.spec(Direction.LOAD, [0], torch.tensor(list(range(T)))))
            assert await asyncio.to_thread(held.entered.acquire, True, BOUND_S), "A's copy never began"
            assert await ask("sever") == 1
            await until_thread(lambda: group.statistics().held_ranks == 1, "A's rank held", BOUND_S)
            assert await ask("close a")
            held.release()  # A's copy ends, its session drains and ends
            assert await ask("a between"), "A's session never ended"
            assert await ask("b"), "B never claimed the rank's entry"
            assert await ask("unblock a")
            assert await ask("a closed"), "A's close never ended"
            assert await ask("unblock b")
            assert await ask("b done") == ["cancelled"]
            # No worker of the rank runs in the process now: the manager must not hold it.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10.0):
                    await asyncio.shield(load.wait())
            stats = group.statistics()
            assert load.done() and stats.held_ranks == 0, (
                f"the job still waits 10 s after both workers ended (held_ranks {stats.held_ranks})")
            assert held.finished_copies() == 1
        finally:
            held.release(8)
            with contextlib.suppress(Exception):
                parent.send("end")
            end_child(proc, 30)
