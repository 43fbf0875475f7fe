"""Adversarial (helper-263): a loop-wide cancel (an application's SIGTERM handler cancelling every
task of the loop, the cache's own background tasks included) landing while a load, a
compute-or-load stream, a prefetch and an offload run at once over a small pool and a disk tier.

The cancel sweeps (``test_adv_rev195_cancel_sweep.py``) cancel one caller at a time; the two
loop-wide cancels of the suite cut ``aclose`` (``test_bridge_close_cut.py``,
``test_adv_rev205_close_cut.py``). Here the write-behind, the disk reads' tasks, the stream's
loader and every wait inside the cache are cancelled at the same loop turn as the callers.

Oracle: token i's KV is a hash of the salt and ``tokens[: i + 1]``. Once the callers ended, their
slots are overwritten at once (POISON; the offload's source with GARBAGE, which a late read would
store and a later load show) and must stay so through a flush, a fresh load of every prompt (only
the oracle's bytes), and the close. Every await is bounded (a hang fails), the loop sees no
unhandled error (``loop_hygiene``), and the cache ends quiescent and closes.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config
from cancel_points import most_attempts, pause
from load_gate import LoadGate
from loop_probes import cancel_every_task_but_nowait, no_loop_reports, until_thread

from aiokv import KVCache
from aiokv.kernels.hostcopy import HostGather, HostScatter
from aiokv.storage import DiskTier

T = LAYOUT.page_tokens
PAGES = 9
N = PAGES * T + 2
POOL_PAGES = 8
SLOTS = 8 * N
POISON = 100.0
GARBAGE = -50.0
MARK = -100.0
BOUND_S = 20.0
DENSE = 30
SEEDS = range(*(int(x) for x in os.environ.get("AIOKV_REV263_SEEDS", "0:2").split(":")))
"""``AIOKV_REV263_SEEDS=a:b`` runs the sweep with seeds ``[a, b)``."""

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU KV buffer: poison checks read it directly")


def oracle(tokens: list[int], salt: str) -> torch.Tensor:
    """``[L, len, rows, D]``: token i's KV from a hash of the salt and ``tokens[: i + 1]``; values
    k/8, k in [-32, 32): exact in fp16, never POISON, GARBAGE or MARK."""
    state = xxhash.xxh64(b"rev263" + salt.encode())
    prefix = np.empty(len(tokens), dtype=np.uint64)
    for i, token in enumerate(tokens):
        state.update(int(token).to_bytes(8, "little"))
        prefix[i] = state.intdigest()
    shape = (LAYOUT.num_layers, 1, LAYOUT.rows, LAYOUT.head_dim)
    where = np.arange(np.prod(shape), dtype=np.uint64).reshape(shape)
    x = prefix.reshape(1, -1, 1, 1) ^ (where * np.uint64(0x9E3779B97F4A7C15))
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    values = ((x >> np.uint64(58)).astype(np.int64) - 32).astype(np.float32) / 8
    return torch.from_numpy(values).to(LAYOUT.dtype)


def slow_copies(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Copies on the copy thread each wait a random 0-2 ms first, so the cancel lands while one runs."""
    pace = random.Random(seed)

    def slowed(real: Callable[..., None]) -> Callable[..., None]:
        def copy(*args: Any, **kwargs: Any) -> None:
            time.sleep(pace.choice([0, 0, 0.0005, 0.002]))
            real(*args, **kwargs)

        return copy

    monkeypatch.setattr(HostScatter, "load", slowed(HostScatter.load))
    monkeypatch.setattr(HostGather, "offload", slowed(HostGather.offload))


class Scene:
    def __init__(self, cache: KVCache, kv: torch.Tensor, seed: int) -> None:
        rng = random.Random(seed)
        self.cache = cache
        self.kv = kv
        trunk = [rng.randrange(0, 3) for _ in range(3 * T)]
        # Two prompts sharing a trunk of three pages (their pages there are one in the pool).
        self.p = trunk + [rng.randrange(0, 3) for _ in range(N - 3 * T)]
        self.q = trunk + [rng.randrange(3, 6) for _ in range(N - 3 * T)]
        self.r = [rng.randrange(0, 3) for _ in range(N)]
        self.load_slots = torch.arange(0, N)
        self.stream_slots = torch.arange(N, 2 * N)
        self.source = torch.arange(2 * N, 3 * N)
        self.check = torch.arange(3 * N, 4 * N)
        self.scratch = torch.arange(4 * N, 5 * N)

    async def store(self, tokens: list[int], salt: str) -> None:
        slots = self.scratch[: len(tokens)]
        self.kv[:, slots] = oracle(tokens, salt)
        await self.cache.offload(tokens, slots, salt=salt)
        self.kv[:, self.scratch] = GARBAGE

    def evict(self, tokens: list[int], salt: str, pages: range) -> None:
        keys = self.cache.keys(tokens, salt)
        for p in pages:
            self.cache.pool.table.discard(keys[p])

    def poisoned(self, what: str, slots: torch.Tensor) -> None:
        changed = (self.kv[:, slots] != POISON).any(dim=(0, 2, 3)).nonzero().flatten().tolist()
        assert not changed, f"{what}: slots {changed[:8]} written after the call ended"

    def holds(self, what: str, slots: torch.Tensor, truth: torch.Tensor, low: int, high: int) -> None:
        got = self.kv[:, slots[low:high]]
        if not torch.equal(got, truth[:, low:high]):
            bad = (got != truth[:, low:high]).any(dim=(0, 2, 3)).nonzero().flatten().tolist()
            raise AssertionError(f"{what}: wrong KV at tokens {[low + b for b in bad][:8]} of [{low}, {high})")

    async def whole(self, what: str, tokens: list[int], salt: str) -> None:
        match = await self.cache.match(tokens, salt)
        self.kv[:, self.check] = POISON
        got = await self.cache.load(match, self.check[: match.tokens])
        self.holds(what, self.check, oracle(tokens, salt), 0, got.tokens)
        self.poisoned(what + " (past the result)", self.check[got.tokens :])


async def _load(scene: Scene, salt: str) -> Any:
    match = await scene.cache.match(scene.p, salt)
    got = await scene.cache.load(match, scene.load_slots[: match.tokens])
    scene.holds("load", scene.load_slots, oracle(scene.p, salt), 0, got.tokens)
    return got


async def _stream(scene: Scene, salt: str, attempt: int) -> Any:
    match = await scene.cache.match(scene.q, salt)
    slots = scene.stream_slots[: match.tokens]
    stream = await scene.cache.start_load(match, slots, layered=attempt % 2 == 1)
    async with stream:
        pos = 0
        while (end := stream.claim(min(pos + 3, T * (attempt % 4)))) > pos:
            scene.kv[:, slots[pos:end]] = MARK
            pos = end
            await asyncio.sleep(0)
        await stream.launched()
        for layer in range(LAYOUT.num_layers):
            await stream.wait_layer(layer)
        result = await stream.finish()
    scene.holds("stream", slots, oracle(scene.q, salt), result.loaded_from, result.tokens)
    return result


async def _offload(scene: Scene, salt: str) -> Any:
    return await scene.cache.offload(scene.r, scene.source, salt=salt)


def _settled(cache: KVCache, disk: DiskTier) -> bool:
    """Nothing left in the background, no reservation, no disk I/O in flight."""
    stats = cache.stats()
    return stats.background_jobs == 0 and stats.pool_reserved == 0 and disk.statistics().in_flight == 0


async def _open(disk: Path, kv: torch.Tensor) -> KVCache:
    cache = KVCache(config(disk, pool_pages=POOL_PAGES, disk_pages=64, offload_wait=0.2, commit_wait=1.0), LAYOUT, kv)
    await cache.start()
    await cache.pool.wait_ready()
    return cache


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cuts", [1, 3])
async def test_a_loop_wide_cancel_mid_calls_leaves_no_copy_running_and_no_wrong_kv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int, cuts: int
) -> None:
    """Each attempt: a cache over the same directory, the four calls, the loop-wide cancel after a
    growing wait (``cuts``: and again, twice, a few turns apart), the slots poisoned, the close
    (the engine's shutdown after its SIGTERM handler);
    the next attempt's cache first serves every prompt whole, exactly, from what the disk kept."""
    slow_copies(monkeypatch, seed)
    kv = torch.full((LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim), POISON, dtype=LAYOUT.dtype)
    outcomes: dict[str, int] = {}
    stored: list[tuple[list[int], str]] = []
    for attempt in range(most_attempts(DENSE)):
        cache = await _open(tmp_path / "disk", kv)
        scene = Scene(cache, kv, seed)
        try:
            async with asyncio.timeout(BOUND_S):
                for n, (tokens, salt) in enumerate(stored):
                    await scene.whole(f"seed {seed} attempt {attempt}: prompt {n} from the last close", tokens, salt)
                await assert_quiescent(cache)
            salt = f"s{attempt % 3}"
            for tokens in (scene.p, scene.q):
                await scene.store(tokens, salt)
            if attempt % 2 == 0:
                await cache.flush()
            scene.evict(scene.p, salt, range(1 + attempt % 3, PAGES))
            scene.evict(scene.q, salt, range(2, PAGES))
            kv[:, scene.source] = oracle(scene.r, f"r{attempt}")
            kv[:, scene.load_slots] = POISON
            kv[:, scene.stream_slots] = POISON
            calls = {
                "load": asyncio.ensure_future(_load(scene, salt)),
                "stream": asyncio.ensure_future(_stream(scene, salt, attempt)),
                "prefetch": asyncio.ensure_future(cache.prefetch(scene.p, salt=salt)),
                "offload": asyncio.ensure_future(_offload(scene, f"r{attempt}")),
            }
            wait = await pause(attempt, DENSE)
            where = f"seed {seed} attempt {attempt} (cancel after {wait})"
            cancel_every_task_but_nowait(asyncio.current_task())
            for cut in range(1, cuts):
                # SIGTERM again: the cut calls' and the cache's clean-ups (waits through
                # cancellation, quiesces) cut in their turn, a few turns later.
                for _ in range((attempt + cut) % 4):
                    await asyncio.sleep(0)
                cancel_every_task_but_nowait(asyncio.current_task())
            async with asyncio.timeout(BOUND_S):
                ends = await asyncio.gather(*calls.values(), return_exceptions=True)
            for name, end in zip(calls, ends, strict=True):
                if isinstance(end, BaseException) and not isinstance(end, asyncio.CancelledError):
                    raise AssertionError(f"{where}: {name} raised {end!r}") from end
                kind = "cancelled" if isinstance(end, asyncio.CancelledError) else "done"
                outcomes[f"{name} {kind}"] = outcomes.get(f"{name} {kind}", 0) + 1
            # The engine reuses every slot at once, then closes the cache.
            kv[:, scene.load_slots] = POISON
            kv[:, scene.stream_slots] = POISON
            kv[:, scene.source] = GARBAGE
            # What the cut calls left in the background ends by itself and gives back every
            # reservation; the references left are the write-behind's (its workers were cut too:
            # only the close writes what they left queued).
            disk = cache.disk
            assert disk is not None
            await until_thread(functools.partial(_settled, cache, disk), f"{where}: the cut calls' ends", BOUND_S)
            left = cache.stats()
            behind = disk.statistics()
            assert left.pool_referenced <= behind.write_behind_queued + behind.write_behind_writing, (where, left)
        finally:
            async with asyncio.timeout(BOUND_S):
                await cache.aclose()
        scene.poisoned(where + ": load", scene.load_slots)
        scene.poisoned(where + ": stream", scene.stream_slots)
        stored = [(scene.p, salt), (scene.q, salt), (scene.r, f"r{attempt}")]
        if all(not isinstance(e, BaseException) for e in ends):
            break
    else:
        raise AssertionError(f"seed {seed}: the calls never completed before the cancel")
    assert os.listdir(tmp_path) == ["disk"], "written outside the cache directory"
    print(outcomes)
    assert outcomes.get("load cancelled", 0) and outcomes.get("offload cancelled", 0), outcomes


@pytest.mark.asyncio
async def test_a_prefetch_cut_by_a_loop_wide_cancel_leaves_no_unread_error_nor_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefetch waiting for its read groups (their disk loads held) when every task is cancelled:
    the groups' tasks end cancelled too, and the gather the prefetch awaited through a shield ended
    with their CancelledError, which nobody read: the loop logged "_GatheringFuture exception was
    never retrieved" (an application's handler sees an error per such prefetch). Nothing of it may
    reach the loop's handler, and the pages the groups reserved all go back."""
    kv = torch.full((LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim), POISON, dtype=LAYOUT.dtype)
    cache = await _open(tmp_path / "disk", kv)
    try:
        async with no_loop_reports("the loop's handler got"):  # checked at its end, before the close
            scene = Scene(cache, kv, 0)
            tokens = scene.p[: 6 * T]
            await scene.store(tokens, "x")
            await cache.flush()
            scene.evict(tokens, "x", range(6))  # on disk only
            assert cache.disk is not None
            gate = LoadGate(cache.disk, monkeypatch)
            try:
                task = asyncio.ensure_future(cache.prefetch(tokens, salt="x"))
                await until_thread(lambda: len(gate.held) > 0, "the prefetch's held reads")
                cancel_every_task_but_nowait(asyncio.current_task())
                with pytest.raises(asyncio.CancelledError):
                    async with asyncio.timeout(BOUND_S):
                        await asyncio.shield(task)
            finally:
                gate.open()
            async with asyncio.timeout(BOUND_S):
                await until_thread(lambda: cache.stats().background_jobs == 0 and cache.disk is not None
                            and cache.disk.statistics().reads_in_flight == 0, "the cut groups' reads")
                await assert_quiescent(cache)  # (nothing queued for write-behind: its cut workers are not waited for)
                await scene.whole("after the cut prefetch", tokens, "x")
            # The cut prefetch's task holds the gather through its error's traceback: dropped here,
            # so the check at the block's end collects it (else only the teardown's collection did).
            del task
    finally:
        async with asyncio.timeout(BOUND_S):
            await cache.aclose()
