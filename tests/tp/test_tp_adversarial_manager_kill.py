"""Adversarial: the scheduler process holding a `TPCache` is SIGKILLed while its live rank
processes copy, then a new `TPCache` starts on the same socket directory and disk directory.

Checked with real processes (the manager in a spawned process of its own): the new manager starts
(a dead manager's socket does not block it), the live ranks notice and re-attach within a bound,
every page on disk that the new manager serves is bit-exact on every rank (the prefix oracle), the
ranks map only the new pool, and nothing holds the dead manager's segment any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from adv_helpers import START_S, AdvRanks, idx, rank_prefix_kv
from child_procs import end_child, fork_context
from tp_helpers import CONFIG

from aiokv import CacheConfig, KVLayout
from aiokv.reclaim import SegmentState, scan
from aiokv.storage import DiskConfig
from aiokv.tp import TPCache

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
NUM_SLOTS = 512
PROMPTS = 16
PAGES = 4
SLOW_S = float(os.environ.get("AIOKV_ADV_SLOW_S", "0"))


def _config(disk: Path) -> CacheConfig:
    return CacheConfig(cpu_bytes=64 * LAYOUT.page_bytes, namespace="tp-adv-mgr-kill",
                       pool_chunk_bytes=8 * LAYOUT.page_bytes,
                       disk=DiskConfig(directory=disk, capacity_bytes=400 * (LAYOUT.page_bytes + 4096)))


def _prompt(i: int) -> list[int]:
    return [7000 * (i + 1) + j for j in range(PAGES * T)]


def _slots(i: int) -> torch.Tensor:
    return torch.arange(i * PAGES * T, (i + 1) * PAGES * T)


def manager_main(ctrl: multiprocessing.connection.Connection, disk: str, sock: str) -> None:
    """The scheduler process: a TPCache that offloads every prompt, then loads and offloads in a
    loop until it is killed. Sends ``("address", path, pool name)`` once listening and ``"stored"``
    after the first round reached disk."""
    torch.set_num_threads(1)

    async def main() -> None:
        async with TPCache(_config(Path(disk)), LAYOUT, tp_size=2, num_slots=NUM_SLOTS, tp_config=CONFIG,
                           directory=sock) as cache:
            ctrl.send(("address", cache.address, cache.pool.name))
            await cache.wait_ranks()
            assert ctrl.recv() == "go"  # the test prefilled the ranks' buffers
            for i in range(PROMPTS):
                await cache.offload(_prompt(i), _slots(i))
            await cache.flush()
            ctrl.send("stored")
            turn = 0
            while True:  # busy until killed: loads into the upper half, offloads
                i = turn % PROMPTS
                match = await cache.match(_prompt(i))
                await cache.load(match, _slots(PROMPTS + i)[: match.tokens])
                await cache.offload(_prompt(i), _slots(i))
                turn += 1

    asyncio.run(main())


@pytest_asyncio.fixture
async def procs_left() -> AsyncIterator[list[object]]:
    left: list[object] = []
    yield left
    for item in left:
        if isinstance(item, AdvRanks):
            await item.kill_all()
        elif isinstance(item, multiprocessing.process.BaseProcess):
            await asyncio.to_thread(end_child, item, 30)


def _state(name: str) -> SegmentState | None:
    """The scan's state of segment ``name`` (None: gone)."""
    return {s.name: s.state for s in scan("aiokv")}.get(name)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_killed_manager_is_replaced_and_live_ranks_serve_the_new_one(tmp_path: Path,
                                                                             procs_left: list[object]) -> None:
    ctx = fork_context()
    parent, child = ctx.Pipe()
    sock, disk = tmp_path / "sock", tmp_path / "disk"
    manager = ctx.Process(target=manager_main, args=(child, os.fspath(disk), os.fspath(sock)), daemon=True)
    manager.start()
    child.close()
    procs_left.append(manager)
    async with asyncio.timeout(START_S):
        kind, address, old_pool = await asyncio.to_thread(parent.recv)
    assert kind == "address"
    ranks = AdvRanks(address, LAYOUT, 2, NUM_SLOTS, dataclasses.replace(CONFIG, inline_copy_bytes=0), slow_s=SLOW_S)
    procs_left.append(ranks)
    ranks.start_all()
    for i in range(PROMPTS):
        for rank in range(2):
            await ranks.write(rank, _slots(i).tolist(), rank_prefix_kv(LAYOUT, _prompt(i), 0, rank, 2))
    parent.send("go")
    async with asyncio.timeout(START_S):
        assert await asyncio.to_thread(parent.recv) == "stored"
    await asyncio.sleep(0.3)  # into the busy loop: loads and offloads in flight
    assert manager.pid is not None
    os.kill(manager.pid, signal.SIGKILL)
    await asyncio.to_thread(manager.join, 30)
    assert manager.exitcode == -signal.SIGKILL
    parent.close()

    async with TPCache(_config(disk), LAYOUT, tp_size=2, num_slots=NUM_SLOTS, tp_config=CONFIG,
                       directory=sock) as cache:
        async with asyncio.timeout(60):  # the live ranks re-attach to the new manager
            await cache.wait_ranks()
        for rank in range(2):
            stats = await ranks.ask(rank, ("stats",))
            assert stats.sessions == 2 and stats.pool_name == cache.pool.name, stats
            assert await ranks.ask(rank, ("maps",)) == {cache.pool.name}, "the dead manager's pool is still mapped"
        loaded = 0
        for i in range(PROMPTS):
            match = await cache.match(_prompt(i))
            target = list(range(NUM_SLOTS - match.tokens, NUM_SLOTS))
            result = await cache.load(match, idx(target))
            loaded += result.tokens
            for rank in range(2):
                got = await ranks.read(rank, target[: result.tokens])
                want = rank_prefix_kv(LAYOUT, _prompt(i), 0, rank, 2)[:, : result.tokens]
                assert torch.equal(got, want), f"prompt {i}: rank {rank} served wrong KV after the manager died"
        assert loaded == PROMPTS * PAGES * T, f"only {loaded} tokens of the flushed pages came back from disk"
        await ranks.stop_all()
        # Nothing holds the dead manager's segment any more (no rank kept its mapping or lock): it
        # is reclaimable, and the test removes it if no start reclaimed it yet. (That no start
        # does so in a quiet host is a defect: see the report's repro, s24_adv_tp.)
        state = _state(old_pool)
        assert state in (None, SegmentState.DEAD), f"the killed manager's segment is still held: {state}"
        if state is SegmentState.DEAD:
            with contextlib.suppress(FileNotFoundError):
                os.unlink("/dev/shm" + old_pool)
