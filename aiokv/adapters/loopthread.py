"""An asyncio event loop on a thread of its own, for engines that call synchronously from theirs.

Two ways to hand work over:

- :meth:`LoopThread.post` / :meth:`~LoopThread.post_call` queue it without waking the loop: a
  ``deque`` append, no system call, so the engine's thread never lets go of the GIL. A waking
  hand-over (``call_soon_threadsafe`` writes to the loop's self-pipe) releases the GIL for that
  write, and the loop thread, woken by it, may take the GIL first and run its Python for up to the
  switch interval before the engine's thread gets it back: that was the longest call into vLLM's
  tier. The loop picks queued work up itself: it polls every ``poll_s`` while it has posted work
  running or had some within ``linger_s``, then parks, looking only every ``idle_poll_s`` (0: not at
  all). :meth:`~LoopThread.wake` (one system call, only while parked with work queued) makes a
  parked loop look now, for callers that prefer that system call to the parked loop's latency.
- :meth:`~LoopThread.submit` / :meth:`~LoopThread.call` / :meth:`~LoopThread.run` wake the loop
  at once and return a ``concurrent.futures.Future`` (for calls that wait anyway).

All aiokv state (the disk tier, its io_uring) lives on the loop and is touched only there.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

_Posted = Coroutine[Any, Any, object] | Callable[[], object]


def check_timing(poll_s: float, linger_s: float, idle_poll_s: float) -> None:
    """Refuse polling settings a loop cannot run with: ``TypeError`` for a non-number, ``ValueError``
    unless ``poll_s > 0``, ``linger_s >= 0`` and ``idle_poll_s >= 0``, all finite (an infinite poll
    would leave posted work waiting for ever)."""
    for name, value in (("poll_s", poll_s), ("linger_s", linger_s), ("idle_poll_s", idle_poll_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number of seconds, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value!r}")
    if not poll_s > 0 or not linger_s >= 0 or not idle_poll_s >= 0:
        raise ValueError(f"poll_s must be > 0, linger_s and idle_poll_s >= 0, got {poll_s}, {linger_s}, {idle_poll_s}")


class LoopThread:
    """A daemon thread running one event loop until :meth:`close`.

    ``poll_s``: how often the loop picks up posted work while busy, seconds. ``linger_s``: how
    long it keeps polling after its last posted work ended before it parks, seconds.
    ``idle_poll_s``: how often a parked loop still looks, seconds; 0: only when woken.
    """

    def __init__(self, name: str, poll_s: float = 0.001, linger_s: float = 0.05, idle_poll_s: float = 0.0) -> None:
        check_timing(poll_s, linger_s, idle_poll_s)
        self._poll_s = poll_s
        self._linger_s = linger_s
        self._idle_poll_s = idle_poll_s
        self._inbox: collections.deque[_Posted] = collections.deque()
        # Read by the engine's threads, written by the loop (and by wake()); see _park.
        self._parked = True
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[object]] = set()
        self._last_work = 0.0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._started.wait()
        self._closed = False

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._started.set)
        self._loop.call_soon(self._park)
        try:
            self._loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop (use only from coroutines running on it)."""
        return self._loop

    # -- non-waking hand-over -------------------------------------------------------------------

    def post(self, work: Coroutine[Any, Any, object]) -> None:
        """Queue the coroutine ``work``; the loop starts it as a task at its next poll. Never
        blocks, makes no system call. ``work`` must handle its own errors (an escaping exception is
        logged). Raises ``RuntimeError`` once closed (``work`` is closed unstarted)."""
        if self._closed:
            work.close()
            raise RuntimeError("loop thread is closed")
        self._inbox.append(work)

    def post_call(self, fn: Callable[[], object]) -> None:
        """Queue the plain function ``fn`` for the loop's next poll (as :meth:`post`)."""
        if self._closed:
            raise RuntimeError("loop thread is closed")
        self._inbox.append(fn)

    @property
    def parked(self) -> bool:
        """True while the loop does not poll every ``poll_s``: posted work waits for :meth:`wake` or
        the next idle look (``idle_poll_s``)."""
        return self._parked

    def pending(self) -> int:
        """Posted items the loop has not picked up yet."""
        return len(self._inbox)

    def wake(self) -> None:
        """Make a parked loop poll now if work is queued (one system call); else nothing."""
        if self._parked and self._inbox and not self._closed:
            self._parked = False
            self._loop.call_soon_threadsafe(self._poll)

    def quiesce(self, timeout: float | None = None) -> None:
        """Block until everything posted so far has run and every posted coroutine finished
        (from any thread but the loop's). Raises ``TimeoutError`` after ``timeout`` seconds."""
        self.run(self._quiesce(), timeout)

    async def _quiesce(self) -> None:
        self._take_inbox()
        while self._tasks:
            await asyncio.wait(set(self._tasks))
            self._take_inbox()

    def _take_inbox(self) -> bool:
        took = False
        while True:
            try:
                work = self._inbox.popleft()
            except IndexError:
                return took
            took = True
            if callable(work):
                try:
                    work()
                except Exception:
                    log.exception("aiokv loop: posted call raised")
                continue
            task: asyncio.Task[object] = self._loop.create_task(work)
            self._tasks.add(task)
            task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[object]) -> None:
        self._tasks.discard(task)
        self._last_work = time.monotonic()
        if not task.cancelled() and task.exception() is not None:
            log.error("aiokv loop: posted coroutine raised", exc_info=task.exception())

    def _poll(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        now = time.monotonic()
        if self._take_inbox() or self._tasks:
            self._last_work = now
        if now - self._last_work < self._linger_s or self._tasks:
            self._timer = self._loop.call_later(self._poll_s, self._poll)
            return
        self._park()

    def _park(self) -> None:
        # Publish "parked" before the last look at the inbox: an engine thread appends, then reads
        # the flag (wake). With the GIL ordering the four steps, either its read sees True (and it
        # wakes the loop) or this look sees its item (and the loop keeps polling).
        self._parked = True
        if self._inbox:
            self._parked = False
            self._timer = self._loop.call_later(self._poll_s, self._poll)
        elif self._idle_poll_s > 0:
            self._timer = self._loop.call_later(self._idle_poll_s, self._idle_look)

    def _idle_look(self) -> None:
        self._timer = None
        if self._inbox:
            self._parked = False
            self._poll()
        else:
            self._timer = self._loop.call_later(self._idle_poll_s, self._idle_look)

    # -- waking hand-over -----------------------------------------------------------------------

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop now (wakes it); returns at once. Raises ``RuntimeError`` once closed."""
        if self._closed:
            coro.close()
            raise RuntimeError("loop thread is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run the plain function ``fn`` on the loop now (wakes it); returns at once. Raises
        ``RuntimeError`` once closed."""
        if self._closed:
            raise RuntimeError("loop thread is closed")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return future

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (from any thread but the loop's)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.run called from its own loop: it would deadlock")
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        """Stop the loop and join the thread. Idempotent; tasks still pending are cancelled and
        posted work never picked up is dropped (coroutines closed unstarted)."""
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        while self._inbox:
            work = self._inbox.popleft()
            if not callable(work):
                work.close()
