"""A caller's region that ``register_memory`` did not pin is no longer exported by the tier once
the call ends, whatever keeps the call's frames.

The tier casts the caller's buffer to a byte view and hands it to the backend, which keeps it (until
its close) only where it pinned something. A view not kept was left to be freed with the call's
frames; a cancelled call's frames live on in the ``CancelledError``'s traceback (a caller or a loop
thread keeping it: vLLM's adapter kept its dead loop's), and with them the view: the caller could
not unmap its region (``mmap.close`` raises ``BufferError``; vLLM logs "still exported" and keeps it
mapped). Now the backend releases a view it does not keep before the call returns or raises."""

from __future__ import annotations

import asyncio
import mmap
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from disk_helpers import uring_tier

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import backends

REGION_BYTES = 1 << 20


class _Paused:
    """``update_in_batches`` whose first call waits for ``release`` before pinning anything."""

    def __init__(self, real: Callable[..., Iterator[list[Any]]], loop: asyncio.AbstractEventLoop) -> None:
        self.real, self.loop = real, loop
        self.entered, self.release = asyncio.Event(), threading.Event()

    def __call__(self, engine: Any, regions: Sequence[Any], stop: threading.Event,
                 prepare: Callable[[Any], None]) -> Iterator[list[Any]]:
        self.loop.call_soon_threadsafe(self.entered.set)
        assert self.release.wait(30), "the test never released the registration"
        yield from self.real(engine, regions, stop, prepare)


def _unmaps(region: mmap.mmap) -> bool:
    try:
        region.close()
    except BufferError:
        return False
    return True


@pytest.mark.asyncio
async def test_a_registration_cancelled_before_any_piece_leaves_no_export(
        disk_dir: Path, layout: KVLayout, pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    tier, io = await uring_tier(disk_dir, layout, pool)
    region = mmap.mmap(-1, REGION_BYTES)
    paused = _Paused(backends.update_in_batches, asyncio.get_running_loop())
    monkeypatch.setattr(backends, "update_in_batches", paused)
    kept: list[BaseException] = []
    try:
        whole = memoryview(region)
        task = asyncio.create_task(tier.register_memory(whole))
        async with asyncio.timeout(30):
            await paused.entered.wait()
        whole.release()  # the caller's own view: only the tier's may export the region now
        task.cancel()
        await asyncio.sleep(0)
        paused.release.set()  # the stop is set: nothing is pinned
        async with asyncio.timeout(30):
            (outcome,) = await asyncio.gather(task, return_exceptions=True)
        assert isinstance(outcome, asyncio.CancelledError), outcome
        assert io._ext_views == [] and io._ext_regions == [], "something was pinned: not the case under test"
        kept.append(outcome)  # its traceback keeps the call's frames, as a caller may
        del task, outcome
        assert _unmaps(region), "the tier still exports the caller's region"
    finally:
        paused.release.set()
        await tier.aclose()
        region.close()
    assert kept
