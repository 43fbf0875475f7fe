"""Review 192 of the loop thread's end (72678f2, 4d850b5): work handed over just before a death.

- A ``submit`` that passed its check while the loop was alive (blocked in a callback) queued its
  start behind the death: the end's snapshot of the tasks to cancel was taken before it existed,
  so the coroutine started afterwards (while the end ran the loop for its finalizers or async
  generators), was never cancelled or awaited, and the loop closed under it, while its caller was
  answered ``LoopDied`` (a copy into the engine's memory still in flight after the engine was told
  it ended).
- A ``quiesce`` so queued (vLLM's ``drain_jobs``) started after the end's snapshot, found posted
  work refused (``_take_inbox`` refuses once ending) and nothing running, and returned normally:
  the drain said every posted job had run while the end dropped them unstarted.
- A ``call`` so queued ran its function on the ending loop: work it started (the store's
  ``register_memory`` starts a task) ran on uncancelled, and the caller got an answer.
- ``post_call`` had no check after its append (``post`` has): a function appended after the end
  dropped the inbox stayed there for good.
- A ``submit`` that passed its check before a :meth:`close`, its start queued after the end's last
  run of the loop and before the loop closed (which drops what is queued): nothing answered its
  future (the end answers waiting callers only after a death), and a ``run`` caller (an SGLang
  lookup racing the backend's close) waited for good.
- A caller's own ``future.cancel()`` stays ``CancelledError`` (``_answer`` turns only the death's
  cancellation into ``LoopDied``): a check.

The deaths are real: a callback lets ``SystemExit`` out on the loop thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any

import pytest

from aiokv.adapters.loopthread import LoopDied, LoopThread

BOUND_S = 10.0


def _hold_then_die(thread: LoopThread) -> threading.Event:
    """Block the loop thread in a callback until the returned event is set, then let
    ``SystemExit`` out of it (the loop dies); returns once the loop is blocked."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(BOUND_S)
        raise SystemExit("injected: the loop thread ends")

    thread.loop.call_soon_threadsafe(hold)
    assert held.wait(BOUND_S), "the loop never ran the callback"
    return release


def test_work_submitted_just_before_a_death_never_runs_past_the_end() -> None:
    thread = LoopThread("rev192-submit")
    started, ended = threading.Event(), threading.Event()

    async def copy() -> int:  # stands for a transfer into the engine's memory
        started.set()
        try:
            await asyncio.sleep(60)
        finally:
            ended.set()
        return 1

    release = _hold_then_die(thread)
    future = thread.submit(copy())  # the loop is alive (blocked): the check passes, the start queues
    release.set()
    assert thread.wait_ended(BOUND_S), "the dying loop never ended"
    with pytest.raises(LoopDied):
        future.result(BOUND_S)
    # Told LoopDied: the copy never started, or ended (its cleanup ran) before the loop closed.
    assert not started.is_set() or ended.is_set(), "the submitted copy ran on past the loop's end, never cancelled"
    thread.close()


def test_a_quiesce_queued_behind_a_death_does_not_report_posted_work_done() -> None:
    thread = LoopThread("rev192-quiesce")
    ran = threading.Event()

    async def job() -> None:
        ran.set()

    release = _hold_then_die(thread)
    thread.post(job())  # posted while the loop is blocked: never picked up before the death
    outcome: list[object] = []

    def drain() -> None:
        try:
            thread.quiesce(BOUND_S)
            outcome.append("returned")
        except BaseException as exc:  # the outcome under test
            outcome.append(exc)

    drainer = threading.Thread(target=drain, name="rev192-drain")
    drainer.start()
    deadline = time.monotonic() + BOUND_S
    while thread.wait_answered(0.01):  # until quiesce's submit is handed over (bounded)
        assert time.monotonic() < deadline, "quiesce never submitted"
    release.set()
    drainer.join(BOUND_S)
    assert not drainer.is_alive(), "quiesce hung"
    assert thread.wait_ended(BOUND_S)
    assert not ran.is_set()
    assert len(outcome) == 1 and isinstance(outcome[0], LoopDied), (
        f"quiesce said the posted job ran, yet it was dropped unstarted: {outcome!r}")
    assert thread.pending() == 0
    thread.close()


def test_a_callers_own_cancel_stays_cancelled_error() -> None:
    thread = LoopThread("rev192-cancel")
    started, cancelled = threading.Event(), threading.Event()

    async def held() -> int:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 1

    try:
        future = thread.submit(held())
        assert started.wait(BOUND_S)
        assert future.cancel()
        with pytest.raises(concurrent.futures.CancelledError):
            future.result(BOUND_S)
        assert cancelled.wait(BOUND_S), "the caller's cancel never reached the coroutine"
        assert thread.died is None
        assert thread.wait_answered(BOUND_S)
    finally:
        thread.close()


def test_a_call_queued_behind_a_death_does_not_run_on_the_ending_loop() -> None:
    # A plain function may start work of its own (the store's register_memory starts the
    # registration of the engine's region as a task): run during the end, after its snapshot, that
    # work ran on uncancelled; and the caller got an answer from a loop that had died.
    thread = LoopThread("rev192-call")
    ran = threading.Event()
    started, ended = threading.Event(), threading.Event()

    async def pin() -> None:  # stands for the region's registration
        started.set()
        try:
            await asyncio.sleep(60)
        finally:
            ended.set()

    def register() -> int:
        ran.set()
        asyncio.get_running_loop().create_task(pin())
        return 1

    release = _hold_then_die(thread)
    future = thread.call(register)  # the loop is alive (blocked): the check passes, the run queues
    release.set()
    assert thread.wait_ended(BOUND_S), "the dying loop never ended"
    assert not started.is_set() or ended.is_set(), "work the call started ran on past the loop's end"
    assert not ran.is_set(), "the call ran on a loop that had died"
    with pytest.raises(LoopDied):
        future.result(BOUND_S)
    thread.close()


def test_a_function_posted_as_the_loop_ends_is_dropped_not_left_behind() -> None:
    # post_call's check passed while the loop was alive; its append came after the end had dropped
    # the inbox. The interleaving is forced with a tracer on the posting thread (the death is real).
    import inspect
    import sys

    thread = LoopThread("rev192-post-call")
    lines, first = inspect.getsourcelines(LoopThread.post_call)
    append_line = first + next(i for i, line in enumerate(lines) if "self._inbox.append(fn)" in line)
    at_append, go = threading.Event(), threading.Event()
    ran = threading.Event()

    def tracer(frame: Any, event: str, arg: object) -> Any:
        if frame.f_code is not LoopThread.post_call.__code__:
            return None

        def local(frame: Any, event: str, arg: object) -> Any:
            if event == "line" and frame.f_lineno == append_line:
                at_append.set()
                go.wait(BOUND_S)
            return local
        return local

    def poster() -> None:
        sys.settrace(tracer)
        try:
            thread.post_call(ran.set)
        finally:
            sys.settrace(None)

    posting = threading.Thread(target=poster, name="rev192-poster")
    posting.start()
    assert at_append.wait(BOUND_S), "post_call never reached its append"
    thread.loop.call_soon_threadsafe(_die)
    assert thread.wait_ended(BOUND_S), "the dying loop never ended"
    go.set()
    posting.join(BOUND_S)
    assert not posting.is_alive()
    assert not ran.is_set()
    assert thread.pending() == 0, "a function posted as the loop ended was left in the inbox for good"
    thread.close()


def _die() -> None:
    raise SystemExit("injected: the loop thread ends")


def _pause_at(code: Any, needle: str, reached: threading.Event, go: threading.Event) -> Any:
    """A tracer (for ``sys.settrace``) pausing the thread at the line of ``code`` holding
    ``needle`` until ``go`` is set."""
    import inspect

    lines, first = inspect.getsourcelines(code)
    line_no = first + next(i for i, line in enumerate(lines) if needle in line)

    def tracer(frame: Any, event: str, arg: object) -> Any:
        if frame.f_code is not code.__code__:
            return None

        def local(frame: Any, event: str, arg: object) -> Any:
            if event == "line" and frame.f_lineno == line_no:
                reached.set()
                go.wait(BOUND_S)
            return local
        return local
    return tracer


def test_a_submit_racing_a_close_is_answered_not_left_waiting() -> None:
    # submit's check passed before the close; its start was queued after the end's last run of
    # the loop and before the loop closed (which drops what is queued): nothing answered the future,
    # and a run() caller (an SGLang lookup racing the backend's close) waited for good. The two
    # interleavings are forced with tracers on the submitting thread and the loop thread.
    import sys

    thread = LoopThread("rev192-submit-close")
    at_submit, submit_go = threading.Event(), threading.Event()
    at_close, close_go = threading.Event(), threading.Event()
    submit_tracer = _pause_at(LoopThread.submit, "asyncio.run_coroutine_threadsafe", at_submit, submit_go)
    end_tracer = _pause_at(LoopThread._end, "self._loop.close()", at_close, close_go)
    thread.loop.call_soon_threadsafe(sys.settrace, end_tracer)  # the loop thread's later frames (_end)
    outcome: list[object] = []

    async def look() -> int:
        return 1

    def caller() -> None:
        sys.settrace(submit_tracer)
        try:
            future = thread.submit(look())
        except BaseException as exc:  # refused: an outcome too
            outcome.append(exc)
            return
        finally:
            sys.settrace(None)
        try:
            outcome.append(future.result(BOUND_S))
        except BaseException as exc:  # the outcome under test
            outcome.append(exc)

    calling = threading.Thread(target=caller, name="rev192-caller")
    calling.start()
    assert at_submit.wait(BOUND_S), "submit never reached its hand-over"
    closing = threading.Thread(target=thread.close, name="rev192-closer")
    closing.start()
    assert at_close.wait(BOUND_S), "the loop's end never reached its close"
    submit_go.set()  # its start is queued now, on a loop about to close
    calling.join(0.5)  # bounded: only so the hand-over is done before the loop closes
    close_go.set()
    closing.join(BOUND_S)
    assert not closing.is_alive(), "close hung"
    calling.join(BOUND_S)
    assert not calling.is_alive(), "the caller still waits after close: its future was never answered"
    assert len(outcome) == 1 and isinstance(outcome[0], (concurrent.futures.CancelledError, RuntimeError)), outcome


def test_a_submit_refused_by_a_loop_closed_after_its_check_closes_the_callers_coroutine() -> None:
    # submit's check passed; the loop closed before its hand-over (which raised): it closed its
    # own wrapper, unstarted, which does not close the caller's coroutine (never awaited: a
    # RuntimeWarning at collection, an error under this suite's warning filters).
    import sys

    thread = LoopThread("rev192-submit-closed")
    at_submit, submit_go = threading.Event(), threading.Event()
    tracer = _pause_at(LoopThread.submit, "asyncio.run_coroutine_threadsafe", at_submit, submit_go)
    outcome: list[object] = []

    async def look() -> int:
        return 1

    coro = look()

    def caller() -> None:
        sys.settrace(tracer)
        try:
            thread.submit(coro)
        except BaseException as exc:  # the outcome under test
            outcome.append(exc)
        finally:
            sys.settrace(None)

    calling = threading.Thread(target=caller, name="rev192-caller")
    calling.start()
    try:
        assert at_submit.wait(BOUND_S)
        thread.close()  # the loop is closed now
        submit_go.set()
        calling.join(BOUND_S)
        assert not calling.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError), outcome
        assert coro.cr_frame is None, "the caller's coroutine was left unclosed (never awaited)"
    finally:
        submit_go.set()
        coro.close()


def test_a_submit_meeting_the_death_answers_only_itself_while_the_end_cancels_the_others() -> None:
    # A caller answered LoopDied is told its work ended: another submit that saw the death (the
    # hand-over done, its future not yet kept) must answer only its own future, not the callers
    # whose cancelled work the end still waits for (a transfer's cleanup waiting for its I/O).
    import sys

    thread = LoopThread("rev192-track")
    started, in_cleanup, cleanup_go = threading.Event(), threading.Event(), threading.Event()

    async def transfer() -> int:
        started.set()
        try:
            await asyncio.sleep(60)
        finally:
            in_cleanup.set()
            cleanup_go.wait(BOUND_S)  # the cancelled transfer waits for its I/O
        return 1

    other = thread.submit(transfer())
    assert started.wait(BOUND_S)
    at_track, track_go = threading.Event(), threading.Event()
    tracer = _pause_at(LoopThread.submit, "return self._track(future)", at_track, track_go)
    mine: list[object] = []

    async def look() -> int:
        return 1

    def caller() -> None:
        sys.settrace(tracer)
        try:
            mine.append(thread.submit(look()))
        except BaseException as exc:  # refused: an outcome too
            mine.append(exc)
        finally:
            sys.settrace(None)

    calling = threading.Thread(target=caller, name="rev192-caller")
    calling.start()
    try:
        assert at_track.wait(BOUND_S)
        thread.loop.call_soon_threadsafe(_die)
        assert in_cleanup.wait(BOUND_S), "the end never cancelled the transfer"
        track_go.set()
        calling.join(BOUND_S)
        assert not calling.is_alive()
        assert not other.done(), "a caller was answered while its cancelled transfer still ran"
        cleanup_go.set()
        with pytest.raises(LoopDied):
            other.result(BOUND_S)
        assert thread.wait_ended(BOUND_S)
    finally:
        track_go.set()
        cleanup_go.set()
        calling.join(BOUND_S)
        thread.close()
