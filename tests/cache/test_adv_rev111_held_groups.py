"""Adversarial review 111: a load's read groups while their reads are held in the kernel.

The page files live on an ext4 whose block device stops answering on command (``gate_helpers``: a
loop device over a FUSE file whose reads are held), read with O_DIRECT so every read reaches it.
With a load's first group held there: a cancel returns at once and the pages under the held reads
stay reserved (every free pool page is taken and overwritten right after; none changed once the
reads ended); the ext4 shut down under the held reads (EIO on everything later) degrades to a
shorter, exact load with counted faults; the cache's close keeps its bound and the load returns
once the reads end, counting its pages withdrawn. Root only.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
import torch
from cache_helpers import assert_quiescent
from group_helpers import GROUP, LAYOUT, T, group_config, put_on_disk, random_kv, random_tokens
from loop_probes import until_thread

from aiokv import CacheConfig, DiskBackend, KVCache
from aiokv.pagetable import PageHandle, ReserveOutcome

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from fs_helpers import shut_down_ext4
from gate_helpers import GateControl, gated_ext4

PAGES = GROUP + 7
N = PAGES * T
POOL_PAGES = 2 * PAGES + 8
BACKENDS = [DiskBackend.URING_FIXED, DiskBackend.THREADS]
CLOSE_S = 1.0
BOUND_S = 30.0


def _config(root: Path, backend: DiskBackend) -> CacheConfig:
    return group_config(root, PAGES, POOL_PAGES, backend, close_timeout=CLOSE_S,
                        disk={"direct_io": True, "min_free_bytes": 1 << 20, "queue_depth": 4})


def _kv(seed: int) -> torch.Tensor:
    return random_kv(seed, 3 * N)


def _tokens(seed: int) -> list[int]:
    return random_tokens(seed, N)


async def _on_disk(root: Path, backend: DiskBackend, tokens: list[int], kv: torch.Tensor) -> None:
    await put_on_disk(_config(root, backend), tokens, kv)


async def _held(gate: GateControl, cache: KVCache) -> None:
    """Until a read waits at the gate (polled in a thread: the gate's state is the kernel's) and
    the tier has a page read holding an I/O slot: the gate also holds the ext4's own I/O, so a
    request held there alone did not say the load's read had begun (as 3799adc found for vLLM)."""
    await asyncio.to_thread(gate.wait_held)
    disk = cache.disk
    assert disk is not None
    await until_thread(lambda: disk.statistics().reads_in_flight > 0, "a page read of the load in flight")


def _take(cache: KVCache, fill: int) -> list[PageHandle]:
    pool = cache.pool
    taken: list[PageHandle] = []
    for i in range(POOL_PAGES):
        (res,) = pool.reserve([bytes([0xEE, 0x11]) + i.to_bytes(14, "little")])
        if res.outcome is not ReserveOutcome.RESERVED or res.handle is None:
            break
        pool.memory.page_view(pool.table.check(res.handle))[:] = bytes([fill]) * LAYOUT.page_bytes
        taken.append(res.handle)
    return taken


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
async def test_a_load_cancelled_with_its_group_held_returns_at_once_and_frees_nothing_under_it(
        tmp_path: Path, backend: DiskBackend) -> None:
    with gated_ext4(tmp_path, 64) as (mount, gate):
        source, tokens = _kv(21), _tokens(21)
        await _on_disk(mount / "kv", backend, tokens, source)
        kv = _kv(22)
        async with KVCache(_config(mount / "kv", backend), LAYOUT, kv) as cache:
            await cache.pool.wait_ready()
            pool = cache.pool
            try:
                match = await cache.match(tokens)
                assert match.disk_pages == PAGES
                gate.hold()
                task = asyncio.create_task(cache.load(match, torch.arange(N, 2 * N)))
                await _held(gate, cache)
                began = time.monotonic()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    async with asyncio.timeout(BOUND_S):
                        await task
                assert time.monotonic() - began < 1.0, "a cancelled load waited for reads held in the kernel"
                taken = _take(cache, 0x77)
                assert len(taken) == POOL_PAGES - PAGES  # every page of both groups stayed reserved
            finally:
                gate.release()
            async with asyncio.timeout(BOUND_S):
                await cache.flush()
            for handle in taken:
                assert bytes(pool.memory.page_view(pool.table.check(handle))) == b"\x77" * LAYOUT.page_bytes
                pool.table.abort(handle)
            await assert_quiescent(cache)
            match = await cache.match(tokens)
            result = await cache.load(match, torch.arange(2 * N, 3 * N))
            assert result.tokens == N
            assert torch.equal(kv[:, 2 * N : 3 * N], source[:, :N])
            await assert_quiescent(cache)
            assert not any(cache.stats().errors.values()), cache.stats().errors


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
async def test_the_file_system_shut_down_under_held_group_reads_shortens_the_load_exactly(
        tmp_path: Path, backend: DiskBackend) -> None:
    with gated_ext4(tmp_path, 64) as (mount, gate):
        source, tokens = _kv(23), _tokens(23)
        await _on_disk(mount / "kv", backend, tokens, source)
        kv = _kv(24)
        before = kv.clone()
        async with KVCache(_config(mount / "kv", backend), LAYOUT, kv) as cache:
            await cache.pool.wait_ready()
            try:
                match = await cache.match(tokens)
                gate.hold()
                task = asyncio.create_task(cache.load(match, torch.arange(N, 2 * N)))
                await _held(gate, cache)
                # The shutdown waits for the held I/O: from a thread, the gate opened behind it.
                # Reads the kernel took before it lands may still succeed; every later one: EIO.
                shutting = asyncio.ensure_future(asyncio.to_thread(shut_down_ext4, mount))
            finally:
                gate.release()
            async with asyncio.timeout(BOUND_S):
                await shutting
                result = await task
            loaded = result.tokens
            assert torch.equal(kv[:, N : N + loaded], source[:, :loaded])
            assert torch.equal(kv[:, N + loaded : 2 * N], before[:, N + loaded : 2 * N])
            stats = cache.stats()
            if loaded < N:
                assert stats.errors["disk_read_failed"] >= 1 and stats.errors["load_shortened"] == 1, stats.errors
            await assert_quiescent(cache)
            match = await cache.match(tokens)  # the pool keeps what was read; nothing after it is served
            again = await cache.load(match, torch.arange(2 * N, 3 * N))
            assert torch.equal(kv[:, 2 * N : 2 * N + again.tokens], source[:, : again.tokens])
            await assert_quiescent(cache)


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
async def test_the_close_with_group_reads_held_keeps_its_bound_and_the_load_withdraws(
        tmp_path: Path, backend: DiskBackend) -> None:
    with gated_ext4(tmp_path, 64) as (mount, gate):
        source, tokens = _kv(25), _tokens(25)
        await _on_disk(mount / "kv", backend, tokens, source)
        kv = _kv(26)
        before = kv.clone()
        cache = KVCache(_config(mount / "kv", backend), LAYOUT, kv)
        await cache.start()
        task: asyncio.Task[object] | None = None
        try:
            await cache.pool.wait_ready()
            match = await cache.match(tokens)
            gate.hold()
            task = asyncio.create_task(cache.load(match, torch.arange(N, 2 * N)))
            await _held(gate, cache)
            began = time.monotonic()
            async with asyncio.timeout(BOUND_S):
                await cache.aclose()
            took = time.monotonic() - began
            assert took < CLOSE_S + 3.0, f"the close waited {took:.1f} s for reads held in the kernel"
        finally:
            gate.release()
        assert task is not None
        async with asyncio.timeout(BOUND_S):
            result = await task
            disk = cache.disk
            assert disk is not None
            await disk.io_ended  # the close goes on in the background until the held reads ended
            await cache.pool.wait_freed()
        stats = cache.stats()
        table = cache.pool.table.statistics()
        assert (table.reserved, table.referenced) == (0, 0), table
        assert torch.equal(kv[:, N : N + result.tokens], source[:, : result.tokens])
        assert torch.equal(kv[:, N + result.tokens : 2 * N], before[:, N + result.tokens : 2 * N])
        faults = {name for name, count in stats.errors.items() if count}
        assert faults <= {"close_timeout"}, stats.errors
        assert stats.pages_withdrawn == PAGES - result.tokens // T, stats
