"""Review 262: managers stopped or SIGKILLed during their own close, each replaced at once in the same
socket and disk directories, while live rank processes copy for them.

The existing harnesses kill a manager mid-traffic (tests/tp/test_tp_adversarial_manager_kill*.py,
tools/chaos_tp.py ``--manager-kills``), never inside ``aclose``: with loads (plain, streamed,
layered) and offloads in flight and cancelled at random, its close waits for them, fences the ranks
and frees the pool, and ends or dies at a random point of that (at times with a rank SIGKILLed
during it, restarted with a zeroed buffer). The next manager starts right as the last one's close returned or
it died (an engine's restart: the stopping manager's directory removal and the new start meet).

Oracles: every prompt a last manager serves from disk is bit-exact on both ranks (each KV value a
hash of its whole prefix: adv_helpers); the offload sources (the lower slots) are never written; the
ranks map only the last pool; no manager's pool segment is left in /dev/shm; every step bounded.
MHA (both ranks write) and MLA (rank 0 writes, both read). ``AIOKV_REV262_SEEDS`` (default "262") makes
it a longer search.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing.connection
import os
import random
import signal
from pathlib import Path

import pytest
import torch
from adv_helpers import START_S, AdvRanks, idx, rank_prefix_kv
from child_procs import end_child, fork_context
from tp_helpers import CONFIG

from aiokv import CacheConfig, KVLayout
from aiokv.results import Match
from aiokv.storage import DiskConfig
from aiokv.tp import TPCache

LAYOUTS = {
    "mha": KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4),  # both ranks write their heads
    "mla": KVLayout.mla(2, 16, torch.float16, page_tokens=4),  # rank 0 writes, both read
}
T = 4
PROMPTS = 12
PAGES = 3
LOWER = PROMPTS * PAGES * T  # offload sources below, load targets above
NUM_SLOTS = 2 * LOWER
MANAGERS = 4
BOUND_S = 60.0
SEEDS = [int(seed) for seed in os.environ.get("AIOKV_REV262_SEEDS", "262").split()]


def _config(layout: KVLayout, disk: Path) -> CacheConfig:
    # 16 pool pages for 36 pages of prompts: offloads evict to disk, loads promote from it.
    return CacheConfig(cpu_bytes=16 * layout.page_bytes, namespace="tp-adv-rev262",
                       pool_chunk_bytes=8 * layout.page_bytes, launch_pages=1, launch_turn_s=0,
                       offload_wait=0.5, close_timeout=5.0,
                       disk=DiskConfig(directory=disk, capacity_bytes=200 * (layout.page_bytes + 4096)))


def _prompt(i: int) -> list[int]:
    return [9000 * (i + 1) + j for j in range(PAGES * T)]


def _slots(i: int) -> list[int]:
    return list(range(i * PAGES * T, (i + 1) * PAGES * T))


async def _streamed(cache: TPCache, match: Match, target: torch.Tensor, layered: bool, rng: random.Random) -> None:
    async with cache.start_load(match, target, layered=layered) as stream:
        stream.claim(rng.randrange(0, match.tokens + 1))  # the engine computes the head
        if layered:
            await stream.launched()
            for layer in range(cache.layout.num_layers):
                await stream.wait_layer(layer)
        await stream.finish()


async def _client(cache: TPCache, rng: random.Random, upper: list[int]) -> None:
    """Offloads from the lower slots, loads (plain, from a token, streamed, layered) into this
    client's upper slots, a third cancelled at a random moment, until the cache closes."""
    while True:
        i = rng.randrange(PROMPTS)
        try:
            if rng.random() < 0.5:
                call = asyncio.ensure_future(cache.offload(_prompt(i), idx(_slots(i))))
            else:
                match = await cache.match(_prompt(i))
                target = idx(upper[: match.tokens])
                mode = rng.choice(["plain", "stream", "layered"])
                if mode == "plain":
                    call = asyncio.ensure_future(cache.load(match, target))
                else:
                    call = asyncio.ensure_future(_streamed(cache, match, target, mode == "layered", rng))
            if rng.random() < 1 / 3:
                await asyncio.sleep(rng.random() * 0.03)
                call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call
        except RuntimeError:
            return  # the cache closed under the call
        await asyncio.sleep(0)


def manager_main(ctrl: multiprocessing.connection.Connection, layout_name: str, disk: str, sock: str,
                 seed: int) -> None:
    """A scheduler process: sends ``("address", path, pool)``; after ``"go"`` runs clients until
    ``"stop"``, then closes the cache under them, saying ``("closing", jobs in flight)`` and ``"closed"``."""
    torch.set_num_threads(1)
    rng = random.Random(seed)
    layout = LAYOUTS[layout_name]

    async def main() -> None:
        cache = TPCache(_config(layout, Path(disk)), layout, tp_size=2, num_slots=NUM_SLOTS, tp_config=CONFIG,
                        directory=sock)
        await cache.start()
        ctrl.send(("address", cache.address, cache.pool.name))
        await cache.wait_ranks()
        assert await asyncio.to_thread(ctrl.recv) == "go"
        width = LOWER // 4
        clients = [asyncio.ensure_future(_client(cache, random.Random(rng.random()),
                                                 list(range(LOWER + c * width, LOWER + (c + 1) * width))))
                   for c in range(4)]
        assert await asyncio.to_thread(ctrl.recv) == "stop"
        in_flight = cache.group_statistics().jobs.in_flight
        closing = asyncio.ensure_future(cache.aclose())
        ctrl.send(("closing", in_flight))
        await closing
        await asyncio.gather(*clients)
        ctrl.send("closed")

    asyncio.run(main())


async def _prefill(ranks: AdvRanks, rank: int) -> None:
    for i in range(PROMPTS):
        await ranks.write(rank, _slots(i), rank_prefix_kv(ranks.layout, _prompt(i), 0, rank, 2))


async def _recv(conn: multiprocessing.connection.Connection) -> object:
    async with asyncio.timeout(START_S):
        return await asyncio.to_thread(conn.recv)


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
async def test_managers_stopped_or_killed_in_their_close_are_replaced(tmp_path: Path, layout_name: str,
                                                                      seed: int) -> None:
    rng = random.Random(seed)
    layout = LAYOUTS[layout_name]
    ctx = fork_context()
    sock, disk = tmp_path / "sock", tmp_path / "disk"
    managers: list[multiprocessing.process.BaseProcess] = []
    pools: list[str] = []
    ranks: AdvRanks | None = None
    closed_busy = 0  # closes begun with jobs in flight
    try:
        for k in range(MANAGERS):
            parent, child = ctx.Pipe()
            manager = ctx.Process(target=manager_main, daemon=True,
                                  args=(child, layout_name, os.fspath(disk), os.fspath(sock), seed * 10 + k))
            manager.start()
            managers.append(manager)
            child.close()
            kind, address, pool = await _recv(parent)  # type: ignore[misc]
            assert kind == "address"
            pools.append(pool)
            if ranks is None:
                ranks = AdvRanks(address, layout, 2, NUM_SLOTS, dataclasses.replace(CONFIG, inline_copy_bytes=0),
                                 slow_s=0.01)
                ranks.start_all()
                for rank in range(2):
                    await _prefill(ranks, rank)
            parent.send("go")
            await asyncio.sleep(rng.uniform(0.05, 0.4))  # traffic in flight
            parent.send("stop")
            kind, in_flight = await _recv(parent)  # type: ignore[misc]
            assert kind == "closing"
            closed_busy += in_flight > 0
            fate = rng.choice(["closed", "closed with a rank killed", "killed", "killed with a rank"])
            if fate.startswith("closed"):
                if fate == "closed with a rank killed":  # its close goes on without that rank's reports
                    await asyncio.sleep(rng.uniform(0.0, 0.02))
                    dying = rng.randrange(2)
                    ranks.kill(dying)
                    ranks.start(dying)
                assert await _recv(parent) == "closed"
                if fate == "closed with a rank killed":
                    await _prefill(ranks, dying)
                    await ranks.reap_dead()
            else:
                victim = rng.randrange(2) if fate == "killed with a rank" else None
                if victim is not None:  # a rank dies as its manager closes, the manager then too
                    await asyncio.sleep(rng.uniform(0.0, 0.02))
                    ranks.kill(victim)
                await asyncio.sleep(rng.uniform(0.0, 0.05))  # somewhere in its close (or after it)
                manager.kill()
                if victim is not None:
                    ranks.start(victim)
                    await _prefill(ranks, victim)  # the engine computes its prompts again
                    await ranks.reap_dead()
            await asyncio.to_thread(manager.join, BOUND_S)
            assert manager.exitcode in (0, -signal.SIGKILL), (fate, manager.exitcode)
            parent.close()
        assert ranks is not None
        assert closed_busy, "no close began with jobs in flight"
        async with TPCache(_config(layout, disk), layout, tp_size=2, num_slots=NUM_SLOTS, tp_config=CONFIG,
                           directory=sock) as cache:
            async with asyncio.timeout(BOUND_S):
                await cache.wait_ranks()
            for rank in range(2):
                assert await ranks.ask(rank, ("maps",)) == {cache.pool.name}
            loaded = 0
            for i in range(PROMPTS):
                async with asyncio.timeout(BOUND_S):
                    match = await cache.match(_prompt(i))
                    target = list(range(NUM_SLOTS - match.tokens, NUM_SLOTS))
                    result = await cache.load(match, idx(target))
                loaded += result.tokens
                for rank in range(2):
                    got = await ranks.read(rank, target[: result.tokens])
                    want = rank_prefix_kv(layout, _prompt(i), 0, rank, 2)[:, : result.tokens]
                    assert torch.equal(got, want), f"prompt {i}: rank {rank} served wrong KV"
            assert loaded, "nothing came back from disk"
            for rank in range(2):  # the offload sources were never written by a load
                for i in range(PROMPTS):
                    got = await ranks.read(rank, _slots(i))
                    assert torch.equal(got, rank_prefix_kv(layout, _prompt(i), 0, rank, 2)), (rank, i)
            await ranks.stop_all()
        present = set(os.listdir("/dev/shm"))
        left = {p for p in pools if p.lstrip("/") in present}
        assert not left, f"pool segments left in /dev/shm: {sorted(left)}"
    finally:
        for manager in managers:
            await asyncio.to_thread(end_child, manager, 30)
        if ranks is not None:
            await ranks.continue_and_kill_all()
