"""Review 196, item (c): a second ``RankWorker`` for the same rank, in the same process, started while
the first one's copy still runs.

The manager holds a rank whose connection ended without CLOSED under a live process (a third party
cut the socket: review 177) until that process exits or says hello again: a worker runs its sessions
one at a time and says hello only once its copies are over. A second worker of the same rank in the
same process (an engine that made a new one while the first still drained: a ``close(timeout)`` that
timed out, a restarted connector) said hello from the same pid while the first worker's copy ran: the
manager took it for the first worker's new session, failed the held job (the load returned, the
engine reused its slots) and the first worker's copy landed in them afterwards: wrong KV.

A real rank process (tp_size 1): its first worker's copy is held inside its mover, its socket is shut
down for real (``pidfd_getfd`` + ``shutdown``), then it starts a second worker. The oracle is on the
rank's KV bytes: the engine reuses the load's slots as soon as the load ends (it writes its own
values there); once the copy is over they must still hold the engine's values.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing.connection
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from adv_helpers import sever_socket
from child_procs import end_child, fork_context
from held_rank import Held, _hold
from loop_probes import until_thread
from tp_helpers import CONFIG

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.tp import Direction, RankGroup, RankWorker, RankWorkerThread, TPConfig

MHA = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = MHA.page_tokens
SLOTS = 4 * T
BOUND_S = 60.0
RANK_CONFIG = dataclasses.replace(CONFIG, inline_copy_bytes=0)  # copies on the copy thread: the loop stays free


def _rank_main(ctrl: multiprocessing.connection.Connection, address: str, config: TPConfig, held: Held) -> None:
    """Rank 0 of 1: worker 1 (async runner) at start; ``"second"`` starts worker 2 (thread runner) in
    this process; ``("write", slots, value)`` is the engine writing its own KV; ``"dump"`` the buffer;
    ``"second stats"`` worker 2's statistics."""
    torch.set_num_threads(1)
    _hold(held)
    kv = torch.zeros(MHA.num_layers, SLOTS, MHA.rows, MHA.head_dim, dtype=MHA.dtype)

    async def main() -> None:
        second: RankWorkerThread | None = None
        async with RankWorker(address, 0, 1, MHA, kv, config):
            await asyncio.to_thread(ctrl.send, ("started", os.getpid()))
            while True:
                command = await asyncio.to_thread(ctrl.recv)
                if command == "second":
                    second = RankWorkerThread(address, 0, 1, MHA, kv, config)
                    second.start()
                    reply: Any = "started"
                elif command == "second stats":
                    assert second is not None
                    reply = await asyncio.to_thread(second.statistics)
                elif command == "dump":
                    reply = kv.numpy().copy()  # plain numpy: torch would pickle through shared memory
                elif isinstance(command, tuple) and command[0] == "write":
                    _, at, value = command
                    kv[:, at] = value
                    reply = "written"
                else:
                    break
                await asyncio.to_thread(ctrl.send, reply)
            if second is not None:
                await asyncio.to_thread(second.close, 60)

    asyncio.run(main())


@pytest.mark.asyncio
async def test_a_second_worker_of_the_rank_does_not_end_the_first_ones_held_copy(
        tmp_path: Path, pool: PagePool) -> None:
    pool.pages[0] = 3.0  # the page the load brings: no slot holds it before
    ctx = fork_context()
    held = Held(ctx.Semaphore(0), ctx.Semaphore(0), ctx.Value("q", 0))
    slots = list(range(T, 2 * T))
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
            load = group.submit_nowait(group.spec(Direction.LOAD, [0], torch.tensor(slots)))
            assert await asyncio.to_thread(held.entered.acquire, True, BOUND_S), "the copy never began"
            try:
                assert sever_socket(proc.pid, os.fspath(group.address)) == 1
            except PermissionError as exc:
                pytest.skip(f"cannot take the rank's socket: {exc}")
            await until_thread(lambda: group.statistics().held_ranks == 1, "the rank held", BOUND_S)
            assert await ask("second") == "started"
            # Worker 2's first try: before, it attached at once (its hello ended the hold); now it waits.
            second: list[Any] = []

            def tried() -> bool:
                if group.all_attached:
                    return True
                parent.send("second stats")
                second[:] = [parent.recv()]
                return second[0].link_errors + second[0].connect_failures > 0

            await until_thread(tried, "worker 2's first try", BOUND_S)
            reused = False
            if load.done():  # the engine takes the slots back at once: its own KV goes there
                assert await ask(("write", slots, -7.0)) == "written"
                reused = True
            held.release()  # worker 1's copy moves its bytes now
            async with asyncio.timeout(BOUND_S):
                outcome = await load.wait()
            copies_then = held.finished_copies()
            if not reused:
                assert await ask(("write", slots, -7.0)) == "written"
            await until_thread(lambda: held.finished_copies() == 1, "worker 1's copy", BOUND_S)
            kv = torch.from_numpy(await ask("dump"))
            assert bool((kv[:, slots] == -7.0).all()), (
                f"the load ended ({outcome}) with {copies_then} copies finished; its copy landed after the "
                "engine reused the slots")
            assert copies_then == 1, outcome
        finally:
            held.release(8)
            end_child(proc, 30)
