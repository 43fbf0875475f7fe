"""The write-behind queue: pages to persist, bounded, drained by a few worker tasks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiokv.keys import PageKey
from aiokv.pagetable import PageHandle

from .uring import not_started

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
        self.writing = 0
        """Pages a worker took from the queue and has not released yet: waiting for an I/O slot,
        being written, or done. They are in neither :meth:`qsize` nor the tier's I/O slots until the
        write holds one, yet their references come back: a caller waiting for pool room must count
        them (review 166: loads gave up for room in that gap)."""
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
        if not self._queue.empty() or self.writing:
            # Workers a loop-wide cancel ended (this close cut too, run again): new ones take
            # their place, else join() waited for ever on what they left queued (review 205).
            self._workers = [w if not w.done() else asyncio.create_task(self._worker()) for w in self._workers]
        await self._queue.join()
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        return dropped

    async def _worker(self) -> None:
        """Write what is queued, each page's reference released and the queue told once it is done.

        A KeyboardInterrupt (a signal) in a write ends this task, as asyncio ends a task then (the
        loop stops): the page it had is finished here (its write, holding a reference of its own,
        goes on or settled itself) and a new worker takes this one's place. Before, the worker was
        gone: once each had met one, queued pages stayed queued and ``join`` (``flush``, the
        draining close) hung."""
        taken: list[object] | None = None
        try:
            while True:
                key, handle = await self._queue.get()
                taken = [handle, 0]  # no call since the get: see _finish
                self.writing += 1
                try:
                    await self._write(key, handle)
                except Exception:
                    self._on_error()
                self._finish(taken)
                taken = None
        except BaseException as exc:
            if taken is not None:
                self._finish(taken)  # (cancelled: the loop is going away; or interrupted)
            if not isinstance(exc, Exception | asyncio.CancelledError):  # (a signal's KeyboardInterrupt)
                self._workers.append(asyncio.get_running_loop().create_task(self._worker()))
            raise

    def _finish(self, taken: list[object]) -> None:
        """A page a worker took is done: its reference released, then the queue told. ``taken`` is
        ``[handle, parts done]``; run again after an interrupt it does what is left, each part once
        (a part an interrupt left at its entry is done again)."""
        if taken[1] == 0:
            handle = taken[0]
            assert isinstance(handle, PageHandle)
            try:
                self._release(handle)
            except BaseException as exc:
                if not not_started(self._release, exc):
                    taken[1] = 1
                    self.writing -= 1
                raise
            taken[1] = 1
            self.writing -= 1
        if taken[1] == 1:
            done = self._queue.task_done
            try:
                done()
            except BaseException as exc:
                if not not_started(done, exc):
                    taken[1] = 2
                raise
            taken[1] = 2
