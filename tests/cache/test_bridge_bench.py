"""tools/bench_bridge.py measures what it says: its stand-in events complete at their instant and not
before, and its hand-over count tells a per-event bridge from a batching one."""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "tools"))
from bench_bridge import BareWaiter, FakeEvent, _started, load_bridge_module, scenario


def _args(**over: object) -> argparse.Namespace:
    base: dict[str, object] = dict(samples=16, burst=4, interval_us=1200.0, layers=4, step_us=50.0, gap_ms=0.2,
                                   idle_ms=1.0, feeder_us=50.0, feeder_period_us=1000.0, step_calls=1,
                                   feeder_calls=4)
    base.update(over)
    return argparse.Namespace(**base)


def test_stand_in_event_sleeps_until_its_instant() -> None:
    # Until its instant: query says no and a thread in synchronize sleeps (no CPU: it neither spins
    # nor polls, so it does not take the GIL either); then it returns, stamped at or after it.
    event = FakeEvent(time.monotonic() + 0.2)
    assert not event.query()
    waiter = threading.Thread(target=event.synchronize)
    waiter.start()
    assert waiter.ident is not None
    clock = time.pthread_getcpuclockid(waiter.ident)
    cpu = time.clock_gettime(clock)
    while time.monotonic() < event.deadline - 0.05:
        pass  # this thread runs Python meanwhile
    cpu = time.clock_gettime(clock) - cpu
    assert waiter.is_alive() and not event.query()
    assert cpu < 0.02, cpu
    waiter.join(5)
    assert event.noticed >= event.deadline and event.query()
    failing = FakeEvent(time.monotonic(), fail=True)
    with pytest.raises(RuntimeError, match="injected"):
        failing.synchronize()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["idle", "convoy"])
async def test_hand_overs_per_event_tell_the_bridges_apart(kind: str) -> None:
    if not hasattr(asyncio.get_running_loop(), "_write_to_self"):
        pytest.skip("counts the asyncio loop's self-pipe writes")
    bridge = load_bridge_module(None)
    args = _args()
    bare = await scenario(BareWaiter, None, args, kind)
    batched = await scenario(_started(bridge), bridge.Lane.LOAD, args, kind)
    for samples in (bare, batched):
        assert samples.events == 16
        assert min(samples.wake) >= 0 and min(samples.total) >= 0  # nothing before its instant
        assert all(e <= t + 1e-6 for e, t in zip(samples.excess, samples.total, strict=True))
    assert bare.writes == 16  # one call_soon_threadsafe per event
    assert batched.writes == 4  # one per 4 events completing together
