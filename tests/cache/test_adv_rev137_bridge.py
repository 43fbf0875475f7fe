"""Adversarial review of CPU copies' outcomes through the bridge's inbox (helper-137).

Real copy thread, real loops, real cancels: a copy's outcome posted while the loop is held, the
future cancelled by its caller before :meth:`CompletionBridge.withdraw`, an exception no asyncio
future accepts, close with outcomes still in the inbox, a loop that closes under a running copy,
and a cache load cancelled while its copy is queued, running or just finished (outcome undrained).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, make_kv, prompt
from cancel_points import most_attempts, pause

from aiokv import KVCache
from aiokv.cuda import CompletionBridge

T = LAYOUT.page_tokens


@pytest.fixture
def bridge() -> Iterator[CompletionBridge]:
    made = CompletionBridge()
    made.prestart(False)
    yield made
    made.close()


def _hold(until: Callable[[], bool]) -> None:
    """On the loop's thread: hold it (no callback runs) until ``until()``, bounded."""
    deadline = time.monotonic() + 10
    while not until():
        assert time.monotonic() < deadline, "the copy thread never got there"
        time.sleep(0.001)


def _idle(bridge: CompletionBridge) -> bool:
    """Every copy submitted so far has ended (a no-op job queued behind them ran)."""
    marker = bridge._cpu_executor().submit(int)
    try:
        marker.result(10)
    except Exception:
        return False
    return True


@pytest.mark.asyncio
async def test_withdraw_after_the_caller_cancelled_the_future_stops_a_queued_copy(bridge: CompletionBridge) -> None:
    # run_cpu's contract: cancelling the future does not stop the copy; withdraw does, and tells
    # whether it can still run. The future's done callback (_forget_cpu) dropped the job as soon as
    # the caller's cancel settled it, so withdraw() answered True ("never runs") without cancelling
    # anything, and the queued copy then ran: into slots its caller had given up. Before 7d4186a the
    # job stayed known until the copy ended and withdraw() cancelled it.
    gate = threading.Event()
    wrote: list[str] = []
    blocker = bridge.run_cpu(lambda: gate.wait(10))
    copy = bridge.run_cpu(lambda: wrote.append("into the caller's slots"))
    copy.cancel()  # e.g. a task awaiting it was cancelled
    await asyncio.sleep(0)  # the future's done callbacks run
    never_runs = bridge.withdraw(copy)
    gate.set()
    await blocker
    assert _idle(bridge)
    assert never_runs == (not wrote), f"withdraw said never_runs={never_runs}, the copy ran: {wrote}"
    assert never_runs and not wrote


@pytest.mark.asyncio
async def test_withdraw_of_a_cancelled_future_whose_copy_runs_says_it_may_run(bridge: CompletionBridge) -> None:
    # The same with the copy already running: withdraw() must answer False (running or over).
    gate, started = threading.Event(), threading.Event()

    def copy_fn() -> None:
        started.set()
        gate.wait(10)

    copy = bridge.run_cpu(copy_fn)
    assert started.wait(10)
    copy.cancel()
    await asyncio.sleep(0)
    try:
        assert bridge.withdraw(copy) is False, "withdraw said a running copy never runs"
    finally:
        gate.set()
    assert _idle(bridge)
    assert bridge.withdraw(copy) is False  # over: still not "never ran"


class _Stop(StopIteration):
    pass


@pytest.mark.parametrize("stop", [StopIteration, _Stop], ids=["StopIteration", "subclass"])
@pytest.mark.asyncio
async def test_a_copy_raising_stop_iteration_strands_no_other_outcome(
    bridge: CompletionBridge, stop: type[StopIteration]
) -> None:
    # asyncio futures refuse StopIteration (TypeError in set_exception). Posted in one batch with
    # other copies' outcomes, it raised out of the inbox's drain and every outcome after it in that
    # batch was dropped: their futures never resolved (a hang). Each copy must settle; the failing
    # one with an error.
    gate = threading.Event()

    def stops() -> None:
        raise stop  # a subclass too: a future refuses every StopIteration

    blocker = bridge.run_cpu(lambda: gate.wait(10))
    failing = bridge.run_cpu(stops)
    later = [bridge.run_cpu(lambda i=i: i) for i in range(3)]  # type: ignore[misc]
    gate.set()
    _hold(lambda: _idle(bridge))  # every outcome is in the inbox: one drain takes them all
    _, pending = await asyncio.wait([blocker, failing, *later], timeout=5)
    assert not pending, f"{len(pending)} outcomes never reached the loop"
    assert [f.result() for f in later] == [0, 1, 2]
    with pytest.raises(RuntimeError):
        failing.result()


@pytest.mark.asyncio
async def test_outcomes_keep_submission_order_and_survive_close(bridge: CompletionBridge) -> None:
    # Copies ending while the loop is held, then the bridge closed (on the loop, as the cache does)
    # before the loop drained: every future still resolves, in submission order, nothing hangs.
    gate = threading.Event()
    order: list[int] = []
    blocker = bridge.run_cpu(lambda: gate.wait(10))
    copies = [bridge.run_cpu(lambda i=i: i) for i in range(20)]  # type: ignore[misc]
    for f in copies:
        f.add_done_callback(lambda f: order.append(f.result()))
    gate.set()
    _hold(lambda: _idle(bridge))
    closer = threading.Thread(target=bridge.close)
    closer.start()
    closer.join(10)
    assert not closer.is_alive(), "close hung"
    _, pending = await asyncio.wait([blocker, *copies], timeout=5)
    assert not pending
    assert order == list(range(20))


def test_a_loop_closing_under_a_running_copy_leaves_no_error_in_the_copy_thread(
        caplog: pytest.LogCaptureFixture) -> None:
    bridge = CompletionBridge()
    gate, started = threading.Event(), threading.Event()
    errors: list[threading.ExceptHookArgs] = []
    previous, threading.excepthook = threading.excepthook, errors.append
    try:
        loop = asyncio.new_event_loop()

        def copy_fn() -> int:
            started.set()
            gate.wait(10)
            return 1

        async def start() -> asyncio.Future[int]:
            return bridge.run_cpu(copy_fn)

        with caplog.at_level(logging.DEBUG):
            orphan = loop.run_until_complete(start())
            assert started.wait(10)
            loop.close()
            gate.set()
            assert _idle(bridge)

            async def again() -> int:  # the copy thread still serves a new loop
                return await asyncio.wait_for(bridge.run_cpu(lambda: 2), 10)

            assert asyncio.run(again()) == 2
            bridge.close()
        assert not orphan.done()
    finally:
        threading.excepthook = previous
        gate.set()
    assert not errors, errors
    bad = [r for r in caplog.records if r.levelno >= logging.WARNING or "closed" in r.getMessage()]
    assert not bad, [r.getMessage() for r in bad]


@pytest.mark.asyncio
async def test_a_load_cancelled_at_any_point_of_its_copies_writes_nothing_after_the_cancel() -> None:
    # Launch groups of one page on the copy thread: cancelled after growing waits (queued, running,
    # finished with the outcome still in the inbox), the slots never change after CancelledError,
    # and the cache ends quiescent.
    kv = make_kv(70)
    tokens = prompt(70, 8 * T)
    async with KVCache(config(None, pool_pages=16, launch_pages=1, launch_turn_s=0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(8 * T))
        target = torch.arange(120, 120 + 8 * T)
        bridge = cache._bridge
        dense = 12
        finished = 0
        for attempt in range(most_attempts(dense)):
            kv[:, target] = 0
            match = await cache.match(tokens)
            task = asyncio.create_task(cache.load(match, target))
            await pause(attempt, dense)
            if attempt % 3 == 2:
                _hold(lambda: _idle(bridge))  # what was queued ended; its outcomes wait for the loop
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                if not match.released:
                    match.release()  # cancelled before the load took it
                snapshot = kv[:, target].clone()
                assert _idle(bridge)  # the copy thread is drained: a late copy would have run by now
                assert torch.equal(kv[:, target], snapshot), f"a copy wrote the slots after the cancel ({attempt})"
            else:
                finished += 1
                if finished > 3:
                    break
        await assert_quiescent(cache)
