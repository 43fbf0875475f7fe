"""Cleanup that an interrupt cannot cut short: handed, from an ``except`` clause, to a thread of its own.

A signal's Python handler (Ctrl-C's ``KeyboardInterrupt``) runs on the main thread only, and only at
the points where the interpreter looks for pending calls: a backward jump, a Python function's entry,
a C function's return. Cleanup made on the main thread has such a point before each of its steps (a
retry's back jump, the entry of the function making the next step): another interrupt (Ctrl-C pressed
again) landing there skipped the rest, leaving what the cleanup was to close open for good (a disk
tier, its directory lock, a loop thread).

There is no such point between an ``except`` clause's entry and the end of its first call when that
call is C code (CPython 3.11 and 3.12: the exception match, loads and forward jumps only; the look
comes once the C function returned). So the clause's first call hands the cleanup over, by C code::

    cleanup = Aside(close_everything, "aiokv-x-cleanup")  # made before the work it cleans up after
    try:
        work()
    except BaseException:
        try:
            _thread.start_new_thread(cleanup.start, ())  # the clause's first call
        except RuntimeError:  # no thread may start (a pids limit): made here, exposed as before
            cleanup.run()
        cleanup.wait()  # interrupted: the cleanup goes on to its end all the same
        raise

The caller still waits for its end (it raises what the cleanup raised); an interrupt in that wait leaves
it running to its end. No signal's handler runs on the cleanup's thread.

An ``Aside`` runs ``fn`` once however often it is started or run: one made ahead (a ``close()`` of its
owner's, made at construction) lets that call's first call hand the close over, with no Python code (no
such point) before it; a later call's start only waits for that one run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Aside:
    """``fn()`` run once, to its end, on a thread of its own (see the module's docstring); ``name``
    names that thread."""

    def __init__(self, fn: Callable[[], object], name: str) -> None:
        self._fn = fn
        self._name = name
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None  # fn's, once the bare thread made it
        self._claimed = threading.Lock()  # held by the one start or run that runs fn

    def start(self) -> None:
        """The bare thread's target (``_thread.start_new_thread(aside.start, ())``): ``fn`` on a named
        thread, one that ``threading`` knows (``fn`` may join threads, which looks the current thread up:
        on a bare thread that registers a dummy thread for good), or here when none may start. Nothing
        when ``fn`` ran or runs already (started or run before)."""
        if not self._claimed.acquire(blocking=False):
            return
        # Kept before its start: fn's end (which the caller's wait looks for) comes after it.
        self._thread = threading.Thread(target=self._run_claimed, name=self._name, daemon=True)
        try:
            self._thread.start()
        except BaseException:  # refused (a pids limit; interpreter shutdown): nothing runs fn yet
            self._thread = None
            self._run_claimed()

    def run(self) -> None:
        """Run ``fn`` on this thread (the caller's way when no thread may start), keeping what it raised;
        nothing when it ran or runs already."""
        if self._claimed.acquire(blocking=False):
            self._run_claimed()

    def _run_claimed(self) -> None:
        try:
            self._fn()
        except BaseException as exc:
            self._error = exc
        finally:
            self._done.set()

    def ended(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``fn``'s end; True once it ended (what it raised is kept
        for :meth:`wait`)."""
        return self._done.wait(timeout)

    def wait(self) -> None:
        """Wait for ``fn``'s end, and its thread's, without a bound (from any thread but its own); raise
        what it raised (to the first wait after its end). The thread is joined: one counted as alive as it
        ended looked leaked."""
        self._done.wait()
        thread = self._thread
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error
