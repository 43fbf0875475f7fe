"""`Cancels`: the rank side's one idiom for a teardown that a cancel must not cut short.

A cancel lands at whichever await of a teardown runs; each step of a rank's close (drain the
copies, join a warm-up, unmap the pool, close the bridge) must still run to its end, and the
cancel propagate after the last one. Used by the worker's session and by the executor's close.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class Cancels:
    """Runs the steps of a teardown to their end even when its task is cancelled meanwhile, and
    remembers the cancel: :meth:`raise_if_cancelled` raises it after the last step. (A cancel
    lands at whichever await runs: a step cut short left the link closing on a running copy, the
    pool mapped or a warm-up thread unjoined.)"""

    def __init__(self) -> None:
        self.cancelled = False

    async def outlast(self, step: Awaitable[T]) -> T:
        """Await ``step`` to its end through any number of cancels; returns or raises what it does."""
        future = asyncio.ensure_future(step)
        while not future.done():
            try:
                await asyncio.wait({future})
            except asyncio.CancelledError:
                self.cancelled = True
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
