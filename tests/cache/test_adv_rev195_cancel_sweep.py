"""Adversarial (helper-195): every public call cancelled at every point it can be, with the disk on.

Each sweep runs one call as a task, waits (``cancel_points.pause``: loop turns, then growing
sleeps), cancels it, and checks what the cancel left, until the call completes first. The scene
of each attempt: a small pool under pressure (the match is larger than the pool, so a load goes
through it in windows, promotions evict), part of the prompt in the pool and the rest on disk
(served by disk reads), write-behind queued (a fresh salt's offload just before), copies on the
copy thread slowed on purpose (a random 0-2 ms before each), and on some attempts a second call
on the same prefix running beside it, never cancelled.

Oracle: a token's KV is a hash of the salt and its whole prefix (:func:`oracle`). Once the call
returned or raised (``CancelledError`` included), the slots it may write are overwritten at once
(``POISON``) and, after ``flush`` (nothing runs any more), must be unchanged; an offload's source
slots are overwritten at once with ``GARBAGE``, so a late read of them stores garbage, which a
later load shows. What a completed call reports loaded holds the oracle's bytes and nothing past
it was written. Every attempt ends quiescent (no reference, reservation or background job) and a
fresh load of the whole prompt serves the oracle's bytes.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config
from cancel_points import most_attempts, pause

from aiokv import KVCache
from aiokv.kernels.hostcopy import HostGather, HostScatter

T = LAYOUT.page_tokens
PAGES = 17
N = PAGES * T + 3  # a partial last page: never stored, never loaded
POOL_PAGES = 11
SLOTS = 6 * N
POISON = 100.0
GARBAGE = -50.0
MARK = -100.0
BOUND_S = 30.0
DENSE = 40
"""Attempts counted in loop turns (cancel_points.pause), then growing sleeps."""
SEEDS = range(*(int(x) for x in os.environ.get("AIOKV_REV195_SEEDS", "0:1").split(":")))
"""``AIOKV_REV195_SEEDS=a:b`` sweeps with seeds ``[a, b)`` (the copies' pace, the prompt, whether
the prompt is still in the write-behind); the default is one."""

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU KV buffer: poison checks read it directly")


def oracle(tokens: list[int], salt: str | None) -> torch.Tensor:
    """``[L, len, rows, D]``: token i's KV is a hash of the salt and ``tokens[: i + 1]``, the layer,
    row and column; values k/8 for k in [-32, 32): exact in fp16, never POISON, GARBAGE or MARK."""
    state = xxhash.xxh64(b"rev195" + (b"\x00" if salt is None else b"\x01" + salt.encode()))
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


def slow_both(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Loads' and offloads' copies on the copy thread each wait a random 0-2 ms first."""
    pace = random.Random(seed)

    def slowed(real: Callable[..., None]) -> Callable[..., None]:
        def copy(*args: Any, **kwargs: Any) -> None:
            time.sleep(pace.choice([0, 0, 0.0005, 0.002]))
            real(*args, **kwargs)

        return copy

    monkeypatch.setattr(HostScatter, "load", slowed(HostScatter.load))
    monkeypatch.setattr(HostGather, "offload", slowed(HostGather.offload))


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 3) for _ in range(N)]  # a tiny alphabet: equal pages under other prefixes


class Scene:
    """One cache, its KV buffer and the prompt every attempt works on."""

    def __init__(self, cache: KVCache, kv: torch.Tensor, tokens: list[int], seed: int) -> None:
        self.seed = seed
        self.cache = cache
        self.kv = kv
        self.tokens = tokens
        self.rng = random.Random(0)
        # Slot ranges: [0, N) the engine's copy of the prompt (an offload's source), [N, 2N) a
        # call's target, [2N, 3N) a second call's, [3N, 4N) the final check's, [4N, 6N) scratch.
        self.source = torch.arange(0, N)
        self.target = torch.arange(N, 2 * N)
        self.other = torch.arange(2 * N, 3 * N)
        self.check = torch.arange(3 * N, 4 * N)

    def keys(self, salt: str | None) -> list[bytes]:
        return self.cache.keys(self.tokens, salt)

    async def offload(self, salt: str | None, tokens: int = N) -> None:
        """The prompt's KV (the oracle's) stored by an engine that is never cancelled."""
        slots = torch.arange(4 * N, 4 * N + tokens)
        self.kv[:, slots] = oracle(self.tokens[:tokens], salt)
        await self.cache.offload(self.tokens[:tokens], slots, salt=salt)
        self.kv[:, slots] = GARBAGE

    def evict(self, salt: str | None, pages: range) -> None:
        """Pages of the prompt out of the pool (they stay on disk once written)."""
        table = self.cache.pool.table
        for key in (self.keys(salt)[p] for p in pages):
            table.discard(key)

    async def pressure(self, attempt: int) -> None:
        """A fresh salt's offload: its pages evict the pool's and queue for disk (write-behind)."""
        await self.offload(f"churn{attempt}", 3 * T)

    def check_slots(self, what: str, slots: torch.Tensor, truth: torch.Tensor, low: int, high: int) -> None:
        got = self.kv[:, slots[low:high]]
        if not torch.equal(got, truth[:, low:high]):
            bad = (got != truth[:, low:high]).any(dim=(0, 2, 3)).nonzero().flatten().tolist()
            raise AssertionError(f"{what}: wrong KV at tokens {[low + b for b in bad][:8]} of [{low}, {high})")

    def poisoned(self, what: str, slots: torch.Tensor) -> None:
        changed = (self.kv[:, slots] != POISON).any(dim=(0, 2, 3)).nonzero().flatten().tolist()
        assert not changed, f"{what}: slots {changed[:8]} written after the call ended"

    async def whole(self, what: str, salt: str | None) -> None:
        """A fresh match and load of the whole prompt: only the oracle's bytes, then quiescent."""
        await assert_quiescent(self.cache)
        match = await self.cache.match(self.tokens, salt)
        self.kv[:, self.check] = POISON
        result = await self.cache.load(match, self.check[: match.tokens])
        self.check_slots(what, self.check, oracle(self.tokens, salt), 0, result.tokens)
        self.poisoned(what + " (past the result)", self.check[result.tokens :])
        await assert_quiescent(self.cache)


async def sweep(scene: Scene, name: str, setup: Callable[[int], Awaitable[str | None]],
                call: Callable[[int, str | None], Awaitable[Any]],
                settle: Callable[[int, str | None, Any], None], beside: Callable[[int, str | None], Awaitable[Any]]
                | None = None, every: bool = False) -> int:
    """Cancel ``call`` at every point until it completes; returns the attempts it took.

    ``setup(attempt)`` builds the scene, returns the salt; ``settle(attempt, salt, result)`` checks
    a completed call. On any end the target slots are poisoned at once and checked after a flush.
    ``beside``: a call on the same prefix started just before it on odd attempts (``every``: on
    all), never cancelled."""
    attempt = 0
    cancelled = 0
    while True:
        assert attempt < most_attempts(DENSE), f"{name} seed {scene.seed}: the call never completed"
        salt = await setup(attempt)
        scene.kv[:, scene.target] = POISON
        scene.kv[:, scene.other] = POISON
        other = None
        if beside is not None and (every or attempt % 2):
            other = asyncio.ensure_future(beside(attempt, salt))
            await asyncio.sleep(0)  # it began (reserved its pages, took its references) first
        task = asyncio.ensure_future(call(attempt, salt))
        wait = await pause(attempt, DENSE)
        task.cancel()
        where = f"{name} seed {scene.seed} attempt {attempt} (cancel after {wait})"
        try:
            async with asyncio.timeout(BOUND_S):
                result = await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
            done = False
        else:
            done = True
        if done:
            settle(attempt, salt, result)
        # The engine reuses what the call used at once: nothing may write it from now on.
        scene.kv[:, scene.target] = POISON
        scene.kv[:, scene.source] = GARBAGE
        async with asyncio.timeout(BOUND_S):
            if other is not None:
                await other
                scene.kv[:, scene.other] = POISON
            await scene.cache.flush()
        scene.poisoned(where, scene.target)
        scene.poisoned(where + " beside", scene.other)
        await scene.whole(where + ": the whole prompt after", salt)
        if not done:
            cancelled += 1
            attempt += 1
            continue
        assert cancelled > 0 or attempt == 0, where
        return attempt


async def _open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int) -> tuple[KVCache, torch.Tensor]:
    slow_both(monkeypatch, seed)
    kv = torch.full((LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim), POISON, dtype=LAYOUT.dtype)
    cache = KVCache(config(tmp_path / "disk", pool_pages=POOL_PAGES, disk_pages=48, offload_wait=0.2,
                           commit_wait=1.0), LAYOUT, kv)
    await cache.start()
    await cache.pool.wait_ready()
    return cache, kv


ALLOWED = {"pool_exhausted", "load_shortened", "commit_wait_expired", "write_behind_full"}


def _errors(cache: KVCache) -> set[str]:
    return {kind for kind, n in cache.stats().errors.items() if n} - ALLOWED


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("from_token", [0, 1, 2 * T + 3])
async def test_load_cancelled_at_every_point_never_writes_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, from_token: int, seed: int
) -> None:
    cache, kv = await _open(tmp_path, monkeypatch, 100 * seed + from_token)
    scene = Scene(cache, kv, prompt(100 * seed + 1), seed)
    try:
        reported: list[int] = []

        async def setup(attempt: int) -> str | None:
            salt = ["a", None][attempt % 2]
            await scene.offload(salt)  # pages already cached are skipped
            if seed % 2 == 0 or attempt % 3:
                await cache.flush()  # on disk (else some may still be queued for it)
            await scene.pressure(attempt)
            scene.evict(salt, range(attempt % 4, PAGES))  # a pool head, the rest from disk
            return salt

        async def call(attempt: int, salt: str | None) -> Any:
            match = await cache.match(scene.tokens, salt)
            reported.append(match.tokens)
            return await cache.load(match, scene.target[: match.tokens - from_token], from_token=from_token)

        async def beside(attempt: int, salt: str | None) -> Any:
            if attempt % 4 == 1:
                return await cache.prefetch(scene.tokens, salt=salt)
            match = await cache.match(scene.tokens, salt)
            got = await cache.load(match, scene.other[: match.tokens])
            scene.check_slots("beside", scene.other, oracle(scene.tokens, salt), 0, got.tokens)
            return got

        def settle(attempt: int, salt: str | None, result: Any) -> None:
            assert result.from_token == from_token, result
            scene.check_slots(f"load attempt {attempt}", scene.target, oracle(scene.tokens, salt)[:, from_token:],
                              0, result.tokens - from_token)
            scene.poisoned(f"load attempt {attempt} past its result", scene.target[result.tokens - from_token :])

        await sweep(scene, f"load from {from_token}", setup, call, settle, beside)
        assert _errors(cache) == set(), cache.stats().errors
    finally:
        await cache.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("layered", [False, True])
async def test_stream_cancelled_at_every_point_never_writes_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layered: bool, seed: int
) -> None:
    cache, kv = await _open(tmp_path, monkeypatch, 100 * seed + 7 + layered)
    scene = Scene(cache, kv, prompt(100 * seed + 2), seed)
    start = T + 1

    async def setup(attempt: int) -> str | None:
        salt = ["b", None][attempt % 2]
        await scene.offload(salt)
        if seed % 2 == 0 or attempt % 3:
            await cache.flush()
        await scene.pressure(attempt)
        scene.evict(salt, range(1 + attempt % 3, PAGES))
        return salt

    async def call(attempt: int, salt: str | None) -> Any:
        match = await cache.match(scene.tokens, salt)
        slots = scene.target[: match.tokens - start]
        stream = await cache.start_load(match, slots, from_token=start, layered=layered)
        async with stream:
            pos = start
            chunk = 1 + attempt % 5
            # The engine computes from the front (what it claims it writes, MARK, itself), up to a
            # point that moves with the attempt: from nothing to all of it.
            stop = min(match.tokens, start + (attempt % 7) * T)
            while (end := stream.claim(min(pos + chunk, stop))) > pos:
                kv[:, slots[pos - start : end - start]] = MARK
                pos = end
                await asyncio.sleep(0)
                if attempt % 3 == 0:
                    await stream.wait_front(max(pos, match.tokens - 2 * T))
            front = await stream.launched()
            for layer in range(LAYOUT.num_layers):
                await stream.wait_layer(layer)
            result = await stream.finish()
            assert result.claimed == pos and front <= result.loaded_from, \
                (result, front)
            return result, slots

    def settle(attempt: int, salt: str | None, outcome: Any) -> None:
        result, slots = outcome
        truth = oracle(scene.tokens, salt)[:, start:]
        low = result.loaded_from - start
        scene.check_slots(f"stream attempt {attempt}", slots, truth, low, result.tokens - start)
        assert bool((kv[:, slots[: result.claimed - start]] == MARK).all()), \
            f"stream attempt {attempt}: the engine's tokens overwritten"
        scene.poisoned(f"stream attempt {attempt} between claim and load",
                       slots[result.claimed - start : result.loaded_from - start])

    try:
        await sweep(scene, f"stream layered={layered}", setup, call, settle)
        assert _errors(cache) == set(), cache.stats().errors
    finally:
        await cache.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", SEEDS)
async def test_offload_cancelled_at_every_point_stores_only_the_oracles_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    cache, kv = await _open(tmp_path, monkeypatch, 100 * seed + 3)
    scene = Scene(cache, kv, prompt(100 * seed + 3), seed)

    async def setup(attempt: int) -> str | None:
        salt = f"o{attempt}"  # fresh pages every attempt
        await scene.offload(salt, (attempt % 4) * T)  # a head of it stored already (skipped)
        await scene.pressure(attempt)
        kv[:, scene.source] = oracle(scene.tokens, salt)
        return salt

    async def call(attempt: int, salt: str | None) -> Any:
        return await cache.offload(scene.tokens, scene.source, salt=salt)

    async def beside(attempt: int, salt: str | None) -> Any:
        # Another engine offloads the same prefix from its own slots at the same time.
        slots = scene.other
        kv[:, slots] = oracle(scene.tokens, salt)
        try:
            return await cache.offload(scene.tokens, slots, salt=salt)
        finally:
            kv[:, slots] = POISON

    def settle(attempt: int, salt: str | None, result: Any) -> None:
        assert result.stored + result.skipped + result.dropped == PAGES, result

    try:
        await sweep(scene, "offload", setup, call, settle, beside)
        assert _errors(cache) == set(), cache.stats().errors
    finally:
        await cache.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", SEEDS)
async def test_prefetch_and_match_cancelled_at_every_point_leave_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    cache, kv = await _open(tmp_path, monkeypatch, 100 * seed + 4)
    scene = Scene(cache, kv, prompt(100 * seed + 4), seed)

    async def setup(attempt: int) -> str | None:
        salt = ["c", None][attempt % 2]
        await scene.offload(salt)
        if seed % 2 == 0 or attempt % 3:
            await cache.flush()
        await scene.pressure(attempt)
        scene.evict(salt, range(attempt % 3, PAGES))
        return salt

    async def prefetch(attempt: int, salt: str | None) -> Any:
        return await cache.prefetch(scene.tokens, salt=salt)

    async def match(attempt: int, salt: str | None) -> Any:
        m = await cache.match(scene.tokens, salt)
        m.release()
        return m

    async def beside(attempt: int, salt: str | None) -> Any:
        # Pages being written into the pool meanwhile: the match waits for their commits.
        slots = scene.other
        kv[:, slots] = oracle(scene.tokens, salt)
        try:
            return await cache.offload(scene.tokens, slots, salt=salt)
        finally:
            kv[:, slots] = POISON

    def settle(attempt: int, salt: str | None, result: Any) -> None:
        pass  # the sweep's checks: nothing written, quiescent, the whole prompt served exactly

    try:
        await sweep(scene, "prefetch", setup, prefetch, settle)
        await sweep(scene, "match", setup, match, settle, beside, every=True)
        assert _errors(cache) == set(), cache.stats().errors
    finally:
        await cache.aclose()
