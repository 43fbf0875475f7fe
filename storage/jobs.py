"""Page jobs of the disk tier and the I/O slots they take turns on.

A read or write of one page is a small object moved on by completion callbacks (checksum done,
slot free, I/O completed) instead of a task per page: the loop runs no coroutine per page on the
common paths. :class:`IOSlots` hands out the per-slot resources (header buffer, iovec pair,
fixed-file entry) in FIFO order, keeping a share of them for reads (writes hung in the kernel never
hold them all).

A KeyboardInterrupt (a signal, raised by Python in the loop's thread at a function's entry or as a
call returns) never loses a job: a completion delivered to a job runs only if the job waits for it
(:attr:`Job.step`, the number of the hand-off it came from), so whoever cannot tell whether its call
of one ran delivers it again; a job handed to :meth:`IOSlots.take` is either queued or has its start
running, which settles it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import Callable
from typing import ClassVar

from aiokv.keys import PageKey
from aiokv.pagetable import PageHandle

from .memory import PageBuffer
from .memory import wait_uncancelled as wait_uncancelled  # one wait for every caller (tierbase, disk, followpath)
from .uring import TURNS, not_started


class Job:
    """A page's I/O driven by completion callbacks: who waits for its end, and its I/O slot."""

    __slots__ = ("ended", "ended_waiters", "handoffs", "holds_slot", "slot", "step", "then", "ticket")

    writes: ClassVar[bool] = False
    """A :class:`WriteJob` (read as an attribute on the hot path, not as an ``isinstance`` call)."""

    def __init__(self) -> None:
        self.slot = -1
        self.ticket = 0  # its place in the FIFO order of :class:`IOSlots`' queues while it waits
        self.holds_slot = False  # until :meth:`IOSlots.give_back`: once, on every path
        self.then: Callable[[Job, int], None] | None = None  # what runs once a slot is free
        self.ended = False
        self.ended_waiters: list[asyncio.Future[None]] | None = None
        self.step = 0
        """The hand-off whose completion the job waits for (its number; 0: none): the backend's
        load or write, the checksums, a refill of spare files or unlinks, a task of its own. Each
        hand-off takes the next number (``step = job.step = job.handoffs = job.handoffs + 1``,
        no call) and its completion carries it: one runs only for the hand-off awaited and clears
        ``step`` first, so one delivered twice (after an interrupt its deliverer cannot tell
        whether its call ran) runs once, also after the job moved on to a later hand-off of the
        same kind (a recycle not taken goes on to a new file's publish at once: a kind, not a
        number, let the stale completion run as the publish's)."""
        self.handoffs = 0

    def end(self) -> None:
        """Mark the job ended and wake those waiting for it (the tier counts the end itself:
        :meth:`~.tierbase.TierBase._job_ended`)."""
        self.ended = True
        self.wake()

    def wake(self) -> None:
        """Resolve the futures of those waiting for the end (idempotent: run again after an interrupt)."""
        for waiter in self.ended_waiters or ():
            if not waiter.done():
                waiter.set_result(None)

    def ended_future(self) -> asyncio.Future[None]:
        """A future resolved when the job ends (made only for those who wait: cancellation, flush)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.ended:
            waiter.set_result(None)
        else:
            if self.ended_waiters is None:
                self.ended_waiters = []
            self.ended_waiters.append(waiter)
        return waiter

    async def wait_ended(self) -> None:
        """Until the job ended, even if cancelled again meanwhile (the caller re-raises afterwards)."""
        while not self.ended:
            with contextlib.suppress(asyncio.CancelledError):
                await self.ended_future()


class WriteJob(Job):
    """A write of ``key`` from its own pool reference ``ref`` or from a caller's ``buffer``.

    ``waiters``: the callers' futures; ``page``: where the bytes are (set when it starts);
    ``checksum``: of the payload, taken before any slot or room; ``victim``: the evicted key whose
    file it recycles, or None (a new file); ``attempt``: ENOSPC retries so far; ``moved``: resolved
    once the victim's file left its name (a new write of the victim waits for it); ``holds_room``:
    room claimed in the index and not yet given back or taken by the file; ``remade``: its new file
    was tried again once after an ENOENT (its fan-out directory removed under it); ``dir_fd``: the
    fan-out directory descriptor its file was handed to the backend in (-1: not yet)."""

    __slots__ = ("attempt", "buffer", "checksum", "dir_fd", "holds_room", "key", "moved", "page", "ref", "remade",
                 "victim", "waiters")

    writes: ClassVar[bool] = True

    def __init__(self, key: PageKey, ref: PageHandle | None, buffer: PageBuffer | None) -> None:
        super().__init__()
        self.key = key
        self.ref = ref
        self.buffer = buffer
        self.page: PageBuffer | None = None
        self.checksum = 0
        self.victim: PageKey | None = None
        self.moved: asyncio.Future[None] | None = None
        self.attempt = 0
        self.holds_room = False
        self.remade = False
        self.dir_fd = -1
        self.waiters: list[asyncio.Future[bool]] = []


class ReadJob(Job):
    """A read into the caller's reserved pool page or buffer (``page``); ``result`` is the caller's
    future, or None for a page of a batch (``batch``, at ``index``: its outcome goes there)."""

    __slots__ = ("batch", "checksum", "generation", "index", "key", "page", "reading", "result")

    def __init__(self, key: PageKey, page: PageBuffer, generation: int, result: asyncio.Future[bool] | None,
                 batch: ReadBatch | None = None, index: int = 0) -> None:
        super().__init__()
        self.key = key
        self.page = page
        self.generation = generation
        self.result = result
        self.checksum = 0
        self.batch = batch
        self.index = index
        self.reading = False  # counted as a reader of its file (PageIndex.readers) until loaded


class ReadBatch:
    """The pages of one ``read_many``: their outcomes (``oks``, False until a page verified) and one
    future (``done``), resolved with ``oks`` once the last of its jobs ended. One future and one
    wake-up of the caller per batch instead of one per page (#14)."""

    __slots__ = ("done", "left", "oks")

    def __init__(self, count: int, done: asyncio.Future[list[bool]]) -> None:
        self.oks = [False] * count
        self.done = done
        self.left = 1  # a guard held while the batch's jobs start (one may end at once)

    def release(self) -> None:
        """One job (or the start's guard) less; at none left the batch's future resolves."""
        self.left -= 1
        if not self.left and not self.done.done():
            self.done.set_result(self.oks)


START_TURN_S = 0.3e-3
"""Pages whose I/O starts at once when asked for (a slot free) start for at most this long in one
turn of the loop; the rest wait as for a slot and start in the next turns. A caller asking for 32
pages at once started all of them in its own turn (a read's start: open, fstat, fcntl and the
chain's SQEs, ~35 us; a recycle's the same), which held the loop ~1.1-1.4 ms (#14). A slot given
back is handed on within the same budget (a completion drain ending many pages would otherwise
start as many in its turn)."""


def reserved_for_reads(count: int) -> int:
    """Slots of ``count`` that writes never take: a read waits behind at most ``count - reserved``
    writes, however long they hang in the kernel (a frozen or stuck file system blocks writes, not
    reads). None of one slot: the one slot serves both."""
    return 0 if count < 2 else max(1, count // 8)


class IOSlots:
    """``count`` I/O slots (header buffer, iovec pair, fixed-file entry each), handed out FIFO.

    Writes (:class:`WriteJob`) hold at most ``write_limit`` of them at once, the rest are kept for
    reads (and any other job): with write-behind workers at least the queue depth, writes hung in
    the kernel held every slot and a load waited behind them until they ended. Reads and writes
    wait in two queues; a slot goes to the older of their heads that may take it.

    ``in_next_turn(fn)`` runs ``fn`` early in the loop's next turn (default: ``loop.call_soon``).
    The tier passes its ring's submission callback, which runs in that turn anyway once a page
    started: the start budget's reset then costs no loop callback of its own (#14).

    A budget opened inside a ring's wake-up callback asks for no reset: it ends with that callback
    (:data:`~.uring.TURNS`), so that callback starts the next pages and submits them in the turn it
    drained the completions, with nothing queued for the next turn. (After a wake-up callback, in
    its turn, only other descriptors' callbacks and due timers run, which start no pages in the
    tier; were one to, it would open a second budget in that turn.)"""

    def __init__(self, count: int, in_next_turn: Callable[[Callable[[], None]], None] | None = None) -> None:
        self._free = list(range(count))
        self._reads: collections.deque[Job] = collections.deque()  # every job that is no write
        self._writes: collections.deque[Job] = collections.deque()
        self._tickets = itertools.count()  # FIFO order across both queues
        self._handing = False
        self._in_next_turn = in_next_turn
        self.in_use = 0
        self.writes_in_use = 0
        self.given_back = 0
        """Slots given back so far: jobs whose I/O ended (a bounded close watches it for progress,
        :meth:`~aiokv.storage.DiskTier.close_within`)."""
        self.write_limit = count - reserved_for_reads(count)
        self._turn_ends = 0.0  # starts stop at this time this turn (0: none started yet this turn)
        self._turn_due = False  # a :meth:`_next_turn` is asked for
        self._turn_stamp = -1  # TURNS.stamp of the wake-up that opened the budget (-1: opened outside one)

    @property
    def waiting(self) -> int:
        """Jobs queued for a slot, reads and writes."""
        return len(self._reads) + len(self._writes)

    def take(self, job: Job, then: Callable[[Job, int], None]) -> None:
        """``then(job, slot)`` with a slot (``job.slot``, held): at once when one is free to it and
        this turn's start budget (:data:`START_TURN_S`) is not spent, else when one is given back or
        in a later turn, in FIFO order (a write only while writes hold fewer than ``write_limit``).
        Give it back with :meth:`give_back`. A KeyboardInterrupt out of here leaves ``job`` queued
        or its ``then`` running (which settles it then), never neither."""
        write = job.writes
        try:
            if (self._free and not self._next_due() and (not write or self.writes_in_use < self.write_limit)
                    and self._may_start()):
                self._start(job, then)
                return
            job.then = then
            job.ticket = next(self._tickets)
            (self._writes if write else self._reads).append(job)
            if self._free and self._next_due():
                # Held back by the budget, not for want of a slot: the next turn starts it.
                self._wake_next_turn()
        except BaseException as exc:
            if not isinstance(exc, Exception):
                if not_started(self._start, exc) and not job.holds_slot and not self._queued(job):
                    # A signal's KeyboardInterrupt before the job was queued or granted a slot (a
                    # grant whose ``then`` never ran is queued again by _start): queued now.
                    job.then = then
                    job.ticket = next(self._tickets)
                    (self._writes if write else self._reads).append(job)
                if self._free and self._next_due():  # (maybe never asked for: asked again)
                    self._wake_next_turn()
            raise

    def _start(self, job: Job, then: Callable[[Job, int], None]) -> None:
        """Grant ``job`` a free slot and run ``then(job, slot)``. From the slot's pop to ``then``'s
        entry there is no call (Python raises a signal's exception at calls): a KeyboardInterrupt at
        that entry gives the slot back and queues the job again at the head of its queue."""
        free = self._free
        slot = free[-1]
        del free[-1]
        self.in_use += 1
        if job.writes:
            self.writes_in_use += 1
        job.slot, job.holds_slot = slot, True
        try:
            then(job, slot)
        except BaseException as exc:
            if not isinstance(exc, Exception) and not_started(then, exc):
                self._give_slot(job)
                job.then = then
                (self._writes if job.writes else self._reads).appendleft(job)
                self._wake_next_turn()
            raise

    def _queued(self, job: Job) -> bool:
        return job.then is not None and self.waits(job)

    def waits(self, job: Job) -> bool:
        """Whether ``job`` is in a queue (a scan: for the paths after an interrupt only)."""
        return job in (self._writes if job.writes else self._reads)

    def _next_due(self) -> bool:
        """Whether a queued job may take a slot now (a read, or a write below ``write_limit``)."""
        return bool(self._reads) or (bool(self._writes) and self.writes_in_use < self.write_limit)

    def _start_next(self) -> None:
        """The older of the two queues' heads that may take a slot (:meth:`_next_due` is True) takes
        a free one and starts. From its removal from the queue to :meth:`_start`'s entry there is
        no call; an interrupt at that entry puts it back at the head."""
        reads, writes = self._reads, self._writes
        if reads and not (writes and self.writes_in_use < self.write_limit and writes[0].ticket < reads[0].ticket):
            queue = reads
        else:
            queue = writes
        job = queue[0]
        del queue[0]
        then = job.then
        job.then = None
        assert then is not None
        try:
            self._start(job, then)
        except BaseException as exc:
            if not isinstance(exc, Exception) and not_started(self._start, exc):
                job.then = then
                queue.appendleft(job)
            raise

    def _may_start(self) -> bool:
        """Whether this turn's start budget has time left. The first start of a turn opens it:
        inside a ring's wake-up, for that wake-up's callback; elsewhere asking for the next turn,
        which resets it (asked for before the budget opens: an interrupt in between leaves none
        open that no next turn would reset)."""
        now = time.perf_counter()
        stamp = self._turn_stamp
        if self._turn_ends and (stamp < 0 or stamp == TURNS.stamp):
            return now < self._turn_ends
        if TURNS.waking:
            self._turn_stamp, self._turn_ends = TURNS.stamp, now + START_TURN_S
        else:
            self._wake_next_turn()
            self._turn_stamp, self._turn_ends = -1, now + START_TURN_S
        return True

    def _wake_next_turn(self) -> None:
        # Flagged once asked for: an interrupt in between asks again later (a second _next_turn
        # does nothing), never leaves the flag set with nothing asked.
        if not self._turn_due:
            if self._in_next_turn is None:
                asyncio.get_running_loop().call_soon(self._next_turn)
            else:
                self._in_next_turn(self._next_turn)
            self._turn_due = True

    def _next_turn(self) -> None:
        """In the next turn: a fresh budget, spent on the waiters held back while slots are free
        (through the hand-off loop: a start that fails and gives its slot back never nests
        another start)."""
        self._turn_due = False
        self._turn_ends = 0.0
        try:
            if self._free and self._next_due():
                self._hand_off()
        except BaseException:
            if self._free and self._next_due():  # interrupted before the hand-off: the next turn
                self._wake_next_turn()
            raise

    def give_back(self, job: Job) -> None:
        """Give ``job``'s slot back if it still holds it (idempotent: every path may call it).

        The slot goes to the next waiter at once. A waiter's ``then`` may give its slot back
        before returning (its start failed): that slot is handed on by the loop below, not by a
        nested call, so the stack stays flat however many waiters fail in a row."""
        if not job.holds_slot:
            return
        self._give_slot(job)
        try:
            if self._next_due():
                self._hand_off()
        except BaseException:
            if self._free and self._next_due():  # interrupted before the hand-off: the next turn
                self._wake_next_turn()
            raise

    def _give_slot(self, job: Job) -> None:
        # No call before the append (whose return is where an interrupt can come: the slot is back).
        job.holds_slot = False
        self.in_use -= 1
        self.given_back += 1
        if job.writes:
            self.writes_in_use -= 1
        self._free.append(job.slot)

    def _hand_off(self) -> None:
        """Hand free slots on to waiters, in order, within this turn's start budget; the rest wait
        for the next turn. Each start costs one pass, however many slots are free."""
        if self._handing:
            return  # the hand-off running further up the stack passes it on
        self._handing = True
        try:
            while self._free and self._next_due():
                if not self._may_start():
                    break  # this turn's start budget is spent: the next turn goes on
                self._start_next()
        finally:
            self._handing = False
            if self._free and self._next_due():  # budget spent, or a ``then`` raised
                self._wake_next_turn()

    def leave(self, job: Job) -> bool:
        """Take ``job`` out of the queue if it is still waiting for a slot; True then.

        Queued means ``then`` is set (it is cleared when a slot is handed over): ``slot`` keeps the
        number of a slot held before (a write retried after ENOSPC queues again)."""
        if job.then is None:
            return False
        queue = self._writes if job.writes else self._reads
        if job in queue:  # (not after an interrupt raised as the removal below returned)
            queue.remove(job)
        job.then = None
        return True
