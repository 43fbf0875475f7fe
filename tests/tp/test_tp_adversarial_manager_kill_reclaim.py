"""A killed TP manager's pool segment is reclaimed once its live ranks let it go.

The new manager's start scans /dev/shm while the ranks (still finishing a copy of the dead
manager's session) hold the segment: LIVE, left alone. Once they re-attached to the new pool
nothing holds it, and it must not stay in /dev/shm until some later pool start on the host: the
rank that lets it go reclaims it. Another process creating an aiokv pool meanwhile reclaims it too
(and hides the leak); to see it fail without the fix, run it in a private /dev/shm:
``unshare -m sh -c 'mount -t tmpfs tmpfs /dev/shm && pytest -q <this file>'`` (root).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from pathlib import Path

import pytest
from adv_helpers import START_S, AdvRanks, rank_prefix_kv
from child_procs import fork_context
from test_tp_adversarial_manager_kill import (
    LAYOUT,
    NUM_SLOTS,
    PROMPTS,
    _config,
    _prompt,
    _slots,
    _state,
    manager_main,
    procs_left,
)
from tp_helpers import CONFIG

from aiokv.reclaim import SegmentState
from aiokv.tp import TPCache

__all__ = ["procs_left"]


@pytest.mark.slow(seconds=24)
@pytest.mark.asyncio
async def test_a_killed_managers_segment_is_reclaimed_once_its_ranks_let_it_go(
    tmp_path: Path, procs_left: list[object]
) -> None:
    ctx = fork_context()
    parent, child = ctx.Pipe()
    sock, disk = tmp_path / "sock", tmp_path / "disk"
    manager = ctx.Process(target=manager_main, args=(child, os.fspath(disk), os.fspath(sock)), daemon=True)
    manager.start()
    child.close()
    procs_left.append(manager)
    async with asyncio.timeout(START_S):
        _, address, old_pool = await asyncio.to_thread(parent.recv)
    # Copies of up to 1.5 s: a rank still copies when the manager dies and holds the old segment
    # past the new manager's start.
    ranks = AdvRanks(address, LAYOUT, 2, NUM_SLOTS, dataclasses.replace(CONFIG, inline_copy_bytes=0), slow_s=0.3)
    procs_left.append(ranks)
    ranks.start_all()
    for i in range(PROMPTS):
        for rank in range(2):
            await ranks.write(rank, _slots(i).tolist(), rank_prefix_kv(LAYOUT, _prompt(i), 0, rank, 2))
    parent.send("go")
    async with asyncio.timeout(START_S):
        assert await asyncio.to_thread(parent.recv) == "stored"
    await asyncio.sleep(0.5)
    assert manager.pid is not None
    os.kill(manager.pid, signal.SIGKILL)
    await asyncio.to_thread(manager.join, 30)
    async with TPCache(_config(disk), LAYOUT, tp_size=2, num_slots=NUM_SLOTS, tp_config=CONFIG,
                       directory=sock) as cache:
        async with asyncio.timeout(60):
            await cache.wait_ranks()
        state = _state(old_pool)
        for _ in range(100):
            state = _state(old_pool)
            if state is None:
                break
            await asyncio.sleep(0.05)
        if state is SegmentState.DEAD:
            os.unlink("/dev/shm" + old_pool)  # the test's own clean-up before it fails
        assert state is None, f"the killed manager's segment {old_pool} stays in /dev/shm ({state})"
        await ranks.stop_all()
