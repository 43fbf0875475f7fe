"""The seam between the manager and whoever moves bytes between the engine's slots and pool pages.

The manager decides *which* pool pages and slots a transfer touches; a :class:`Transfers`
implementation runs it and reports completion as a :class:`Copy`. :class:`LocalTransfers` is the
in-process worker (one process holds the KV buffer and the pool: ``KVCache``); the ranks of a
tensor-parallel group run theirs in their own processes (:mod:`aiokv.tp`).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from aiokv.cuda import CompletionBridge, Lane

if TYPE_CHECKING:
    from aiokv.kernels import PageMover
    from aiokv.kernels.mover import PacedLayers

Mark = torch.cuda.Event | None
"""A point in the engine's queued work (:meth:`Transfers.mark`) that a load is ordered after."""


@dataclass(frozen=True, slots=True)
class Copy:
    """One launched transfer: its completion future and, on CUDA, the event that marks its end.

    The future resolves to None when every byte moved, or raises what failed (a fault: the
    manager counts it and shortens or drops), or :class:`CopyWithdrawn` when the cache's close
    withdrew it before it ran (not a fault).
    """

    future: asyncio.Future[None]
    event: torch.cuda.Event | None = None
    layer_events: tuple[torch.cuda.Event, ...] = ()
    """CUDA, layer by layer: event ``l`` completes once layers ``0..l`` landed."""
    layer_futures: tuple[asyncio.Future[bool], ...] = ()
    """CPU, layer by layer: future ``l`` resolves True once layer ``l`` landed (False: it never will);
    with a :attr:`handover`, only once wanted (:meth:`want_layer`), or at the end."""
    ordered: bool = True
    """Whether the engine's stream was made to wait on the whole copy at launch."""
    paced: PacedLayers | None = None
    """CUDA, a paced layer-wise load: ``layer_events[l]`` exists on the GPU only once
    ``layer_futures[l]`` resolved (``paced.wait_issued(l)`` from a thread), True when the layer's
    copies were queued, False when the load gave it up; stop it with ``paced.stop()``.
    ``layer_futures[-1]`` resolves once it queues nothing more, after ``event`` exists."""
    launch: PacedLaunch | None = None
    """CUDA, a paced whole-page copy: launched only once earlier copies drained (``event`` is
    then ``launch.event``; before that nothing of it is on the GPU and it can be withdrawn)."""
    handover: LayerHandover | None = None
    """Where the copy thread reports ``layer_futures``' outcomes: they resolve once awaited through
    :meth:`want_layer` (at once when reported already), at the last layer, or when the copy ends;
    None: they resolve as reported (a TP job's)."""

    def want_layer(self, layer: int) -> None:
        """On the loop, before awaiting ``layer_futures[layer]``: have it resolved as soon as it is
        reported (now, with no loop turn, when it was)."""
        if self.handover is not None and not self.layer_futures[layer].done():
            self.handover.want(layer)


class LayerHandover:
    """A layer-wise copy's per-layer outcomes, reported by the thread that copies (or queues) the
    layers and handed to the loop only for a layer someone waits on.

    A layer's future used to be posted to the loop as each layer landed: a wake-up per layer
    (~32 per streaming hit, each the self-pipe, a hand-over and the GIL taken from the loop) while
    the engine usually asks for a layer after it landed. Now the thread records each outcome. A
    loop-side :meth:`want` of a reported layer resolves every reported layer on the spot (no loop
    turn); of a layer not reported yet, it has the thread post that one future when it is (with
    every layer before it). The last layer's future is always posted (a paced load's quiesce
    waits for it); :meth:`settle` resolves every future left once the copy is over.
    """

    __slots__ = ("_bridge", "_futures", "_lock", "_resolved", "_results", "_through", "_wants")

    def __init__(self, bridge: CompletionBridge, futures: tuple[asyncio.Future[bool], ...]) -> None:
        self._bridge = bridge
        self._futures = futures
        self._results: list[bool | None] = [None] * len(futures)
        self._through = 0  # layers [0, _through) are reported
        self._resolved = 0  # layers [0, _resolved) were resolved on the loop by want()
        self._wants: set[int] = set()  # layers awaited on the loop, not reported yet
        self._lock = threading.Lock()

    def report(self, layer: int, outcome: bool) -> None:
        """From the copying thread: layer ``layer`` landed (queued on CUDA) or, False, never will."""
        with self._lock:
            results = self._results
            results[layer] = outcome
            last = len(results)
            before = through = self._through
            while through < last and results[through] is not None:
                through += 1
            self._through = through
            due = {w for w in self._wants if w < through}
            self._wants -= due
            if before < through == last:
                due.add(last - 1)  # every layer is reported: the last one's future goes now
        for index in due:  # usually one future: one wake-up, whatever the layers reported before it
            self._bridge.resolve_threadsafe(self._futures[index], results[index] is True)

    def want(self, layer: int) -> None:
        """On the loop: ``layer``'s future is about to be awaited."""
        with self._lock:
            through = self._through
            if layer >= through:
                self._wants.add(layer)
                return
            start, self._resolved = self._resolved, max(self._resolved, through)
        for index in range(start, through):
            _resolve_layer(self._futures[index], self._results[index] is True)

    def settle(self) -> None:
        """On the loop, once the copy is over: every future left resolves with its layer's outcome
        (False where none was reported: it never lands)."""
        for future, outcome in zip(self._futures, self._results, strict=True):
            _resolve_layer(future, outcome is True)


class CopyWithdrawn(RuntimeError):
    """A paced copy the cache's close withdrew before it was launched: nothing of it ran.

    Not a fault: the manager counts its pages as withdrawn (``stats().pages_withdrawn``), never
    as ``copy_failed``."""


@dataclass(eq=False, slots=True)
class PacedLaunch:
    """One copy held by a :class:`LaunchPacer` until earlier copies of its direction drained."""

    start: Callable[[], tuple[asyncio.Future[None], torch.cuda.Event | None]]
    """Launches the copy: its completion future and end event. Raises on a launch fault."""
    nbytes: int
    future: asyncio.Future[None]
    """Resolves as the launched copy does; cancelled when withdrawn before its launch."""
    event: torch.cuda.Event | None = None
    launched: bool = False


@dataclass(eq=False)
class LaunchPacer:
    """At most ``budget`` bytes of one direction's whole-page copies queued on the GPU at a time.

    CUDA maps streams onto a few hardware queues (``CUDA_DEVICE_MAX_CONNECTIONS``): an engine
    stream sharing one with aiokv's copy stream runs nothing queued after aiokv's copies until
    they are done. A 32K-token offload queued at once (4 GiB, ~80 ms) held other requests' prefill
    and decode kernels that long; paced, they wait for at most ``budget`` bytes. Later copies wait
    in FIFO order and are launched from the loop as earlier ones complete (a launch is the same
    host work it was at the call). One copy larger than the budget still runs, alone.
    """

    budget: int
    in_flight: int = 0
    queue: deque[PacedLaunch] = field(default_factory=deque)
    closed: bool = False
    running: set[asyncio.Future[None]] = field(default_factory=set)
    """Completion futures of launched copies not yet done."""

    def run(self, nbytes: int, start: Callable[[], tuple[asyncio.Future[None], torch.cuda.Event | None]]
            ) -> PacedLaunch:
        """Launch now when the budget allows and nobody waits, else queue; returns its handle.

        Closed: nothing is launched, the copy is withdrawn at once (:class:`CopyWithdrawn`)."""
        entry = PacedLaunch(start, nbytes, asyncio.get_running_loop().create_future())
        if self.closed:
            entry.future.set_exception(CopyWithdrawn("the cache is closing: copy not launched"))
        elif not self.queue and (self.in_flight == 0 or self.in_flight + nbytes <= self.budget):
            self._launch(entry)
        else:
            self.queue.append(entry)
        return entry

    def withdraw(self, entry: PacedLaunch) -> bool:
        """Cancel ``entry`` if it was not launched (nothing of it ever runs): True; False once launched."""
        return self.withdraw_all([entry])[0]

    def withdraw_all(self, entries: Sequence[PacedLaunch]) -> list[bool]:
        """:meth:`withdraw` for several entries, all before the queue moves on: withdrawing one
        must not launch another of the same cancelled call."""
        withdrawn = []
        for entry in entries:
            if not entry.launched:
                entry.future.cancel()
            withdrawn.append(not entry.launched)
        self._pump()
        return withdrawn

    def close(self) -> None:
        """Launch nothing more: waiting copies are withdrawn (:class:`CopyWithdrawn`, nothing of them
        ran: their owner aborts their pages, not a fault); launched ones run out (:meth:`drain`)."""
        self.closed = True
        while self.queue:
            entry = self.queue.popleft()
            if not entry.future.done():
                entry.future.set_exception(CopyWithdrawn("the cache is closing: copy not launched"))

    async def drain(self) -> None:
        """Wait until no launched copy is running (bound it with ``asyncio.timeout``)."""
        while self.running:
            await asyncio.wait(set(self.running))

    def _launch(self, entry: PacedLaunch) -> None:
        try:
            inner, event = entry.start()
        except Exception as exc:  # a launch fault: this copy fails, the next may run
            entry.launched = True
            if not entry.future.done():
                entry.future.set_exception(exc)
            return
        entry.launched, entry.event = True, event
        self.in_flight += entry.nbytes
        self.running.add(inner)
        inner.add_done_callback(lambda done: self._landed(entry, done))

    def _landed(self, entry: PacedLaunch, inner: asyncio.Future[None]) -> None:
        self.in_flight -= entry.nbytes
        self.running.discard(inner)
        outer = entry.future
        if not outer.done():
            if inner.cancelled():
                outer.cancel()
            elif (exc := inner.exception()) is not None:
                outer.set_exception(exc)
            else:
                outer.set_result(None)
        self._pump()

    def _pump(self) -> None:
        queue = self.queue
        while queue and not self.closed:
            head = queue[0]
            if head.future.done():  # withdrawn (or cancelled by its owner) while it waited
                queue.popleft()
                continue
            if self.in_flight and self.in_flight + head.nbytes > self.budget:
                return
            queue.popleft()
            self._launch(head)


class Transfers(Protocol):
    """Runs the manager's transfers. ``slots`` are host int64 tensors, validated by the caller."""

    def offload(self, slots: torch.Tensor, page_ids: list[int]) -> Copy:
        """Gather ``slots`` (``len(page_ids) * page_tokens`` of them) into the pages ``page_ids``."""
        ...

    def load(self, page_ids: list[int], slots: torch.Tensor, skip: int, after: Mark = None) -> Copy:
        """Scatter tokens ``[skip, ...)`` of the concatenated pages into ``slots``: behind the engine's
        work queued so far, or only behind ``after`` (a :meth:`mark`) when what it queued since
        never touches ``slots``."""
        ...

    def load_layers(self, page_ids: list[int], slots: torch.Tensor, skip: int, after: Mark = None) -> Copy:
        """:meth:`load` layer by layer, with per-layer readiness where the worker can give it."""
        ...

    def mark(self) -> Mark:
        """The engine's work queued so far, for ``after`` (CUDA: an event on the current stream;
        None where copies are not ordered on this process's streams)."""
        ...

    def order_after(self, events: Sequence[torch.cuda.Event], seen: set[tuple[int, int]] | None = None) -> None:
        """Make the engine's stream wait (on the GPU) for ``events`` of this worker's copies.
        ``seen``: (stream, event) pairs ordered already, skipped and added to (the caller keeps the
        events alive and never records them again while it holds the set)."""
        ...

    async def quiesce(self, copies: Sequence[Copy], *, offload: bool) -> None:
        """Return only when none of ``copies`` still touches the caller's slots (see LocalTransfers)."""
        ...


def failed_copy(exc: BaseException) -> Copy:
    """A copy that failed before it started (a launch fault): it settles as a failed transfer."""
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.set_exception(exc)
    return Copy(future)


class LocalTransfers:
    """The in-process worker: a :class:`PageMover` over the engine's KV buffer and the pool.

    CPU KV buffers copy on the bridge's copy thread (never on the loop); CUDA copies run on the
    mover's side streams and complete through the bridge's waiter threads.
    """

    def __init__(self, mover: PageMover, bridge: CompletionBridge, device: torch.device,
                 pace_bytes: int | None = None) -> None:
        from aiokv.kernels.mover import PACE_BYTES

        self.mover = mover
        self._bridge = bridge
        self._device = device
        self._cuda = device.type == "cuda"
        self.offloads = LaunchPacer(PACE_BYTES if pace_bytes is None else pace_bytes)
        """Paces offloads on CUDA (see :class:`LaunchPacer`). The cache's close closes it first."""

    @property
    def closing(self) -> bool:
        """Whether the cache's close began (it closes :attr:`offloads` first): from then on nothing
        is launched, every new copy is withdrawn at once (:class:`CopyWithdrawn`). A copy launched
        later could outlive the bridge's close (no waiter) and read or write a freed pool."""
        return self.offloads.closed

    def offload(self, slots: torch.Tensor, page_ids: list[int]) -> Copy:
        mover = self.mover
        if self.closing:
            return _withdrawn()
        if not self._cuda:
            return Copy(self._bridge.run_cpu(lambda: _call(mover.offload, slots, page_ids, checked=True)))
        # What the engine wrote so far, also for a launch deferred behind earlier offloads.
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(torch.cuda.current_stream(self._device))
        bridge = self._bridge

        def start() -> tuple[asyncio.Future[None], torch.cuda.Event | None]:
            if bridge.closed:  # nothing may reach the GPU that no one would wait for
                raise RuntimeError("completion bridge is closed")
            try:
                event = mover.offload(slots, page_ids, ready, checked=True)
            except Exception as exc:
                # Failed part-way: gathers queued before the fault may still write the pool pages,
                # which the manager aborts (and reuses) as soon as the copy fails. It fails once they
                # ran; the pacer counts its bytes until then.
                return self._failed_after_queued(exc, Lane.OFFLOAD)
            return bridge.wait(event, Lane.OFFLOAD), event

        entry = self.offloads.run(len(page_ids) * mover.pages[0].nbytes, start)
        return Copy(entry.future, entry.event, launch=entry)

    def _failed_after_queued(
        self, exc: Exception, lane: Lane
    ) -> tuple[asyncio.Future[None], torch.cuda.Event | None]:
        """A CUDA launch that raised part-way (``exc``): the mover made the current stream wait for
        what it had queued before raising; a future that fails with ``exc`` only once that work is
        done on the GPU (the TP executor reports such a failure the same way), and the event it
        waits on. When not even that event can be recorded (a sticky CUDA error: nothing queued
        runs any more), it fails at once."""
        failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            queued = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            queued.record(torch.cuda.current_stream(self._device))
            waited = self._bridge.wait(queued, lane)
        except Exception:
            failed.set_exception(exc)
            return failed, None

        def done(_: asyncio.Future[None]) -> None:
            if not failed.done():
                failed.set_exception(exc)

        waited.add_done_callback(done)
        return failed, queued

    def _fence_failed_load(self) -> None:
        """A CUDA load whose launch raised part-way is reported failed at once, but the copies it
        queued still read pool pages until the GPU runs them (the mover ordered the current stream
        after them): the bridge is handed their end, so that a close waits for them (the bridge
        joins the events it holds) before the pool is unregistered and unmapped under them. A
        sticky error records nothing: then nothing queued runs any more."""
        try:
            queued = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            queued.record(torch.cuda.current_stream(self._device))
            waited = self._bridge.wait(queued, Lane.LOAD)
        except Exception:
            return
        waited.add_done_callback(_retrieve)

    def mark(self) -> Mark:
        if not self._cuda:
            return None
        mark = torch.cuda.Event()  # type: ignore[no-untyped-call]
        mark.record(torch.cuda.current_stream(self._device))
        return mark

    def load(self, page_ids: list[int], slots: torch.Tensor, skip: int, after: Mark = None) -> Copy:
        mover = self.mover
        if self.closing:
            return _withdrawn()
        if not self._cuda:
            return Copy(self._bridge.run_cpu(lambda: _call(mover.load, page_ids, slots, skip, checked=True)))
        try:
            event = mover.load(page_ids, slots, skip, checked=True, after=after)
        except Exception as exc:
            # A launch fault (arguments were validated): settles as a failed copy at once. Unlike an
            # offload's, scatters queued before the fault only read pool pages and write slots past
            # the loaded prefix, and the mover ordered the engine's stream after them.
            self._fence_failed_load()
            return failed_copy(exc)
        if event is not None:
            # Order the engine's stream after the copy on the GPU side; the host does not wait. No
            # await separates this from the launch, so a cancellation cannot fall in between.
            torch.cuda.current_stream(self._device).wait_event(event)
        return Copy(self._bridge.wait(event, Lane.LOAD), event)

    def load_layers(self, page_ids: list[int], slots: torch.Tensor, skip: int, after: Mark = None) -> Copy:
        """A load copied layer 0 of every page first, then layer 1, ... with readiness per layer.

        CUDA: the engine's stream is NOT made to wait here; the caller orders it per layer (and
        after the whole copy before anything else touches the slots). CPU: one future per layer.
        """
        mover = self.mover
        if self.closing:
            return _withdrawn()
        loop = asyncio.get_running_loop()
        if self._cuda:
            try:
                paced = mover.start_layers(page_ids, slots, skip, checked=True, after=after)
            except Exception as exc:  # a launch fault (arguments were validated): settles as a failed copy
                return failed_copy(exc)
            if paced is not None:
                return self._feed(paced, loop)
            try:
                events = mover.load_layers(page_ids, slots, skip, checked=True, after=after)
            except Exception as exc:  # a launch fault (arguments were validated): settles as a failed copy
                self._fence_failed_load()
                return failed_copy(exc)
            assert events is not None
            return Copy(self._bridge.wait(events[-1], Lane.LOAD), events[-1], tuple(events), ordered=False)
        layers = tuple(loop.create_future() for _ in range(mover.kv.layout.num_layers))
        handover = LayerHandover(self._bridge, layers)

        def landed(layer: int) -> None:
            handover.report(layer, True)  # wakes the loop only for a layer it waits on

        future = self._bridge.run_cpu(lambda: _call(mover.load_layers, page_ids, slots, skip, landed, checked=True))

        def settled(_: asyncio.Future[None]) -> None:
            handover.settle()  # withdrawn or failed: what did not land never will

        future.add_done_callback(settled)
        return Copy(future, layer_futures=layers, handover=handover)

    def _feed(self, paced: PacedLayers, loop: asyncio.AbstractEventLoop) -> Copy:
        """Queue a paced layer-wise load on the copy thread (idle on CUDA): it issues the units a few
        ahead of the GPU and resolves layer ``l``'s future as layer ``l``'s event is queued."""
        layers = tuple(loop.create_future() for _ in paced.events)
        # The loop is woken for a layer only once it waits on it (and for the last one, which
        # quiesce waits for); a closed loop: dropped.
        handover = LayerHandover(self._bridge, layers)

        try:
            future = self._bridge.run_cpu(lambda: paced.feed(handover.report))
        except Exception as exc:  # the bridge is closed: nothing was queued
            paced.discard()
            return failed_copy(exc)

        def settled(done: asyncio.Future[None]) -> None:
            if done.cancelled():
                paced.discard()  # withdrawn before it ran (a no-op once it ran)
            handover.settle()  # what was not queued never will be

        future.add_done_callback(settled)
        return Copy(future, paced.events[-1], tuple(paced.events), layers, ordered=False, paced=paced,
                    handover=handover)

    def order_after(self, events: Sequence[torch.cuda.Event], seen: set[tuple[int, int]] | None = None) -> None:
        if not self._cuda:
            return
        stream = torch.cuda.current_stream(self._device)
        if seen is None:
            for event in events:
                stream.wait_event(event)
            return
        key = stream.cuda_stream
        for event in events:
            pair = (key, id(event))
            if pair not in seen:
                stream.wait_event(event)
                seen.add(pair)

    async def quiesce(self, copies: Sequence[Copy], *, offload: bool) -> None:
        """Return only when no copy of a failing or cancelled call still touches the caller's slots.

        A cancel during the wait is waited through and not raised: the caller raises its own error.
        CPU: copies that have not started are withdrawn, the running one (one launch group at
        most) is awaited, also through further cancellations. CUDA: the engine's stream is made to
        wait on every copy's event (loads did at launch), so its later work, such as reusing the
        slots, is ordered after them; the host does not wait.
        """
        if self._cuda:
            paced = [c for c in copies if c.paced is not None]
            for copy in paced:
                assert copy.paced is not None
                copy.paced.stop()
                # Still waiting behind another load on the copy thread: it never runs (discarded).
                self._bridge.withdraw(copy.future)
            # A paced load queues its last events on the copy thread: wait (host, never the GPU)
            # until it queued nothing more, also through further cancellations.
            feeding = {c.layer_futures[-1] for c in paced if not c.layer_futures[-1].done()}
            while feeding:
                try:
                    _, feeding = await asyncio.wait(feeding)
                except asyncio.CancelledError:
                    continue
            stream = torch.cuda.current_stream(self._device)
            # Not launched yet: never will be (all withdrawn before the queue moves on, so none of
            # them starts now). Launched: ordered like any other copy.
            self.offloads.withdraw_all([c.launch for c in copies if c.launch is not None])
            for copy in copies:
                if copy.launch is not None:
                    if copy.launch.launched and copy.launch.event is not None:
                        stream.wait_event(copy.launch.event)
                    continue
                # A paced load's last layer event is queued after all of its work, on every path,
                # before its last layer future resolves (its ``end`` only after: not yet there).
                if copy.event is not None and (offload or not copy.ordered):
                    stream.wait_event(copy.event)
            return
        pending = {c.future for c in copies if not c.future.done() and not self._bridge.withdraw(c.future)}
        while pending:
            try:
                _, pending = await asyncio.wait(pending)
            except asyncio.CancelledError:
                # Still wait. The caller raises its own error (load, offload); a caller without one
                # keeps the cancel itself (StreamCopies.quiesce runs this in a task of its own).
                continue


def _retrieve(future: asyncio.Future[None]) -> None:
    """Read a future's outcome nobody awaits (no "exception was never retrieved")."""
    if not future.cancelled():
        future.exception()


def _withdrawn() -> Copy:
    return failed_copy(CopyWithdrawn("the cache is closing: copy not launched"))


def _call(fn: Callable[..., object], *args: object, **kwargs: object) -> None:
    fn(*args, **kwargs)


def _resolve_layer(future: asyncio.Future[bool], landed: bool) -> None:
    if not future.done():
        future.set_result(landed)
