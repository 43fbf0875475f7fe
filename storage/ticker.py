"""`Ticker`: the pause of a periodic task of the disk tier (the follower's looks, the writer's
checks: :mod:`.followpath`), cut short on demand."""

from __future__ import annotations

import asyncio


class Ticker:
    """A pause of a periodic task: ``interval`` seconds, or less once :meth:`soon` is called."""

    def __init__(self) -> None:
        self._wake: asyncio.Future[None] | None = None
        self._now = False

    def soon(self) -> None:
        """The next pause ends now (the one in progress, else the next one is skipped)."""
        self._now = True
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def wait(self, interval: float) -> None:
        if self._now:
            self._now = False
            return
        loop = asyncio.get_running_loop()
        wake = self._wake = loop.create_future()
        timer = loop.call_later(interval, _wake, wake)
        try:
            await wake
        finally:
            timer.cancel()
            self._wake = None
            self._now = False


def _wake(wake: asyncio.Future[None]) -> None:
    if not wake.done():
        wake.set_result(None)
