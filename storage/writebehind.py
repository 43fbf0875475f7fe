"""The write-behind queue: pages to persist, bounded, drained by a few worker tasks."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable

from aiokv.keys import PageKey
from aiokv.pagetable import PageHandle

from .memory import drop_cancel
from .uring import not_started

log = logging.getLogger(__name__)


class WriteBehind:
    """A bounded queue of ``(key, handle)``; each handle is a reference the queue owns.

    ``workers`` tasks call ``write(key, handle)`` for each entry, then ``release(handle)``; a
    failing write is reported to ``on_error`` and never raises into the loop. Create inside the loop.
    Workers a cancel ended that the queue did not ask for (a loop-wide cancel) are replaced by the
    next ``put``, ``put_nowait``, ``join`` or ``aclose``, and by a ``put`` or ``join`` already
    waiting when one ends; counted in :attr:`workers_replaced`.
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
        self.workers_replaced = 0
        """Workers a cancel this queue did not ask for ended (a loop-wide cancel: an application's
        SIGTERM handler cancelling every task of the loop) that a new one replaced."""
        self._putters: collections.deque[asyncio.Future[None]] = collections.deque()
        """Puts waiting for room, first come first served; each is woken by a worker's take (or a
        close's drop) of an entry. Not ``Queue.put``'s own wait: that one could not also wait for
        the workers' end (see :meth:`put`)."""
        self._count = workers
        self._stopped = False  # aclose() stops the workers: none is replaced from then on
        self._workers = [self._start_worker() for _ in range(workers)]

    def put_nowait(self, key: PageKey, handle: PageHandle) -> bool:
        """Queue and take ownership of ``handle``; False (ownership not taken) when full or closed."""
        if self._stopped:
            return False
        self._revive()
        try:
            self._queue.put_nowait((key, handle))
        except asyncio.QueueFull:
            return False
        return True

    async def put(self, key: PageKey, handle: PageHandle) -> None:
        """Wait for room, then queue (ownership is taken only when this returns, in the step that
        queued it). ``RuntimeError`` once closed.

        The wait also ends when a worker ends: workers a cancel ended that this queue did not ask
        for (a loop-wide cancel that spared the caller) are replaced, as :meth:`join` does. Before
        (review 263's leftover, helper 271), the wait in ``Queue.put`` noticed nothing: with every
        worker gone, no entry was taken and the put waited until another call replaced them, for
        ever if none came."""
        if self._stopped:
            raise RuntimeError("the write-behind queue is closed")
        self._revive()
        while self._queue.full():
            room: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._putters.append(room)
            try:
                await asyncio.wait({room, *(w for w in self._workers if not w.done())},
                                   return_when=asyncio.FIRST_COMPLETED)
            except BaseException:
                if room.done() and not room.cancelled() and not self._queue.full():
                    self._wake_putter()  # the room this caller was woken for goes to the next one
                raise
            finally:
                if not room.done():  # (a worker ended, or this caller was cancelled)
                    room.cancel()
                    self._putters.remove(room)
            if self._stopped:
                raise RuntimeError("the write-behind queue is closed")
            self._revive()  # (a worker ended: replaced; woken for room: nothing to do)
        self._queue.put_nowait((key, handle))

    def qsize(self) -> int:
        """Entries waiting (not counting those a worker is writing)."""
        return self._queue.qsize()

    async def join(self) -> None:
        """Wait until every entry queued so far is written or dropped.

        Workers a cancel ended that this queue did not ask for are replaced first, and again when
        one ends while this waits (a loop-wide cancel that spared the caller): before, nothing
        replaced them and this waited for ever on what they left queued (review 263)."""
        self._revive()
        if not self._queue.qsize() and not self.writing:
            # Nothing queued or taken: Queue.join returns without a loop turn, as before (a
            # flush between two calls let nothing else run: tests/cache/test_adv_bad_input.py).
            await self._queue.join()
            return
        while True:
            self._revive()
            joined = asyncio.ensure_future(self._queue.join())
            try:
                await asyncio.wait({joined, *(w for w in self._workers if not w.done())},
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                joined.cancel()
            if joined.done() and not joined.cancelled():
                return
            # A worker ended, or the same cancel cut the wait's own task: look again.

    def _wake_putter(self) -> None:
        """An entry left the queue: the first put still waiting for room is woken."""
        while self._putters:
            room = self._putters.popleft()
            if not room.done():
                room.set_result(None)
                return

    def _revive(self) -> None:
        """Replace the workers that ended (a loop-wide cancel; never after aclose began stopping them).

        Called by put, put_nowait, join and aclose only, never from a worker's done callback: a
        callback respawned workers at every cancel, for ever, under a canceller that cancels every
        task until none is left (and after ``asyncio.run`` had cancelled them for its loop's end)."""
        if self._stopped:
            return
        alive: list[asyncio.Task[None]] = []
        for worker in self._workers:
            if not worker.done():
                alive.append(worker)
            elif worker.cancelled():
                self.workers_replaced += 1
            elif isinstance(exc := worker.exception(), Exception):  # retrieved: no "never retrieved"
                log.error("write-behind worker failed; replaced", exc_info=exc)
            # (else an interrupt's KeyboardInterrupt: that worker replaced itself)
        missing = self._count - len(alive)
        if missing > 0:
            alive.extend(self._start_worker() for _ in range(missing))
        self._workers = alive

    async def aclose(self, drain: bool) -> int:
        """Write out (``drain``) or drop what is queued, then stop the workers; returns the count dropped.

        Puts waiting for room may still queue until the workers stop (each woken by a take, or
        refused ``RuntimeError`` once stopped): what they queued is written or dropped too."""
        dropped = 0
        while True:
            if not drain:
                while not self._queue.empty():
                    _key, handle = self._queue.get_nowait()
                    dropped += 1
                    self._release(handle)
                    self._queue.task_done()
                    self._wake_putter()
            # Workers a loop-wide cancel ended (this close cut too, run again): new ones take their
            # place, else the join waited for ever on what they left queued (reviews 205, 263).
            await self.join()
            if not self._queue.qsize() and not self.writing:
                break
            # Review 278: the join was woken as the last page taken was done, but a put that
            # page's take woke (its write needing no I/O: a page stored already, a read-only
            # tier's refusal) ran first and queued its page; stopped now, that page stayed
            # queued for good, its put returned and its reference never released.
        self._stopped = True  # (in the step of the look: no put queues from here on)
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        return dropped

    def _start_worker(self) -> asyncio.Task[None]:
        worker = asyncio.get_running_loop().create_task(self._worker())
        # A worker a cancel ended lets go of its CancelledError at once: kept (CPython 3.11 keeps
        # it until retrieved), its traceback's frames held the cut write's job and its export of
        # the pool's memory, and the pool's close could not unmap the segment (review 302).
        worker.add_done_callback(drop_cancel)
        return worker

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
                self._wake_putter()  # (an interrupt here: this worker's end wakes the put too)
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
                self._workers.append(self._start_worker())
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
