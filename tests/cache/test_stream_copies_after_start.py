"""A stream's copies are ordered after the engine's work queued before ``start_load``, not after the
chunks the engine claims and queues while the stream runs (those never touch the loaded slots).

Ordered behind every queued chunk, a copy launched at the meeting point of an 8K split on the H200
ran only once the chunks queued before it had, and ``finish()`` waited ~40 ms for it. CUDA only:
on the CPU copies run on the copy thread and there is no stream to order after.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, config, make_kv, prompt

from aiokv import KVCache

T = LAYOUT.page_tokens
MARK = 7.0
BOUND_S = 10.0
SLEEP_CYCLES = 2_000_000_000  # ~1 s of one GPU thread spinning (400M cycles took ~0.2 s on the H200)

pytestmark = pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA stream ordering")


async def _fill_disk(path: Path, tokens: list[int]) -> torch.Tensor:
    """Store ``tokens``' pages on disk (the cache then closes: the pool is gone); the source KV."""
    kv = make_kv(90)
    async with KVCache(config(path, pool_pages=32), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(len(tokens)))
        await cache.flush()
    return kv


def _gate_reads(monkeypatch: pytest.MonkeyPatch, cache: KVCache, gate: asyncio.Event) -> None:
    """Hold every disk read of ``cache`` until ``gate`` opens (its copy launches only then)."""
    disk = cache.disk
    assert disk is not None
    real: Callable[..., Awaitable[bool]] = disk.read

    async def held(*args: Any) -> bool:
        await gate.wait()
        return await real(*args)

    monkeypatch.setattr(disk, "read", held)


@pytest.mark.asyncio
async def test_copies_launched_while_the_engine_computes_do_not_wait_for_its_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 4 * T
    tokens = prompt(95, n)
    source = await _fill_disk(tmp_path, tokens)
    kv = make_kv(96)
    async with KVCache(config(tmp_path, pool_pages=32), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.wait_warm()
        gate = asyncio.Event()
        _gate_reads(monkeypatch, cache, gate)
        target = torch.arange(20, 20 + n)
        on_device = target.to(DEVICE)  # before the sleep: a pageable copy would wait for it
        stream = await cache.start_load(await cache.match(tokens), target)
        # The engine claims the first page and queues its "compute": a long kernel, then its writes.
        assert stream.claim(T) == T
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        # index_fill_: the scalar is a kernel argument (kv[...] = MARK copies it to the device from
        # pageable memory, which blocked the host until the sleep ended).
        kv.index_fill_(1, on_device[:T], MARK)
        chunk_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        chunk_done.record()
        assert not chunk_done.query(), "the host waited for the sleep: the test would not test the order"
        gate.set()  # the reads land now: their copies are launched behind the queued chunk
        async with asyncio.timeout(BOUND_S):
            result = await stream.finish()
        assert not chunk_done.query(), "the stream's copies waited for a chunk queued after its start"
        assert result.loaded_from == T and result.disk_pages == n // T - 1
        torch.cuda.synchronize()
        # The engine's stream is still ordered after the copies, and the claimed page is its own.
        assert torch.equal(kv[:, on_device[T:]], source[:, T:n])
        assert bool((kv[:, on_device[:T]] == MARK).all())


@pytest.mark.asyncio
async def test_copies_still_wait_for_the_work_queued_before_the_stream_began(tmp_path: Path) -> None:
    # A kernel queued before start_load that writes the slots (a previous owner's, say) runs first:
    # the loaded bytes land after it, not under it.
    n = 4 * T
    tokens = prompt(97, n)
    kv = make_kv(98)
    async with KVCache(config(None, pool_pages=32), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.wait_warm()
        await cache.offload(tokens, torch.arange(n))
        await cache.flush()
        source = kv[:, :n].clone()
        target = torch.arange(40, 40 + n)
        on_device = target.to(DEVICE)
        torch.cuda._sleep(SLEEP_CYCLES // 4)  # type: ignore[no-untyped-call]
        kv.index_fill_(1, on_device, MARK)  # no host sync (see above): queued behind the sleep
        queued = torch.cuda.Event()  # type: ignore[no-untyped-call]
        queued.record()
        stream = await cache.start_load(await cache.match(tokens), target)
        assert not queued.query(), "the host waited for the sleep: the test would not test the order"
        async with asyncio.timeout(BOUND_S):
            result = await stream.finish()
        assert result.loaded_from == 0
        torch.cuda.synchronize()
        assert torch.equal(kv[:, on_device], source), "a copy ran before the work queued ahead of the stream"
