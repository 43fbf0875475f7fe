"""Outcomes of the threads backend's workers, handed to the loop in batches.

A worker that finished a job posts its outcome here; the first post after a drain schedules one
:meth:`Outcomes.drain` with ``call_soon_threadsafe`` (a self-pipe write: a GIL release in the
worker, and a wake-up of the loop), later posts only append until that drain has begun. Pages of a
read group that end while the loop is busy or waiting for the GIL (beside an engine thread running
Python: up to a switch interval, 5 ms) so reach it in one wake-up, not one each (as
``aiokv/cuda.py``'s bridge inbox does for CPU copies).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import threading
from collections.abc import Callable
from typing import ParamSpec

log = logging.getLogger(__name__)

P = ParamSpec("P")

Outcome = tuple["asyncio.Future[object]", object, BaseException | None]
"""A job's future, its result and its error (None when it succeeded)."""


def again_after_interrupt(callback: Callable[P, None]) -> Callable[P, None]:
    """``callback`` (run on the loop, its consumers ignoring a second call) run again in the next
    turn when a signal's KeyboardInterrupt (any BaseException not an Exception) leaves it; the
    interrupt goes on. A worker's outcome is then delivered at least once, never lost."""

    @functools.wraps(callback)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            callback(*args, **kwargs)
        except BaseException as exc:
            if not isinstance(exc, Exception):
                asyncio.get_running_loop().call_soon(functools.partial(run, *args, **kwargs))
            raise

    return run


def future_error(error: BaseException) -> BaseException:
    """``error`` as a future can take it: a future refuses a ``StopIteration`` (or a subclass) with
    ``TypeError``, which, raised out of a drain, would leave the rest of its batch unsettled for
    good; it becomes a ``RuntimeError`` caused by it, as PEP 479 does in a generator. (Also used by
    ``aiokv/cuda.py``'s inbox.)"""
    if not isinstance(error, StopIteration):
        return error
    wrapped = RuntimeError(f"a job raised {type(error).__name__}")
    wrapped.__cause__ = error
    return wrapped


def settle(future: asyncio.Future[object], result: object, error: BaseException | None) -> None:
    """On the loop: a worker's outcome into its job's future (unless the job was cancelled, or it
    was settled already: a second call does nothing)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(future_error(error))
    else:
        future.set_result(result)


class Outcomes:
    """The outcomes waiting for one loop (see the module docstring). Workers :meth:`post`."""

    __slots__ = ("_lock", "_outcomes", "_pending", "loop", "wakes")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._outcomes: collections.deque[Outcome] = collections.deque()
        self._pending = False
        # Several workers post: the flag's check-and-set is atomic under it, so two of them never
        # both schedule a drain for one batch (uncontended, taking it keeps the GIL).
        self._lock = threading.Lock()
        self.wakes = 0
        """Drains scheduled so far (each a ``call_soon_threadsafe``: one loop wake-up)."""

    def post(self, future: asyncio.Future[object], result: object, error: BaseException | None) -> None:
        """From a worker: ``future``'s job ended with ``result`` or ``error``."""
        with self._lock:
            self._outcomes.append((future, result, error))
            if self._pending:
                return  # the drain already scheduled has not begun: it takes this one too
            self._pending = True
            self.wakes += 1
        try:
            self.loop.call_soon_threadsafe(self.drain)
        except RuntimeError:  # the loop is closed: nobody waits any more
            log.debug("disk I/O finished after its loop closed")
            with self._lock:
                self._pending = False
                self._outcomes.clear()

    def drain(self) -> None:
        """On the loop: settle every outcome posted so far, in the order posted."""
        with self._lock:
            # Cleared before the batch is taken: a post from here on schedules a drain of its own.
            self._pending = False
            batch, self._outcomes = self._outcomes, collections.deque()
        _settle_from(list(batch), 0)


def _settle_from(batch: list[Outcome], first: int) -> None:
    """Settle ``batch[first:]``. A signal's KeyboardInterrupt leaves none unsettled: the rest, the
    one it interrupted included (settling is idempotent), are settled in the next turn."""
    i = first
    try:
        for i in range(first, len(batch)):
            future, result, error = batch[i]
            settle(future, result, error)
    except BaseException as exc:
        if not isinstance(exc, Exception):
            asyncio.get_running_loop().call_soon(_settle_from, batch, i)
        raise
