"""`IOSlots` hands a slot on without nesting: many waiters whose start fails at once (a closed
engine) all end and every slot comes back, with a flat stack."""

from __future__ import annotations

import sys

import pytest

from aiokv.storage.jobs import IOSlots, Job

WAITERS = 5 * sys.getrecursionlimit()
"""More waiters than the stack allows nested hand-offs."""


@pytest.mark.asyncio
@pytest.mark.parametrize("count", [1, 3])
async def test_failing_waiters_all_end_and_slots_return(count: int) -> None:
    slots = IOSlots(count)
    depth = [0, 0]  # now, deepest
    ended: list[Job] = []

    def start(job: Job, _slot: int) -> None:
        # As a page job whose backend call raises synchronously: its except gives the slot back.
        depth[0] += 1
        depth[1] = max(depth[1], depth[0])
        try:
            raise OSError("engine closed")
        except OSError:
            slots.give_back(job)
            job.end()
            ended.append(job)
        finally:
            depth[0] -= 1

    holders = [Job() for _ in range(count)]
    for holder in holders:
        slots.take(holder, lambda _job, _slot: None)
    waiters = [Job() for _ in range(WAITERS)]
    for job in waiters:
        slots.take(job, start)
    assert slots.in_use == count and not ended
    for holder in holders:
        slots.give_back(holder)
    assert len(ended) == WAITERS and all(job.ended and not job.holds_slot for job in waiters)
    assert depth[1] == 1  # each start ran from the hand-off loop, none nested in another
    assert slots.in_use == 0
    # Every slot is free again: new jobs get one at once.
    got: list[int] = []
    for _ in range(count):
        slots.take(Job(), lambda _job, slot: got.append(slot))
    assert sorted(got) == list(range(count))
