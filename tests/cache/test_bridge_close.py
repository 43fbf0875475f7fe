"""CompletionBridge.close racing wait() and prestart(): nothing left unresolved, no thread left running.

The races are widened by a delay at the exact point where the other thread used to slip in (lane
creation), with real threads and the real bridge; the events are host stand-ins (no GPU needed).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from aiokv.cuda import CompletionBridge, Lane


class _Done:
    """A CUDA event stand-in that has already completed."""

    def synchronize(self) -> None:
        pass


class _SlowLanes(CompletionBridge):
    """Lane lookup/creation takes a while (a thread start under load): the old race window."""

    delay = 0.0

    def __init__(self) -> None:
        super().__init__()
        self.inside = threading.Event()  # set once a lane lookup is inside the window

    def _lane(self, lane: Lane):  # type: ignore[no-untyped-def]
        if self.delay:
            self.inside.set()
            time.sleep(self.delay)  # the injected delay: the window the other thread used to slip into
        return super()._lane(lane)


def _waiters_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aiokv-cuda") and t.is_alive()]


@pytest.mark.asyncio
async def test_wait_racing_close_resolves_or_raises_never_hangs() -> None:
    # Regression (review): wait() checked "closed" then put on the lane queue; a close() between
    # the two left the item behind the waiter's sentinel, a future that never resolved.
    bridge = _SlowLanes()
    bridge.prestart(True)
    bridge.delay = 0.05
    closer = threading.Thread(target=lambda: (bridge.inside.wait(5), bridge.close()))
    closer.start()
    future = bridge.wait(_Done(), Lane.OFFLOAD)  # type: ignore[arg-type]
    await asyncio.to_thread(closer.join)
    await asyncio.wait_for(future, 5)
    with pytest.raises(RuntimeError, match="closed"):
        bridge.wait(_Done(), Lane.OFFLOAD)  # type: ignore[arg-type]
    assert not _waiters_alive()


def test_close_during_prestart_leaves_no_waiter_thread() -> None:
    # Regression (review): a cancelled start closed the bridge while prestart, now on a thread of
    # its own, was still creating lanes; lanes made after close kept their threads for good.
    before = set(_waiters_alive())
    bridge = _SlowLanes()
    bridge.delay = 0.02
    starter = threading.Thread(target=bridge.prestart, args=(True,))
    starter.start()
    assert bridge.inside.wait(5)  # prestart is inside its lane loop
    bridge.close()
    starter.join(5)
    for thread in bridge._threads:
        thread.join(5)  # every waiter thread the bridge made got its sentinel
    assert not set(_waiters_alive()) - before
