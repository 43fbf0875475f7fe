"""`RoomQueue`: submissions of a :class:`~aiokv.tp.RankGroup` waiting for room, moved in order.

At most ``max_jobs`` jobs are in flight (:class:`~aiokv.tp.jobs.JobTable`). Beyond that a
submission waits here, in submission order: a held job (``RankGroup.submit_queued``: its
:class:`~aiokv.tp.jobs.Job` and layer futures exist, nothing is sent) or the turn of an awaiting
``RankGroup.submit``. As jobs leave the table the queue moves from its head while there is room: a
held job goes to the group's ``send_held`` (sent, or failed when its ranks are missing); a waiting
submission is granted its turn and sends its own spec before anything behind it moves. So specs
reach the ranks in job-id order.

Synchronous bookkeeping: the queue moves in a loop callback scheduled when room frees (never inside
the job table's own bookkeeping); the only await is a submission's wait for its turn.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable, Iterable

from .jobs import Job, JobTable


class RoomQueue:
    """Submissions waiting for room among the jobs of ``jobs`` in flight (see the module docstring).

    ``send_held(job)``: called on the loop with a held job whose turn came, room reserved for it;
    it admits and sends the job, or ends it unsent (the ranks are missing). Call :meth:`room_freed`
    each time a job leaves ``jobs`` (its ``on_room``).
    """

    def __init__(self, jobs: JobTable, send_held: Callable[[Job], None]) -> None:
        self._jobs = jobs
        self._send_held = send_held
        # Held jobs and turns of waiting submissions, in submission order.
        self._queue: collections.deque[Job | asyncio.Future[None]] = collections.deque()
        self._granted: asyncio.Future[None] | None = None  # a submission given its turn, not yet resumed
        self._pump_handle: asyncio.Handle | None = None
        self._closed = False

    @property
    def waiting(self) -> int:
        """Submissions waiting now: held jobs and waiting submissions (one granted included)."""
        return len(self._queue) + (self._granted is not None)

    def has_room(self) -> bool:
        """Whether a new submission may be sent now: nothing waits and fewer than ``max_jobs`` are
        in flight."""
        return not self._queue and self._granted is None and self._jobs.in_flight < self._jobs.max_jobs

    def hold(self, job: Job) -> None:
        """Queue held ``job`` (:meth:`JobTable.hold`) behind every earlier submission."""
        self._queue.append(job)

    async def wait_turn(self) -> bool:
        """Wait until every earlier submission moved and there is room for one more job: True, and
        the caller must then send its spec at once, before it awaits anything (the queue behind it
        moves only after that). False when :meth:`close` ended the wait: send nothing.

        Cancelled while it waits: its turn passes on, nothing of it is kept; ``CancelledError``
        propagates.
        """
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            # Our turn came but we were cancelled before taking it: pass it on. Still queued: the
            # cancellation cancelled ``turn`` with us; drop it now (it holds no spec).
            if self._granted is turn:
                self._granted = None
                self._schedule_pump()
            with contextlib.suppress(ValueError):
                self._queue.remove(turn)
            raise
        if self._granted is turn:
            self._granted = None
        if self._closed:  # woken by the close: nothing is sent
            return False
        self._schedule_pump()  # those behind us: after our spec is sent, in order
        return True

    def withdraw(self, jobs: Iterable[Job]) -> list[Job]:
        """Withdraw those of ``jobs`` still held (:meth:`JobTable.withdraw`): none of them is ever
        sent, all before the queue moves on. Returns them; jobs sent or ended are left alone."""
        ended = [job for job in jobs if self._jobs.withdraw(job)]
        if ended:
            self._queue = collections.deque(entry for entry in self._queue if not entry.done())
            self._schedule_pump()  # a withdrawn head may have stood before room
        return ended

    def room_freed(self) -> None:
        """A job left the table. Called by the table inside its bookkeeping: the queue moves from a
        later callback, never here."""
        if self._queue:
            self._schedule_pump()

    def close(self) -> None:
        """Nothing moves any more: held jobs are withdrawn, waiting submissions woken (their caller
        sends nothing: :meth:`wait_turn` returns False). Idempotent."""
        self._closed = True
        queue, self._queue = self._queue, collections.deque()
        for entry in queue:
            if isinstance(entry, Job):
                self._jobs.withdraw(entry)
            elif not entry.done():
                entry.set_result(None)

    def _schedule_pump(self) -> None:
        if self._pump_handle is None and self._queue:
            self._pump_handle = asyncio.get_running_loop().call_soon(self._pump)

    def _pump(self) -> None:
        """Send held jobs and wake waiting submissions in order while there is room; a woken
        submission sends its own spec (then pumps again), so nothing overtakes it."""
        self._pump_handle = None
        jobs = self._jobs
        while self._queue and self._granted is None and not self._closed:
            head = self._queue[0]
            if head.done():  # withdrawn, or a cancelled submission
                self._queue.popleft()
                continue
            if jobs.in_flight >= jobs.max_jobs:
                return
            self._queue.popleft()
            if isinstance(head, Job):
                self._send_held(head)
            else:
                self._granted = head
                head.set_result(None)
