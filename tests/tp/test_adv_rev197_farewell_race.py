"""Review 197: a closing worker's farewell hello against a second worker of the rank in the same process.

A closing worker whose last session was cut says hello once more (its farewell, review 196) so a
manager holding the rank for this process frees it. It checked, before connecting, that no other
worker of the rank in this process was in a session, but did not claim the rank's entry: a worker
started after that check connected, attached and ran copies while the farewell was still on its way.
When that worker's socket was then cut (the manager holds the rank for this process: its copy runs),
the late farewell hello (same pid) was taken for the end of that hold: the load failed while the
copy ran, the engine reused its slots and the copy landed in them afterwards: wrong KV.

A real rank process (tp_size 1). Worker A (async runner, on the engine's loop) has a copy held when
its socket is shut down for real, then is closed; its farewell connects and the engine's loop then
blocks (a synchronous step) before the hello is written. Worker B (thread runner) starts meanwhile.
The oracle is on the rank's KV bytes: the engine reuses the load's slots as soon as the load ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing.connection
import os
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from child_procs import end_child, fork_context
from held_rank import Held, _hold
from loop_probes import until_spin, until_thread
from tp_helpers import CONFIG

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.tp import Direction, RankGroup, RankWorker, RankWorkerThread, TPConfig

MHA = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = MHA.page_tokens
SLOTS = 4 * T
BOUND_S = 60.0
RANK_CONFIG = dataclasses.replace(CONFIG, inline_copy_bytes=0)  # copies on the copy thread: the loop stays free


def _socket_inodes() -> set[int]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                found.add(int(target[8:-1]))
    return found


def _sever(address: str, spare: set[int]) -> int:
    """Shut down (for real) this process's connections to ``address``, but those in ``spare``."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino in spare or not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:["):
                continue
            sock = socket.socket(fileno=os.dup(fd))
            with sock:
                if sock.family == socket.AF_UNIX and sock.getpeername() == address:
                    sock.shutdown(socket.SHUT_RDWR)
                    count += 1
    return count


def _rank_main(ctrl: multiprocessing.connection.Connection, address: str, config: TPConfig, held: Held) -> None:
    """Rank 0 of 1: worker A on the main loop; a control thread takes the test's commands (the main
    loop blocks for part of the test)."""
    torch.set_num_threads(1)
    _hold(held)
    kv = torch.zeros(MHA.num_layers, SLOTS, MHA.rows, MHA.head_dim, dtype=MHA.dtype)
    connected, unblock, a_closed, started = threading.Event(), threading.Event(), threading.Event(), threading.Event()
    farewell: set[int] = set()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        worker = RankWorker(address, 0, 1, MHA, kv, config)
        closing: list[asyncio.Future[Any]] = []

        async def watch(before: set[int]) -> None:
            # Each loop turn: once the farewell's socket exists (connected in the step that made
            # it), the engine's loop blocks, before the step that writes the hello.
            await until_spin(lambda: bool(_socket_inodes() - before), "A's farewell connection", BOUND_S)
            farewell.update(_socket_inodes() - before)  # no await since the check: the same turn
            connected.set()
            unblock.wait(BOUND_S)  # the engine's synchronous step

        async def close_a() -> None:
            before = _socket_inodes()
            watcher = loop.create_task(watch(before))
            closer = loop.create_task(worker.aclose())
            await asyncio.sleep(0)  # the closer's first step ran: the worker is closing
            started.set()
            await closer
            a_closed.set()
            watcher.cancel()

        def control() -> None:
            second: RankWorkerThread | None = None
            try:
                while True:
                    command = ctrl.recv()
                    reply: Any
                    if command == "close a":
                        closing.append(asyncio.run_coroutine_threadsafe(close_a(), loop))
                        reply = "closing" if started.wait(BOUND_S) else "not closing"
                    elif command == "farewell connected":
                        reply = connected.wait(BOUND_S)
                    elif command == "second":
                        second = RankWorkerThread(address, 0, 1, MHA, kv, config)
                        second.start()
                        reply = "started"
                    elif command == "second stats":
                        assert second is not None
                        reply = second.statistics()
                    elif command == "sever":
                        reply = _sever(address, farewell)
                    elif command == "unblock":
                        unblock.set()
                        reply = "unblocked"
                    elif command == "a closed":
                        reply = a_closed.wait(BOUND_S)
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
                unblock.set()
                if second is not None:
                    second.close(BOUND_S)
                loop.call_soon_threadsafe(done.set)

        done = asyncio.Event()
        async with worker:
            ctrl.send(("started", os.getpid()))
            threading.Thread(target=control, daemon=True).start()
            await done.wait()

    asyncio.run(main())


@pytest.mark.asyncio
async def test_a_late_farewell_does_not_end_the_hold_of_a_later_worker_of_the_rank(
        tmp_path: Path, pool: PagePool) -> None:
    pool.pages[0] = 3.0  # the page the loads bring
    ctx = fork_context()
    held = Held(ctx.Semaphore(0), ctx.Semaphore(0), ctx.Value("q", 0))
    slots_a, slots_b = list(range(0, T)), list(range(T, 2 * T))
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
            # Worker A: a copy held, its socket cut (the manager holds the rank), then closed.
            load_a = group.submit_nowait(group.spec(Direction.LOAD, [0], torch.tensor(slots_a)))
            assert await asyncio.to_thread(held.entered.acquire, True, BOUND_S), "A's copy never began"
            assert await ask("sever") == 1
            await until_thread(lambda: group.statistics().held_ranks == 1, "A's rank held", BOUND_S)
            assert await ask("close a") == "closing"
            held.release()  # A's copy ends; its close then says its farewell
            assert await ask("farewell connected"), "A's farewell never connected"
            # The engine's loop is blocked now, A's hello not yet written. Worker B starts.
            assert await ask("second") == "started"
            second: list[Any] = []

            def tried() -> bool:
                if group.all_attached:
                    return True
                parent.send("second stats")
                second[:] = [parent.recv()]
                return second[0].link_errors + second[0].connect_failures > 0

            await until_thread(tried, "worker B's first try", BOUND_S)
            b_first = group.all_attached
            if b_first:
                # Before: B attached while A's farewell was on its way. B's copy held, its socket cut.
                load_b = group.submit_nowait(group.spec(Direction.LOAD, [0], torch.tensor(slots_b)))
                assert await asyncio.to_thread(held.entered.acquire, True, BOUND_S), "B's copy never began"
                assert await ask("sever") == 1
                await until_thread(lambda: group.statistics().held_ranks == 1, "B's rank held", BOUND_S)
                assert await ask("unblock") == "unblocked"
                assert await ask("a closed")
                # The farewell hello reaches the manager (it frees the hold it takes for A's).
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(5.0):
                        await asyncio.shield(load_b.wait())
            else:
                assert await ask("unblock") == "unblocked"
                assert await ask("a closed")
                async with asyncio.timeout(BOUND_S):
                    await load_a.wait()  # the farewell freed A's hold: its copy is over
                    await group.wait_attached()  # B, once A's farewell is over
                load_b = group.submit_nowait(group.spec(Direction.LOAD, [0], torch.tensor(slots_b)))
                assert await asyncio.to_thread(held.entered.acquire, True, BOUND_S), "B's copy never began"
                assert await ask("sever") == 1
                await until_thread(lambda: group.statistics().held_ranks == 1, "B's rank held", BOUND_S)
            reused = False
            if load_b.done():  # the engine takes the slots back at once: its own KV goes there
                assert await ask(("write", slots_b, -7.0)) == "written"
                reused = True
            held.release()  # B's copy moves its bytes now
            async with asyncio.timeout(BOUND_S):
                outcome = await load_b.wait()
            copies_then = held.finished_copies()
            if not reused:
                assert await ask(("write", slots_b, -7.0)) == "written"
            await until_thread(lambda: held.finished_copies() == 2, "B's copy", BOUND_S)
            kv = torch.from_numpy(await ask("dump"))
            assert bool((kv[:, slots_b] == -7.0).all()), (
                f"B attached during A's farewell: {b_first}; B's load ended ({outcome}) with {copies_then} "
                "copies finished; its copy landed after the engine reused the slots")
            assert copies_then == 2, outcome
            assert load_a.done()
        finally:
            held.release(8)
            with contextlib.suppress(Exception):
                parent.send("end")
            end_child(proc, 30)
