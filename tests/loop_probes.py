"""Event-driven probes for async tests: where a task waits, a bounded wait on a condition, and
what reached the loop's exception handler.

Importable from every test folder (``tests/`` is on ``sys.path`` through ``tests/conftest.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field
from typing import Any


def waiting_in(task: asyncio.Future[Any] | None, function: str) -> bool:
    """Whether ``task`` is suspended in a coroutine named ``function`` (anywhere down its await chain)."""
    coro = task.get_coro() if isinstance(task, asyncio.Task) else None
    while coro is not None:
        code = getattr(coro, "cr_code", None)
        if code is not None and code.co_name == function:
            return True
        coro = getattr(coro, "cr_await", None)
    return False


async def until(condition: Callable[[], bool], turns: int = 10_000) -> None:
    """Let the loop run until ``condition()`` holds; ``AssertionError`` after ``turns`` loop turns
    (counted in turns, not seconds: a condition that needs no thread never depends on the load)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


THREAD_FAST_TURNS = 64
THREAD_POLL_S = 0.001


async def until_thread(condition: Callable[[], bool], what: str = "condition", timeout_s: float = 30.0) -> None:
    """Until ``condition()`` holds where a thread makes it hold (a copy thread entering a copy):
    a few loop turns, then 1 ms sleeps up to ``timeout_s`` (``AssertionError``). Counting turns
    alone failed under load: a loop spinning through ``sleep(0)`` keeps the GIL from the thread
    (10,000 turns passed with the copy thread not yet in its copy, in a full run beside other work)."""
    for _ in range(THREAD_FAST_TURNS):
        if condition():
            return
        await asyncio.sleep(0)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} not reached in {timeout_s} s")
        await asyncio.sleep(THREAD_POLL_S)


async def until_spin(condition: Callable[[], bool], what: str = "condition", timeout_s: float = 30.0,
                     release_s: float = 0.0) -> None:
    """Until ``condition()`` holds, checked at every loop turn (``sleep(0)``), where the first turn
    it holds matters (a window a later step must land in) and a thread makes it hold: bounded in
    seconds, not turns. A bound of 2,000 turns failed in CI: under load the read threads, starved of
    the GIL by the spinning loop, took longer than 2,000 turns to end their reads.

    ``release_s`` > 0: each turn the condition does not hold, the loop thread also sleeps that long
    (``time.sleep``: the GIL released for that time, the loop blocked, so still one check a turn).
    Without it the spin lets go of the GIL only inside the selector's zero-timeout poll, about a
    microsecond a turn; a thread waiting for the GIL must wake and take it within that microsecond,
    and CPython's forced switch never comes to its help (it is asked for only after a switch
    interval in which nobody took the GIL, and the spin takes it again every turn). On a loaded host
    the thread's wake-up can be slower than that window: a listing thread that takes the GIL back
    after each of 4,100 stats had not ended after 30 s on a 16-core host (review 198's test). Use it
    where a thread that takes the GIL often must make the condition hold."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} not reached in {timeout_s} s")
        if release_s > 0:
            time.sleep(release_s)  # noqa: ASYNC251 (blocking on purpose: the GIL free for the thread, no turn skipped)
        await asyncio.sleep(0)


async def cancel_within(tasks: Collection[asyncio.Task[Any]], timeout_s: float) -> set[asyncio.Task[Any]]:
    """Cancel ``tasks`` and wait up to ``timeout_s`` for them to end; returns those still running
    (a task that ignores its cancel, waiting on a future nobody resolves, is reported instead of
    hanging the caller). The ended ones' exceptions are retrieved."""
    for task in tasks:
        task.cancel()
    if not tasks:
        return set()
    done, stuck = await asyncio.wait(tasks, timeout=timeout_s)
    for task in done:
        if not task.cancelled():
            task.exception()
    return stuck


def cancel_every_task_but_nowait(*spared: asyncio.Task[Any] | None) -> list[asyncio.Task[Any]]:
    """Cancel every other task of the loop that is not done (those of the code under test included),
    as an application's SIGTERM handler does, in this step (none of them runs before the caller's
    next await); returns them."""
    cut = [task for task in asyncio.all_tasks() if task not in spared and not task.done()]
    for task in cut:
        task.cancel()
    return cut


async def cancel_every_task_but(*spared: asyncio.Task[Any] | None, timeout_s: float = 10.0) -> int:
    """As :func:`cancel_every_task_but_nowait`, then wait up to ``timeout_s`` until they ended
    (``AssertionError`` naming those still running); returns how many were cancelled."""
    cut = cancel_every_task_but_nowait(*spared)
    if cut:
        _done, pending = await asyncio.wait(cut, timeout=timeout_s)
        assert not pending, pending
    return len(cut)


SETTLE_TURNS = 3
"""Loop turns run before a check of :class:`LoopReports`: a thread's outcome posted with
``call_soon_threadsafe`` reaches its future, and the callbacks that future schedules (a shield's, a
gather's) run, so what they leave unretrieved is garbage by the collection that follows."""


@dataclass
class LoopReports:
    """The contexts the running loop's exception handler got while :func:`no_loop_reports` was in
    force: "Future/Task exception was never retrieved" (asyncio reports it when the future is freed:
    at once when its last reference goes, or only at a garbage collection when it sits in a cycle,
    as a task and its coroutine's frame do), an exception raised in a callback or a protocol
    method, anything else given to ``loop.call_exception_handler``."""

    what: str
    """The failure's message: what a report here means for the test."""
    contexts: list[dict[str, Any]] = field(default_factory=list)

    def _handle(self, _loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        self.contexts.append(context)

    async def assert_none(self, turns: int = SETTLE_TURNS) -> None:
        """Run ``turns`` loop turns, collect garbage (``gc.collect()``: the reports of dropped futures
        in cycles come only then), then ``AssertionError`` if any report came so far."""
        for _ in range(turns):
            await asyncio.sleep(0)
        gc.collect()
        assert not self.contexts, f"{self.what}: {[_summary(context) for context in self.contexts]}"


def _summary(context: dict[str, Any]) -> str:
    return f"{context.get('message')!s}: {context.get('exception')!r}"


@contextlib.asynccontextmanager
async def no_loop_reports(what: str = "unhandled exceptions in the loop",
                          turns: int = SETTLE_TURNS) -> AsyncIterator[LoopReports]:
    """Collect what reaches the running loop's exception handler inside the block, and fail (a
    test failure naming ``what``) if anything did: checked at each ``await reports.assert_none()``
    the block makes and when the block ends, after ``turns`` loop turns and a ``gc.collect()``. The
    previous handler is restored at the end; if the block raises (a failure, ``pytest.skip``), what
    was collected goes on to that handler, so nothing is swallowed.

    The suite's ``loop_hygiene`` fixture (tests/conftest.py) fails a test that leaves a report in
    its loop too, but only after the test and the other fixtures' teardowns, as an error of its own.
    This checks where the test says: after the fault's thread ended and the futures it concerns were
    dropped, before the test's close, unmount or other teardown, and in a loop that fixture does not
    watch (the test's own ``asyncio.Runner`` in a synchronous test)."""
    loop = asyncio.get_running_loop()
    reports = LoopReports(what)
    previous = loop.get_exception_handler()
    loop.set_exception_handler(reports._handle)
    try:
        yield reports
    except BaseException:
        loop.set_exception_handler(previous)
        for context in reports.contexts:
            loop.call_exception_handler(context)
        raise
    try:
        await reports.assert_none(turns)
    finally:
        loop.set_exception_handler(previous)
