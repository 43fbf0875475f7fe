"""CompletionBridge hands completions to the loop in batches, and its waiters never spin.

The events are host stand-ins that behave like CUDA's where the bridge relies on it: ``synchronize``
blocks with the GIL released (a ``threading.Event`` wait, as a blocking-sync event sleeps in the
driver) and ``query`` is a cheap non-blocking check. Real waiter threads, real loops.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from aiokv.cuda import CompletionBridge, Lane


class _Gated:
    """Completes when ``gate`` is set; ``fail``: synchronize raises and query reports the error too
    (a CUDA error is sticky: cudaEventQuery returns it as well)."""

    def __init__(self, gate: threading.Event, fail: bool = False) -> None:
        self.gate = gate
        self.fail = fail
        self.syncs = 0

    def query(self) -> bool:
        if self.fail and self.gate.is_set():
            raise RuntimeError("injected CUDA error (query)")
        return self.gate.is_set()

    def synchronize(self) -> None:
        self.syncs += 1
        assert self.gate.wait(10), "the test never completed this event"
        if self.fail:
            raise RuntimeError("injected CUDA error")


def _count_handovers(loop: asyncio.AbstractEventLoop) -> list[int] | None:
    """Count ``call_soon_threadsafe`` calls (each one a self-pipe write: a loop wake-up). None on
    loops whose methods cannot be wrapped (uvloop)."""
    calls = [0]
    original = loop.call_soon_threadsafe

    def counted(callback: Callable[..., object], *args: Any, **kwargs: Any) -> asyncio.Handle:
        calls[0] += 1
        return original(callback, *args, **kwargs)

    try:
        loop.call_soon_threadsafe = counted  # type: ignore[method-assign,assignment]
    except AttributeError:
        return None
    return calls


def _restore(loop: asyncio.AbstractEventLoop) -> None:
    if "call_soon_threadsafe" in getattr(loop, "__dict__", {}):
        del loop.call_soon_threadsafe


@pytest.fixture
def bridge() -> Iterator[CompletionBridge]:
    made = CompletionBridge()
    made.prestart(True)
    yield made
    made.close()
    assert not any(t.is_alive() for t in made._threads)


def _block_loop_until(done: Callable[[], bool]) -> None:
    """On the loop's thread: hold it (no callback runs) until ``done()``, bounded."""
    deadline = time.monotonic() + 10
    while not done():
        assert time.monotonic() < deadline, "the waiter threads never got there"
        time.sleep(0.001)


@pytest.mark.asyncio
async def test_events_completing_together_cost_one_wakeup(bridge: CompletionBridge) -> None:
    # A layer-wise load's layers often land together (or while the loop is busy): one hand-over to
    # the loop for all of them, not one self-pipe write, handle and GIL grab each. Fails on the
    # per-event call_soon_threadsafe (32 calls).
    loop = asyncio.get_running_loop()
    gate = threading.Event()
    events = [_Gated(gate) for _ in range(32)]
    calls = _count_handovers(loop)
    try:
        futures = [bridge.wait(event, Lane.LOAD) for event in events]  # type: ignore[arg-type]
        gate.set()
        await asyncio.wait_for(asyncio.gather(*futures), 10)
    finally:
        _restore(loop)
    if calls is not None:
        assert calls[0] == 1, calls
    assert bridge.completed == 32
    # Only the oldest is waited for; those behind it were found completed by a query.
    assert events[0].syncs == 1 and sum(e.syncs for e in events[1:]) == 0


@pytest.mark.asyncio
async def test_no_second_wakeup_while_one_is_pending(bridge: CompletionBridge) -> None:
    # Two lanes complete while the loop is held: the second finds a hand-over already scheduled and
    # only adds to it. Fails on the per-event call_soon_threadsafe (2 calls).
    loop = asyncio.get_running_loop()
    first, second = threading.Event(), threading.Event()
    calls = _count_handovers(loop)
    try:
        load = bridge.wait(_Gated(first), Lane.LOAD)  # type: ignore[arg-type]
        offload = bridge.wait(_Gated(second), Lane.OFFLOAD)  # type: ignore[arg-type]
        first.set()
        _block_loop_until(lambda: bridge.completed == 1)
        second.set()
        _block_loop_until(lambda: bridge.completed == 2)
        assert not load.done() and not offload.done()  # only the loop resolves them
        await asyncio.wait_for(asyncio.gather(load, offload), 10)
    finally:
        _restore(loop)
    if calls is not None:
        assert calls[0] == 1, calls


@pytest.mark.asyncio
async def test_a_completion_after_a_drain_wakes_the_loop_again(bridge: CompletionBridge) -> None:
    # The pending flag is cleared when the batch is taken: a later completion is not lost behind it.
    gate = threading.Event()
    for _ in range(3):
        gate.clear()
        future = bridge.wait(_Gated(gate), Lane.LOAD)  # type: ignore[arg-type]
        gate.set()
        await asyncio.wait_for(future, 10)
    assert bridge.completed == 3


@pytest.mark.asyncio
async def test_failed_and_cancelled_events_in_a_batch(bridge: CompletionBridge) -> None:
    # A failed event raises in its own future only and counts as completed, as before; a waiter
    # cancelled meanwhile is left alone; the others resolve.
    gate = threading.Event()
    events = [_Gated(gate), _Gated(gate, fail=True), _Gated(gate), _Gated(gate)]
    futures = [bridge.wait(event, Lane.LOAD) for event in events]  # type: ignore[arg-type]
    futures[2].cancel()
    gate.set()
    done, _ = await asyncio.wait(futures, timeout=10)
    assert len(done) == 4
    assert futures[0].result() is None and futures[3].result() is None
    with pytest.raises(RuntimeError, match="injected CUDA error"):
        futures[1].result()
    assert futures[2].cancelled()
    assert bridge.completed == 4


@pytest.mark.asyncio
async def test_waiter_does_not_spin_while_the_next_event_runs(bridge: CompletionBridge) -> None:
    # The rule (#10): a waiter thread blocks while copies are in flight. After the first
    # event, the waiter takes the next one off its queue, finds it still running (query) and must
    # then block in synchronize, not poll it.
    first, second = threading.Event(), threading.Event()
    a = bridge.wait(_Gated(first), Lane.LOAD)  # type: ignore[arg-type]
    later = _Gated(second)
    b = bridge.wait(later, Lane.LOAD)  # type: ignore[arg-type]
    first.set()
    await asyncio.wait_for(a, 10)
    lane = next(t for t in bridge._threads if t.name == "aiokv-cuda-load")
    assert lane.ident is not None
    clock = time.pthread_getcpuclockid(lane.ident)
    _block_loop_until(lambda: later.syncs == 1)  # blocked in the second synchronize
    cpu, wall = time.clock_gettime(clock), time.monotonic()
    await asyncio.sleep(0.2)  # the window the waiter's CPU is measured over
    cpu, wall = time.clock_gettime(clock) - cpu, time.monotonic() - wall
    assert cpu < 0.05 * wall, f"the waiter used {cpu * 1e3:.1f} ms of CPU in {wall * 1e3:.0f} ms"
    second.set()
    await asyncio.wait_for(b, 10)


def test_completion_after_the_loop_closed_leaves_the_waiter_working() -> None:
    # Nobody waits on a closed loop: the hand-over fails quietly, the waiter goes on, close returns.
    bridge = CompletionBridge()
    bridge.prestart(True)
    gate = threading.Event()
    errors: list[threading.ExceptHookArgs] = []
    previous, threading.excepthook = threading.excepthook, errors.append
    try:
        loop = asyncio.new_event_loop()

        async def start() -> asyncio.Future[None]:
            return bridge.wait(_Gated(gate), Lane.LOAD)  # type: ignore[arg-type]

        orphan = loop.run_until_complete(start())
        loop.close()
        gate.set()
        _block_loop_until(lambda: bridge.completed == 1)
        assert not orphan.done()

        async def again() -> None:  # the same waiter still serves a new loop
            await asyncio.wait_for(bridge.wait(_Gated(gate), Lane.LOAD), 10)  # type: ignore[arg-type]

        asyncio.run(again())
        closer = threading.Thread(target=bridge.close)
        closer.start()
        closer.join(10)
        assert not closer.is_alive(), "close hung"
    finally:
        threading.excepthook = previous
    assert not errors, errors
    assert bridge.completed == 2


@pytest.mark.asyncio
async def test_values_settled_from_a_thread_share_one_wakeup(bridge: CompletionBridge) -> None:
    # A thread settling many futures in a row (a paced load's feeder as it queues each layer) wakes
    # the loop once: one call_soon_threadsafe per future before (32 here).
    loop = asyncio.get_running_loop()
    layers: list[asyncio.Future[bool]] = [loop.create_future() for _ in range(32)]
    layers[5].cancel()  # a consumer gave up on it: left alone
    calls = _count_handovers(loop)
    try:
        def settle_all() -> None:
            for i, f in enumerate(layers):
                bridge.resolve_threadsafe(f, i % 3 != 0)

        feeder = threading.Thread(target=settle_all)
        feeder.start()
        _block_loop_until(lambda: not feeder.is_alive())  # all settled while the loop is held
        assert not any(f.done() for i, f in enumerate(layers) if i != 5)  # only the loop resolves them
        await asyncio.wait_for(asyncio.gather(*(f for i, f in enumerate(layers) if i != 5)), 10)
    finally:
        _restore(loop)
    if calls is not None:
        assert calls[0] == 1, calls
    assert [f.result() for i, f in enumerate(layers) if i != 5] == [i % 3 != 0 for i in range(32) if i != 5]
    assert layers[5].cancelled()


def test_value_settled_after_its_loop_closed_is_dropped() -> None:
    bridge = CompletionBridge()
    loop = asyncio.new_event_loop()
    future: asyncio.Future[bool] = loop.create_future()
    loop.close()
    bridge.resolve_threadsafe(future, True)  # no loop to run it: nothing, and no error
    assert not future.done()

    async def later() -> bool:  # the bridge serves a new loop afterwards
        fresh: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        bridge.resolve_threadsafe(fresh, True)
        return await asyncio.wait_for(fresh, 10)

    assert asyncio.run(later()) is True
    bridge.close()


@pytest.mark.asyncio
async def test_cpu_copies_ending_together_cost_one_wakeup(bridge: CompletionBridge) -> None:
    # A load's launch groups queued on the copy thread end one after another while the loop waits:
    # their outcomes go through the inbox, one self-pipe write (a loop wake-up, the GIL handed to the
    # loop) for those that ended before the loop drained. A failed copy raises in its own future,
    # a withdrawn one never runs. Fails on the per-copy call_soon_threadsafe (7 calls: the withdrawn one too).
    loop = asyncio.get_running_loop()
    gate = threading.Event()
    ran: list[int] = []

    def failing() -> None:
        raise RuntimeError("injected copy fault")

    calls = _count_handovers(loop)
    try:
        held = bridge.run_cpu(lambda: gate.wait(10))
        copies = [bridge.run_cpu(lambda i=i: ran.append(i)) for i in range(4)]  # type: ignore[misc]
        failed = bridge.run_cpu(failing)
        withdrawn = bridge.run_cpu(lambda: ran.append(-1))
        assert bridge.withdraw(withdrawn) and withdrawn.cancelled()
        gate.set()
        _block_loop_until(lambda: all(job.done() for job in bridge._cpu_jobs.values()))
        assert not any(f.done() for f in [held, *copies, failed])  # only the loop resolves them
        done, _ = await asyncio.wait([held, *copies, failed], timeout=10)
    finally:
        _restore(loop)
    assert len(done) == 6 and ran == [0, 1, 2, 3]
    assert held.result() is True and all(f.result() is None for f in copies)
    with pytest.raises(RuntimeError, match="injected copy fault"):
        failed.result()
    if calls is not None:
        assert calls[0] == 1, calls
    assert not bridge._cpu_jobs  # every entry dropped once its future was done
