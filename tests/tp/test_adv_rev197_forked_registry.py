"""Review 197: the per-process session registry (review 196) across ``fork``.

Workers of one process run sessions of a (manager socket, rank) one at a time: a worker waits while
the registry names another worker of the rank whose session task runs. A process forked (without
exec) while a worker of it was in a session inherited that entry, with a task that never ends there
on a loop never closed there: every worker of that rank the child made found it "in a session" and
waited for good, long after the parent's worker (another process: nothing of the child's) was gone.

A real fork of this process while its worker is attached; the parent's worker then closes, and the
child's worker of the same rank must attach.
"""

from __future__ import annotations

import asyncio
import os
import select
from pathlib import Path

import pytest
import torch
from tp_helpers import CONFIG

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.tp import RankGroup, RankWorker

MHA = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
SLOTS = 4 * MHA.page_tokens
BOUND_S = 30.0
CHILD_WAIT_S = 10.0


def _child(address: str, go: int, out: int) -> None:
    """In the forked child: once told, run a worker of rank 0 and write whether it attached."""
    try:
        low, high = sorted((go, out))  # the parent's sockets (its manager's, its worker's) are closed here:
        os.closerange(3, low)  # a copy of either end kept the parent's link open after it closed it
        os.closerange(low + 1, high)
        os.closerange(high + 1, 1 << 16)
        os.read(go, 1)
        torch.set_num_threads(1)
        kv = torch.zeros(MHA.num_layers, SLOTS, MHA.rows, MHA.head_dim, dtype=MHA.dtype)

        async def main() -> bytes:
            async with RankWorker(address, 0, 1, MHA, kv, CONFIG) as worker:
                try:
                    async with asyncio.timeout(CHILD_WAIT_S):
                        await worker.wait_attached()
                    return b"attached"
                except TimeoutError:
                    stats = worker.statistics()
                    return f"not attached: {stats.link_errors} link errors".encode()

        os.write(out, asyncio.run(main()))
    except BaseException as exc:
        os.write(out, f"child failed: {exc!r}".encode())
    finally:
        os._exit(0)


@pytest.mark.asyncio
async def test_a_child_forked_during_a_session_runs_its_own_worker_of_the_rank(tmp_path: Path, pool: PagePool) -> None:
    kv = torch.zeros(MHA.num_layers, SLOTS, MHA.rows, MHA.head_dim, dtype=MHA.dtype)
    async with RankGroup(MHA, 1, pool.name, pool.num_pages, CONFIG, tmp_path / "m") as group:
        address = os.fspath(group.address)
        go_r, go_w = os.pipe()
        out_r, out_w = os.pipe()
        pid = -1
        try:
            async with RankWorker(address, 0, 1, MHA, kv, CONFIG):
                async with asyncio.timeout(BOUND_S):
                    await group.wait_attached()
                pid = os.fork()
                if pid == 0:
                    _child(address, go_r, out_w)
                os.close(go_r)
                os.close(out_w)
            # The parent's worker closed: rank 0 is free for the child's.
            os.write(go_w, b"g")
            readable = await asyncio.to_thread(select.select, [out_r], [], [], BOUND_S)
            assert readable[0], "the child never answered"
            said = os.read(out_r, 4096).decode()
            assert said == "attached", f"the child's worker of rank 0: {said}"
        finally:
            for fd in (go_w, out_r):
                os.close(fd)
            if pid > 0:
                await asyncio.to_thread(os.waitpid, pid, 0)
