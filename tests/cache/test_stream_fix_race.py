"""``StreamCopies.fix`` racing between the engine's launching thread and the loop.

``LoadStream.order_layer`` may run ``fix()`` on the engine's thread while the loop's ``wait_layer``
runs it too. A ``fix()`` that published the copy list before the CUDA flag let the loop see the
list with the flag still False: it took the CPU path, returned the layer as landed and never made
the engine's stream wait for the copy (wrong KV: the engine reads slots still being written).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from aiokv.streamcopies import StreamCopies
from aiokv.transfers import Copy


class _Transfers:
    def __init__(self) -> None:
        self.ordered_after: list[list[object]] = []

    def order_after(self, events: list[object], seen: set[tuple[int, int]] | None = None) -> None:
        self.ordered_after.append(list(events))


class _CudaCopy:
    """A launched CUDA copy (an end event, no per-layer events) whose ``event`` read blocks on the
    engine's thread, holding that thread inside ``fix()`` at the point a switch is worst."""

    def __init__(self, loop: asyncio.AbstractEventLoop, engine_thread: list[threading.Thread]) -> None:
        self._engine_thread = engine_thread
        self.entered = threading.Event()
        self.release = threading.Event()
        self.end_event = object()  # stands for the copy's torch.cuda.Event
        done: asyncio.Future[Any] = loop.create_future()
        done.set_result(None)
        landed: asyncio.Future[bool] = loop.create_future()
        landed.set_result(True)
        self.future = done
        self.layer_events: tuple[object, ...] = ()
        self.layer_futures = (landed,)
        self.ordered = False
        self.paced = None
        self.handover = None

    @property
    def event(self) -> object:
        if self._engine_thread and threading.current_thread() is self._engine_thread[0] and not self.release.is_set():
            self.entered.set()
            self.release.wait(10)
        return self.end_event

    def want_layer(self, layer: int) -> None:
        pass


@pytest.mark.asyncio
async def test_the_loop_never_sees_the_copy_list_before_the_cuda_flag() -> None:
    loop = asyncio.get_running_loop()
    engine: list[threading.Thread] = []
    copy = _CudaCopy(loop, engine)
    transfers = _Transfers()
    copies = StreamCopies(transfers, last_page=0)  # type: ignore[arg-type]
    copies.add(0, copy, [object()], "pool")  # type: ignore[arg-type, list-item]
    fixed: list[list[Copy]] = []
    thread = threading.Thread(target=lambda: fixed.append(copies.fix()), name="engine-launcher")
    engine.append(thread)
    thread.start()
    try:
        assert await asyncio.to_thread(copy.entered.wait, 10), "the engine's fix() never read the copy's event"
        landed = await asyncio.wait_for(copies.wait_layer(0), 10)
    finally:
        copy.release.set()
        await asyncio.to_thread(thread.join, 10)
    assert landed
    # The CUDA path: the engine's stream ordered after the copy's event, not a CPU wait.
    assert transfers.ordered_after == [[copy.end_event]], transfers.ordered_after
    assert fixed and [id(c) for c in fixed[0]] == [id(copy)]
