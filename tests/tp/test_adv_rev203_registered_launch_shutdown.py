"""Review 203: a loop's shutdown ended a CUDA load launched once its pages' chunk was registered.

A CUDA rank registers its mapping of the pool in the background; a spec whose pages lie in a chunk
not registered yet waits in a task of its own (``RankExecutor._launch_when_registered``), which
then launched the copy and *awaited* its report. ``asyncio.run`` ending cancels every task left:
cancelling that task cancelled the future it awaited, the task ended cancelled and the spec was
reported ``WORKER_CLOSING`` ("withdrawn before it began") while its copy still ran. The drain
ended, the manager freed the slots, the engine reused them and the copy landed there (wrong KV):
the paced feed's case (review 202), left on this path.

Without a GPU: a real executor on CPU with a real pool mapping, the real bridge and its copy
thread, marked CUDA with one registration chunk the test completes; the GPU launch is played by the
real CPU copy on the copy thread, held there, whose report settles the spec by callback as the
bridge's event wait does on CUDA. The rank's loop is an ``asyncio.run`` on a thread; its main
coroutine returns with the copy held (the shutdown cancels every task left), and the oracle is
the KV bytes of the slots the engine reuses once the drain ended.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import torch
from held_call import BOUND_S, Hold
from tp_helpers import full_kv, new_pool

from aiokv.cuda import CompletionBridge
from aiokv.kernels import mover as mover_module
from aiokv.layout import KVBuffer, KVLayout
from aiokv.pool import PagePool
from aiokv.shm import ChunkResult
from aiokv.tp import Direction, RankExecutor, RankReport, RankStatus, TPConfig, TransferSpec
from aiokv.tp import executor as executor_module
from aiokv.tp.cancels import Cancels

LAYOUT = KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
EPOCH = 1
CONFIG = TPConfig(inline_copy_bytes=0)
SPIN_TURNS = 200  # loop turns the shutdown gives the drain to end (before the fix: about five)
REUSED = -7.0


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[PagePool]:
    pool = await new_pool(LAYOUT.for_tp(1), 8)
    yield pool
    await pool.aclose()


def _rank(pool: PagePool, hold: Hold, raw: torch.Tensor, slots: list[int], seen: dict[str, Any]) -> None:
    """The rank's loop: launch the load after its chunk registered, then return with its copy held."""
    bridge = CompletionBridge()

    async def main() -> None:
        executor = RankExecutor(KVBuffer.wrap(LAYOUT, raw), PagePool.attach(pool.name, pool.layout), EPOCH, bridge,
                                CONFIG)
        chunk: concurrent.futures.Future[ChunkResult] = concurrent.futures.Future()
        executor._cuda = True  # its pages wait for the registration of chunk 0
        executor._chunks = [chunk]
        executor._pages_per_chunk = pool.num_pages

        def launch(spec: TransferSpec, result: asyncio.Future[RankReport], progress: object = None,
                   after: object = None) -> None:
            # The GPU launch's stand-in: queued now, the report settles ``result`` by callback.
            copy = bridge.run_cpu(functools.partial(executor._copy_on_thread, spec, None, None))
            copy.add_done_callback(functools.partial(executor_module._forward, result))

        executor._launch_cuda = launch  # type: ignore[method-assign]
        report = executor.execute(TransferSpec.build(1, Direction.LOAD, EPOCH, T, [0], slots))
        assert not report.done(), "the spec did not wait for its chunk"
        chunk.set_result(ChunkResult(0, 0, pool.num_pages * pool.layout.page_bytes, True, None))
        assert await asyncio.to_thread(hold.entered.wait, BOUND_S), "the copy was never launched"
        drained: list[asyncio.Future[None]] = []
        started = asyncio.Event()

        async def drain() -> None:  # the worker's session: drain, then the slots go back
            drained.append(executor.drained())
            await Cancels().outlast(drained[0])
            seen["copied_at_drain"] = hold.returned.is_set()
            seen["report"] = report.result().status if report.done() else None
            raw[:, slots] = REUSED  # the manager freed the slots: the engine writes its own KV there
            await Cancels().settle(executor.aclose())

        async def watch() -> None:
            started.set()
            try:
                await asyncio.Event().wait()
            finally:  # the shutdown's cancel (every task left): give the drain its turns, then the copy
                for _ in range(SPIN_TURNS):
                    if drained and drained[0].done():
                        break
                    await asyncio.sleep(0)
                hold.release()

        seen["left"] = {asyncio.create_task(drain()), asyncio.create_task(watch())}  # left to the shutdown
        await started.wait()

    try:
        asyncio.run(main())
    finally:
        hold.release()
        bridge.close()  # joins the copy thread: every copy is over after this


@pytest.mark.asyncio
async def test_a_loop_s_shutdown_does_not_end_a_load_launched_after_its_chunk_registered(
        pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    hold = Hold()
    monkeypatch.setattr(mover_module.HostScatter, "load", hold.wrap(mover_module.HostScatter.load))
    pool.pages[0] = 3.0  # the page the load brings
    raw = full_kv(LAYOUT, 5, slots=8 * T)
    slots = list(range(T))
    seen: dict[str, Any] = {}
    try:
        async with asyncio.timeout(BOUND_S):
            await asyncio.to_thread(_rank, pool, hold, raw, slots, seen)
    finally:
        hold.release()
    assert "copied_at_drain" in seen, "the drain never ended"
    assert seen["copied_at_drain"], f"the drain ended (the spec reported {seen['report']}) while its copy ran"
    assert seen["report"] is RankStatus.OK
    assert bool((raw[:, slots] == REUSED).all()), "the copy landed after the engine reused the slots"
