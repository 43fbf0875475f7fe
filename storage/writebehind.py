"""The write-behind queue: pages to persist, bounded, drained by a few worker tasks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiokv.keys import PageKey
from aiokv.pagetable import PageHandle

log = logging.getLogger(__name__)


class WriteBehind:
    """A bounded queue of ``(key, handle)``; each handle is a reference the queue owns.

    ``workers`` tasks call ``write(key, handle)`` for each entry, then ``release(handle)``; a
    failing write is reported to ``on_error`` and never raises into the loop. Create inside the loop.
    """

    def __init__(self, depth: int, workers: int, write: Callable[[PageKey, PageHandle], Awaitable[object]],
                 release: Callable[[PageHandle], None], on_error: Callable[[], None]) -> None:
        self._queue: asyncio.Queue[tuple[PageKey, PageHandle]] = asyncio.Queue(depth)
        self._write = write
        self._release = release
        self._on_error = on_error
        self._workers = [asyncio.create_task(self._worker()) for _ in range(workers)]

    def put_nowait(self, key: PageKey, handle: PageHandle) -> bool:
        """Queue and take ownership of ``handle``; False (ownership not taken) when full."""
        try:
            self._queue.put_nowait((key, handle))
        except asyncio.QueueFull:
            return False
        return True

    async def put(self, key: PageKey, handle: PageHandle) -> None:
        """Wait for room, then queue (ownership is taken only when this returns)."""
        await self._queue.put((key, handle))

    def qsize(self) -> int:
        """Entries waiting (not counting those a worker is writing)."""
        return self._queue.qsize()

    async def join(self) -> None:
        """Wait until every entry queued so far is written or dropped."""
        await self._queue.join()

    async def aclose(self, drain: bool) -> int:
        """Write out (``drain``) or drop what is queued, then stop the workers; returns the count dropped."""
        dropped = 0
        if not drain:
            while not self._queue.empty():
                _key, handle = self._queue.get_nowait()
                dropped += 1
                self._release(handle)
                self._queue.task_done()
        await self._queue.join()
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        return dropped

    async def _worker(self) -> None:
        while True:
            key, handle = await self._queue.get()
            try:
                await self._write(key, handle)
            except Exception:
                self._on_error()
            finally:
                self._release(handle)
                self._queue.task_done()
