"""`GroupTransfers`: the manager's transfers run by the rank workers of a :class:`RankGroup`.

Each transfer becomes one spec sent to every rank that takes part (LOAD: all; OFFLOAD: the writers).
Its :class:`aiokv.transfers.Copy` resolves when every such rank reported: None when all succeeded,
:class:`TransferFailedError` when any failed, was lost or was not attached. The job stays owned by
the group until every rank is accounted for, whoever still awaits it.

Beyond ``TPConfig.max_jobs`` jobs in flight a spec is held by the group and sent, in launch order,
as room frees (:meth:`RankGroup.submit_queued`): a large load or offload waits for room instead of
failing. A held spec is withdrawn when its call is cancelled (:meth:`GroupTransfers.quiesce`) or the
group closes: nothing of it runs, and its copy raises :class:`~aiokv.transfers.CopyWithdrawn`.

Every spec carries the ranks' attachment sessions of its *call* (:meth:`GroupTransfers.admitted`,
entered by ``TPCache`` when a load, offload or stream begins): a spec sent later (held for room, a
later round or launch group) goes only to the rank processes the call was admitted for. A rank
restarted meanwhile fails it (RANK_LOST) before any rank is sent anything: the new process's KV
buffer holds its own engine's state, so an offload would store those bytes under the call's keys
and a load would overwrite them.

A load stream's copies (:class:`~aiokv.tp.TPLoadStream`) carry the stream's id: :meth:`mark`,
called by the stream as it begins, has the group tell every rank (``RankGroup.begin_stream``), and
each rank orders those copies after the mark it recorded on its engine's stream then, not after its
engine's stream at each copy's launch (the chunks a split's engine queued meanwhile never touch the
loaded slots; ordered behind them, the copies landed only once those chunks had run).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import weakref
from collections.abc import Iterator, Sequence

import torch

from aiokv.transfers import Copy, CopyWithdrawn, Mark, failed_copy

from .group import RankGroup
from .jobs import Job, JobOutcome
from .specs import Direction


class TransferFailedError(RuntimeError):
    """A spec failed on at least one rank (the outcome says which and why)."""

    def __init__(self, outcome: JobOutcome) -> None:
        parts = ", ".join(f"rank {f.rank}: {f.status.name} {f.text}".rstrip() for f in outcome.failures)
        super().__init__(f"job {outcome.job_id} ({outcome.direction.name}) failed: {parts}")
        self.outcome = outcome


_ADMITTED: contextvars.ContextVar[tuple[RankGroup, tuple[int, ...]] | None] = contextvars.ContextVar(
    "aiokv_tp_admitted", default=None
)
"""The group and its ranks' sessions of the call running in this context (:meth:`GroupTransfers.admitted`).

A context variable because the manager's paths (``CacheManager``'s load and offload rounds, a
``LoadStream``'s loader task, created inside the call and copying its context) reach the transfers
through the generic :class:`aiokv.transfers.Transfers` seam, which has no notion of a call."""


class _StreamScope:
    """The load stream being built in this context (:meth:`GroupTransfers.streaming`): its id, once
    :meth:`GroupTransfers.mark` began it. Mutable and shared: the stream's loader task, created
    while the scope is entered, copies the context and so sees the id set by ``mark``."""

    __slots__ = ("group", "stream")

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.stream = 0


_STREAM: contextvars.ContextVar[_StreamScope | None] = contextvars.ContextVar("aiokv_tp_stream", default=None)
"""The stream whose copies are launched in this context (a ``TPLoadStream``'s loader), if any.

A context variable for the reason ``_ADMITTED`` is one: ``LoadStream`` reaches the transfers through
the generic seam, whose ``Mark`` is a CUDA event of this process (a rank's mark lives in the rank)."""


class GroupTransfers:
    """Implements :class:`aiokv.transfers.Transfers` over a started :class:`RankGroup`."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        # Each copy's job, sent or held (the job drops its reference to the copy's future once done).
        self._jobs: weakref.WeakKeyDictionary[asyncio.Future[None], Job] = weakref.WeakKeyDictionary()

    @contextlib.contextmanager
    def admitted(self) -> Iterator[tuple[int, ...]]:
        """Admit one call: every copy launched in this context (and in tasks created in it, such as
        a stream's loader) carries the ranks' sessions of now and is sent only to those sessions
        (see the module docstring). Yields them. Enter it in the task that runs the call."""
        sessions = self.group.sessions()
        token = _ADMITTED.set((self.group, sessions))
        try:
            yield sessions
        finally:
            _ADMITTED.reset(token)

    @contextlib.contextmanager
    def streaming(self) -> Iterator[None]:
        """Build a load stream in this context: its :meth:`mark` begins a stream on the ranks, and the
        LOAD copies its loader task (created inside) launches carry the stream's id. Enter it only
        around the stream's construction (``TPLoadStream`` does): the caller's later calls are not
        the stream's."""
        token = _STREAM.set(_StreamScope(self.group))
        try:
            yield
        finally:
            _STREAM.reset(token)

    def offload(self, slots: torch.Tensor, page_ids: list[int]) -> Copy:
        return self._submit(Direction.OFFLOAD, page_ids, slots, 0)

    def mark(self) -> Mark:
        """Inside :meth:`streaming`: begin the stream on the ranks (``RankGroup.begin_stream``;
        each rank records its own mark on its engine's stream as it reads that). Returns None: no
        event of this process orders a rank's copies. Outside a stream's construction, nothing."""
        scope = _STREAM.get()
        if scope is not None and scope.group is self.group and not scope.stream:
            scope.stream = self.group.begin_stream()
        return None

    def load(self, page_ids: list[int], slots: torch.Tensor, skip: int, after: Mark = None) -> Copy:
        return self._submit(Direction.LOAD, page_ids, slots, skip)

    def load_layers(self, page_ids: list[int], slots: torch.Tensor, skip: int, after: Mark = None) -> Copy:
        """A layered LOAD spec: each rank copies layer by layer. The copy's ``layer_futures`` resolve
        as every rank reports a layer landed (CPU ranks report each; a CUDA rank's layers resolve
        with its whole part, its own stream waits per layer: ``RankWorker.wait_layer``)."""
        return self._submit(Direction.LOAD, page_ids, slots, skip, layered=True)

    def job_id(self, copy: Copy) -> int | None:
        """The job id of a copy this object launched, sent or held for room (None: failed before
        it was sent). Specs reach the ranks in job-id order, held ones too."""
        job = self._jobs.get(copy.future)
        return None if job is None else job.id

    def _submit(
        self, direction: Direction, page_ids: list[int], slots: torch.Tensor, skip: int, layered: bool = False
    ) -> Copy:
        group = self.group
        if group.closing:  # nothing is sent any more: withdrawn, as a held spec would be
            return failed_copy(CopyWithdrawn("the rank group is closing: spec not sent"))
        admitted = _ADMITTED.get()
        # A copy launched outside an admitted call (a direct user of this object) is admitted now.
        sessions = admitted[1] if admitted is not None and admitted[0] is group else None
        scope = _STREAM.get()
        # A load stream's copy: each rank orders it after the mark it recorded when the stream began.
        stream = scope.stream if scope is not None and scope.group is group and direction is Direction.LOAD else 0
        try:
            # Sent now, or held (in launch order) until the jobs in flight leave room for it.
            spec = group.spec(direction, page_ids, slots, skip, layered, stream)
            job = group.submit_queued(spec, sessions=sessions)
        except ValueError as exc:  # arguments were validated by the manager: a counted fault
            return failed_copy(exc)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def settle(done: Job) -> None:
            if future.done():
                return
            outcome = done.outcome()
            if outcome.ok:
                future.set_result(None)
            elif outcome.withdrawn:
                future.set_exception(CopyWithdrawn(f"job {outcome.job_id} withdrawn before it was sent"))
            else:
                future.set_exception(TransferFailedError(outcome))

        job.add_done_callback(settle)
        if not job.done():  # sent or held (a job failed before sending is done already)
            self._jobs[future] = job
        return Copy(future, layer_futures=job.layer_futures)

    def order_after(self, events: Sequence[torch.cuda.Event], seen: set[tuple[int, int]] | None = None) -> None:
        """Nothing to order here: each rank orders its own stream after its copies."""

    async def quiesce(self, copies: Sequence[Copy], *, offload: bool) -> None:
        """Wait until every rank finished (or was lost) with each of ``copies``.

        Specs of ``copies`` still held for room are withdrawn first, all at once (none is ever
        sent). The ranks copy into and out of the engine's buffers in their own processes: a
        failing or cancelled call returns only when none of its specs still runs anywhere (a dead
        rank's part ends when the group notices its connection drop).
        """
        self.group.withdraw([job for c in copies if (job := self._jobs.get(c.future)) is not None])
        pending = {c.future for c in copies if not c.future.done()}
        while pending:
            try:
                _, pending = await asyncio.wait(pending)
            except asyncio.CancelledError:
                continue  # cancelled again: still wait; the caller re-raises its own error
