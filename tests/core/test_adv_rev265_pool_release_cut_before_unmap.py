"""Review 265: the pool's release cut before it handed the unmap to a thread, and nobody to run it
again: a loop that ends while an ``aclose()`` runs (``asyncio.run`` returning: its end cancels every
task left), or a loop-wide cancel (an application's SIGTERM handler cancelling every task) with no
later ``aclose()``. Cut at its first step or in its wait for a chunk still preparing, the release never
submitted the unmap: the segment stayed mapped and named in /dev/shm until exit (review 205's rerun
needs a later ``aclose()``/``wait_freed()``, which a loop's end never makes). The cut release now hands
the unmap to a pool thread that waits for the running chunks itself.

The segment is real (/dev/shm); the chunk's preparation is held at its start by the test (a gate),
so the release waits for it.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from loop_probes import cancel_every_task_but_nowait, until, until_thread, waiting_in

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.shm import ChunkResult, SharedSegment

LAYOUT = KVLayout.mha(2, 2, 16, torch.bfloat16, page_tokens=8)
BOUND_S = 10.0


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Chunk preparation held at its start until the returned event is set."""
    go = threading.Event()
    real = SharedSegment.prepare_chunk

    def held(self: SharedSegment, index: int, offset: int, length: int, register_cuda: bool) -> ChunkResult:
        assert go.wait(30), "the test never let the chunk go"
        return real(self, index, offset, length, register_cuda)

    monkeypatch.setattr(SharedSegment, "prepare_chunk", held)
    try:
        yield go
    finally:
        go.set()


def _segment_left(pool: PagePool) -> bool:
    return os.path.exists("/dev/shm/" + pool.name.lstrip("/"))


async def _start_aclose(pool: PagePool, where: str) -> asyncio.Future[None]:
    """An aclose() whose release is at ``where``: not started yet, or waiting for the held chunk."""
    first = asyncio.ensure_future(pool.aclose())
    if where == "first step":
        await asyncio.sleep(0)  # aclose's first step made the release task, which has not run yet
    else:
        await until(lambda: waiting_in(pool._closing, "_wait_chunks"))
    assert pool._closing is not None and not pool._closing.done() and pool._unmap is None
    return first


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["first step", "chunk wait"])
async def test_a_loop_ending_under_a_release_still_frees_the_segment(gate: threading.Event, where: str) -> None:
    pool = PagePool.create(LAYOUT, 4 * LAYOUT.page_bytes, register_cuda=False, workers=1)
    ended: list[Any] = []

    async def application() -> None:
        await _start_aclose(pool, where)
        ended.append(pool._closing)
        # Returning: asyncio.run cancels every task left (the release among them), then closes its loop.

    await asyncio.to_thread(asyncio.run, application())
    assert ended and ended[0].cancelled()
    gate.set()
    await until_thread(lambda: not _segment_left(pool), "the segment unlinked after the loop's end", BOUND_S)
    assert pool.memory.segment.closed
    async with asyncio.timeout(BOUND_S):
        await pool.aclose()  # waits for that unmap (never a second)
    assert pool._released


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["first step", "chunk wait"])
async def test_a_loop_wide_cancel_of_a_release_still_frees_the_segment(gate: threading.Event, where: str) -> None:
    pool = PagePool.create(LAYOUT, 4 * LAYOUT.page_bytes, register_cuda=False, workers=1)
    first = await _start_aclose(pool, where)
    release = pool._closing
    assert release is not None
    cancel_every_task_but_nowait(asyncio.current_task())
    await asyncio.wait({first, release})
    assert first.cancelled() and release.cancelled()
    gate.set()
    # No later aclose(): the application's shutdown goes on without one.
    await until_thread(lambda: not _segment_left(pool), "the segment unlinked after the cut", BOUND_S)
    assert pool.memory.segment.closed
    async with asyncio.timeout(BOUND_S):
        await pool.aclose()
    assert pool._released
