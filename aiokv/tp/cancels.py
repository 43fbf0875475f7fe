"""`Cancels`: the rank side's one idiom for a teardown that a cancel must not cut short.

A cancel lands at whichever await of a teardown runs; each step of a rank's close (drain the
copies, join a warm-up, unmap the pool, close the bridge) must still run to its end, and the
cancel propagate after the last one. Used by the worker's session and by the executor's close.

A loop's shutdown (``asyncio.run`` ending) cancels every task left once, a step's own task too,
and so does an application's SIGTERM handler that cancels every task: a teardown step is a plain
future (:func:`in_thread` for a thread's work, ``RankExecutor.drained``), or a coroutine awaited in
the caller's own task, which :meth:`Cancels.outlast` keeps going through any number of cancels.
A step's task run anew a bounded number of times (``Cancels.finish``, review 202) was exhausted by
three loop-wide cancels under a running copy (review 203) and was removed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class Cancels:
    """Runs the steps of a teardown to their end even when its task is cancelled meanwhile, and
    remembers the cancel: :meth:`raise_if_cancelled` raises it after the last step. (A cancel
    lands at whichever await runs: a step cut short left the link closing on a running copy, the
    pool mapped or a warm-up thread unjoined.)"""

    def __init__(self) -> None:
        self.cancelled = False

    async def outlast(self, step: Awaitable[T], on_cancel: Callable[[], None] | None = None) -> T:
        """Await ``step`` to its end through any number of cancels of this task, calling
        ``on_cancel()`` at each (a step may bound itself from the first); returns or raises
        what it does (``CancelledError`` when the step's own task was cancelled, as a loop-wide cancel
        does to the task a coroutine step runs in: a step that must outlast those is a plain future,
        or its caller makes it anew, as the farewell's tries are)."""
        future = asyncio.ensure_future(step)
        while not future.done():
            try:
                await asyncio.wait({future})
            except asyncio.CancelledError:
                self.cancelled = True
                if on_cancel is not None:
                    on_cancel()
        return future.result()

    async def settle(self, step: Awaitable[None]) -> None:
        """Await ``step``, which itself runs to its end through a cancel and raises it after
        (``RankWarmUp.aclose``), and remember that cancel instead. Awaited in this task: no task
        of its own, and a probe of this task's await chain sees the step."""
        try:
            await step
        except asyncio.CancelledError:
            self.cancelled = True

    def raise_if_cancelled(self) -> None:
        if self.cancelled:
            raise asyncio.CancelledError


def in_thread(fn: Callable[[], T]) -> asyncio.Future[T]:
    """``fn()`` on the loop's default executor, as a plain future (no task): awaited through
    :meth:`Cancels.outlast`, ``asyncio.to_thread`` ran in a task of its own, which a loop's shutdown
    cancelled while the thread went on (an unmap or a reclaim still running, reported over)."""
    return asyncio.get_running_loop().run_in_executor(None, fn)
