"""A rank process killed while another process holds a copy of its socket: its jobs end with it.

Regression (review 177): the manager learned of a rank's death only from its connection's end. A
process holding a copy of the rank's socket (a child the rank forked without exec: multiprocessing
'fork' helpers, data loader workers; a tool that took the descriptor) kept the connection open after
the rank died: its jobs waited for reports that never came, the call hung (cancelling it too:
the call waits for its ranks), the rank stayed "attached", and the close waited forever.

Now the group watches each rank's process (a pidfd from its hello): when it exits, its connection
is ended and its unreported parts fail (RANK_LOST), as when the kernel closed its socket.

The ranks are real spawned processes with real workers; rank 1's copy is held inside its mover
(``held_rank``), and this test takes a copy of rank 1's socket (``pidfd_getfd``) before killing it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from adv_helpers import socket_copies
from held_rank import HeldRanks
from tp_helpers import CONFIG, SLOTS

from aiokv import CacheConfig, KVLayout
from aiokv.tp import RankStatus, TPCache

MHA = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = MHA.page_tokens
BOUND_S = 60.0
NOTICE_S = 10.0
"""Bound on the call's end once rank 1 died (before the fix it never ended)."""
RANK_CONFIG = dataclasses.replace(CONFIG, inline_copy_bytes=0)


async def _acquire(semaphore: Any) -> None:
    assert await asyncio.to_thread(semaphore.acquire, True, BOUND_S), "the rank's copy never began"


@pytest.mark.asyncio
@pytest.mark.parametrize("direction", ["load", "offload"])
async def test_a_rank_killed_while_its_socket_is_held_elsewhere_fails_its_part(tmp_path: Path,
                                                                              direction: str) -> None:
    config = CacheConfig(cpu_bytes=16 * MHA.page_bytes, disk=None, namespace="tp-held-socket",
                         pool_chunk_bytes=4 * MHA.page_bytes)
    cache = TPCache(config, MHA, tp_size=2, num_slots=SLOTS, tp_config=CONFIG, directory=tmp_path / "sock")
    await cache.start()
    ranks = HeldRanks(Path(cache.address), MHA, 2, seed=5, held=frozenset({1}), config=RANK_CONFIG)
    held = ranks.held[1]
    copies: list[Any] = []
    try:
        ranks.start_all()
        await cache.wait_ranks()
        tokens = list(range(3000, 3000 + T))
        source, target = torch.arange(T), torch.arange(40, 40 + T)
        if direction == "load":
            held.release()  # the offload that fills the pool runs freely
            assert (await cache.offload(tokens, source)).stored == 1
            await _acquire(held.entered)
            call: asyncio.Task[Any] = asyncio.create_task(cache.load(await cache.match(tokens), target))
        else:
            call = asyncio.create_task(cache.offload(tokens, source))
        await _acquire(held.entered)  # rank 1's copy has begun and waits on the gate
        pid = ranks.procs[1].pid
        assert pid is not None
        try:
            copies = socket_copies(pid, os.fspath(cache.address))
        except PermissionError as exc:
            pytest.skip(f"cannot take the rank's socket: {exc}")
        assert len(copies) == 1
        os.kill(pid, signal.SIGKILL)  # its copy dies with it; the connection lives on in `copies`
        async with asyncio.timeout(NOTICE_S):  # before: never (the rank's report was awaited for ever)
            await asyncio.wait({call})
        result = call.result()
        assert (result.tokens if direction == "load" else result.stored) == 0
        jobs = cache.group.statistics().jobs
        assert jobs.in_flight == 0 and jobs.rank_failures.get(RankStatus.RANK_LOST) == 1, jobs
        assert 1 not in cache.group.attached
    finally:
        for sock in copies:
            sock.close()
        held.release(8)  # never leave a rank held when the test fails
        async with asyncio.timeout(BOUND_S):
            await cache.aclose()
        await ranks.kill_all()
