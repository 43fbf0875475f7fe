"""Payload checksums off the event loop for large pages.

xxh3 runs at memory speed here (~10 GB/s from DRAM, 0.1 core-s/GB): a 4 MiB page holds the loop
~0.4 ms and a 32 MiB page ~3 ms, and a completion drain that verifies a few pages at once stalls it
longer. The xxhash binding releases the GIL while it hashes, so a thread takes that time off the
loop. Small pages are hashed inline: the hand-off (a queue put, a wake-up of the loop) costs more
than hashing them.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable

from aiokv.pool import run_in_new_thread

from .memory import wait_uncancelled
from .pagefile import payload_checksum
from .uring import TURNS, not_started

log = logging.getLogger(__name__)

INLINE_CHECKSUM_BYTES = 1 << 20
"""Payloads up to this size (a page read) are hashed on the loop (~0.1 ms for 1 MiB), larger ones
in a checksum thread; the per-turn budget below bounds what one turn hashes. Was 256 KiB: a 1 MiB
read then paid the hand-off (a queue put, the thread's wake-up, the GIL going back and forth, a
second wake-up of the loop per page besides its CQE's), which cost more process CPU than the hash
saved the loop: 0.47 -> 0.38 core-s/GB at queue depth 8 and 0.62 -> 0.53 at 32 for cold 1 MiB reads,
0.31 -> 0.26 / 0.30 -> 0.29 cached (8 alternated rounds, 2 vCPUs, #14)."""

INLINE_WRITE_CHECKSUM_BYTES = 1 << 20
"""The same for a page being written (hashed in the writer's own call, one page at a time): up to
1 MiB (~0.1 ms of the loop) inline. The thread's hand-off cost a recycled 1 MiB write ~30% of its
CPU without the hash (0.31 -> 0.21 core-s/GB here)."""

INLINE_WRITE_BYTES_PER_TURN = 2 << 20
"""At most this many bytes (written and read pages alike) are hashed inline in one turn of the loop
(~0.3 ms); further pages started in the same turn go to the thread. A caller starting 32 writes of
1 MiB at once held the loop 5-12 ms hashing them all inline (the loop-lag budget is 3 ms). All
inline hashes of a turn run in one callback: a per-call budget reset by a callback of the next turn
let one turn hash up to twice the budget (the pages started before the reset ran, then after it)."""

INLINE_HASH_WINDOW_S = 1e-3
"""A batch's inline bytes stay charged against a later batch's budget for up to this long,
decreasing linearly (the budget refills at ``INLINE_WRITE_BYTES_PER_TURN`` per window): what the
budget protects is the loop's lag (~1 ms per turn), so "bytes hashed inline in the last ms" is the
quantity that counts. asyncio counts no turns, and a callback per turn to end a charge costs what
#14 removed: keyed on the wake-up counter alone, a caller's batch charged whichever ring wake-up
came next, turns later, and sent its reads' pages to the thread for nothing."""

DELIVER_TURN_S = 0.5e-3
"""Callbacks of finished hashes run in one turn of the loop for at most this long (the rest in the
next turn): at queue depth 32 the thread's results for up to 30 pages came back in one wake-up, and
every page's next step (room, slot, submit) ran in that one callback."""

CHECKSUM_THREADS = 1
"""Threads hashing large payloads: one hashes ~10 GB/s, several times what a disk moves."""

Done = Callable[[int | BaseException], None]
_Job = tuple[memoryview, asyncio.AbstractEventLoop, Done] | None


class Checksums:
    """Hashes payloads for one loop: inline when small, else in ``threads`` background threads.

    ``start(view, done)`` calls ``done(checksum)`` (or ``done(exception)``) on the loop, never
    synchronously from ``start`` (one code path for callers). The caller keeps ``view``'s memory
    alive and unchanged until ``done`` ran. :meth:`aclose` waits for the threads. One loop per
    instance: results of the threads reach it in batches, one wake-up of the loop for all the
    hashes finished meanwhile (a wake-up per page cost a socket write, a poll and a read)."""

    def __init__(self, inline_bytes: int | None = None, threads: int | None = None, start: bool = True,
                 inline_write_bytes: int | None = None) -> None:
        # None: the module constants as they are now (read here, so tests and the lead's config can set them).
        self._inline = INLINE_CHECKSUM_BYTES if inline_bytes is None else inline_bytes
        self._inline_write = INLINE_WRITE_CHECKSUM_BYTES if inline_write_bytes is None else inline_write_bytes
        self._turn_budget = INLINE_WRITE_BYTES_PER_TURN
        # Pages to hash on the loop, and whether the one callback per turn that hashes them is due.
        self._inline_jobs: list[tuple[memoryview, Done]] = []
        self._batch_scheduled = False
        # TURNS.stamp of the wake-up at whose end a batch was last asked for (one there a wake-up).
        self._batch_stamp = -1
        # The bytes the last batch hashed inline (``_charge``, at ``perf_counter()`` ``_charged_at``),
        # charged against a batch at the end of wake-up ``_epoch`` (TURNS.stamp) less what the window
        # let expire since: a batch run from a queued callback charges the next wake-up (in the same
        # turn when its CQEs were there before the turn's poll), a wake-up's batch its own wake-up.
        self._window_s = INLINE_HASH_WINDOW_S
        self._epoch = -1
        self._charge = 0
        self._charged_at = 0.0
        self.in_next_turn: Callable[[Callable[[], None]], None] | None = None
        """Runs the turn's inline batch early in the loop's next turn (None: ``loop.call_soon``).
        The disk tier passes its ring's submission callback, which runs then anyway while pages
        move: the batch costs no loop callback of its own, and the writes it moves on have their
        SQEs go out in that same submission (#14)."""
        threads = CHECKSUM_THREADS if threads is None else threads
        self.cpu_s = 0.0
        """CPU seconds spent hashing so far, inline and in the threads (benchmarks report the share)."""
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._results: collections.deque[tuple[Done, int | BaseException]] = collections.deque()
        self._lock = threading.Lock()
        self._wake_pending = False  # a _deliver is scheduled on the loop and has not delivered every result yet
        self._waker: Callable[[], bool] | None = None  # see wake_through
        self._threads = [threading.Thread(target=self._run, name=f"aiokv-checksum-{i}", daemon=True)
                         for i in range(threads)]
        self._joined: asyncio.Future[None] | None = None  # the join of the stopped threads, once aclose ran
        if start:
            self.start_threads()

    def wake_through(self, wake: Callable[[], bool] | None) -> None:
        """Have the threads announce results with ``wake()`` (called in a thread; False when it
        cannot wake the loop any more) instead of ``loop.call_soon_threadsafe``; its owner then
        calls :meth:`deliver` on the loop after each wake-up. The disk tier passes its ring's
        eventfd: one wake-up serves completions and hashes alike, where each batch of hashes cost
        a socket write, a wake-up, two ``recv`` and a turn of the loop of its own (#14). None:
        back to ``call_soon_threadsafe``."""
        self._waker = wake

    def start_threads(self) -> None:
        """Start the threads (``start=False``: from a thread other than the loop's — ``Thread.start``
        waits until the new thread runs, which on a loaded machine holds the caller for ms)."""
        for thread in self._threads:
            thread.start()

    def start(self, view: memoryview, done: Done, writing: bool = False) -> None:
        """Hash ``view``, then ``done(checksum)`` on the loop; ``writing``: a page being written
        (hashed inline up to ``inline_write_bytes`` instead of ``inline_bytes``).

        Inline hashes run in one callback per turn of the loop (scheduled by the first of them), so
        the turn's budget (``INLINE_WRITE_BYTES_PER_TURN``) holds whatever callbacks started them
        and in which order; the pages past it go to the thread.

        Once this started, ``done`` runs even if a KeyboardInterrupt (a signal) leaves it: a page
        not handed on yet is hashed inline in the next turn, and a batch maybe left unscheduled
        is scheduled (a second run of one does nothing)."""
        handed = False
        try:
            size = len(view)
            if size > (self._inline_write if writing else self._inline):
                loop = asyncio.get_running_loop()
                handed = True  # no call before the put: an interrupt raised as it returns finds this set
                self._jobs.put((view, loop, done))
                return
            handed = True
            self._inline_jobs.append((view, done))
            if not self._batch_scheduled:
                self._schedule_batch()
                self._batch_scheduled = True  # asked for first: an interrupt in between asks again
        except BaseException as exc:
            if isinstance(exc, Exception):
                raise
            if not handed:
                self._inline_jobs.append((view, done))
            if self._inline_jobs:
                asyncio.get_running_loop().call_soon(self._hash_inline)
                self._batch_scheduled = True
            raise

    def _schedule_batch(self) -> None:
        # Started inside a ring's wake-up (a read's completion): hashed at that wake-up's end, in
        # its turn, not in a turn of its own after it (#14); once a wake-up (a page started by that
        # batch's callbacks waits for the next turn, as before).
        turns = TURNS
        if turns.waking and self._batch_stamp != turns.stamp and turns.call_after_wake(self._hash_inline):
            self._batch_stamp = turns.stamp
        elif self.in_next_turn is None:
            asyncio.get_running_loop().call_soon(self._hash_inline)
        else:
            self.in_next_turn(self._hash_inline)

    def _hash_inline(self) -> None:
        """On the loop, at most once per turn: hash the pages started inline since the last run,
        up to the turn's budget; the rest go to the thread. Each ``done`` runs here. A drain: run
        again (after an interrupt), it hashes what is left, each page once."""
        jobs: list[tuple[memoryview, Done]] = []
        handed = 0  # the jobs handed on: to the thread, or to their ``done`` (called or running)
        calling: Done | None = None  # the ``done`` being called
        epoch = self._epoch
        spent = charged = 0
        hashing = 0.0
        try:
            # Inside the try from the first line: a signal's KeyboardInterrupt is raised at the next
            # call (a clock read below); the jobs are taken only after the last call before the loop,
            # so an interrupt before then leaves them queued, and one after it re-queues the rest.
            self._batch_scheduled = False
            loop = asyncio.get_running_loop()  # before the loop: a job is put without a call before it
            budget = self._turn_budget
            turns = TURNS
            if turns.waking:  # at a ring wake-up's end: within what is left of its drain's time
                epoch = turns.stamp
                if self._epoch == epoch:  # a queued batch ran ahead of this wake-up (maybe turns ago)
                    # What is left of its charge: all of it in the same turn, none a window later. One
                    # clock read, only after such a batch (the wake-ups alone read none).
                    expired = (time.perf_counter() - self._charged_at) * budget / self._window_s
                    spent = max(0, self._charge - int(expired))
                deadline = turns.deadline
            else:  # from a queued callback: ahead of the next wake-up, maybe in its turn
                epoch = turns.stamp + 1
                # spent = 0: a queued callback runs once a turn: the previous one ran in an earlier turn
                deadline = time.perf_counter() + DELIVER_TURN_S
            charged = spent
            jobs, self._inline_jobs = self._inline_jobs, []
            for n, (view, done) in enumerate(jobs):
                if n and time.perf_counter() > deadline:
                    # The callbacks took this turn's time: the rest wait for the next turn (not the thread).
                    handed = len(jobs)
                    self._inline_jobs[:0] = jobs[n:]
                    if not self._batch_scheduled:
                        self._schedule_batch()
                        self._batch_scheduled = True  # asked for first: an interrupt in between asks again
                    break
                t0 = time.thread_time()
                try:
                    # len() inside: a released view raises there already, and must fail its own page
                    # only (raising out of the batch lost the pages after it: their reads never ended).
                    size = len(view)
                    if spent + size > budget:
                        # Counted handed before the put, with no call between them: an interrupt
                        # raised as the put returns neither loses the page nor hashes it twice.
                        handed = n + 1
                        self._jobs.put((view, loop, done))
                        continue
                    spent += size
                    value: int | BaseException = payload_checksum(view)
                except Exception as exc:  # a released view: a bug, reported to the caller
                    value = exc
                hashing += time.thread_time() - t0
                handed = n + 1  # before the call: a callback that started is never called twice
                calling = done
                try:
                    done(value)
                except Exception:  # a bug in a caller's callback: the others still get theirs
                    log.exception("checksum callback failed")
                calling = None
        except BaseException as exc:
            # A signal's KeyboardInterrupt (most likely while a page is hashed: the GIL is released
            # then) or a callback's BaseException: the pages not handed on yet wait for the next
            # turn (the loop's next run); before, they were forgotten and their reads and writes
            # never ended. A callback interrupted at its entry never ran: its page waits too.
            if calling is not None and not_started(calling, exc):
                handed -= 1
            self._inline_jobs[:0] = jobs[handed:]
            if self._inline_jobs and not self._batch_scheduled:
                self._batch_scheduled = True
                self._schedule_batch()
            raise
        finally:
            if spent > charged:  # hashed some: charged from now (one clock read per batch that hashed)
                self._epoch, self._charge, self._charged_at = epoch, spent, time.perf_counter()
            self.cpu_s += hashing

    async def checksum(self, view: memoryview) -> int:
        """``view``'s checksum (inline or in a thread); keeps ``view`` until the hash is done, even
        when cancelled (the caller's memory must not be recycled under the thread)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()

        def done(value: int | BaseException) -> None:
            if future.done():
                return
            if isinstance(value, BaseException):
                future.set_exception(value)
            else:
                future.set_result(value)

        self.start(view, done)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            while not future.done():  # the thread still reads the memory
                try:
                    await asyncio.wait({future})
                except asyncio.CancelledError:
                    continue
            raise

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            view, loop, done = job
            t0 = time.thread_time()
            try:
                value: int | BaseException = payload_checksum(view)
            except Exception as exc:
                value = exc
            # One float add per page; races between threads could lose an add (one thread by default).
            self.cpu_s += time.thread_time() - t0
            with self._lock:
                self._results.append((done, value))
                wake, self._wake_pending = not self._wake_pending, True
            if wake:
                waker = self._waker
                try:
                    woken = waker is not None and waker()
                except Exception:  # (its eventfd refused the write): this thread must live on
                    log.exception("checksum wake-up failed; waking the loop through call_soon_threadsafe")
                    woken = False
                if not woken:  # no waker, or its ring is closing: the loop's own wake-up
                    try:
                        loop.call_soon_threadsafe(self._deliver)
                    except RuntimeError:  # the loop is closed: nobody waits any more
                        log.debug("checksum finished after its loop closed")
            # Not held while waiting for the next job: the view may be a caller's memory it unmaps.
            del job, view, done

    def deliver(self, deadline: float) -> None:
        """On the loop, from the owner of :meth:`wake_through`'s wake-up: the results finished so
        far (none: nothing to do), until ``deadline`` (``time.perf_counter()``; at least one: the
        rest in the next turn)."""
        if self._results:  # read without the lock: a result appended after this wakes the loop again
            try:
                self._deliver(deadline)
            except BaseException:
                # (a signal's KeyboardInterrupt, maybe at its entry: the threads write no other
                # wake-up until their results are delivered) the rest in the next turn
                asyncio.get_running_loop().call_soon(self._deliver)
                raise

    def _deliver(self, deadline: float | None = None) -> None:
        """On the loop: every result finished so far, in order, for at most ``DELIVER_TURN_S`` (or
        until ``deadline``), the rest in the next turn (``_wake_pending`` stays set until the
        queue is empty: the threads write no wake-up meanwhile).

        A drain, under a KeyboardInterrupt (a signal, raised by Python at calls) too: a result
        leaves the queue as its ``done`` is called; one an interrupt left popped but not handed
        on, or at its ``done``'s entry (``not_started``), goes back to the head, and the rest are
        delivered in the next turn. A ``done`` that started is not called again (but for a
        ``functools.partial``, whose start cannot be told: the disk tier's steps ignore a second
        result). Before, the results were taken out of the queue together first: an interrupt
        as they were taken, or at this method's entry from the ring's hook, lost them (their
        pages' jobs never ended)."""
        results = self._results
        taking = 0  # 1: a result popped, not handed on yet; 2: its ``done`` called
        done: Done | None = None
        value: int | BaseException = 0
        try:
            if deadline is None:
                deadline = time.perf_counter() + DELIVER_TURN_S
            n = 0
            while True:
                if not results:
                    with self._lock:  # a thread that appends after this wakes the loop again
                        if not results:
                            self._wake_pending = False
                            return
                if n and time.perf_counter() > deadline:
                    break  # the rest in the next turn, ahead of whatever the threads finish meanwhile
                done, value = results[0]
                n += 1
                taking = 1
                results.popleft()
                taking = 2
                try:
                    done(value)
                except Exception:  # a bug in a caller's callback: the others still get theirs
                    log.exception("checksum callback failed")
                taking = 0
        except BaseException as exc:
            if taking == 1 or (taking == 2 and not_started(done, exc)):
                results.appendleft((done, value))  # type: ignore[arg-type]
            asyncio.get_running_loop().call_soon(self._deliver)  # (a signal's KeyboardInterrupt)
            raise
        asyncio.get_running_loop().call_soon(self._deliver)  # the rest, next turn (still pending)

    async def aclose(self) -> None:
        """Stop the threads once the queued hashes are done and wait until they have ended.
        Idempotent (a later call waits for the same threads). A cancelled call still waits for
        them, then raises ``CancelledError``.

        They are joined on a thread started without the loop waiting for it: ``asyncio.to_thread``'s
        first call starts the default executor's thread on the loop, and ``Thread.start`` waits
        there until it runs (#11)."""
        threads = self.close_nowait()
        if threads:
            self._joined = run_in_new_thread(functools.partial(_join, threads), "aiokv-join-checksums", _joined)
        if self._joined is None:
            return
        try:
            await asyncio.shield(self._joined)
        except asyncio.CancelledError:
            await wait_uncancelled(self._joined)
            raise

    def close_nowait(self) -> list[threading.Thread]:
        """Tell the started threads to stop once the queued hashes are done (they are daemons);
        returns them, to join. Idempotent."""
        threads, self._threads = [t for t in self._threads if t.ident is not None], []
        for _ in threads:
            self._jobs.put(None)
        return threads


def _join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join()


def _joined(_: None) -> None:
    """The join finished after its loop closed: the threads have ended, nothing is left to do."""
