"""A rank worker's kernel warm-up: :func:`aiokv.kernels.warmup.warm_up` of one session's mover.

As in :class:`aiokv.KVCache`: on a path that launches Triton kernels, the warm-up runs on a thread
of its own (started without the loop waiting for it), compiles and loads every kernel variant the
session's copies use, and the session runs no spec before the variants of page-aligned copies are
warm (an await, never a loop stall). The session's end stops it between two launches and waits for
it before the pool is unmapped; a failure is counted and copies go on (compiling what they launch).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from aiokv.kernels import TransferPath
from aiokv.kernels.mover import PageMover
from aiokv.kernels.warmup import WarmUp, warm_up
from aiokv.pool import run_in_new_thread

log = logging.getLogger(__name__)


def _nothing(_: object) -> None:
    """A warm-up's result has nothing to dispose of."""


def _set(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class RankWarmUp:
    """The warm-up of ``mover`` (None: nothing to warm). Create it on the session's loop.

    ``first``: pool registrations the DIRECT plan needs (its first chunk; CUDA), waited for on the
    warm-up's thread. ``on_failed(error)`` is called on the loop when the warm-up raised.
    """

    def __init__(
        self,
        mover: PageMover | None,
        on_failed: Callable[[BaseException], None],
        first: Sequence[concurrent.futures.Future[Any]] = (),
    ) -> None:
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[None] = loop.create_future()
        """Resolved once the variants of page-aligned copies are warm, or the warm-up ended."""
        self._stop = threading.Event()
        self._on_failed = on_failed
        self._thread: asyncio.Future[WarmUp] | None = None
        if mover is None or mover.effective_path is TransferPath.REFERENCE:
            self.ready.set_result(None)
            return

        def on_ready() -> None:  # on the warm-up thread
            try:
                loop.call_soon_threadsafe(_set, self.ready)
            except RuntimeError:
                pass  # the loop is closed: nobody waits any more

        work = functools.partial(self._run, mover, list(first), on_ready)
        self._thread = run_in_new_thread(work, "aiokv-warmup", _nothing)
        self._thread.add_done_callback(self._ended)

    def _run(self, mover: PageMover, first: list[concurrent.futures.Future[Any]],
             on_ready: Callable[[], None]) -> WarmUp:
        # Without its first registration the pool is not mapped for the kernels yet and the
        # warm-up would leave the DIRECT plan out (a failed registration: it does so anyway).
        pending = set(first)
        while pending and not self._stop.is_set():
            _, pending = concurrent.futures.wait(pending, timeout=0.05)
        return warm_up(mover, self._stop, on_ready)

    def _ended(self, done: asyncio.Future[WarmUp]) -> None:
        _set(self.ready)
        if done.cancelled():
            return
        error = done.exception()
        if error is not None:
            log.warning("rank kernel warm-up failed (%r): copies compile what they launch, on the loop", error)
            self._on_failed(error)

    @property
    def result(self) -> WarmUp | None:
        """What the warm-up did, once it ended (None: running, nothing to warm, or it failed)."""
        thread = self._thread
        if thread is None or not thread.done() or thread.cancelled() or thread.exception() is not None:
            return None
        return thread.result()

    async def wait_ended(self) -> None:
        """Wait until the warm-up's thread is done (at once when there is none)."""
        if self._thread is not None:
            await asyncio.wait({self._thread})

    def stop(self) -> None:
        """Ask the warm-up to stop at its next launch (a helper process is killed)."""
        self._stop.set()

    async def aclose(self) -> None:
        """Stop the warm-up between two launches and wait until its thread is done (also when
        cancelled meanwhile: then ``CancelledError`` is raised after). Idempotent."""
        self._stop.set()
        thread = self._thread
        if thread is None:
            return
        cancelled = False
        while not thread.done():
            try:
                await asyncio.wait({thread})
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError
