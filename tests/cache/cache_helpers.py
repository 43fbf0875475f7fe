"""Shared set-up for the cache manager's tests: small layouts, buffers, invariant checks."""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import torch
from load_gate import LoadGate
from loop_probes import until_thread

from aiokv import CacheConfig, DiskBackend, KVCache, KVLayout
from aiokv.kernels import PageMover
from aiokv.storage import DiskConfig

LAYOUT = KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4)
SLOTS = 256
DEVICE = torch.device(os.environ.get("AIOKV_TEST_DEVICE", "cpu"))
"""Where the engine's KV buffer lives: the CPU in CI; ``AIOKV_TEST_DEVICE=cuda`` on a GPU machine."""


def make_kv(seed: int = 0, layout: KVLayout = LAYOUT, slots: int = SLOTS) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(layout.num_layers, slots, layout.rows, layout.head_dim, generator=gen).to(layout.dtype)
    return kv.to(DEVICE)


def config(
    disk: Path | None,
    pool_pages: int = 16,
    disk_pages: int = 64,
    backend: DiskBackend = DiskBackend.AUTO,
    layout: KVLayout = LAYOUT,
    **extra: object,
) -> CacheConfig:
    """A small cache's config; ``disk=None``: no disk tier (``disk_pages`` and ``backend`` unused)."""
    tier = None if disk is None else DiskConfig(
        directory=disk, capacity_bytes=disk_pages * (layout.page_bytes + 4096), backend=backend
    )
    return CacheConfig(
        cpu_bytes=pool_pages * layout.page_bytes,
        disk=tier,
        namespace="test-model",
        pool_chunk_bytes=4 * layout.page_bytes,
        **extra,  # type: ignore[arg-type]
    )


def prompt(seed: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (length,), generator=gen).tolist()


async def assert_quiescent(cache: KVCache) -> None:
    """After write-behind drains: no references, reservations or background jobs, a consistent table."""
    await cache.flush()
    cache.pool.table.check_invariants()
    stats = cache.stats()
    assert stats.pool_reserved == 0, stats
    assert stats.pool_referenced == 0, stats
    assert stats.background_jobs == 0, stats


def mover_of(cache: KVCache) -> PageMover:
    """The in-process worker's page mover (tests patch its copies to inject faults or delays)."""
    transfers = cache._transfers
    assert transfers is not None, "the cache is not started"
    return transfers.mover


async def cancel_behind_a_busy_copy_thread(cache: KVCache, kv: torch.Tensor, target: torch.Tensor,
                                           load: Coroutine[Any, Any, object],
                                           launched: Callable[[], Awaitable[object]]) -> torch.Tensor:
    """``load`` run as a task while the CPU copy thread is held by someone else's copy, cancelled
    once ``launched()`` returned (it must raise CancelledError); returns ``kv[:, target]`` as it was
    at its CancelledError. The copy thread is let go (also when the test fails), its copy awaited
    and the cache flushed before it returns: compare the slots now with what it returned."""
    gate = threading.Event()
    blocker = cache._bridge.run_cpu(gate.wait)
    task = asyncio.create_task(load)
    try:
        await launched()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        after_cancel = kv[:, target].clone()
    finally:
        gate.set()  # never leave the copy thread blocked
    await blocker
    await cache.flush()
    return after_cancel


async def record_loop_gaps(gaps: list[float]) -> None:
    """Until cancelled: append each gap between this loop's 1 ms ticks (a stall shows as a long one)."""
    last = time.perf_counter()
    while True:
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


def slow_host_copies(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Loads' copies on the copy thread take a short random while (0, 0.5 or 2 ms), so cancels and
    faults land while they run (a CPU KV buffer; a GPU's copies are queued on its streams: no-op)."""
    if DEVICE.type != "cpu":
        return
    from aiokv.kernels.hostcopy import HostScatter

    pace = random.Random(seed)
    real = HostScatter.load

    def copy(*args: Any, **kwargs: Any) -> None:
        time.sleep(pace.choice([0, 0.0005, 0.002]))
        real(*args, **kwargs)

    monkeypatch.setattr(HostScatter, "load", copy)


class CopyThreadGate:
    """Holds the cache's copy thread: the copies queued behind it wait until :meth:`open` (a test
    must always open it)."""

    def __init__(self, cache: KVCache) -> None:
        self._event = threading.Event()
        self.blocker = cache._bridge.run_cpu(self._event.wait)

    async def open(self) -> None:
        self._event.set()
        await self.blocker


def errors_of(cache: KVCache) -> dict[str, int]:
    """The fault counters of ``cache`` that are not zero (kind -> count)."""
    return {kind: n for kind, n in cache.stats().errors.items() if n}


async def on_disk_only(cache: KVCache, tokens: torch.Tensor, slots: torch.Tensor) -> list[Any]:
    """Offload ``tokens`` from ``slots`` and flush, then drop their pages from the pool: each is on
    disk only. Returns their keys."""
    disk = cache.disk
    assert disk is not None
    keys = cache.keys(tokens)
    assert (await cache.offload(tokens, slots)).stored == len(keys)
    await cache.flush()
    assert all(disk.contains(k) and cache.pool.table.discard(k) for k in keys)  # on disk only
    return keys


def reserve_each(cache: KVCache, keys: list[Any]) -> list[Any]:
    """A page-table reservation of each key (its writer, for a test): their handles, in order."""
    writers = []
    for key in keys:
        (res,) = cache.pool.reserve([key])
        assert res.handle is not None, res
        writers.append(res.handle)
    return writers


async def held_read_call(cache: KVCache, monkeypatch: pytest.MonkeyPatch, call: str, tokens: list[int],
                         target: torch.Tensor, pages: int) -> tuple[LoadGate, asyncio.Task[Any], int]:
    """``call`` ("load", "prefetch" or "stream" into ``target``) of ``tokens``, whose ``pages`` pages
    are all on disk only (a load or stream of a match that counted every page on disk), started with
    the disk tier's page loads held (:class:`LoadGate`), once the reads it launches at once are held.
    Returns the gate (the test opens it), the call's task and those reads: a stream reads back to
    front, one promotion at a time (its read-ahead may launch the next one too)."""
    disk = cache.disk
    assert disk is not None
    gate = LoadGate(disk, monkeypatch)
    try:
        if call == "prefetch":
            task: asyncio.Task[Any] = asyncio.create_task(cache.prefetch(tokens))
            reads = pages
        else:
            match = await cache.match(tokens)
            assert (match.pool_pages, match.disk_pages) == (0, pages), match
            if call == "load":
                task = asyncio.create_task(cache.load(match, target))
                reads = pages
            else:

                async def stream() -> Any:
                    s = await cache.start_load(match, target)
                    return await s.finish()

                task = asyncio.create_task(stream())
                reads = 1
        await until_thread(lambda: len(gate.held) >= reads, "the reads' loads")
    except BaseException:
        gate.open()  # a failed start must not leave the cache's close waiting for held loads
        raise
    return gate, task, reads
