"""Rank-side readiness of layered loads: which layers of which job are in this rank's KV buffer.

The copy thread (or the worker's loop) marks layers as they land; the engine's rank process waits
on them from any thread: blocking (:meth:`LayerProgress.wait`, a synchronous model runner) or on
its own event loop (:meth:`LayerProgress.wait_async`). A job the engine asks about before its spec
arrived gets a placeholder that the spec's arrival fills (specs arrive in job-id order on one
connection, so a later spec's arrival means the job will never come: the placeholder then fails).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Sequence

import torch

RETAINED_JOBS = 1024
"""Ended layered jobs whose outcome a table keeps for late waiters (older ones are forgotten)."""


class LayerProgress:
    """One layered job on one rank. Thread-safe: marked from the copy thread, waited on anywhere.

    ``landed`` counts the layers the engine may use, in order. CPU: layers in the buffer. CUDA:
    layers whose event is queued (``events``, one per layer, the last ending the whole copy): the
    engine's stream waits on event ``l`` on the GPU, which a paced load queues only as it goes.
    """

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self._cond = threading.Condition()
        self.landed = 0
        self.events: tuple[torch.cuda.Event, ...] = ()
        self.arrived = False
        """Whether the spec reached this rank (False: a placeholder for an early waiter)."""
        self.ended = False
        """The copy is over (or will never run); layers not landed by then never land."""
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[bool], int]] = []

    # -- the copy's side ------------------------------------------------------------------------

    def arrive(self) -> None:
        with self._cond:
            self.arrived = True

    def mark(self, landed: int) -> None:
        """Layers ``0 .. landed-1`` are in the buffer (CPU) or their events are queued (CUDA)."""
        with self._cond:
            self.landed = max(self.landed, landed)
            self._cond.notify_all()
            self._wake()

    def launch(self, events: Sequence[torch.cuda.Event], issued: int | None = None) -> None:
        """The CUDA copy started: event ``l`` completes when layers ``0..l`` landed. ``issued``: how
        many events are queued already (None: all); a paced load :meth:`mark` s the rest as it
        queues them (an event not queued yet would complete at once on the GPU)."""
        with self._cond:
            self.events = tuple(events)
            self.landed = max(self.landed, len(self.events) if issued is None else issued)
            self._cond.notify_all()
            self._wake()

    def end(self) -> None:
        """The copy is over (its report went out) or will never run."""
        with self._cond:
            self.ended = True
            self._cond.notify_all()
            self._wake()

    # -- the engine's side ----------------------------------------------------------------------

    def _state(self, layer: int) -> bool | None:
        """True: the layer landed (or its event is queued); False: it never will; None: not yet."""
        if self.landed > layer:
            return True
        return False if self.ended else None

    def wait(self, layer: int, timeout: float | None = None) -> bool:
        """Block until :meth:`_state` is known; raises ``TimeoutError`` after ``timeout`` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._state(layer) is not None, timeout):
                raise TimeoutError(f"layer {layer} not ready within {timeout} s")
            state = self._state(layer)
            assert state is not None
            return state

    async def wait_async(self, layer: int) -> bool:
        """:meth:`wait` on the running event loop (never blocks it)."""
        loop = asyncio.get_running_loop()
        with self._cond:
            state = self._state(layer)
            if state is not None:
                return state
            future: asyncio.Future[bool] = loop.create_future()
            self._waiters.append((loop, future, layer))
        try:
            return await future
        finally:
            with self._cond:
                self._waiters = [w for w in self._waiters if w[1] is not future]

    def _wake(self) -> None:
        # Under the lock: resolve the waiters whose layer is decided, each on its own loop.
        keep = []
        for loop, future, layer in self._waiters:
            state = self._state(layer)
            if state is None:
                keep.append((loop, future, layer))
            else:
                try:
                    loop.call_soon_threadsafe(_resolve, future, state)
                except RuntimeError:
                    pass  # that loop is closed: nobody waits any more
        self._waiters = keep


def _resolve(future: asyncio.Future[bool], state: bool) -> None:
    if not future.done():
        future.set_result(state)


class LayerTable:
    """The layered jobs of one attached session (one pool epoch), by job id. Thread-safe."""

    def __init__(self, epoch: int, layers: int, first_job: int = 0) -> None:
        self.epoch = epoch
        self.layers = layers
        self._lock = threading.Lock()
        self._jobs: collections.OrderedDict[int, LayerProgress] = collections.OrderedDict()  # arrived
        self._waiting: dict[int, LayerProgress] = {}  # placeholders: asked for, not arrived
        # Highest job id that arrived (any spec), or was issued before this session (``first_job``,
        # the manager's WELCOME): a session of a rank attached again to the same pool never gets
        # the specs of jobs issued before it, and no later spec may come to end a wait for them.
        self._highest = max(0, first_job - 1)
        self._gone: collections.OrderedDict[int, None] = collections.OrderedDict()  # withdrawn, never sent
        self._closed = False

    def arrived(self, job_id: int, layered: bool) -> LayerProgress | None:
        """A spec arrived (in job-id order): fail placeholders of earlier jobs that never came;
        returns the progress of a layered job. Cheap for a plain spec with nobody waiting."""
        with self._lock:
            self._highest = max(self._highest, job_id)
            stale = [j for j in self._waiting if j < job_id] if self._waiting else []
            ended = [self._waiting.pop(j) for j in stale]
            progress = None
            if layered:
                progress = self._waiting.pop(job_id, None) or LayerProgress(self.layers)
                progress.arrive()
                self._jobs[job_id] = progress
                self._forget()
        for placeholder in ended:
            placeholder.end()
        return progress

    def withdrawn(self, job_id: int) -> None:
        """Job ``job_id`` was withdrawn unsent (a WITHDRAWN frame): it never arrives, so its
        placeholder ends now, and a later wait for it ends at once. Other placeholders stay: an
        earlier job may still be held for room and arrive."""
        with self._lock:
            placeholder = self._waiting.pop(job_id, None)
            self._gone[job_id] = None
            while len(self._gone) > RETAINED_JOBS:
                self._gone.popitem(last=False)
        if placeholder is not None:
            placeholder.end()

    def progress(self, job_id: int) -> LayerProgress:
        """The job's progress; a placeholder for one not arrived yet; an ended one for a job that
        arrived but was not layered here, or was forgotten (its layers are not known to be ready)."""
        with self._lock:
            progress = self._jobs.get(job_id) or self._waiting.get(job_id)
            if progress is None:
                progress = LayerProgress(self.layers)
                if job_id <= self._highest or self._closed or job_id in self._gone:
                    progress.end()
                else:
                    self._waiting[job_id] = progress
            return progress

    def close(self) -> None:
        """The session ended: every job not over never lands more."""
        with self._lock:
            self._closed = True
            pending = [*self._jobs.values(), *self._waiting.values()]
            self._waiting.clear()
        for progress in pending:
            progress.end()

    def _forget(self) -> None:
        # Oldest first: drop ended jobs beyond what late waiters may still ask about.
        while len(self._jobs) > RETAINED_JOBS:
            job_id, oldest = next(iter(self._jobs.items()))
            if not oldest.ended:
                return
            del self._jobs[job_id]


def wait_all(progress: Sequence[LayerProgress], layer: int, timeout: float | None) -> bool:
    """Block until ``layer`` is decided for every job; True when it landed (or is queued) for all.
    Raises ``TimeoutError`` after ``timeout`` seconds in all."""
    deadline = None if timeout is None else time.monotonic() + timeout
    ok = True
    for p in progress:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ok = p.wait(layer, left) and ok
    return ok


async def wait_all_async(progress: Sequence[LayerProgress], layer: int) -> bool:
    """:func:`wait_all` on the running loop."""
    return all([await p.wait_async(layer) for p in progress])
