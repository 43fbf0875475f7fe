"""The one owner of in-flight transfer jobs on the manager side: which ranks still owe a report.

Synchronous bookkeeping (no awaits except the ``wait_*`` helpers), driven by the transport: a
:class:`~aiokv.tp.RankGroup` over its socket, or an engine that carries specs and completions over
its own channel and calls :meth:`JobTable.report` / :meth:`JobTable.rank_lost` itself.

A job resolves once EVERY rank it was sent to is accounted for: it reported (success or error), or
it is gone (disconnected, dead). Until then a live rank may still be writing the job's pool pages
or KV slots, so the manager must not reuse them: it settles pages in a done-callback (see
:class:`Job`), which also runs when the caller that awaited the job was cancelled.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any

from .specs import Direction, TransferSpec
from .wire import RankStatus


@dataclass(frozen=True)
class RankFailure:
    """One rank's failed part of a job."""

    rank: int
    status: RankStatus
    text: str


@dataclass(frozen=True)
class JobOutcome:
    """How a job ended: ``ok`` when every rank it was sent to reported success."""

    job_id: int
    direction: Direction
    failures: tuple[RankFailure, ...]
    withdrawn: bool = False
    """Never sent: withdrawn while it waited for room (by its owner, or the group's close). No
    rank ran any of it; not a fault (``failures`` is empty)."""

    @property
    def ok(self) -> bool:
        """True when no rank failed: the pages (OFFLOAD) or slots (LOAD) hold the right bytes."""
        return not self.failures and not self.withdrawn


class Job:
    """A submitted spec. Await it (or :meth:`wait`) for its :class:`JobOutcome`.

    Awaiting is shielded: cancelling the awaiting coroutine never cancels the job, which stays owned
    by its table until every rank is accounted for. Settle pages in :meth:`add_done_callback`
    (commit on ``ok``, else abort/release): that runs whether or not anyone still awaits.
    """

    __slots__ = ("_future", "layer_futures", "ranks", "sessions", "spec")

    def __init__(
        self,
        spec: TransferSpec,
        ranks: frozenset[int],
        future: asyncio.Future[JobOutcome],
        layer_futures: tuple[asyncio.Future[bool], ...] = (),
        sessions: tuple[int, ...] = (),
    ) -> None:
        self.spec = spec
        self.ranks = ranks
        """Ranks the spec was sent to (OFFLOAD: writers only; LOAD: all)."""
        self._future = future
        self.layer_futures = layer_futures
        """A layered spec: future ``l`` resolves True once every rank reported layer ``l`` landed (a
        LAYERS frame, or its whole part succeeded), False once the job ended without that; in layer
        order, each before the job itself. Empty for other specs."""
        self.sessions = sessions
        """Per rank, the attachment session the job was admitted for (``RankGroup.sessions()``
        when its call began; 0: not attached then). A :class:`~aiokv.tp.RankGroup` sends the job
        only to ranks still in those sessions (a held job's turn may come after a rank restarted).
        Empty: not checked (a table driven by an engine's own channel)."""

    @property
    def id(self) -> int:
        """The spec's job id."""
        return self.spec.job_id

    def done(self) -> bool:
        """True once every rank is accounted for."""
        return self._future.done()

    def outcome(self) -> JobOutcome:
        """The outcome of a done job; raises ``asyncio.InvalidStateError`` before."""
        return self._future.result()

    async def wait(self) -> JobOutcome:
        """Wait for the outcome; cancelling the waiter leaves the job running."""
        if self._future.done():
            return self._future.result()
        # A private waiter per call (what asyncio.shield does, one loop turn shorter): cancelling the
        # caller cancels only its waiter, never the job's future that the table resolves.
        waiter: asyncio.Future[JobOutcome] = asyncio.get_running_loop().create_future()

        def wake(done: asyncio.Future[JobOutcome]) -> None:
            if not waiter.done():
                waiter.set_result(done.result())

        self._future.add_done_callback(wake)
        try:
            return await waiter
        finally:
            self._future.remove_done_callback(wake)

    def __await__(self) -> Generator[Any, None, JobOutcome]:
        return self.wait().__await__()

    def add_done_callback(self, fn: Callable[[Job], None]) -> None:
        """Call ``fn(job)`` on the loop once the job is done (soon, if it already is)."""
        self._future.add_done_callback(lambda _: fn(self))

    def __repr__(self) -> str:
        if not self.done():
            state = "pending"
        else:
            outcome = self.outcome()
            state = "ok" if outcome.ok else "withdrawn" if outcome.withdrawn else "failed"
        return f"Job({self.spec!r}, ranks={sorted(self.ranks)}, {state})"


@dataclass(frozen=True)
class JobStatistics:
    """Counts of a :class:`JobTable`."""

    in_flight: int
    max_jobs: int
    submitted: int
    succeeded: int
    failed: int
    rank_failures: dict[RankStatus, int]
    """Failed rank parts by status (a job failed on two ranks counts twice)."""
    stray_reports: int
    """Reports for no job in flight on that rank (late after a failure, or a confused peer)."""
    layer_reports: int = 0
    """LAYERS reports taken (a rank's layered part growing before its whole part ended)."""
    held: int = 0
    """Jobs waiting for room now (:meth:`JobTable.hold`): not sent, not in flight."""
    queued: int = 0
    """Jobs held for room so far (sent later, withdrawn, or held now)."""
    withdrawn: int = 0
    """Held jobs withdrawn before they were sent (:meth:`JobTable.withdraw`): nothing of them ran."""


class _Entry:
    __slots__ = ("failures", "job", "landed", "pending", "ready")

    def __init__(self, job: Job) -> None:
        self.job = job
        self.pending = set(job.ranks)
        self.failures: list[RankFailure] = []
        self.landed = dict.fromkeys(job.ranks, 0) if job.layer_futures else {}  # layered: per rank
        self.ready = 0  # layered: layer futures resolved True so far


class JobTable:
    """In-flight jobs and the ranks each still waits for; at most ``max_jobs`` at once.

    Jobs beyond that may be held (:meth:`hold`): their futures exist, nothing is sent; the sender
    moves them in flight with :meth:`admit` as room frees (``on_room`` is called, synchronously,
    each time a job leaves the table: schedule the sending, never send from inside it) or
    withdraws them (:meth:`withdraw`).
    """

    def __init__(self, max_jobs: int, on_room: Callable[[], None] | None = None) -> None:
        if isinstance(max_jobs, bool) or not isinstance(max_jobs, int) or max_jobs <= 0:
            raise ValueError(f"max_jobs must be a positive int, got {max_jobs!r}")
        self.max_jobs = max_jobs
        self._on_room = on_room
        self._jobs: dict[int, _Entry] = {}
        self._held: dict[int, Job] = {}
        self._by_rank: dict[int, set[int]] = collections.defaultdict(set)
        self._idle = asyncio.Event()
        self._idle.set()
        self._submitted = 0
        self._succeeded = 0
        self._failed = 0
        self._rank_failures: collections.Counter[RankStatus] = collections.Counter()
        self._stray = 0
        self._layer_reports = 0
        self._withdrawn = 0
        self._queued = 0

    # -- opening --------------------------------------------------------------------------------

    def open(
        self, spec: TransferSpec, ranks: Iterable[int], layers: int = 0, sessions: tuple[int, ...] = ()
    ) -> Job:
        """Track ``spec`` as sent to ``ranks``; a layered spec with readiness for ``layers`` layers;
        ``sessions``: see :attr:`Job.sessions`.

        Raises ``asyncio.QueueFull`` when ``max_jobs`` are in flight and ``ValueError`` when a job
        of the same id is in flight or held, ``ranks`` is empty or ``layers`` does not fit ``spec.layered``.
        """
        targets = self._check(spec, ranks, layers)
        if len(self._jobs) >= self.max_jobs:
            raise asyncio.QueueFull(f"{len(self._jobs)} jobs in flight (max_jobs={self.max_jobs})")
        job = self._new_job(spec, targets, layers, sessions)
        self._submitted += 1
        self._track(job)
        return job

    def hold(
        self, spec: TransferSpec, ranks: Iterable[int], layers: int = 0, sessions: tuple[int, ...] = ()
    ) -> Job:
        """A job for ``spec`` that waits for room, to be sent to ``ranks`` later (:meth:`admit`).

        Its futures exist at once (layer futures included); it is not in flight until admitted.
        ``sessions``: see :attr:`Job.sessions`. Raises ``ValueError`` as :meth:`open` does.
        """
        job = self._new_job(spec, self._check(spec, ranks, layers), layers, sessions)
        self._submitted += 1
        self._queued += 1
        self._held[spec.job_id] = job
        return job

    def admit(self, job: Job) -> None:
        """Move held ``job`` in flight (its spec is being sent now).

        Raises ``asyncio.QueueFull`` when ``max_jobs`` are in flight and ``ValueError`` when ``job``
        is not held here (admitted, withdrawn, or another table's).
        """
        if self._held.get(job.id) is not job:
            raise ValueError(f"job {job.id} is not held by this table")
        if len(self._jobs) >= self.max_jobs:
            raise asyncio.QueueFull(f"{len(self._jobs)} jobs in flight (max_jobs={self.max_jobs})")
        del self._held[job.id]
        self._track(job)

    def withdraw(self, job: Job) -> bool:
        """End held ``job`` unsent: its outcome is ``withdrawn``, its layer futures False. True when
        it was held; False (nothing changes) once admitted or ended."""
        if self._held.get(job.id) is not job:
            return False
        del self._held[job.id]
        self._withdrawn += 1
        self._end_unsent(job, JobOutcome(job.id, job.spec.direction, (), withdrawn=True))
        return True

    def fail_held(self, job: Job, failures: Iterable[RankFailure]) -> bool:
        """End held ``job`` unsent as failed (its ranks are missing now): counted as :meth:`failed_job`.
        False (nothing changes) once admitted or ended."""
        if self._held.get(job.id) is not job:
            return False
        del self._held[job.id]
        found = tuple(failures)
        self._failed += 1
        self._rank_failures.update(f.status for f in found)
        self._end_unsent(job, JobOutcome(job.id, job.spec.direction, found))
        return True

    def _check(self, spec: TransferSpec, ranks: Iterable[int], layers: int) -> frozenset[int]:
        targets = frozenset(ranks)
        if not targets:
            raise ValueError("a job needs at least one rank")
        if spec.job_id in self._jobs or spec.job_id in self._held:
            raise ValueError(f"job {spec.job_id} is already in flight")
        if (layers > 0) != spec.layered or layers < 0:
            raise ValueError(f"layers={layers} for a {'layered' if spec.layered else 'whole'} spec")
        return targets

    @staticmethod
    def _new_job(spec: TransferSpec, targets: frozenset[int], layers: int, sessions: tuple[int, ...] = ()) -> Job:
        loop = asyncio.get_running_loop()
        return Job(spec, targets, loop.create_future(), tuple(loop.create_future() for _ in range(layers)), sessions)

    def _track(self, job: Job) -> None:
        self._jobs[job.id] = _Entry(job)
        for rank in job.ranks:
            self._by_rank[rank].add(job.id)
        self._idle.clear()

    @staticmethod
    def _end_unsent(job: Job, outcome: JobOutcome) -> None:
        for layer in job.layer_futures:
            if not layer.done():
                layer.set_result(False)
        job._future.set_result(outcome)

    def failed_job(self, spec: TransferSpec, failures: Iterable[RankFailure], layers: int = 0) -> Job:
        """A job that failed before it was sent (ranks missing, group closed): done at once, not tracked."""
        found = tuple(failures)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[JobOutcome] = loop.create_future()
        future.set_result(JobOutcome(spec.job_id, spec.direction, found))
        layer_futures = tuple(loop.create_future() for _ in range(layers))
        for layer in layer_futures:
            layer.set_result(False)
        self._submitted += 1
        self._failed += 1
        self._rank_failures.update(f.status for f in found)
        return Job(spec, frozenset(f.rank for f in found), future, layer_futures)

    def withdrawn_job(self, spec: TransferSpec, ranks: Iterable[int], layers: int = 0) -> Job:
        """A job withdrawn before it was sent (the close ended its wait for room): done at once,
        not tracked, counted as withdrawn."""
        job = self._new_job(spec, frozenset(ranks), layers)
        self._submitted += 1
        self._withdrawn += 1
        self._end_unsent(job, JobOutcome(spec.job_id, spec.direction, (), withdrawn=True))
        return job

    # -- reports --------------------------------------------------------------------------------

    def report(self, job_id: int, rank: int, status: RankStatus, text: str = "") -> bool:
        """Rank ``rank``'s part of ``job_id`` ended; False (counted) when no such part is in flight."""
        entry = self._jobs.get(job_id)
        if entry is None or rank not in entry.pending:
            self._stray += 1
            return False
        self._settle_part(entry, rank, status, text)
        return True

    def report_layers(self, job_id: int, rank: int, landed: int) -> bool:
        """Rank ``rank`` has layers ``0 .. landed-1`` of layered job ``job_id`` in its buffer.

        Resolves the layer futures every rank has reached. False (counted as a stray report) for
        no such part in flight, a job that is not layered, or a count that does not grow or
        exceeds the layers.
        """
        entry = self._jobs.get(job_id)
        layers = len(entry.job.layer_futures) if entry is not None else 0
        # A whole job has no per-rank counts (``landed`` is empty): a report for it is stray, never
        # a KeyError (raised in the link's read callback, it aborted the link of a live rank and
        # failed its jobs while its copies ran).
        if entry is None or rank not in entry.pending or not entry.landed.get(rank, layers) < landed <= layers:
            self._stray += 1
            return False
        entry.landed[rank] = landed
        self._layer_reports += 1
        self._resolve_layers(entry)
        return True

    def _resolve_layers(self, entry: _Entry) -> None:
        futures = entry.job.layer_futures
        if not futures or entry.failures:
            return  # a failed part never lands its later layers: they resolve False with the job
        reached = min(entry.landed.values())
        while entry.ready < reached:
            if not futures[entry.ready].done():  # a consumer may have cancelled its future
                futures[entry.ready].set_result(True)
            entry.ready += 1

    def rank_lost(self, rank: int, status: RankStatus = RankStatus.RANK_LOST, text: str = "") -> int:
        """Fail ``rank``'s part of every job in flight (it disconnected or died); returns how many."""
        ids = self._by_rank.pop(rank, set())
        for job_id in sorted(ids):
            entry = self._jobs.get(job_id)
            if entry is not None and rank in entry.pending:
                self._settle_part(entry, rank, status, text or f"rank {rank} lost with the job in flight")
        return len(ids)

    def fail_all(self, status: RankStatus, text: str) -> int:
        """Fail every part still in flight (closing); returns the jobs failed."""
        count = len(self._jobs)
        for rank in list(self._by_rank):
            self.rank_lost(rank, status, text)
        return count

    def owing_ranks(self) -> frozenset[int]:
        """Ranks that still owe a report for some job in flight."""
        return frozenset(rank for rank, ids in self._by_rank.items() if ids)

    def owed_by(self, rank: int) -> frozenset[int]:
        """Ids of the jobs in flight that ``rank`` still owes a report."""
        return frozenset(self._by_rank.get(rank, ()))

    def pending_ranks(self, job_id: int) -> frozenset[int]:
        """Ranks that still owe ``job_id`` a report (empty when it is not in flight)."""
        entry = self._jobs.get(job_id)
        return frozenset(entry.pending) if entry is not None else frozenset()

    def _settle_part(self, entry: _Entry, rank: int, status: RankStatus, text: str) -> None:
        entry.pending.discard(rank)
        ranks = self._by_rank.get(rank)
        if ranks is not None:
            ranks.discard(entry.job.id)
        if status is not RankStatus.OK:
            entry.failures.append(RankFailure(rank, status, text))
            self._rank_failures[status] += 1
        elif entry.job.layer_futures:
            entry.landed[rank] = len(entry.job.layer_futures)  # its whole part landed
            self._resolve_layers(entry)
        if entry.pending:
            return
        del self._jobs[entry.job.id]
        for layer in entry.job.layer_futures:
            if not layer.done():
                layer.set_result(False)
        outcome = JobOutcome(entry.job.id, entry.job.spec.direction, tuple(entry.failures))
        if outcome.ok:
            self._succeeded += 1
        else:
            self._failed += 1
        entry.job._future.set_result(outcome)
        if not self._jobs:
            self._idle.set()
        if self._on_room is not None:
            self._on_room()

    # -- waiting --------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Jobs sent and not yet resolved."""
        return len(self._jobs)

    @property
    def held(self) -> int:
        """Jobs waiting for room (held, not sent)."""
        return len(self._held)

    async def wait_idle(self) -> None:
        """Wait until no job is in flight."""
        await self._idle.wait()

    def statistics(self) -> JobStatistics:
        """Counts so far."""
        return JobStatistics(
            in_flight=len(self._jobs),
            max_jobs=self.max_jobs,
            submitted=self._submitted,
            succeeded=self._succeeded,
            failed=self._failed,
            rank_failures=dict(self._rank_failures),
            stray_reports=self._stray,
            layer_reports=self._layer_reports,
            held=len(self._held),
            queued=self._queued,
            withdrawn=self._withdrawn,
        )
