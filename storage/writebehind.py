"""The write-behind queue: pages to persist, bounded, at most ``workers`` writes in flight."""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from collections.abc import Awaitable, Callable

from aiokv.keys import PageKey
from aiokv.pagetable import PageHandle

log = logging.getLogger(__name__)


class WriteBehind:
    """A bounded queue of ``(key, handle)``; each handle is a reference the queue owns.

    Up to ``workers`` entries are written at once: ``write(key, handle)`` starts one and returns an
    awaitable of its end, then ``release(handle)``; a failing write is reported to ``on_error`` and
    never raises into the loop. Up to ``depth`` more entries wait for a turn. Create inside the loop.

    Driven by callbacks, not worker tasks: an entry is started as it is queued (or as an earlier
    write ends) and its end is a done-callback on the future ``write`` returns. Worker tasks cost
    the loop, per page, a queue hand-over, a coroutine for the write and a task step to resume it
    (~10% of the loop's CPU per page written). A ``write`` that returns a coroutine runs in a task.
    """

    def __init__(self, depth: int, workers: int, write: Callable[[PageKey, PageHandle], Awaitable[object]],
                 release: Callable[[PageHandle], None], on_error: Callable[[], None]) -> None:
        self._depth = depth
        self._workers = workers
        self._write = write
        self._release = release
        self._on_error = on_error
        self._waiting: collections.deque[tuple[PageKey, PageHandle]] = collections.deque()
        self._writing = 0  # entries started and not ended
        self._putters: collections.deque[asyncio.Future[None]] = collections.deque()  # put() waiting for room
        self._idle = asyncio.Event()  # set while no entry is waiting or being written (join)
        self._idle.set()
        self._closed = False

    def put_nowait(self, key: PageKey, handle: PageHandle) -> bool:
        """Queue and take ownership of ``handle``; False (ownership not taken) when full or closed."""
        if self._closed or not self._room():
            return False
        self._take(key, handle)
        return True

    async def put(self, key: PageKey, handle: PageHandle) -> None:
        """Wait for room (in turn with other callers of ``put``), then queue; ownership is taken only
        when this returns. ``RuntimeError`` once closed (ownership not taken)."""
        first = True
        while not self._closed and ((first and self._putters) or not self._room()):
            room: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            if first:
                self._putters.append(room)
            else:
                self._putters.appendleft(room)  # woken, yet the room was taken meanwhile: keeps its turn
            first = False
            try:
                await room
            except asyncio.CancelledError:
                if room in self._putters:
                    self._putters.remove(room)
                elif room.done() and not room.cancelled():
                    self._wake_putter()  # the room it was handed goes to the next one
                raise
        if self._closed:
            raise RuntimeError("the write-behind is closed")
        self._take(key, handle)

    def qsize(self) -> int:
        """Entries the queue holds: waiting, or being written (each holds its pool page until its
        write ends). A write starts as it is queued, so counting only those waiting would hide the
        pages a full pool waits for (the manager's wait for room looks at this)."""
        return len(self._waiting) + self._writing

    async def join(self) -> None:
        """Wait until every entry queued so far is written or dropped."""
        await self._idle.wait()

    async def aclose(self, drain: bool) -> int:
        """Write out (``drain``) or drop what is queued and wait for the writes in flight; returns the
        count dropped. Nothing is queued afterwards (``put`` raises ``RuntimeError``)."""
        self._closed = True
        while self._putters:
            room = self._putters.popleft()
            if not room.done():
                room.set_result(None)  # it finds the queue closed
        dropped = 0
        if not drain:
            while self._waiting:
                _key, handle = self._waiting.popleft()
                dropped += 1
                self._release(handle)
            self._settle_idle()
        await self._idle.wait()
        # One loop turn before the tier's close goes on, as the worker tasks' cancellation gave it:
        # without it a spare file made during the last write outlives the close (test_disk_spares;
        # the tier's close of spares depends on a turn here: see the session's report).
        await asyncio.sleep(0)
        return dropped

    # -- internals --------------------------------------------------------------------------------

    def _room(self) -> bool:
        return self._writing < self._workers or len(self._waiting) < self._depth

    def _take(self, key: PageKey, handle: PageHandle) -> None:
        self._idle.clear()
        self._waiting.append((key, handle))
        self._pump()

    def _pump(self) -> None:
        """Start waiting entries while fewer than ``workers`` are written (in order; one whose start
        fails ends right there, no recursion), then hand room on to ``put`` and settle ``join``."""
        while self._waiting and self._writing < self._workers:
            self._start(*self._waiting.popleft())
        self._wake_putter()
        self._settle_idle()

    def _start(self, key: PageKey, handle: PageHandle) -> None:
        try:
            end = asyncio.ensure_future(self._write(key, handle))
        except Exception:  # the write refused to start: reported, its reference released
            self._on_error()
            self._release(handle)
            return
        self._writing += 1
        end.add_done_callback(functools.partial(self._ended, handle))

    def _ended(self, handle: PageHandle, end: asyncio.Future[object]) -> None:
        try:
            if not end.cancelled() and end.exception() is not None:
                self._on_error()
        finally:
            self._release(handle)
            self._writing -= 1
            self._pump()

    def _wake_putter(self) -> None:
        while self._putters and self._room():
            room = self._putters.popleft()
            if not room.done():
                room.set_result(None)
                return

    def _settle_idle(self) -> None:
        if not self._waiting and not self._writing:
            self._idle.set()
