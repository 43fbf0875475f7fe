"""Adversarial (helper-263): seeded random public calls, some cancelled at random turns, over a real
small ext4 on a loop device that goes through the faults an operator or another program causes:
healthy, filled up by another program (ENOSPC), remounted read-only (EROFS) with that ballast still
there, read-write again with the room back, frozen (``fsfreeze``: writes stuck in the kernel), thawed.

``tests/storage/test_adv_cache_fs.py`` goes through fill-up and read-only with plain offloads and
loads, none cancelled; ``test_adv_rev195_cancel_sweep.py`` cancels over a healthy directory. Here
every phase runs offloads, loads (from token 0 or mid-page), compute-or-load streams (whole or
layer by layer), prefetches and pool evictions as tasks, some cancelled after a random number of
loop turns, over prompts sharing trunks under two salts.

Oracle: token i's KV is a hash of the salt and ``tokens[: i + 1]`` (``test_adv_rev263_loop_cancel``);
what a call reports loaded holds exactly that, nothing past it is written, and once a call ended
(cancelled included) its slots are poisoned and must stay so through every later phase. Every call
is bounded (a hang fails), faults are counted (ENOSPC, never EIO), each phase but the frozen one
ends quiescent, and a cache reopened over the directory at the end serves only right KV. A watchdog
thaws if the test hangs. Root only (loop mounts).

``AIOKV_REV263_FS_SEEDS=a:b`` runs seeds ``[a, b)`` (default one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config
from loop_probes import until_thread
from test_adv_rev263_frozen_pool import Engine
from test_adv_rev263_loop_cancel import POISON, oracle

from aiokv import KVCache
from aiokv.storage import DiskConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from fs_helpers import fill_up, freeze, loop_ext4, remount, thaw
from test_adv_cache_fs import remount_read_only

T = LAYOUT.page_tokens
POOL_PAGES = 12
CALL_BOUND_S = 10.0
SETTLE_S = 30.0
THAW_S = 90.0
OPS = 14
PHASES = ("healthy", "full", "read-only", "room back", "frozen", "thawed")
SEEDS = range(*(int(x) for x in os.environ.get("AIOKV_REV263_FS_SEEDS", "0:1").split(":")))

pytestmark = [
    pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU KV buffer: poison checks read it directly"),
    pytest.mark.skipif(shutil.which("fsfreeze") is None, reason="fsfreeze is not installed"),
]


def _settings(directory: Path) -> Any:
    settings = config(None, pool_pages=POOL_PAGES, offload_wait=0.3, commit_wait=0.5, close_timeout=5.0)
    tier = DiskConfig(directory=directory, capacity_bytes=16 << 20, min_free_bytes=0, free_space_recheck_s=0.1,
                      queue_depth=8, write_behind_workers=4)
    return dataclasses.replace(settings, disk=tier)


def _prompts(rng: random.Random) -> list[list[int]]:
    trunks = [[rng.randrange(0, 3) for _ in range(2 * T)] for _ in range(2)]
    return [rng.choice(trunks) + [rng.randrange(0, 3) for _ in range(rng.randrange(3, 9) * T + rng.randrange(0, T))]
            for _ in range(6)]


async def _load(engine: Engine, tokens: list[int], salt: str, what: str, rng: random.Random) -> None:
    cache = engine.cache
    match = await cache.match(tokens, salt)
    start = min(match.tokens, rng.choice([0, 0, 1, T + 2]))
    slots = engine.slots(match.tokens - start)
    engine.kv[:, slots] = POISON
    try:
        got = await cache.load(match, slots, from_token=start)
        n = got.tokens - start
        assert torch.equal(engine.kv[:, slots[:n]], oracle(tokens, salt)[:, start : got.tokens]), \
            f"{what}: wrong KV within the tokens reported loaded"
        assert not (engine.kv[:, slots[n:]] != POISON).any().item(), f"{what}: written past its result"
    finally:
        engine.end(what, slots)


async def _stream(engine: Engine, tokens: list[int], salt: str, what: str, rng: random.Random) -> None:
    cache = engine.cache
    match = await cache.match(tokens, salt)
    slots = engine.slots(match.tokens)
    engine.kv[:, slots] = POISON
    layered = rng.random() < 0.5
    upto = rng.randrange(0, match.tokens + 1)
    try:
        stream = await cache.start_load(match, slots, layered=layered)
        async with stream:
            pos = 0
            while (end := stream.claim(min(pos + T, upto))) > pos:
                pos = end
                await asyncio.sleep(0)
            if layered:
                front = await stream.launched()
                for layer in range(LAYOUT.num_layers):
                    if await stream.wait_layer(layer):
                        truth = oracle(tokens, salt)[layer, front : len(slots)]
                        assert torch.equal(engine.kv[layer, slots[front:]], truth), f"{what}: layer {layer} wrong"
            result = await stream.finish()
        truth = oracle(tokens, salt)
        assert torch.equal(engine.kv[:, slots[result.loaded_from : result.tokens]],
                           truth[:, result.loaded_from : result.tokens]), f"{what}: wrong KV loaded"
        assert not (engine.kv[:, slots[: result.loaded_from]] != POISON).any().item(), \
            f"{what}: written below loaded_from {result.loaded_from}"
    finally:
        engine.end(what, slots)


async def _offload(engine: Engine, tokens: list[int], salt: str, what: str) -> None:
    await engine.store(tokens, salt)


async def _prefetch(engine: Engine, tokens: list[int], salt: str, what: str) -> None:
    await engine.cache.prefetch(tokens, salt=salt)


def _evict(cache: KVCache, tokens: list[int], salt: str, rng: random.Random) -> None:
    for key in cache.keys(tokens, salt)[rng.randrange(0, 3):]:
        cache.pool.table.discard(key)  # refused (False) for a page someone holds


async def _enter(phase: str, mount: Path) -> None:
    if phase == "full":
        await asyncio.to_thread(fill_up, mount / "ballast", 0)
    elif phase == "read-only":
        await remount_read_only(mount)
    elif phase == "room back":
        await asyncio.to_thread(remount, mount, "rw")
        (mount / "ballast").unlink()
    elif phase == "frozen":
        await asyncio.to_thread(freeze, mount)
    elif phase == "thawed":
        await asyncio.to_thread(thaw, mount)


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", SEEDS)
async def test_random_cancelled_calls_through_fs_faults_serve_only_right_kv(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    prompts = _prompts(rng)
    salts = ("a", "b")
    with loop_ext4(tmp_path, 24, reserved_percent=0) as mount:
        watchdog = threading.Timer(THAW_S, thaw, [mount])
        watchdog.start()
        kv = torch.full((LAYOUT.num_layers, 1 << 14, LAYOUT.rows, LAYOUT.head_dim), POISON, dtype=LAYOUT.dtype)
        cache = KVCache(_settings(mount / "kv"), LAYOUT, kv)
        engine = Engine(cache, kv)
        done = cancelled = 0
        try:
            await cache.start()
            await cache.pool.wait_ready()
            for phase in PHASES:
                await _enter(phase, mount)
                for op in range(OPS):
                    tokens = rng.choice(prompts)
                    salt = rng.choice(salts)
                    what = f"seed {seed} {phase} op {op}"
                    kind = rng.choice(["offload", "offload", "load", "load", "stream", "stream", "prefetch", "evict"])
                    if kind == "evict":
                        _evict(cache, tokens, salt, rng)
                        continue
                    if kind == "offload":
                        call = _offload(engine, tokens, salt, what)
                    elif kind == "load":
                        call = _load(engine, tokens, salt, f"{what} load", rng)
                    elif kind == "stream":
                        call = _stream(engine, tokens, salt, f"{what} stream", rng)
                    else:
                        call = _prefetch(engine, tokens, salt, what)
                    task = asyncio.ensure_future(call)
                    if rng.random() < 0.4:
                        for _ in range(rng.randrange(0, 30)):
                            await asyncio.sleep(0)
                        task.cancel()
                    try:
                        async with asyncio.timeout(CALL_BOUND_S):
                            await asyncio.shield(task)
                        done += 1
                    except asyncio.CancelledError:
                        if not task.cancelled():
                            raise
                        cancelled += 1
                engine.check_ended()
                if phase != "frozen":
                    async with asyncio.timeout(SETTLE_S):
                        await cache.flush()
                        engine.check_ended()
                        await assert_quiescent(cache)
            errors = {k: n for k, n in cache.stats().errors.items() if n}
            assert not errors.get("disk_eio") and not errors.get("disk_other"), errors
            async with asyncio.timeout(SETTLE_S):
                for tokens in prompts:
                    for salt in salts:
                        await _load(engine, tokens, salt, f"seed {seed} whole", random.Random(0))
            engine.check_ended()
            assert done and cancelled, (done, cancelled)
            # Healthy again: the tier takes writes once more (within free_space_recheck_s of a look).
            disk = cache.disk
            assert disk is not None
            await until_thread(lambda: disk.read_only is None, "the tier writable again", SETTLE_S)
            fresh = [rng.randrange(10, 20) for _ in range(3 * T)]
            await engine.store(fresh, "fresh")
            async with asyncio.timeout(SETTLE_S):
                await cache.flush()
            assert all(disk.contains(k) for k in cache.keys(fresh, "fresh")), disk.statistics()
        finally:
            thaw(mount)
            watchdog.cancel()
            async with asyncio.timeout(SETTLE_S):
                await cache.aclose()
        engine.check_ended()
        # What the faults left on disk, through a new cache: only right KV, the last prompt whole.
        cache = KVCache(_settings(mount / "kv"), LAYOUT, kv)
        engine = Engine(cache, kv)
        async with cache:
            async with asyncio.timeout(SETTLE_S):
                for tokens in prompts:
                    for salt in salts:
                        await _load(engine, tokens, salt, f"seed {seed} reopened", random.Random(0))
                match = await cache.match(fresh, "fresh")
                assert match.tokens == len(fresh), (match, cache.stats().disk)
                await _load(engine, fresh, "fresh", f"seed {seed} reopened: the last prompt", random.Random(0))
                match.release()
            errors = {k: n for k, n in cache.stats().errors.items() if n}
            assert not errors.get("disk_eio") and not errors.get("disk_corrupt"), errors
        assert set(os.listdir(mount)) == {"kv", "lost+found"}, "written outside the cache directory"
