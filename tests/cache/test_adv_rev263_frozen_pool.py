"""Adversarial (helper-263): a frozen file system (``fsfreeze -f`` on a real loop-mounted ext4) whose
stuck write-behind holds every page of a small pool, under the public calls, some cancelled.

``tests/storage/test_adv_frozen_fs.py`` checks that a load of disk pages does not wait behind the
writes a freeze blocks, with room in the pool, and the close's bound. Here the pool itself is held:
each of its pages is referenced by a write stuck in the kernel (or queued behind those), so an
offload of new pages, a load or stream of pages on disk only (each needs pool room to promote
into) and a prefetch find no room, while a match and load of the pool's own (unwritten) pages
must still serve them. Every call must return within its waits' bounds (``offload_wait``,
``commit_wait``), shortened or dropped and counted, never with wrong KV (prefix oracle); a call
cancelled at a random point writes nothing into its slots once the cancel returned (poisoned, then
checked after the thaw and a flush). After the thaw everything queued reaches the disk and every
prompt is served whole and exactly. A watchdog thaws if the test hangs. Root only (loop mounts).
"""

from __future__ import annotations

import asyncio
import dataclasses
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
from test_adv_rev263_loop_cancel import GARBAGE, POISON, oracle

from aiokv import KVCache
from aiokv.storage import DiskConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from fs_helpers import freeze, loop_ext4, thaw

T = LAYOUT.page_tokens
POOL_PAGES = 8
CALL_BOUND_S = 5.0
"""A call on the frozen disk: its waits are offload_wait 0.3 s and commit_wait 0.5 s."""
THAW_S = 60.0
ATTEMPTS = 24

pytestmark = [
    pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU KV buffer: poison checks read it directly"),
    pytest.mark.skipif(shutil.which("fsfreeze") is None, reason="fsfreeze is not installed"),
]


def _prompt(rng: random.Random, pages: int) -> list[int]:
    return [rng.randrange(0, 4) for _ in range(pages * T)]


class Engine:
    """The KV buffer cut into regions: each call gets its own slots, poisoned once it ended."""

    def __init__(self, cache: KVCache, kv: torch.Tensor) -> None:
        self.cache = cache
        self.kv = kv
        self.next = 0
        self.ended: list[tuple[str, torch.Tensor]] = []

    def slots(self, count: int) -> torch.Tensor:
        assert self.next + count <= self.kv.shape[1], "the test ran out of slots"
        got = torch.arange(self.next, self.next + count)
        self.next += count
        return got

    async def store(self, tokens: list[int], salt: str) -> Any:
        slots = self.slots(len(tokens))
        self.kv[:, slots] = oracle(tokens, salt)
        try:
            async with asyncio.timeout(CALL_BOUND_S):
                return await self.cache.offload(tokens, slots, salt=salt)
        finally:
            self.kv[:, slots] = GARBAGE  # reused at once: a late read would store garbage

    def holds(self, what: str, slots: torch.Tensor, truth: torch.Tensor, high: int) -> None:
        got = self.kv[:, slots[:high]]
        assert torch.equal(got, truth[:, :high]), f"{what}: wrong KV within the {high} tokens reported loaded"

    def end(self, what: str, slots: torch.Tensor) -> None:
        """The call ended (any way): its slots are the engine's again, poisoned from now on."""
        self.kv[:, slots] = POISON
        self.ended.append((what, slots))

    def check_ended(self) -> None:
        for what, slots in self.ended:
            changed = (self.kv[:, slots] != POISON).any(dim=(0, 2, 3)).nonzero().flatten().tolist()
            assert not changed, f"{what}: slots {changed[:8]} written after the call ended"


async def _load(engine: Engine, tokens: list[int], salt: str, what: str) -> None:
    cache = engine.cache
    match = await cache.match(tokens, salt)
    slots = engine.slots(match.tokens)
    engine.kv[:, slots] = POISON
    try:
        got = await cache.load(match, slots)
        engine.holds(what, slots, oracle(tokens, salt), got.tokens)
        past = (engine.kv[:, slots[got.tokens :]] != POISON).any().item()
        assert not past, f"{what}: written past the {got.tokens} tokens reported loaded"
    finally:
        engine.end(what, slots)


async def _stream(engine: Engine, tokens: list[int], salt: str, what: str, claim: int) -> None:
    cache = engine.cache
    match = await cache.match(tokens, salt)
    slots = engine.slots(match.tokens)
    engine.kv[:, slots] = POISON
    try:
        stream = await cache.start_load(match, slots)
        async with stream:
            pos = 0
            while (end := stream.claim(min(pos + T, claim))) > pos:
                pos = end
                await asyncio.sleep(0)
            result = await stream.finish()
        truth = oracle(tokens, salt)
        got = engine.kv[:, slots[result.loaded_from : result.tokens]]
        assert torch.equal(got, truth[:, result.loaded_from : result.tokens]), f"{what}: wrong KV loaded"
    finally:
        engine.end(what, slots)


@pytest.mark.asyncio
async def test_a_pool_held_by_frozen_write_behind_bounds_every_call_and_serves_only_right_kv(tmp_path: Path) -> None:
    rng = random.Random(263)
    with loop_ext4(tmp_path, 64) as mount:
        watchdog = threading.Timer(THAW_S, thaw, [mount])
        watchdog.start()
        kv = torch.full((LAYOUT.num_layers, 1 << 12, LAYOUT.rows, LAYOUT.head_dim), POISON, dtype=LAYOUT.dtype)
        settings = config(None, pool_pages=POOL_PAGES, offload_wait=0.3, commit_wait=0.5, close_timeout=5.0)
        tier = DiskConfig(directory=mount / "disk", capacity_bytes=16 << 20, min_free_bytes=0)
        cache = KVCache(dataclasses.replace(settings, disk=tier), LAYOUT, kv)
        try:
            await cache.start()
            await cache.pool.wait_ready()
            disk = cache.disk
            assert disk is not None
            engine = Engine(cache, kv)
            on_disk = _prompt(rng, 6)
            assert (await engine.store(on_disk, "a")).stored == 6
            await cache.flush()
            for key in cache.keys(on_disk, "a"):
                assert cache.pool.table.discard(key)  # on disk only
            freeze(mount)
            # The pool's pages, each queued for disk: their writes stick in the kernel.
            in_pool = _prompt(rng, POOL_PAGES)
            assert (await engine.store(in_pool, "b")).stored == POOL_PAGES
            await until_thread(lambda: disk.statistics().writes_in_flight > 0, "a write held by the freeze")
            stats = cache.stats()
            assert stats.pool_referenced == POOL_PAGES, stats  # nothing evictable: all await their writes

            # An offload of new pages finds no room: dropped and counted, within offload_wait.
            dropped = await engine.store(_prompt(rng, 3), "c")
            assert dropped.stored == 0 and dropped.dropped == 3, dropped
            assert cache.stats().errors["pool_exhausted"] > 0, cache.stats().errors

            calls = 0
            cancelled = 0
            for attempt in range(ATTEMPTS):
                what = f"attempt {attempt}"
                kind = attempt % 4
                if kind == 0:
                    call = _load(engine, on_disk, "a", f"{what}: load from disk")
                elif kind == 1:
                    call = _stream(engine, on_disk, "a", f"{what}: stream from disk", (attempt // 4 % 3) * T)
                elif kind == 2:
                    call = _load(engine, in_pool, "b", f"{what}: load from the held pool")
                else:
                    call = _stream(engine, in_pool, "b", f"{what}: stream from the held pool", (attempt // 4 % 3) * T)
                task = asyncio.ensure_future(call)
                if attempt % 3:
                    for _ in range(rng.randrange(0, 12)):
                        await asyncio.sleep(0)
                    task.cancel()
                try:
                    async with asyncio.timeout(CALL_BOUND_S):
                        await asyncio.shield(task)
                    calls += 1
                except asyncio.CancelledError:
                    if not task.cancelled():
                        raise
                    cancelled += 1
                if attempt % 5 == 0:
                    async with asyncio.timeout(CALL_BOUND_S):
                        promoted = await cache.prefetch(on_disk, salt="a")
                    assert promoted.promoted == 0, promoted  # no room to promote into
            assert calls and cancelled, (calls, cancelled)
            errors = {k: n for k, n in cache.stats().errors.items() if n}
            assert errors.get("disk_eio", 0) == 0 and errors.get("disk_other", 0) == 0, errors
            # The slots of every ended call stay untouched while the disk is frozen...
            engine.check_ended()
            thaw(mount)
            async with asyncio.timeout(CALL_BOUND_S * 4):
                await cache.flush()
                # ... and once everything queued reached the disk.
                engine.check_ended()
                for tokens, salt in ((on_disk, "a"), (in_pool, "b")):
                    await _load(engine, tokens, salt, f"whole {salt} after the thaw")
                await assert_quiescent(cache)
            assert disk.contains(cache.keys(in_pool, "b")[-1]), "the held pages never reached the disk"
            engine.check_ended()
        finally:
            thaw(mount)
            watchdog.cancel()
            async with asyncio.timeout(30):
                await cache.aclose()
