"""Review 196: the manager's process SIGKILLed at seeded random points of a worker's close.

The worker's engine closes it while the manager streams specs to it; the manager is killed before
the close, at its start, while the copies drain, or once the session ended (CLOSED written, the
worker waiting for the manager's end). The worker's close must end within its bound (it waits
``handshake_timeout_s`` at most for the end; a farewell hello meets a dead socket at once), with no
error and no mapping of the dead manager's pool left in this process; a manager restarted on the
same directory then serves a new worker of the same rank in the same process (nothing of the old
session's bookkeeping blocks it).

The manager is a real separate process (forked); the worker runs in the test's process with its
copies on its copy thread, each slowed by a seeded random sleep.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing.connection
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from child_procs import fork_context
from loop_probes import until_thread
from test_adv_rev107_hostile_manager import held
from tp_helpers import CONFIG, SLOTS, full_kv, new_pool, rank_kv

from aiokv.kernels import mover
from aiokv.layout import KVLayout
from aiokv.tp import Direction, RankGroup, RankStatus, RankWorker

MHA = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = MHA.page_tokens
BOUND_S = 60.0
WAIT_S = 2.0
"""The worker's ``handshake_timeout_s``."""
PAGES = 8


def _manager_main(ctrl: multiprocessing.connection.Connection, directory: str) -> None:
    """A manager streaming offloads to rank 0 of 1 (8 in flight) until it is killed or told ``end``."""

    async def main() -> None:
        pool = await new_pool(MHA.for_tp(1), PAGES)
        try:
            async with RankGroup(MHA, 1, pool.name, pool.num_pages, CONFIG, directory) as group:
                ctrl.send(("address", os.fspath(group.address), pool.name))
                async with asyncio.timeout(BOUND_S):
                    await group.wait_attached()
                ok = 0
                stream = asyncio.create_task(asyncio.to_thread(ctrl.recv))
                while not stream.done():
                    jobs = [group.submit_nowait(group.spec(Direction.OFFLOAD, [p], torch.arange(p * T, (p + 1) * T)))
                            for p in range(PAGES)]
                    outcomes = await asyncio.gather(*(j.wait() for j in jobs))
                    ok += sum(o.ok for o in outcomes)
                    if ok and not group.all_attached:
                        break
                ctrl.send(("served", ok))
                await stream
        finally:
            await pool.aclose()

    asyncio.run(main())


class _Manager:
    def __init__(self, directory: Path) -> None:
        ctx = fork_context()
        self.ctrl, child = ctx.Pipe()
        self.proc = ctx.Process(target=_manager_main, args=(child, os.fspath(directory)), daemon=True)
        self.proc.start()
        child.close()

    async def address(self) -> tuple[str, str]:
        assert await asyncio.to_thread(self.ctrl.poll, BOUND_S), "the manager never started"
        kind, address, pool_name = self.ctrl.recv()
        assert kind == "address"
        return address, pool_name

    def kill(self) -> None:
        assert self.proc.pid is not None
        os.kill(self.proc.pid, signal.SIGKILL)

    async def end(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        await asyncio.to_thread(self.proc.join, BOUND_S)
        self.ctrl.close()


@pytest.fixture
def slow_copies() -> Iterator[random.Random]:
    """Each offload copy of this process first sleeps up to 5 ms (seeded per test)."""
    rng = random.Random(0)
    offload = mover.HostGather.offload

    def slowed(*args: Any) -> None:
        time.sleep(rng.uniform(0, 0.005))
        offload(*args)

    mover.HostGather.offload = slowed  # type: ignore[method-assign]
    yield rng
    mover.HostGather.offload = offload  # type: ignore[method-assign]


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(8))
async def test_a_manager_killed_during_the_close_never_holds_it(
        tmp_path: Path, slow_copies: random.Random, seed: int) -> None:
    rng = random.Random(seed)
    slow_copies.seed(seed)
    point = seed % 4
    config = dataclasses.replace(CONFIG, handshake_timeout_s=WAIT_S, inline_copy_bytes=0)
    kv = rank_kv(full_kv(MHA, seed, SLOTS), MHA, 0, 1)
    manager = _Manager(tmp_path / "m")
    try:
        address, pool_name = await manager.address()
        worker = RankWorker(address, 0, 1, MHA, kv, config)
        run = asyncio.create_task(worker.run())
        try:
            async with asyncio.timeout(BOUND_S):
                await worker.wait_attached()
            specs = rng.randrange(1, 40)
            await until_thread(lambda: worker.statistics().specs >= specs, "the manager's specs", BOUND_S)
            began = time.monotonic()
            if point == 0:
                manager.kill()
            closing = asyncio.create_task(worker.aclose())
            if point == 1:
                manager.kill()
            elif point >= 2:
                async with asyncio.timeout(BOUND_S):
                    await worker.wait_detached()  # the session ended: it takes nothing more
                for _ in range(rng.randrange(0, 50) if point == 2 else 0):
                    await asyncio.sleep(0)
                manager.kill()
            async with asyncio.timeout(BOUND_S):
                await closing
            took = time.monotonic() - began
            assert took < WAIT_S + 10.0, f"seed {seed} (point {point}): the close took {took:.1f} s"
            await asyncio.wait({run}, timeout=BOUND_S)
            assert run.done() and (run.cancelled() or run.exception() is None), run
            assert not worker.attached
            assert held(pool_name)[0] == 0, f"seed {seed}: the dead manager's pool is still mapped here"
        finally:
            await worker.aclose()
            await asyncio.wait({run}, timeout=BOUND_S)
    finally:
        await manager.end()
    # A manager restarted there serves a new worker of the same rank in this process.
    manager = _Manager(tmp_path / "m")
    try:
        address, _ = await manager.address()
        async with RankWorker(address, 0, 1, MHA, kv, config) as worker:
            async with asyncio.timeout(BOUND_S):
                await worker.wait_attached()
            await until_thread(lambda: worker.statistics().reports.get(RankStatus.OK, 0) > 0, "a copy", BOUND_S)
            assert worker.statistics().sessions == 1
    finally:
        await manager.end()
