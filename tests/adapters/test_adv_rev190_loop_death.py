"""The adapters' loop thread dying, as review 184's seeded damage runs met it (200 seeds).

- A job submitted as the first call after a death nobody had seen yet was reported twice: ``_start``
  put it among the unreported jobs, its own ``_reap`` answered every unreported job (it too), and
  ``_start`` answered it again. vLLM's manager asserts on the second ("Finished job_id N ... not in
  _jobs"): the engine's step failed.
- A second ``SystemExit`` queued on the loop before the first ran (two deaths) escaped the dying
  thread's end: the work in flight was never cancelled, the loop never closed, and a caller waiting
  in ``run`` (``drain_jobs``' quiesce) waited for good.
- A caller waiting in ``run`` while the loop died got ``CancelledError`` (the death cancels the
  coroutine) instead of ``LoopDied``: the adapters catch ``LoopDied``, so the error reached the
  engine's thread (SGLang's lookups, vLLM's drain).
- A poll queued behind the death (a wake-up, a poll timer) ran while the end waited for the
  cancelled work and started posted work after the end's snapshot: it ran on, never cancelled or
  awaited, and the loop closed under it (a vLLM promotion's read into a chunk vLLM was told had
  failed). Work posted as the loop ended, after its end had dropped the inbox, stayed there unclosed.

The deaths are real: a callback lets ``SystemExit`` out on the loop thread."""

from __future__ import annotations

import asyncio
import collections
import gc
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiokv.adapters.loopthread import LoopDied, LoopThread

BOUND_S = 10.0


def _die() -> None:
    raise SystemExit("injected: the loop thread ends")


async def _held(started: threading.Event) -> int:
    started.set()
    await asyncio.sleep(60)
    return 1


def _run_in_thread(thread: LoopThread, started: threading.Event) -> tuple[threading.Thread, list[BaseException]]:
    raised: list[BaseException] = []

    def call() -> None:
        try:
            thread.run(_held(started), timeout=BOUND_S)
        except BaseException as exc:  # the outcome under test
            raised.append(exc)

    caller = threading.Thread(target=call, name="rev190-caller")
    caller.start()
    assert started.wait(BOUND_S), "the coroutine never started"
    return caller, raised


@pytest.mark.parametrize("deaths", [1, 2])
def test_a_caller_waiting_in_run_gets_loop_died_when_the_loop_dies(deaths: int) -> None:
    thread = LoopThread("rev190")
    try:
        caller, raised = _run_in_thread(thread, threading.Event())
        # Both deaths queued in one hand-over: the second runs while the first death ends the loop.
        thread.loop.call_soon_threadsafe(lambda: [thread.loop.call_soon(_die) for _ in range(deaths)])
        caller.join(BOUND_S + 5)
        assert not caller.is_alive()
        assert len(raised) == 1 and isinstance(raised[0], LoopDied), raised  # not CancelledError, not a timeout
        assert thread.wait_ended(BOUND_S) and thread.dead
        assert thread.loop.is_closed()  # the end went through: work cancelled, loop closed
        with pytest.raises(LoopDied):
            thread.run(_held(threading.Event()))
    finally:
        thread.close()


def test_a_second_death_during_the_end_still_answers_every_caller() -> None:
    thread = LoopThread("rev190")
    try:
        futures = [thread.submit(_held(threading.Event())) for _ in range(3)]
        late = thread.call(lambda: 1)  # may run before the deaths: then it is answered 1
        thread.loop.call_soon_threadsafe(lambda: [thread.loop.call_soon(_die) for _ in range(2)])
        for future in futures:
            with pytest.raises(LoopDied):
                future.result(BOUND_S)
        assert late.result(BOUND_S) == 1
        assert thread.wait_ended(BOUND_S) and thread.loop.is_closed()
    finally:
        thread.close()


def test_posted_work_is_never_started_by_a_poll_queued_behind_the_death() -> None:
    thread = LoopThread("rev190")
    started: list[str] = []

    async def work() -> None:
        started.append("started")
        await asyncio.Event().wait()  # never set: this work must never start
        started.append("finished")

    def die_then_poll() -> None:  # on the loop: the death, then a poll (as wake() queues one)
        thread.loop.call_soon(_die)
        thread.post(work())
        thread.loop.call_soon(thread._poll)

    try:
        thread.loop.call_soon_threadsafe(die_then_poll)
        assert thread.wait_ended(BOUND_S) and thread.loop.is_closed()
        gc.collect()  # a coroutine left unclosed would warn (an error here) when collected
        assert started == []
        assert thread.pending() == 0
    finally:
        thread.close()


def test_work_posted_as_the_loop_ends_is_closed_not_left_behind() -> None:
    thread = LoopThread("rev190")
    closed: list[bool] = []

    class DyingInbox(collections.deque[Any]):
        def append(self, item: Any) -> None:  # the death lands between post's check and its append
            if not closed:
                closed.append(False)
                thread.loop.call_soon_threadsafe(_die)
                assert thread.wait_ended(BOUND_S)
            super().append(item)

    async def work() -> None:
        raise AssertionError("never started")

    thread._inbox = DyingInbox(thread._inbox)
    try:
        coro = work()
        thread.post(coro)  # passed the check while alive: no LoopDied, the owner answers for it
        assert thread.pending() == 0
        assert coro.cr_frame is None  # closed unstarted, not left in the inbox for good
    finally:
        thread.close()


vllm = pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                           reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm.v1.kv_offload.base import ReqContext  # noqa: E402
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob  # noqa: E402
from vllm_helpers import keys_of, make_manager, tier_of  # noqa: E402


@pytest.mark.parametrize("load", [False, True])
def test_a_job_submitted_first_after_an_unseen_death_is_reported_once(
        tmp_path: Path, managers: list[Any], load: bool) -> None:
    managers.append(manager := make_manager(tmp_path))
    tier = tier_of(manager)
    thread = tier._store.thread
    thread.loop.call_soon_threadsafe(_die)
    assert thread.wait_ended(BOUND_S) and thread.dead  # ended; no tier call has seen it yet
    ctx = ReqContext(req_id="r1")
    job = TransferJob(job_id=7, keys=keys_of("rev190", 2), chunk_ids=np.array([0, 1], dtype=np.int64),
                      is_promotion=load, req_context=ctx)
    with manager.lock:
        manager.on_new_request(ctx)
        (tier.submit_load if load else tier.submit_store)(job)
        assert list(tier.get_finished_jobs()) == [JobResult(job_id=7, success=False)]
        assert list(tier.get_finished_jobs()) == []
        assert not tier.has_pending_work()
        manager.on_request_finished(ctx)
