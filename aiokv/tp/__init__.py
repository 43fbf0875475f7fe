"""Tensor parallelism across processes: a scheduler-side manager and one worker per rank process.

The manager (no engine tensors, no CUDA) owns the pool's page table and sends *transfer specs*
through a :class:`RankGroup`; each rank's process runs a :class:`RankWorker` that attaches the same
pool by name and copies its head slice of every page. A job resolves when every rank it was sent to
reported or is gone; pages are committed only when all succeeded::

    # scheduler process
    async with RankGroup(layout, tp_size, pool.name, pool.num_pages) as group:
        await group.wait_attached()                     # every rank's worker has the pool mapped
        handles = [r.handle for r in pool.reserve(keys)]  # RESERVED pages (check the outcomes)
        job = group.submit_nowait(group.spec(Direction.OFFLOAD, [h.page for h in handles], slots))
        job.add_done_callback(settle)  # commit every handle if job.outcome().ok, else abort them
        outcome = await job            # cancelling this await leaves the job (and pages) owned

    # each rank process: its own heads of the KV buffer
    with RankWorkerThread(group.address, rank, tp_size, layout, kv_slice):   # synchronous runner
        ...
    async with RankWorker(group.address, rank, tp_size, layout, kv_slice):  # or on the rank's loop
        ...

Layer-wise loads through a :class:`TPCache` (``start_load(..., layered=True)``): see
:mod:`aiokv.tp.stream`.
"""

from .cache import TPCache
from .config import TPConfig
from .executor import RankExecutor, RankReport
from .group import GroupStatistics, RankGroup
from .jobs import Job, JobOutcome, JobStatistics, JobTable, RankFailure
from .specs import Direction, LayeredLoad, TransferSpec
from .stream import TPLoadStream
from .wire import ProtocolError, RankStatus, RefuseReason
from .worker import RankWorker, RankWorkerThread, WorkerRefusedError, WorkerStatistics

__all__ = [
    "Direction",
    "GroupStatistics",
    "Job",
    "JobOutcome",
    "JobStatistics",
    "JobTable",
    "LayeredLoad",
    "ProtocolError",
    "RankExecutor",
    "RankFailure",
    "RankGroup",
    "RankReport",
    "RankStatus",
    "RankWorker",
    "RankWorkerThread",
    "RefuseReason",
    "TPCache",
    "TPConfig",
    "TPLoadStream",
    "TransferSpec",
    "WorkerRefusedError",
    "WorkerStatistics",
]
