"""Review 114: a restart that needs the memory of a SIGKILLed creator's pool, still held a moment.

In a private /dev/shm (a tmpfs of 6 MiB in a mount namespace of its own: the space is really
short, nothing is mocked), a creator's pool of 4 MiB is prepared (its tmpfs pages allocated), a
second process attaches it (a rank worker finishing a copy, or the H200's driver letting go of a
killed creator's CUDA-registered memory: fa7a7fe), the creator is SIGKILLed and the new pool of
4 MiB is opened at once, while the late holder lets go 0.8 s later. fa7a7fe retries such a
segment in the background only: when the new pool needs its memory the start failed at once
with SegmentSpaceError ("/dev/shm has 2 MiB free"), so a TP manager restarted right after a crash
in a tight /dev/shm did not start. Now the start waits (in its thread, never on the loop, at most
``RECLAIM_SETTLE_S``) while a dead creator's held segment could free the room, then reclaims it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from typing import Any

from private_shm import SCENARIO, fork_pool_creator, needs_namespace, run_in_private_shm

MIB = 1 << 20


def _in_private_shm(*args: str) -> dict[str, Any]:
    """Run this file's scenario in a new mount namespace over a 6 MiB /dev/shm; its JSON report."""
    return run_in_private_shm(__file__, 6, *args)


@needs_namespace
def test_a_restart_waits_for_a_dead_creators_held_pool_when_it_needs_the_room() -> None:
    report = _in_private_shm("held")
    assert report["error"] is None, report  # SegmentSpaceError before the fix
    assert report["old_gone"] and report["reclaimed"] == [report["old"]], report
    assert 0.6 < float(report["elapsed"]) < 10, report  # it waited for the late holder, not past it
    assert float(report["max_gap"]) < 0.5, report  # the loop ran all along


@needs_namespace
def test_a_live_pool_it_cannot_reclaim_still_fails_at_once_and_clearly() -> None:
    # A live creator's pool holds the room: nothing to wait for, the start says why at once.
    report = _in_private_shm("live")
    assert report["error"] == "SegmentSpaceError", report
    assert float(report["elapsed"]) < 2, report
    assert report["old_present"], report  # never touched


# -- the scenario, run in the private namespace -------------------------------------------------------


def _scenario(kind: str) -> dict[str, object]:

    import torch

    from aiokv import KVLayout
    from aiokv.pool import PagePool
    from aiokv.shm import SHM_DIR, SegmentSpaceError

    layout = KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4)
    budget = 4 * MIB // layout.page_bytes * layout.page_bytes
    proc, old = fork_pool_creator(layout, budget)
    late = None
    if kind == "held":
        late = PagePool.attach(old, layout)  # the late holder
        os.kill(proc.pid or 0, signal.SIGKILL)
        proc.join(30)
        threading.Timer(0.8, late.close).start()

    async def restart() -> dict[str, object]:
        gaps: list[float] = []
        stop = False

        async def ticker() -> None:
            last = time.monotonic()
            while not stop:
                await asyncio.sleep(0.005)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        started = time.monotonic()
        error = None
        reclaimed: list[str] = []
        try:
            pool = await PagePool.open(layout, budget, register_cuda=False, chunk_bytes=budget)
        except SegmentSpaceError as exc:
            error = type(exc).__name__
        else:
            reclaimed = [s.name for s in await pool.wait_reclaimed()]
            await pool.aclose()
        elapsed = time.monotonic() - started
        stop = True
        await tick
        return {"error": error, "elapsed": elapsed, "reclaimed": reclaimed, "max_gap": max(gaps, default=0.0)}

    report = asyncio.run(restart())
    report["old"] = old
    report["old_present"] = os.path.exists(SHM_DIR + old)
    report["old_gone"] = not report["old_present"]
    if proc.is_alive():
        os.kill(proc.pid or 0, signal.SIGKILL)
        proc.join(30)
    return report


if __name__ == "__main__" and sys.argv[1:2] == [SCENARIO]:
    print(json.dumps(_scenario(sys.argv[2])))
