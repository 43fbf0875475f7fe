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

If the loop ends without :meth:`LoopThread.close` (a callback let ``SystemExit`` or
``KeyboardInterrupt`` out, or something stopped the loop), the thread cancels the work in flight
(each coroutine's own cleanup runs, so I/O into a caller's memory has ended), runs the finalizers
(:meth:`~LoopThread.add_finalizer`: the disk tier closes), fails every caller still waiting with
``LoopDied`` and ends; :attr:`~LoopThread.dead` then says so, and every later hand-over raises
``LoopDied`` instead of waiting for ever.
"""

from __future__ import annotations

import _thread
import asyncio
import collections
import concurrent.futures
import logging
import math
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

_Posted = Coroutine[Any, Any, object] | Callable[[], object]


QUIESCE_REPORT_S = 30.0
"""How long :meth:`LoopThread.quiesce` waits before it logs what it is waiting for (then again)."""


def _where(task: asyncio.Task[object]) -> str:
    """Where a pending task is suspended: its chain of coroutines, outermost first, and what the
    innermost one awaits."""
    steps: list[str] = []
    awaited: object = task.get_coro()
    while awaited is not None and len(steps) < 16:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
        if frame is None:
            steps.append(type(awaited).__name__)
            break
        steps.append(f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})")
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    return " -> ".join(steps)


class LoopDied(RuntimeError):
    """The loop thread ended without being closed; what it was running was cancelled."""


def finite_seconds(value: object, name: str) -> float:
    """``value`` as a float: ``TypeError`` unless it is an int or float (not a bool), ``ValueError``
    unless it is finite (an int too large for a float included: ``math.isfinite`` raised
    ``OverflowError`` on it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf
    if not math.isfinite(seconds):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return seconds


def check_timing(poll_s: float, linger_s: float, idle_poll_s: float) -> None:
    """Refuse polling settings a loop cannot run with: ``TypeError`` for a non-number, ``ValueError``
    unless ``poll_s > 0``, ``linger_s >= 0`` and ``idle_poll_s >= 0``, all finite (an infinite poll
    would leave posted work waiting for ever)."""
    for name, value in (("poll_s", poll_s), ("linger_s", linger_s), ("idle_poll_s", idle_poll_s)):
        finite_seconds(value, name)
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
        self._waiting: set[concurrent.futures.Future[Any]] = set()  # callers of submit/call not answered yet
        # submit's coroutines (its _answer, the caller's) by future until answered: closed if the
        # loop closes without starting them
        # submit()'s hand-overs not started yet, by id of the caller's coroutine: _answer leaves at
        # its start; once the loop is closed nothing starts them, and they are closed (never awaited).
        self._unstarted: dict[int, tuple[Coroutine[Any, Any, Any], Coroutine[Any, Any, Any]]] = {}
        self._finalizers: list[Callable[[], Coroutine[Any, Any, object]]] = []
        self._ending = False  # the thread's end began (_end): posted work is no longer taken
        # when_ended's calls, made by the thread as its last act; None once it made them (later ones: at once).
        self._after_end: list[Callable[[], object]] | None = []
        self._after_end_lock = threading.Lock()
        self.died: BaseException | None = None
        """Why the loop ended without :meth:`close` (None while it runs or after a close)."""
        self._last_work = 0.0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        try:
            self._thread.start()
            self._started.wait()
        except RuntimeError:  # refused (a pids limit): the loop's self-pipe and selector are closed now, not by gc
            self._loop.close()
            raise
        except BaseException:
            # Interrupted (a KeyboardInterrupt from a signal handler, Ctrl-C at start-up) once the thread
            # started, in start()'s wait for it or in the wait for the loop: stopped, by a bare thread handed the
            # stop by this clause's first call (C code: no signal's handler runs before it; see aside.py). Left,
            # it ran for good, idle, held by nobody; closing the loop (as for a refusal) raised "Cannot close a
            # running event loop" instead of the interrupt. (One landing in start() before the thread's start,
            # within threading's own bookkeeping, leaves the stop queued on a loop nothing runs.)
            self._closed = True
            try:
                _thread.start_new_thread(self._loop.call_soon_threadsafe, (self._loop.stop,))
            except RuntimeError:  # no thread may start (a pids limit): here
                self._loop.call_soon_threadsafe(self._loop.stop)
            raise

    def _main(self) -> None:
        # Nothing but ``self`` is bound here: this frame is in the traceback of the death ``died``
        # keeps for the life of the owner, and what its locals held stayed alive with it.
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._started.set)
        self._loop.call_soon(self._park)
        try:
            self._loop.run_forever()
            if not self._closed:
                raise LoopDied("the loop was stopped without LoopThread.close()")
        except BaseException as exc:  # the thread ends here; callers learn it through `died`
            self._record_death(exc)
        finally:
            try:
                self._end()
            finally:
                self._call_after_end()

    def _record_death(self, exc: BaseException) -> None:
        """Log the death with its traceback, then keep it in ``died`` without what its frames
        held: their locals (a cancelled transfer's view of a caller's memory, reached through the
        loop's frames) stayed alive as long as ``died``, and a caller's memory they reach could
        never be unmapped (vLLM keeps a region mapped while anything exports it)."""
        log.critical("aiokv loop thread %s died (%r); its work in flight is cancelled",
                     self._thread.name, exc, exc_info=exc)
        traceback.clear_frames(exc.__traceback__)  # this thread's frames still running are skipped
        died = exc if isinstance(exc, LoopDied) else LoopDied(f"aiokv loop thread died: {exc!r}")
        if died is not exc:
            died.__cause__ = exc
        self.died = died

    def _end(self) -> None:
        """The thread's end: cancel the work in flight, run the finalizers after a death, close the
        loop, answer the callers still waiting."""
        self._ending = True
        try:
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._run_to_end(asyncio.gather(*pending, return_exceptions=True))
            del pending  # the cancelled work (and what its frames hold) goes now, not with this frame
            if self.died is not None:
                self._finalize()
            self._run_to_end(self._loop.shutdown_asyncgens())
            self._loop.close()
        finally:
            # Even if the end itself failed: a caller left waiting would wait for good (after a
            # close too: a start queued after the end's last run was dropped with the loop).
            self._answer_left()
            if self.died is not None:
                self._drop_inbox()

    def _run_to_end(self, work: Awaitable[object]) -> None:
        """Run ``work`` on the (no longer running) loop to its end, even if a ``stop()`` scheduled
        meanwhile (a :meth:`close` racing with the loop's end) interrupts it."""
        future = asyncio.ensure_future(work, loop=self._loop)
        while True:
            try:
                self._loop.run_until_complete(future)
                return
            except BaseException as exc:
                if future.done():
                    raise
                # A stop() scheduled meanwhile (RuntimeError), or a callback queued before the
                # death raising again (a second SystemExit): the end goes on, else the work in
                # flight is never cancelled, the loop never closed and its callers never answered.
                if not isinstance(exc, RuntimeError):
                    log.error("aiokv loop: %r raised while the loop thread %s ended; ending it anyway",
                              exc, self._thread.name)

    def _finalize(self) -> None:
        for finalizer in self._finalizers:
            try:
                self._run_to_end(finalizer())
            except BaseException:  # one failing finalizer must not skip the others
                log.exception("aiokv loop: finalizer raised while the loop thread ended")

    def _call_after_end(self) -> None:
        with self._after_end_lock:
            calls, self._after_end = self._after_end or [], None
        for fn in calls:
            try:
                fn()
            except Exception:
                log.exception("aiokv loop: a call after the end of loop thread %s raised", self._thread.name)

    def when_ended(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` once the thread's end is over (after a :meth:`close` or a death: its work cancelled
        and ended, the finalizers run, the loop closed): on that thread, as its last act (what ``fn`` raises
        is logged), or now, on the caller's, when it is over already. ``fn`` must not block: the thread
        (and :meth:`wait_ended`) waits for it. No thread is started for it (the kernel may refuse one)."""
        with self._after_end_lock:
            if self._after_end is not None:
                self._after_end.append(fn)
                return
        fn()

    def _answer_left(self, futures: list[concurrent.futures.Future[Any]] | None = None) -> None:
        """Answer every caller still waiting (or those of ``futures``): ``LoopDied`` after a death,
        cancelled after a close; once the loop is closed, the coroutines it never started are closed
        (never awaited), whether or not their callers were answered before."""
        if self._loop.is_closed():
            self._close_unstarted()
        for future in list(self._waiting) if futures is None else futures:
            if self.died is not None:
                _fail(future, self.died)
            else:
                future.cancel()

    def _close_unstarted(self) -> None:
        while self._unstarted:
            try:
                _, (answer, coro) = self._unstarted.popitem()  # pop: one thread closes each
            except KeyError:
                return
            answer.close()  # unstarted: that does not close ``coro``
            coro.close()

    def _drop_inbox(self) -> None:
        while True:
            try:
                work = self._inbox.popleft()
            except IndexError:  # empty: two closers drop it at once (a look, then a pop, raised here)
                return
            if not callable(work):
                work.close()

    @property
    def dead(self) -> bool:
        """True once the loop ended without :meth:`close` and its thread is gone: everything it
        was running has ended (cancelled), and hand-overs raise ``LoopDied``."""
        return self.died is not None and not self._thread.is_alive()

    def wait_ended(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a loop that died to finish ending (its work cancelled:
        a cancelled transfer waits for its I/O); True once its thread is gone. From any thread but
        the loop's."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def add_finalizer(self, finalizer: Callable[[], Coroutine[Any, Any, object]]) -> None:
        """Run ``finalizer()`` on the loop, after the work in flight was cancelled, if the loop
        ever ends without :meth:`close` (e.g. close a disk tier whose owner can no longer reach it)."""
        self._finalizers.append(finalizer)

    def _check_running(self) -> None:
        if self.died is not None:
            raise _died_error(self.died)
        if self._closed:
            raise RuntimeError("loop thread is closed")

    def _track(self, future: concurrent.futures.Future[T]) -> concurrent.futures.Future[T]:
        """Keep ``future`` until answered, so a loop that ends fails (or cancels) it instead of
        leaving its caller waiting. Added before the check: either the ending thread's sweep sees
        it, or this check sees ``died`` or the closed loop (each set before the sweep)."""
        self._waiting.add(future)
        future.add_done_callback(self._waiting.discard)
        if self.died is not None or self._loop.is_closed():
            self._answer_left([future])  # its own only: the end may still be cancelling the others
        return future

    def in_loop_thread(self) -> bool:
        """Whether the caller runs on the loop's own thread (where waiting for the loop deadlocks)."""
        return threading.current_thread() is self._thread

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop (use only from coroutines running on it)."""
        return self._loop

    # -- non-waking hand-over -------------------------------------------------------------------

    def post(self, work: Coroutine[Any, Any, object]) -> None:
        """Queue the coroutine ``work``; the loop starts it as a task at its next poll. Never
        blocks, makes no system call. ``work`` must handle its own errors (an escaping exception is
        logged). Raises ``RuntimeError`` once closed, ``LoopDied`` once the loop died (``work`` is
        closed unstarted)."""
        if self._closed or self.died is not None:
            work.close()
            self._check_running()
        self._inbox.append(work)
        if self._closed or self.died is not None:
            # Ended since the check: its end may have dropped the inbox already, and nothing takes
            # it any more. Closed unstarted, as the end would have (its owner answers for it).
            self._drop_inbox()

    def post_call(self, fn: Callable[[], object]) -> None:
        """Queue the plain function ``fn`` for the loop's next poll (as :meth:`post`: dropped
        unrun if the loop ended as it was queued)."""
        self._check_running()
        self._inbox.append(fn)
        if self._closed or self.died is not None:
            self._drop_inbox()  # ended since the check: nothing takes it any more (see post)

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
        if self._parked and self._inbox and not self._closed and self.died is None:
            self._parked = False
            try:
                self._loop.call_soon_threadsafe(self._poll)
            except RuntimeError:
                # The loop died or was closed after the checks above: its end has dropped or
                # answered what was queued, and later hand-overs raise; nothing reaches the caller
                # (an engine's thread) from here.
                if not self._loop.is_closed():
                    raise

    def quiesce(self, timeout: float | None = None) -> None:
        """Block until everything posted so far has run and every posted coroutine finished
        (from any thread but the loop's). Raises ``TimeoutError`` after ``timeout`` seconds."""
        self.run(self._quiesce(), timeout)

    async def _quiesce(self) -> None:
        self._take_inbox()
        waited = 0.0
        while self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=QUIESCE_REPORT_S)
            if pending:  # still waiting: say on what (a hang must be diagnosable), then keep waiting
                waited += QUIESCE_REPORT_S
                log.warning("aiokv loop: quiesce has waited %.0f s for %d posted coroutines; first: %s",
                            waited, len(pending), _where(next(iter(pending))))
            self._take_inbox()

    def _take_inbox(self) -> bool:
        if self._ending:
            # The end cancels what runs and drops what was posted: a poll still queued (run while
            # the end waits for the cancelled work) must not start posted work after its snapshot,
            # work that would then run on unawaited (its I/O into the caller's memory included).
            return False
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
        """Schedule ``coro`` on the loop now (wakes it); returns at once. Raises ``RuntimeError`` once
        closed, ``LoopDied`` once the loop died; the future fails with ``LoopDied`` if it dies before
        ``coro`` ended (once ``coro`` ended: its work cancelled)."""
        if self._closed or self.died is not None:
            coro.close()
            self._check_running()
        answer = self._answer(coro)
        self._unstarted[id(coro)] = (answer, coro)
        try:
            future = asyncio.run_coroutine_threadsafe(answer, self._loop)
        except RuntimeError:  # the loop closed as it died, after the check
            self._close_unstarted()
            self._check_running()
            raise
        return self._track(future)

    async def _answer(self, coro: Coroutine[Any, Any, T]) -> T:
        """``coro``, whose cancellation by the loop's death (its end cancels the work in flight and
        waits for it) reaches the caller as ``LoopDied``, as for work the loop never started: the
        adapters catch ``LoopDied``, and a ``CancelledError`` reached the engine's thread. A
        :meth:`close` leaves the ``CancelledError`` (see :meth:`wait_answered`)."""
        self._unstarted.pop(id(coro), None)
        if self._ending:
            # Started behind the death or the close (its start was queued after the end took its
            # snapshot of the work to cancel): it would run on unawaited, never cancelled, and the
            # loop close under it (a copy into the engine's memory after the caller was answered).
            coro.close()
            if self.died is not None:
                raise _died_error(self.died)
            raise asyncio.CancelledError
        try:
            return await coro
        except asyncio.CancelledError:
            if self.died is not None:
                raise _died_error(self.died) from None
            raise

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run the plain function ``fn`` on the loop now (wakes it); returns at once. Raises
        ``RuntimeError`` once closed, ``LoopDied`` once the loop died; the future fails with
        ``LoopDied`` if it dies before running ``fn`` (is cancelled if a :meth:`close` ends it first)."""
        self._check_running()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if self._ending:
                # Queued behind the death or the close: run after the end's snapshot, work ``fn``
                # starts (a region's registration) would run on uncancelled, the loop closed under it.
                if self.died is not None:
                    _fail(future, self.died)
                else:
                    future.cancel()
                return
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        self._track(future)
        try:
            self._loop.call_soon_threadsafe(run)
        except RuntimeError:  # the loop closed as it died, after the check
            self._check_running()
            raise
        return future

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (from any thread but the loop's). Raises
        ``LoopDied`` if the loop died before or while it ran (once ``coro`` ended: its work
        cancelled), ``CancelledError`` if a :meth:`close` cancelled it."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.run called from its own loop: it would deadlock")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except (SystemExit, KeyboardInterrupt) as exc:
            if future.done() and future.exception() is exc:  # it ended the loop, not this thread
                raise LoopDied(f"aiokv loop thread died: {exc!r}") from exc
            raise

    def wait_answered(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until every future :meth:`submit` / :meth:`call` handed out
        so far is answered (from any thread but the loop's); True when they all are. Lets an owner
        stop the loop only once the calls other threads wait on have ended: :meth:`close` cancels
        what still runs, and their callers get ``CancelledError`` instead of an answer."""
        _, pending = concurrent.futures.wait(list(self._waiting), timeout=timeout)
        return not pending

    def close_from_loop(self) -> None:
        """:meth:`close` from the loop's own thread, which cannot join itself: the loop stops after the
        running callback and the thread ends as after a close (work posted and not picked up is dropped
        now). For where no thread may start to call :meth:`close` (a pids limit reached)."""
        if not self._closed and self.died is None:
            self._closed = True
            self._loop.stop()
        self._drop_inbox()

    def close_soon(self, name: str) -> RuntimeError | None:
        """:meth:`close` from a callback (mostly on the loop's own thread, which cannot join itself) on a
        thread named ``name``, not waited for. When none may start (a pids limit reached: ``RuntimeError``
        "can't start new thread"; Python 3.12+ at interpreter shutdown), the loop stops itself
        (:meth:`close_from_loop`; off the loop: :meth:`close` here) and that refusal is returned for the
        caller to log (None when the thread started): raised in the callback, the loop ran for good."""
        try:
            threading.Thread(target=self.close, name=name, daemon=True).start()
        except RuntimeError as exc:
            if self.in_loop_thread():
                self.close_from_loop()
            else:
                self.close()
            return exc
        return None

    def _ask_stop(self) -> None:
        """Ask the loop to stop (from any thread but its own)."""
        try:
            self._loop.call_soon_threadsafe(self._loop.stop)
        except RuntimeError:  # closed: it ended (or died) meanwhile
            pass

    def close(self) -> None:
        """Stop the loop and join the thread (the first call; a later one asks for the stop again and
        returns). Idempotent; tasks still pending are cancelled and posted work never picked up is
        dropped (coroutines closed unstarted). After the loop died it asks for no stop (the dying thread
        ends by itself): the first call still joins that thread (its end: the work it cancelled, waited
        for, then its finalizers; without a bound), later ones only drop what was posted since. On the
        loop's own thread (a callback, which cannot join its thread): :meth:`close_from_loop`."""
        if self.in_loop_thread():
            self.close_from_loop()
            return
        first = not self._closed
        self._closed = True
        if self.died is None:  # a dying loop ends by itself (a stop would cut its finalizers short)
            # At each call: one interrupted (a KeyboardInterrupt from a signal handler) before its stop
            # left the loop running for good, counted as closed. A stop more only turns the loop once
            # more (the end's runs go on after it). Asked by a bare thread, handed it by the first call
            # after the mark (C code: no signal's handler runs before it; see aside.py): asked here, an
            # interrupt at the entry of call_soon_threadsafe (Ctrl-C once, at a close made once) left it
            # running for good.
            try:
                _thread.start_new_thread(self._ask_stop, ())
            except RuntimeError:  # no thread may start (a pids limit): here
                self._ask_stop()
        if first:
            self._thread.join()
        self._drop_inbox()


def _died_error(died: BaseException | None) -> LoopDied:
    """A ``LoopDied`` of one caller's own, caused by the death ``died``: a raise adds the raiser's
    frames to the exception's traceback, and raising ``died`` itself (or failing every waiter with
    it) kept each caller's frames, and what they held, alive as long as the thread's owner kept
    ``died``."""
    error = LoopDied(str(died) if died is not None else "aiokv loop thread died")
    error.__cause__ = died
    return error


def _fail(future: concurrent.futures.Future[Any], died: BaseException | None) -> None:
    if not future.done():
        try:
            future.set_exception(_died_error(died))
        except concurrent.futures.InvalidStateError:  # answered meanwhile
            pass
