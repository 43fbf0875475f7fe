"""A CUDA rank's layer-wise load fed a few units at a time, as the single-process cache does.

``PageMover.start_layers`` plans a STAGING layer-wise load; its :meth:`~aiokv.kernels.mover.PacedLayers.feed`
queues the units at most ``pace_bytes`` ahead of the GPU (CUDA maps streams onto a few hardware
queues: an engine stream sharing one with the copy stream would otherwise wait for the whole load).
Here it runs on the worker's copy thread (idle on CUDA ranks: one feeding thread, loads fed in
the order they were started), with two kinds of readiness per layer:

- the rank's engine (:class:`~aiokv.tp.layers.LayerProgress`): layer ``l`` is ready once its event
  is queued (``issued``); the engine's stream then waits on it on the GPU, never before;
- the manager (``on_landed``, LAYERS frames): layer ``l`` once its event has completed, in order,
  each before the job's own report.

The logic takes any object with ``events`` and ``feed(on_issued)``, so it is tested without a GPU
(``tests/tp/test_paced.py``) against CPU stand-ins for the events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from aiokv.cuda import CompletionBridge, Lane
from aiokv.kernels.mover import PacedLoadStopped

from .layers import LayerProgress


class PacedLoad(Protocol):
    """What :func:`feed_layers` needs of a :class:`~aiokv.kernels.mover.PacedLayers`."""

    @property
    def events(self) -> Sequence[Any]:
        """Per layer, a CUDA event completing once layers ``0..l`` landed (it exists once issued)."""
        ...

    def feed(self, on_issued: Callable[[int, bool], None] | None = None) -> None:
        """Queue every unit, calling ``on_issued(l, True)`` as layer ``l``'s event is queued and
        ``on_issued(l, False)`` for layers given up; returns once the GPU is done, raises on failure."""
        ...

    def discard(self) -> bool:
        """Give up a load never fed: it queues nothing."""
        ...


def feed_layers(
    paced: PacedLoad,
    progress: LayerProgress,
    bridge: CompletionBridge,
    on_landed: Callable[[int], None] | None = None,
) -> asyncio.Future[None]:
    """Feed ``paced`` on ``bridge``'s copy thread; call on the worker's loop, right after
    ``start_layers`` (loads are fed in the order they were started).

    ``progress`` counts layer ``l`` as ready once its event is queued; ``on_landed(l + 1)`` is
    called on the loop once that event completed, in layer order. The returned future resolves
    after the feed returned (the GPU finished everything it queued) and every landed layer was
    reported; it raises what the feed raised (stopped, a launch fault, a CUDA error). Raises
    ``RuntimeError`` at once when the bridge is closed (the load is then discarded: nothing queued).
    """
    loop = asyncio.get_running_loop()
    events = paced.events
    progress.launch(events, issued=0)
    landing: list[asyncio.Future[None]] = []

    def watch(layer: int) -> None:
        # On the loop, in issue order: the waiter thread completes the waits in that order too.
        try:
            landing.append(watch_landed(bridge, events[layer], layer, on_landed))
        except RuntimeError:
            pass  # the bridge closed: nobody reads LAYERS frames any more

    def issued(layer: int, queued: bool) -> None:
        # On the feeding thread. A layer given up (queued False) is left to the job's end.
        if not queued:
            return
        progress.mark(layer + 1)
        try:
            loop.call_soon_threadsafe(watch, layer)
        except RuntimeError:
            pass  # the loop is closed: nobody waits for the layer any more

    try:
        fed = bridge.run_cpu(lambda: paced.feed(issued))
    except RuntimeError:
        paced.discard()
        raise

    # A plain future settled by callbacks, not a task: a loop's shutdown (asyncio.run ending)
    # cancelled that task while the feed still queued units on the GPU; the load reported
    # COPY_FAILED, the worker's drain ended and the manager freed the slots under the copies
    # (review 202). The drain now waits for the feed itself.
    settled: asyncio.Future[None] = loop.create_future()

    def settle(_: asyncio.Future[None]) -> None:
        # Every watch() was queued on the loop before the feed's completion (same thread, in
        # order): the LAYERS reports of what landed go out before the job's own report.
        waiting = next((w for w in landing if not w.done()), None)
        if waiting is not None:
            waiting.add_done_callback(settle)
        else:
            # A turn later, as the task's end came: a caller woken by the last LAYERS report that
            # then awaits the future finds it pending, and its done-callbacks (the job's report)
            # run before that caller goes on (tests/tp/test_paced.py relies on it).
            loop.call_soon(resolve)

    def resolve() -> None:
        if settled.done():
            return
        if fed.cancelled():
            settled.cancel()
        elif (exc := fed.exception()) is not None:
            settled.set_exception(exc)
        else:
            settled.set_result(None)

    fed.add_done_callback(settle)
    return settled


class StoppableLoad(Protocol):
    """What :func:`stopped_by_request` needs of a :class:`~aiokv.kernels.mover.PacedLayers`."""

    @property
    def stopped(self) -> bool:
        """Whether ``stop()`` was called."""
        ...


def stopped_by_request(paced: StoppableLoad, exc: BaseException) -> bool:
    """Whether the feed raised ``exc`` only because ``paced.stop()`` was called: the feed then
    raises :class:`~aiokv.kernels.mover.PacedLoadStopped` once the GPU finished what it queued. A
    launch fault or a CUDA error raised meanwhile wins over the stop: that is a fault, not a stop."""
    return paced.stopped and isinstance(exc, PacedLoadStopped)


def watch_landed(
    bridge: CompletionBridge, event: Any, layer: int, on_landed: Callable[[int], None] | None
) -> asyncio.Future[None]:
    """Wait (bridge's LOAD waiter, in the order of the calls) for ``event``, layer ``layer``'s, then
    call ``on_landed(layer + 1)`` on the loop unless the wait failed. Raises ``RuntimeError`` when
    the bridge is closed."""
    waited = bridge.wait(event, Lane.LOAD)
    if on_landed is not None:
        waited.add_done_callback(lambda done: _landed(done, on_landed, layer))
    return waited


def _landed(done: asyncio.Future[None], on_landed: Callable[[int], None], layer: int) -> None:
    if not done.cancelled() and done.exception() is None:
        on_landed(layer + 1)
