"""`GroupTransfers`: the manager's transfers run by the rank workers of a :class:`RankGroup`.

Each transfer becomes one spec sent to every rank that takes part (LOAD: all; OFFLOAD: the writers).
Its :class:`aiokv.transfers.Copy` resolves when every such rank reported: None when all succeeded,
:class:`TransferFailedError` when any failed, was lost or was not attached. The job stays owned by
the group until every rank is accounted for, whoever still awaits it.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence

import torch

from aiokv.transfers import Copy, failed_copy

from .group import RankGroup
from .jobs import Job, JobOutcome
from .specs import Direction


class TransferFailedError(RuntimeError):
    """A spec failed on at least one rank (the outcome says which and why)."""

    def __init__(self, outcome: JobOutcome) -> None:
        parts = ", ".join(f"rank {f.rank}: {f.status.name} {f.text}".rstrip() for f in outcome.failures)
        super().__init__(f"job {outcome.job_id} ({outcome.direction.name}) failed: {parts}")
        self.outcome = outcome


class GroupTransfers:
    """Implements :class:`aiokv.transfers.Transfers` over a started :class:`RankGroup`."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self._jobs: weakref.WeakKeyDictionary[asyncio.Future[None], int] = weakref.WeakKeyDictionary()

    def offload(self, slots: torch.Tensor, page_ids: list[int]) -> Copy:
        return self._submit(Direction.OFFLOAD, page_ids, slots, 0)

    def load(self, page_ids: list[int], slots: torch.Tensor, skip: int) -> Copy:
        return self._submit(Direction.LOAD, page_ids, slots, skip)

    def load_layers(self, page_ids: list[int], slots: torch.Tensor, skip: int) -> Copy:
        """A layered LOAD spec: each rank copies layer by layer. The copy's ``layer_futures`` resolve
        as every rank reports a layer landed (CPU ranks report each; a CUDA rank's layers resolve
        with its whole part, its own stream waits per layer: ``RankWorker.wait_layer``)."""
        return self._submit(Direction.LOAD, page_ids, slots, skip, layered=True)

    def job_id(self, copy: Copy) -> int | None:
        """The job id of a copy this object launched and sent (None: failed before it was sent)."""
        return self._jobs.get(copy.future)

    def _submit(
        self, direction: Direction, page_ids: list[int], slots: torch.Tensor, skip: int, layered: bool = False
    ) -> Copy:
        try:
            job = self.group.submit_nowait(self.group.spec(direction, page_ids, slots, skip, layered))
        except (asyncio.QueueFull, ValueError) as exc:  # too many jobs in flight: a counted fault
            return failed_copy(exc)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def settle(done: Job) -> None:
            if future.done():
                return
            outcome = done.outcome()
            if outcome.ok:
                future.set_result(None)
            else:
                future.set_exception(TransferFailedError(outcome))

        job.add_done_callback(settle)
        if not job.done():  # sent to the ranks (a job failed before sending is done already)
            self._jobs[future] = job.id
        return Copy(future, layer_futures=job.layer_futures)

    def order_after(self, events: Sequence[torch.cuda.Event]) -> None:
        """Nothing to order here: each rank orders its own stream after its copies."""

    async def quiesce(self, copies: Sequence[Copy], *, offload: bool) -> None:
        """Wait until every rank finished (or was lost) with each of ``copies``.

        The ranks copy into and out of the engine's buffers in their own processes: a failing or
        cancelled call returns only when none of its specs still runs anywhere (a dead rank's part
        ends when the group notices its connection drop).
        """
        pending = {c.future for c in copies if not c.future.done()}
        while pending:
            try:
                _, pending = await asyncio.wait(pending)
            except asyncio.CancelledError:
                continue  # cancelled again: still wait; the caller re-raises its own error
