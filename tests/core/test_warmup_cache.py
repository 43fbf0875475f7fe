"""`KVCache`'s kernel warm-up: started by ``start`` on a thread of its own, copies wait for it (an
await, never on the loop), close stops it, a failure leaves the copies working.

On a CPU machine the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set by
``tests/conftest.py``): there is nothing to compile, so these tests check the logic; the loop-stall
check of a real compile is ``tests/core/test_warmup_gpu.py``. The warm-up thread is held inside
its first launch by a :func:`record_launches` hook, so every ordering below is forced, not timed.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import pytest
import torch
from loop_probes import until, waiting_in
from warmup_gate import WARM, Gate, open_into_close, warm_threads, warmup_gates

from aiokv import CacheConfig, KVCache, KVLayout, TransferPath
from aiokv.kernels.launch import LaunchRecord, record_launches
from aiokv.kernels.paths import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU test: kernels under the Triton interpreter")

LAYOUT = KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4)


def _cache(path: TransferPath = TransferPath.DIRECT) -> KVCache:
    kv = torch.randn(LAYOUT.num_layers, 64, LAYOUT.rows, LAYOUT.head_dim).to(LAYOUT.dtype)
    config = CacheConfig(cpu_bytes=16 * LAYOUT.page_bytes, disk=None, transfer_path=path, namespace="warm")
    return KVCache(config, LAYOUT, kv)


@pytest.fixture
def gated() -> Iterator[Callable[..., tuple[Gate, LaunchRecord]]]:
    with warmup_gates() as make:
        yield make


@pytest.mark.asyncio
async def test_start_returns_while_the_warm_up_runs_off_the_loop_and_copies_wait_for_it(
    gated: Callable[..., tuple[Gate, LaunchRecord]],
) -> None:
    gate, record = gated()
    cache = _cache()
    await cache.start()  # returns with the warm-up held in its first launch
    try:
        await gate.held.wait()
        tokens = list(range(3 * LAYOUT.page_tokens))
        offload = asyncio.ensure_future(cache.offload(tokens, torch.arange(len(tokens))))
        await until(lambda: waiting_in(offload, "_kernels_ready") or gate.other.is_set())
        assert not gate.other.is_set(), "a copy launched before the warm-up made its kernels ready"
        gate.open()
        assert (await offload).stored == 3
        warm = await cache.wait_warm()
        assert warm is not None and not warm.stopped
        assert 0 < warm.ready_variants <= warm.variants
        loop_thread = threading.current_thread().name
        warm_keys = [k for k, t in zip(record.keys, record.threads, strict=True) if t == WARM]
        assert len(warm_keys) == len(set(warm_keys)) == warm.variants
        assert loop_thread not in record.threads, "a launch ran on the event loop's thread"
        first_real = next(i for i, t in enumerate(record.threads) if t != WARM)
        assert first_real >= warm.ready_variants  # the page-aligned variants came first
        real = {k for k, t in zip(record.keys, record.threads, strict=True) if t != WARM}
        assert real <= set(warm_keys)
        match = await cache.match(tokens)
        assert (await cache.load(match, torch.arange(len(tokens)) + 20)).tokens == len(tokens)
    finally:
        await cache.aclose()
    assert cache.stats().errors.get("warm_up_failed", 0) == 0


@pytest.mark.asyncio
async def test_aclose_during_the_warm_up_stops_it_and_nothing_runs_afterwards(
    gated: Callable[..., tuple[Gate, LaunchRecord]],
) -> None:
    gate, record = gated()
    cache = _cache(TransferPath.STAGING)
    await cache.start()
    await gate.held.wait()
    threads = warm_threads()
    assert len(threads) == 1
    closing = asyncio.ensure_future(cache.aclose())
    await until(lambda: cache._warm_stop.is_set())
    await until(lambda: waiting_in(cache._close_task, "wait"))  # _close waits for the warm-up
    assert not closing.done(), "aclose did not wait for the warm-up"
    await open_into_close(gate, closing, record, threads[0])
    assert cache._warm is not None and cache._warm.result().stopped
    assert await cache.wait_warm() is not None  # after close: what it did, at once


@pytest.mark.asyncio
async def test_a_copy_cancelled_while_waiting_for_the_warm_up_changes_nothing(
    gated: Callable[..., tuple[Gate, LaunchRecord]],
) -> None:
    gate, _ = gated()
    cache = _cache()
    await cache.start()
    try:
        await gate.held.wait()
        tokens = list(range(2 * LAYOUT.page_tokens))
        offload = asyncio.ensure_future(cache.offload(tokens, torch.arange(len(tokens))))
        await until(lambda: waiting_in(offload, "_kernels_ready"))
        offload.cancel()
        with pytest.raises(asyncio.CancelledError):
            await offload
        stats = cache.stats()
        assert (stats.pool_reserved, stats.pool_ready, stats.background_jobs) == (0, 0, 0)
        assert not gate.other.is_set()
        waiter = asyncio.ensure_future(cache.wait_warm())
        await until(lambda: waiting_in(waiter, "wait_warm"))
        waiter.cancel()  # a cancelled wait_warm does not stop the warm-up
        with pytest.raises(asyncio.CancelledError):
            await waiter
        gate.open()
        warm = await cache.wait_warm()
        assert warm is not None and not warm.stopped
        assert (await cache.offload(tokens, torch.arange(len(tokens)))).stored == 2
    finally:
        await cache.aclose()


@pytest.mark.asyncio
async def test_a_failed_warm_up_is_counted_and_copies_go_on(
    gated: Callable[..., tuple[Gate, LaunchRecord]],
) -> None:
    gate, record = gated(fail=True)  # the warm-up's first launch raises
    cache = _cache()
    async with cache:
        assert await cache.wait_warm() is None
        assert cache.stats().errors.get("warm_up_failed") == 1
        tokens = list(range(2 * LAYOUT.page_tokens))
        assert (await cache.offload(tokens, torch.arange(len(tokens)))).stored == 2
        assert gate.other.is_set()  # the copy launched its kernels itself
    assert WARM in record.threads


@pytest.mark.asyncio
async def test_a_cache_without_kernels_starts_no_warm_up() -> None:
    cache = _cache(TransferPath.REFERENCE)
    with record_launches(launch=False) as record:
        async with cache:
            assert await cache.wait_warm() is None
            assert not warm_threads()
            tokens = list(range(LAYOUT.page_tokens))
            assert (await cache.offload(tokens, torch.arange(len(tokens)))).stored == 1
    assert record.keys == []
