"""`RoomQueue` on its own, over a real `JobTable`: submissions waiting for room move in submission
order, a cancelled or closed wait keeps nothing, withdrawn jobs never move. No processes: the
group's sender is a function that does what ``RankGroup._send_held`` does for attached ranks
(admit the held job) and records the order in which specs would reach the ranks.
(``tests/tp/test_tp_submit_room.py`` runs the same through spawned ranks.)
"""

from __future__ import annotations

import asyncio

import pytest

from aiokv.tp import Direction, Job, JobTable, RankStatus, TransferSpec
from aiokv.tp.room import RoomQueue

RANKS = frozenset({0, 1})


def _spec(job_id: int) -> TransferSpec:
    return TransferSpec.build(job_id, Direction.LOAD, 1, 4, [job_id], list(range(4)))


class _Sender:
    """The order specs leave in: held jobs admitted by the queue's pump, turns sent by their caller."""

    def __init__(self, table: JobTable) -> None:
        self.table = table
        self.sent: list[int] = []

    def send_held(self, job: Job) -> None:
        self.table.admit(job)
        self.sent.append(job.id)

    def open(self, job_id: int) -> Job:
        job = self.table.open(_spec(job_id), RANKS)
        self.sent.append(job_id)
        return job


def _finish(table: JobTable, job: Job) -> None:
    for rank in sorted(job.ranks):
        table.report(job.id, rank, RankStatus.OK)


def _queue(max_jobs: int) -> tuple[JobTable, RoomQueue, _Sender]:
    room: list[RoomQueue] = []
    table = JobTable(max_jobs, on_room=lambda: room[0].room_freed())
    sender = _Sender(table)
    room.append(RoomQueue(table, sender.send_held))
    return table, room[0], sender


async def _settled() -> None:
    """Loop turns (no time passes) until the pump scheduled by the last change ran (it runs from a
    loop callback, never inline) and a turn it granted resumed its task."""
    for _ in range(3):
        await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_held_jobs_and_waiting_turns_move_in_submission_order() -> None:
    table, room, sender = _queue(1)
    first = sender.open(1)
    assert not room.has_room()
    held = table.hold(_spec(2), RANKS)
    room.hold(held)

    async def submit(job_id: int) -> Job | None:
        if not await room.wait_turn():
            return None
        return sender.open(job_id)  # at once, as RankGroup.submit does

    waiting = asyncio.ensure_future(submit(3))
    await _settled()  # its turn is queued
    later = table.hold(_spec(4), RANKS)
    room.hold(later)
    await _settled()
    assert room.waiting == 3 and sender.sent == [1]

    _finish(table, first)
    await _settled()
    assert sender.sent == [1, 2] and not waiting.done()  # no room for the turn yet
    _finish(table, held)
    third = await asyncio.wait_for(waiting, 10)
    assert third is not None
    await _settled()
    assert sender.sent == [1, 2, 3]  # job 4 did not overtake the turn
    _finish(table, third)
    await _settled()
    assert sender.sent == [1, 2, 3, 4] and room.waiting == 0
    _finish(table, later)
    assert table.in_flight == 0 and table.held == 0 and room.has_room()


@pytest.mark.asyncio
async def test_a_turn_cancelled_once_granted_passes_it_on() -> None:
    table, room, sender = _queue(1)
    first = sender.open(1)
    waiting = asyncio.ensure_future(room.wait_turn())
    await _settled()
    held = table.hold(_spec(2), RANKS)
    room.hold(held)

    _finish(table, first)
    await asyncio.sleep(0)  # the pump ran: the turn is granted, its task not resumed yet
    assert room.waiting == 2 and sender.sent == [1]
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await _settled()
    assert sender.sent == [1, 2]  # the turn went on to the held job
    assert room.waiting == 0
    _finish(table, held)
    assert table.in_flight == 0 and room.has_room()


@pytest.mark.asyncio
async def test_a_turn_cancelled_while_it_waits_is_skipped_even_by_a_pump_already_due() -> None:
    table, room, sender = _queue(1)
    first = sender.open(1)
    waiting = asyncio.ensure_future(room.wait_turn())
    await _settled()
    held = table.hold(_spec(2), RANKS)
    room.hold(held)

    _finish(table, first)  # the pump is due before the cancelled task runs its cleanup
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await _settled()
    assert sender.sent == [1, 2] and room.waiting == 0
    _finish(table, held)
    assert table.in_flight == 0 and room.has_room()


@pytest.mark.asyncio
async def test_withdrawn_jobs_never_move_and_close_ends_every_wait() -> None:
    table, room, sender = _queue(1)
    first = sender.open(1)
    a, b, c = (table.hold(_spec(i), RANKS) for i in (2, 3, 4))
    for job in (a, b, c):
        room.hold(job)
    assert room.withdraw([a, first]) == [a]  # a sent job is left alone
    assert a.outcome().withdrawn and not first.done()
    waiting = asyncio.ensure_future(room.wait_turn())
    await _settled()

    _finish(table, first)
    await _settled()
    assert sender.sent == [1, 3]  # the withdrawn head was skipped
    room.close()
    assert await asyncio.wait_for(waiting, 10) is False  # the caller sends nothing
    assert c.outcome().withdrawn and not c.outcome().failures
    _finish(table, b)
    await _settled()
    assert sender.sent == [1, 3] and room.waiting == 0  # nothing moves after the close
    stats = table.statistics()
    assert (stats.withdrawn, stats.held, stats.in_flight) == (2, 0, 0)
