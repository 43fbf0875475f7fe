"""Adversarial (review 107): every public coroutine of a `TPCache` cancelled at every loop turn.

Two real rank workers (async runner) on the test's loop copy on their copy threads. Each call —
``offload``, ``load``, ``prefetch``, ``match``, and a stream's ``finish``/``aclose`` (plain and
layered) — is started and cancelled after k loop turns, for every k up to DENSE, then after ever
longer sleeps, until the call finishes first. Right after a cancelled call returns: no job of it
is in flight or held (no rank still copies into or out of the caller's slots), and a sentinel
written into its slots on both ranks is never overwritten later. At the end nothing is referenced
or reserved, and everything that matches loads bit-exact on both ranks (the prefix oracle).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from adv_helpers import idx, rank_prefix_kv
from cancel_points import most_attempts, pause
from tp_helpers import CONFIG

from aiokv import CacheConfig, KVLayout
from aiokv.tp import RankWorker, TPCache

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
NUM_SLOTS = 96
PAGES = 3
SOURCE = list(range(PAGES * T))
TARGET = list(range(NUM_SLOTS - PAGES * T, NUM_SLOTS))
DENSE = 200
"""Attempts counted in loop turns (cancel_points.pause), then growing sleeps: the workers' copy
threads and the ranks' answers need the GIL, which a loop spinning through turns keeps."""
ATTEMPTS = most_attempts(DENSE)
RANK_CONFIG = dataclasses.replace(CONFIG, inline_copy_bytes=0)  # copies on the ranks' copy threads


@dataclasses.dataclass
class Setup:
    cache: TPCache
    kv: list[torch.Tensor]
    workers: list[RankWorker]


@pytest_asyncio.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    config = CacheConfig(cpu_bytes=64 * LAYOUT.page_bytes, disk=None, namespace="tp-adv-cancel-sweep",
                         pool_chunk_bytes=16 * LAYOUT.page_bytes)
    kv = [torch.zeros(LAYOUT.num_layers, NUM_SLOTS, LAYOUT.rows // 2, LAYOUT.head_dim, dtype=LAYOUT.dtype)
          for _ in range(2)]
    async with TPCache(config, LAYOUT, tp_size=2, num_slots=NUM_SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "sock") as cache, contextlib.AsyncExitStack() as stack:
        workers = [await stack.enter_async_context(RankWorker(cache.address, r, 2, LAYOUT, kv[r], RANK_CONFIG))
                   for r in range(2)]
        async with asyncio.timeout(30):
            await cache.wait_ranks()
        yield Setup(cache, kv, workers)


def prefill(s: Setup, tokens: list[int]) -> None:
    for r in range(2):
        s.kv[r][:, SOURCE] = rank_prefix_kv(LAYOUT, tokens, 0, r, 2)


def nothing_in_flight(s: Setup, what: str) -> None:
    jobs = s.cache.group.jobs
    assert (jobs.in_flight, jobs.held) == (0, 0), f"{what}: a rank may still copy for a call that returned"


async def sentinel_stays(s: Setup, slots: list[int], what: str) -> None:
    """Write a sentinel into ``slots`` on both ranks; the workers go idle; it is still there."""
    for r in range(2):
        s.kv[r][:, slots] = -7.0
    async with asyncio.timeout(10):
        while any(w.statistics().in_flight for w in s.workers):  # noqa: ASYNC110 (a counter of the workers)
            await asyncio.sleep(0.001)
    for _ in range(20):
        await asyncio.sleep(0)
    for r in range(2):
        assert bool((s.kv[r][:, slots] == -7.0).all()), f"{what}: rank {r}'s slots written after the call returned"


async def sweep(s: Setup, name: str, call: Callable[[int], Awaitable[Any]], slots: list[int]) -> int:
    """Cancel the i-th ``call(i)`` after i loop turns, then ever longer sleeps
    (``cancel_points.pause``), until it finishes first (i counts the calls: a prompt index, never
    past ATTEMPTS); returns how many times it was cancelled."""
    cancelled = 0
    for i in range(ATTEMPTS):
        task = asyncio.ensure_future(call(i))
        waited = await pause(i, DENSE)
        finished = task.done()
        task.cancel()
        try:
            async with asyncio.timeout(10):
                await asyncio.wait({task})
        except TimeoutError:
            raise AssertionError(f"{name}: cancelled after {waited}, it did not return in 10 s") from None
        if task.cancelled():
            cancelled += 1
        else:
            task.result()  # no other error
        nothing_in_flight(s, f"{name} after {waited}")
        await sentinel_stays(s, slots, f"{name} after {waited}")
        stats = s.cache.stats()
        assert stats.pool_reserved == 0 and stats.pool_referenced == 0, (name, waited, stats)
        if finished:
            return cancelled
    raise AssertionError(f"{name} never finished in {ATTEMPTS} attempts")


async def loads_exact(s: Setup, tokens: list[int]) -> None:
    match = await s.cache.match(tokens)
    result = await s.cache.load(match, idx(TARGET[: match.tokens]))
    assert result.tokens == match.tokens
    for r in range(2):
        want = rank_prefix_kv(LAYOUT, tokens, 0, r, 2)[:, : match.tokens]
        assert torch.equal(s.kv[r][:, TARGET[: match.tokens]], want), f"rank {r}: wrong KV"


@pytest.mark.asyncio
async def test_every_call_cancelled_at_every_turn_leaves_no_copy_running(setup: Setup) -> None:
    s, cache = setup, setup.cache
    prompts = [[10_000 * (k + 1) + j for j in range(PAGES * T)] for k in range(ATTEMPTS)]

    async def offload(k: int) -> None:
        prefill(s, prompts[k])
        await cache.offload(prompts[k], idx(SOURCE))

    counts = {"offload": await sweep(s, "offload", offload, SOURCE)}
    # A cancelled offload stored its pages whole or not at all: whatever matches loads bit-exact.
    hits = 0
    for p in prompts[: counts["offload"] + 1]:
        match = await cache.match(p)
        hits += match.tokens > 0
        match.release()
        if match.tokens:
            await loads_exact(s, p)
    assert hits, "no offload stored anything"
    full = prompts[counts["offload"]]  # the offload that finished uncancelled
    prefill(s, full)

    async def load(_: int) -> None:
        match = await cache.match(full)
        await cache.load(match, idx(TARGET))

    async def stream(layered: bool, how: str) -> Callable[[int], Awaitable[None]]:
        async def run(_: int) -> None:
            match = await cache.match(full)
            # The stream's own idiom: whatever is cancelled inside, the exit closes it.
            async with cache.start_load(match, idx(TARGET), layered=layered) as load:
                await load.launched()
                if how == "finish":
                    await load.finish()
                else:
                    await load.aclose()
        return run

    async def prefetch(_: int) -> None:
        await cache.prefetch(full)

    async def match(_: int) -> None:
        (await cache.match(full)).release()

    counts["load"] = await sweep(s, "load", load, TARGET)
    for layered in (False, True):
        for how in ("finish", "aclose"):
            counts[f"stream {layered} {how}"] = await sweep(s, f"stream layered={layered} {how}",
                                                            await stream(layered, how), TARGET)
    counts["prefetch"] = await sweep(s, "prefetch", prefetch, TARGET)
    counts["match"] = await sweep(s, "match", match, TARGET)
    assert all(n > 3 for name, n in counts.items() if name not in ("prefetch", "match")), counts
    await loads_exact(s, full)
    s.cache.pool.table.check_invariants()
