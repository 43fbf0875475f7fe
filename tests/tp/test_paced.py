"""A CUDA rank's paced layer-wise load (``aiokv.tp.paced.feed_layers``), without a GPU.

``feed_layers`` drives ``PageMover.start_layers``' load on the worker's copy thread. Here a CPU
stand-in plays that load: it copies each layer for real (``reference_scatter`` into a KV buffer)
when the test lets it, calls ``on_issued`` as ``PacedLayers.feed`` does, and its per-layer events
complete only when the test sets them. The real ``CompletionBridge`` and ``LayerProgress`` run:

- the engine sees layer ``l`` only once the feed issued it (an event not queued yet would complete
  at once on the GPU: the engine's stream would read bytes not yet there);
- the manager hears of layer ``l`` (LAYERS) only once its event completed, in order, and before
  the job's own report; a failed feed reports what landed, never the layers it gave up.

The same flow on a GPU: ``tests/tp/test_tp_gpu.py::test_cuda_ranks_paced_layered_load_bit_exact_per_layer``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio
import torch

from aiokv.cuda import CompletionBridge
from aiokv.kernels.reference import reference_scatter
from aiokv.layout import KVBuffer, KVLayout
from aiokv.tp.layers import LayerProgress
from aiokv.tp.paced import feed_layers

LAYOUT = KVLayout.mha(4, 2, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
PAGES = 3
SKIP = 1
WAIT_S = 60.0


class HostEvent:
    """A CPU stand-in for a layer's CUDA event: ``synchronize`` blocks until the test sets it."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def synchronize(self) -> None:
        assert self.done.wait(WAIT_S), "the test never completed this event"


class HostPacedLoad:
    """A CPU stand-in for ``PacedLayers``: layer ``l`` is copied (for real) once the test releases
    ``gate``; ``fail_at``: the layer whose launch raises. Like ``PacedLayers.feed`` it reports every
    issued layer, gives up the rest (``on_issued(l, False)``), waits for what it issued, then raises."""

    def __init__(self, kv: KVBuffer, pages: torch.Tensor, slots: torch.Tensor, fail_at: int | None = None) -> None:
        self.kv, self.pages, self.slots, self.fail_at = kv, pages, slots, fail_at
        self.events = [HostEvent() for _ in range(LAYOUT.num_layers)]
        self.gate = threading.Semaphore(0)
        self.fed = 0
        self.discarded = False

    def feed(self, on_issued: Callable[[int, bool], None] | None = None) -> None:
        assert on_issued is not None
        self.fed += 1
        issued = 0
        error: BaseException | None = None
        try:
            for layer in range(LAYOUT.num_layers):
                assert self.gate.acquire(timeout=WAIT_S), "the test never released this layer"
                if layer == self.fail_at:
                    raise RuntimeError(f"injected launch fault at layer {layer}")
                reference_scatter(self.kv, self.pages, self.slots, list(range(PAGES)), SKIP, range(layer, layer + 1))
                issued = layer + 1
                on_issued(layer, True)
        except RuntimeError as exc:
            error = exc
        for layer in range(issued, LAYOUT.num_layers):
            on_issued(layer, False)
        for event in self.events[:issued]:  # as PacedLayers waits for its end event
            event.synchronize()
        if error is not None:
            raise error

    def discard(self) -> bool:
        self.discarded = True
        return True


@pytest_asyncio.fixture
async def bridge() -> AsyncIterator[CompletionBridge]:
    bridge = CompletionBridge()
    yield bridge
    await asyncio.to_thread(bridge.close)


def _buffers() -> tuple[torch.Tensor, KVBuffer, torch.Tensor, torch.Tensor]:
    """The engine's KV buffer (zeros) and its view, pool pages (random), the load's slots."""
    gen = torch.Generator().manual_seed(5)
    pages = torch.randn(PAGES, LAYOUT.num_layers, T, LAYOUT.rows, LAYOUT.head_dim, generator=gen).to(LAYOUT.dtype)
    raw = torch.zeros(LAYOUT.num_layers, 32, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    return raw, KVBuffer.wrap(LAYOUT, raw), pages, torch.arange(20, 20 + PAGES * T - SKIP)


def _want(pages: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer ``layer`` of the load's tokens ``[SKIP, PAGES*T)``: ``[tokens, rows, D]``."""
    return pages[:, layer].reshape(PAGES * T, LAYOUT.rows, LAYOUT.head_dim)[SKIP:]


class Reports:
    """The ``on_landed`` calls (LAYERS frames), and a way to await the next one."""

    def __init__(self) -> None:
        self.landed: list[int] = []
        self._changed = asyncio.Event()

    def __call__(self, count: int) -> None:
        self.landed.append(count)
        self._changed.set()

    async def until(self, count: int) -> None:
        async with asyncio.timeout(WAIT_S):
            while len(self.landed) < count:
                self._changed.clear()
                await self._changed.wait()


def _not_ready(progress: LayerProgress, layer: int) -> bool:
    try:
        progress.wait(layer, 0)
    except TimeoutError:
        return True
    return False


@pytest.mark.asyncio
async def test_a_layer_is_ready_once_issued_and_reported_once_landed_in_order(bridge: CompletionBridge) -> None:
    raw, kv, pages, slots = _buffers()
    paced = HostPacedLoad(kv, pages, slots)
    progress = LayerProgress(LAYOUT.num_layers)
    reports = Reports()
    fed = feed_layers(paced, progress, bridge, reports)
    # What had landed when the job's report came, taken by a done-callback: awaited through a
    # future of its own (await fed on a done future returns without yielding, before its
    # callbacks ran: at_report read empty once in a loaded run).
    at_report: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
    fed.add_done_callback(lambda _: at_report.set_result(list(reports.landed)))
    # The events exist but nothing is queued: before the fix every layer read as ready here, and
    # the engine's stream would have waited on events never recorded (no wait at all on a GPU).
    assert len(progress.events) == LAYOUT.num_layers and progress.landed == 0
    assert _not_ready(progress, 0)
    for layer in range(LAYOUT.num_layers):
        paced.gate.release()  # layer `layer` may be issued now, nothing later
        assert await asyncio.to_thread(progress.wait, layer, WAIT_S) is True
        assert torch.equal(raw[layer, slots], _want(pages, layer))
        if layer + 1 < LAYOUT.num_layers:
            assert _not_ready(progress, layer + 1)
            assert not raw[layer + 1, slots].any(), "a later layer was copied early"
        # Issued is not landed: the manager hears nothing until the layer's event completed.
        assert reports.landed == list(range(1, layer + 1))
        paced.events[layer].done.set()
        await reports.until(layer + 1)
        assert reports.landed == list(range(1, layer + 2))
    await fed
    assert await at_report == list(range(1, LAYOUT.num_layers + 1))  # every LAYERS before the job's report
    assert paced.fed == 1 and not paced.discarded


@pytest.mark.asyncio
async def test_a_failed_feed_reports_what_landed_and_never_the_layers_it_gave_up(bridge: CompletionBridge) -> None:
    raw, kv, pages, slots = _buffers()
    paced = HostPacedLoad(kv, pages, slots, fail_at=2)
    progress = LayerProgress(LAYOUT.num_layers)
    reports = Reports()
    fed = feed_layers(paced, progress, bridge, reports)
    fed.add_done_callback(lambda _: progress.end())  # as the executor does with the job's report
    for event in paced.events:
        event.done.set()
    for _ in range(LAYOUT.num_layers):
        paced.gate.release()
    with pytest.raises(RuntimeError, match="injected launch fault at layer 2"):
        await fed
    assert reports.landed == [1, 2]
    assert [progress.wait(layer, 0) for layer in range(LAYOUT.num_layers)] == [True, True, False, False]
    assert torch.equal(raw[1, slots], _want(pages, 1))
    assert not raw[2:, slots].any()


@pytest.mark.asyncio
async def test_two_loads_are_fed_one_after_the_other_in_start_order(bridge: CompletionBridge) -> None:
    # PacedLayers of one mover must be fed in the order they were started, by one thread.
    _, kv, pages, slots = _buffers()
    first, second = HostPacedLoad(kv, pages, slots), HostPacedLoad(kv, pages, slots)
    one, two = LayerProgress(LAYOUT.num_layers), LayerProgress(LAYOUT.num_layers)
    fed = [feed_layers(first, one, bridge), feed_layers(second, two, bridge)]
    for event in [*first.events, *second.events]:
        event.done.set()
    second.gate.release(LAYOUT.num_layers)  # the second may run whole: it still waits for the first
    first.gate.release()
    assert await asyncio.to_thread(one.wait, 0, WAIT_S) is True
    assert second.fed == 0 and two.landed == 0
    first.gate.release(LAYOUT.num_layers - 1)
    await asyncio.gather(*fed)
    assert first.fed == second.fed == 1 and one.landed == two.landed == LAYOUT.num_layers


@pytest.mark.asyncio
async def test_a_closed_bridge_discards_the_load(bridge: CompletionBridge) -> None:
    _, kv, pages, slots = _buffers()
    paced = HostPacedLoad(kv, pages, slots)
    await asyncio.to_thread(bridge.close)
    with pytest.raises(RuntimeError, match="closed"):
        feed_layers(paced, LayerProgress(LAYOUT.num_layers), bridge)
    assert paced.discarded and paced.fed == 0
