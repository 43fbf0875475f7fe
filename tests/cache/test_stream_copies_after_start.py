"""A stream's copies are ordered after the engine's work queued before ``start_load``, not after the
chunks the engine claims and queues while the stream runs (those never touch the loaded slots).

Ordered behind every queued chunk, a copy launched at the meeting point of an 8K split on the H200
ran only once the chunks queued before it had, and ``finish()`` waited ~40 ms for it. The ordering
tests are CUDA only: on the CPU copies run on the copy thread and there is no stream to order after.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, config, make_kv, prompt

from aiokv import KVCache

T = LAYOUT.page_tokens
MARK = 7.0
BOUND_S = 10.0
SLEEP_CYCLES = 2_000_000_000  # ~1 s of one GPU thread spinning (400M cycles took ~0.2 s on the H200)

cuda_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA stream ordering")


def load_module(kv: torch.Tensor, slots: torch.Tensor) -> None:
    """Launch the engine's "writes" once before the sleep: a kernel's first launch in a process
    loads its module (CUDA lazy loading), which waits for the device to go idle — on the H200 the
    first ``index_fill_`` after the sleep blocked the host ~1 s, so the test could not test the order."""
    kv.index_fill_(1, slots, -MARK)  # not the mark: the engine's own write must still land last
    torch.cuda.synchronize()


@cuda_only
@pytest.mark.asyncio
async def test_copies_launched_while_the_engine_computes_do_not_wait_for_its_chunks() -> None:
    n = 4 * T
    tokens = prompt(95, n)
    kv = make_kv(96)
    async with KVCache(config(None, pool_pages=32, launch_pages=1, launch_turn_s=0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.wait_warm()
        await cache.offload(tokens, torch.arange(n))
        await cache.flush()
        source = kv[:, :n].clone()
        target = torch.arange(40, 40 + n)
        on_device = target.to(DEVICE)  # before the sleep: a pageable copy would wait for it
        load_module(kv, on_device[:T])
        stream = await cache.start_load(await cache.match(tokens), target)
        # No await until the chunk is queued: the loader launches its first copy after it. The
        # engine claims the first page and queues its "compute": a long kernel, then its writes.
        assert stream.claim(T) == T
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        # index_fill_: the scalar is a kernel argument (kv[...] = MARK copies it to the device from
        # pageable memory, which blocks the host until the sleep ends).
        kv.index_fill_(1, on_device[:T], MARK)
        chunk_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        chunk_done.record()
        assert not chunk_done.query(), "the host waited for the sleep: the test would not test the order"
        async with asyncio.timeout(BOUND_S):
            result = await stream.finish()
        assert not chunk_done.query(), "the stream's copies waited for a chunk queued after its start"
        assert result.loaded_from == T and result.pool_pages == n // T - 1
        torch.cuda.synchronize()
        # The engine's stream is still ordered after the copies, and the claimed page is its own.
        assert torch.equal(kv[:, on_device[T:]], source[:, T:n])
        assert bool((kv[:, on_device[:T]] == MARK).all())


@cuda_only
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
        load_module(kv, on_device)
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


@pytest.mark.asyncio
async def test_a_mark_that_raises_leaves_the_match_with_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    # Review 115: the mark was recorded after the match was taken; a CUDA error there (a sticky
    # one) left the match's pool pages referenced for good. Now it is recorded before the take:
    # start_load raises with the match still the caller's, who releases it.
    n = 4 * T
    tokens = prompt(99, n)
    kv = make_kv(100)
    async with KVCache(config(None, pool_pages=32), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(n))
        await cache.flush()
        transfers = cache._transfers
        assert transfers is not None

        def broken() -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

        monkeypatch.setattr(transfers, "mark", broken)
        match = await cache.match(tokens)
        assert match.tokens == n
        with pytest.raises(RuntimeError, match="injected"):
            await cache.start_load(match, torch.arange(40, 40 + n))
        assert cache.stats().pool_referenced == n // T
        match.release()
        assert cache.stats().pool_referenced == 0
        monkeypatch.undo()
        loaded = await (await cache.start_load(await cache.match(tokens), torch.arange(40, 40 + n))).finish()
        assert loaded.loaded_from == 0
