"""Review 191 of CLOSED (protocol 9, 5b9f208): a manager stalled past ``handshake_timeout_s``.

A worker closed by its engine says CLOSED, shuts its write side and waits for the manager to end the
link, ``handshake_timeout_s`` at most. Here the manager's process is stopped (SIGSTOP) through the
whole wait: the worker's close must end within that bound, and the manager, resumed, must still read
the CLOSED (the worker's socket is closed by then) and free the rank without holding it; a call that
goes to the rank afterwards fails at once (not attached) instead of waiting for the rank process.

The manager is a real separate process (forked) with a real group and pool; the worker runs in the
test's process. Passes before and after review 191's fix (a check, not a regression).
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing.connection
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from child_procs import fork_context
from tp_helpers import CONFIG, SLOTS, full_kv, new_pool, rank_kv

from aiokv.layout import KVLayout
from aiokv.tp import Direction, RankGroup, RankWorker

MHA = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = MHA.page_tokens
BOUND_S = 60.0
WAIT_S = 1.5
"""The worker's ``handshake_timeout_s``: how long its close waits for the manager's end."""


def _manager_main(ctrl: multiprocessing.connection.Connection, directory: str) -> None:
    async def main() -> None:
        pool = await new_pool(MHA.for_tp(1), 4)
        try:
            async with RankGroup(MHA, 1, pool.name, pool.num_pages, CONFIG, directory) as group:
                ctrl.send(("address", os.fspath(group.address)))
                while (command := await asyncio.to_thread(ctrl.recv)) != "end":
                    if command == "attached":
                        async with asyncio.timeout(BOUND_S):
                            await group.wait_attached()
                        ctrl.send(sorted(group.attached))
                    elif command == "detached":
                        async with asyncio.timeout(BOUND_S):
                            while group.attached:
                                await group.wait_change()
                        stats = group.statistics()
                        ctrl.send((sorted(stats.attached), stats.worker_closes, stats.held_ranks, stats.jobs.in_flight))
                    elif command == "offload":
                        job = group.submit_nowait(group.spec(Direction.OFFLOAD, [0], torch.arange(T)))
                        async with asyncio.timeout(BOUND_S):
                            outcome = await job
                        ctrl.send([f.status.name for f in outcome.failures])
        finally:
            await pool.aclose()

    asyncio.run(main())


async def _ask(ctrl: multiprocessing.connection.Connection, command: str) -> Any:
    ctrl.send(command)
    assert await asyncio.to_thread(ctrl.poll, BOUND_S), f"the manager did not answer {command!r}"
    return ctrl.recv()


@pytest.mark.asyncio
async def test_a_worker_closing_under_a_stopped_manager_is_freed_once_it_resumes(tmp_path: Path) -> None:
    ctx = fork_context()
    parent, child = ctx.Pipe()
    manager = ctx.Process(target=_manager_main, args=(child, os.fspath(tmp_path / "m")), daemon=True)
    manager.start()
    child.close()
    assert manager.pid is not None
    stopped = False
    try:
        assert await asyncio.to_thread(parent.poll, BOUND_S), "the manager never started"
        kind, address = parent.recv()
        assert kind == "address"
        config = dataclasses.replace(CONFIG, handshake_timeout_s=WAIT_S)
        kv = rank_kv(full_kv(MHA, 4, SLOTS), MHA, 0, 1)
        worker = RankWorker(address, 0, 1, MHA, kv, config)
        run = asyncio.create_task(worker.run())
        try:
            async with asyncio.timeout(BOUND_S):
                await worker.wait_attached()
            assert await _ask(parent, "attached") == [0]
            assert await _ask(parent, "offload") == []  # the link works
            os.kill(manager.pid, signal.SIGSTOP)
            stopped = True
            began = time.monotonic()
            async with asyncio.timeout(BOUND_S):
                await worker.aclose()  # CLOSED written; the manager cannot end the link
            took = time.monotonic() - began
            assert WAIT_S - 0.2 <= took < WAIT_S + 10.0, f"the worker's close took {took:.1f} s (a stopped manager)"
        finally:
            await worker.aclose()
            await asyncio.wait({run}, timeout=BOUND_S)
        os.kill(manager.pid, signal.SIGCONT)
        stopped = False
        attached, closes, held, in_flight = await _ask(parent, "detached")
        assert (attached, closes, held, in_flight) == ([], 1, 0, 0)  # freed by CLOSED, not held for the pid
        assert await _ask(parent, "offload") == ["NOT_ATTACHED"]
        parent.send("end")
        await asyncio.to_thread(manager.join, BOUND_S)
        assert manager.exitcode == 0
    finally:
        if manager.is_alive():
            if stopped:
                os.kill(manager.pid, signal.SIGCONT)
            manager.kill()
            await asyncio.to_thread(manager.join, BOUND_S)
        parent.close()
