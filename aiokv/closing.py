"""Awaiting a close that runs in a task of its own, across loop-wide cancels."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def await_close(running: Callable[[], asyncio.Future[None]]) -> None:
    """Await the close ``running()`` returns (its task, made on the first call), shielded: a
    caller's own cancel stops only its wait (raised), the close goes on.

    A loop-wide cancel (an application's SIGTERM handler cancelling every task, a loop's shutdown)
    also ends the close's own task: every later call then raised that cancel at once, and what the
    close frees was never freed (review 205). When the task ended cancelled while this call was not
    cancelled, ``running()`` is asked again: it must then make a new task (each step of the close
    may run twice)."""
    me = asyncio.current_task()
    cancels = me.cancelling() if me is not None else 0
    while True:
        task = running()
        try:
            await asyncio.shield(task)
            return
        except asyncio.CancelledError:
            if not task.cancelled() or me is None or me.cancelling() > cancels:
                raise
