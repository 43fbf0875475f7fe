"""`RankExecutor.aclose` cancelled while it waits still unmaps the pool, and a second call waits
for that unmap.

Regression: ``aclose`` awaited the drain, then the unmap thread, with no care for a cancel. A cancel
during the drain (a copy still running) ended it there: the mover and the pool's mapping were never
released. A cancel during the unmap thread returned at once, and a second ``aclose`` (the mover was
already dropped) returned before the pool was unmapped.

A real executor on CPU with a real pool mapping and the real copy thread; the copy (or the unmap)
is held inside the real call on a ``threading.Event`` until the test lets it go, so each cancel
lands at a known point. Mapped or not is read from ``/proc/self/maps`` and ``/proc/self/fd``.

The fence of a paced CUDA load (stopped between two units, reported ``WORKER_CLOSING``) needs
``PacedLayers``, that is a GPU: ``tests/tp/test_tp_gpu.py::test_cuda_rank_fence_stops_a_paced_load``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
import torch
from held_call import BOUND_S, Hold
from loop_probes import until
from tp_helpers import full_kv, new_pool

from aiokv.cuda import CompletionBridge
from aiokv.kernels import mover as mover_module
from aiokv.layout import KVBuffer, KVLayout
from aiokv.pool import PageMemory, PagePool
from aiokv.tp import Direction, RankExecutor, RankStatus, TPConfig, TransferSpec

LAYOUT = KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
EPOCH = 1
CONFIG = TPConfig(inline_copy_bytes=0)
"""Every CPU copy goes through the copy thread (none runs on the loop), where the test holds it."""


@pytest.fixture
def hold() -> Iterator[Hold]:
    made = Hold()
    yield made
    made.release()  # a failing test never leaves a thread held


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[PagePool]:
    pool = await new_pool(LAYOUT.for_tp(1), 8)
    yield pool
    await pool.aclose()


@pytest_asyncio.fixture
async def bridge() -> AsyncIterator[CompletionBridge]:
    bridge = CompletionBridge()
    yield bridge
    await asyncio.to_thread(bridge.close)


def mappings(name: str) -> int:
    """Lines of ``/proc/self/maps`` that map segment ``name``, plus descriptors open on it."""
    path = "/dev/shm" + name
    with open("/proc/self/maps") as maps:
        mapped = sum(1 for line in maps if len(line.split()) >= 6 and line.split()[5] == path)
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}") == path
        except OSError:
            pass  # closed meanwhile (the listing's own descriptor)
    return mapped + fds


def _executor(pool: PagePool, bridge: CompletionBridge) -> RankExecutor:
    kv = KVBuffer.wrap(LAYOUT, full_kv(LAYOUT, 5, slots=8 * T))
    return RankExecutor(kv, PagePool.attach(pool.name, pool.layout), EPOCH, bridge, CONFIG)


async def _cancel(task: asyncio.Future[None]) -> None:
    """Cancel ``task`` and let the loop hand it the cancel (a few turns: a task that ignored it is
    waiting again by then, one that did not is done)."""
    task.cancel()
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_aclose_cancelled_twice_while_a_copy_runs_still_unmaps_the_pool(
    pool: PagePool, bridge: CompletionBridge, hold: Hold, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mover_module.HostScatter, "load", hold.wrap(mover_module.HostScatter.load))
    baseline = mappings(pool.name)
    executor = _executor(pool, bridge)
    assert mappings(pool.name) > baseline, "the probe does not see the executor's mapping"
    report = executor.execute(TransferSpec.build(1, Direction.LOAD, EPOCH, T, [0], range(T)))
    closing: asyncio.Future[None] | None = None
    try:
        async with asyncio.timeout(BOUND_S):
            await hold.wait_entered()  # the copy runs on the copy thread, over the mapping
            closing = asyncio.ensure_future(executor.aclose())
            # Its first step fences and then waits in the drain (a task cancelled before its first
            # step would never run at all).
            await until(lambda: executor._closing)
            await _cancel(closing)
            await _cancel(closing)
            # Old code: the first cancel ended the close in its drain, the copy still running.
            assert not closing.done(), "the close ended while the copy still ran"
            assert executor._mover is not None and not executor.memory.segment.closed
            hold.release()
            await asyncio.gather(closing, return_exceptions=True)
    finally:
        hold.release()
        await executor.aclose()
    assert closing.cancelled(), "the cancel was swallowed"
    assert (await report).status is RankStatus.OK
    assert executor._mover is None and executor.memory.segment.closed, "the pool is still mapped"
    assert mappings(pool.name) == baseline, "the executor's mapping of the pool is still in the process"
    assert executor.in_flight == 0


@pytest.mark.asyncio
async def test_a_second_aclose_waits_for_the_unmap_of_a_cancelled_first(
    pool: PagePool, bridge: CompletionBridge, hold: Hold, monkeypatch: pytest.MonkeyPatch
) -> None:
    baseline = mappings(pool.name)
    executor = _executor(pool, bridge)
    memory = executor.memory
    real_close = PageMemory.close

    def close(self: PageMemory) -> None:
        if self is memory:
            hold.wrap(real_close)(self)
        else:
            real_close(self)

    monkeypatch.setattr(PageMemory, "close", close)
    closes: list[asyncio.Future[None]] = []
    try:
        async with asyncio.timeout(BOUND_S):
            closes.append(asyncio.ensure_future(executor.aclose()))
            await hold.wait_entered()  # the unmap thread is inside memory.close
            await _cancel(closes[0])
            await _cancel(closes[0])
            closes.append(asyncio.ensure_future(executor.aclose()))
            for _ in range(5):
                await asyncio.sleep(0)
            # Old code: the first returned at its cancel; the second at once (the mover was gone).
            assert not any(c.done() for c in closes), "a close returned before the pool was unmapped"
            hold.release()
            results = await asyncio.gather(*closes, return_exceptions=True)
    finally:
        hold.release()
        await asyncio.gather(*closes, return_exceptions=True)
    assert hold.returned.is_set() and memory.segment.closed
    assert closes[0].cancelled() and results[1] is None
    assert mappings(pool.name) == baseline
    await executor.aclose()  # idempotent once unmapped
