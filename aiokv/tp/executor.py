"""`RankExecutor`: runs transfer specs for one rank against one attached pool mapping.

It lives in the rank's process. A :class:`~aiokv.kernels.PageMover` over this rank's KV buffer
(its head slice) and its part of every page of the attached pool moves the bytes (the pool is
rank-major, ``KVLayout.for_tp``: the part is one contiguous block per page, so a CUDA rank uses the
STAGING path, one copy-engine memcpy per page; an offload page whose slots are one ascending run is
copied straight from the KV buffer by one 2-D copy-engine memcpy, no kernel, ``TPConfig.offload_runs``):

- CPU KV buffer: the copy runs on the :class:`~aiokv.cuda.CompletionBridge`'s copy thread (specs
  stay in order); a thread runner's private loop is itself the copy thread (``copy_on_loop``). A
  copy of at most ``TPConfig.inline_copy_bytes`` runs on the driving loop when no copy is queued
  (order kept): the hop to the copy thread and back cost more than such a copy (a spec round trip
  of an async runner took 2.5x a thread runner's on the H200 host, the difference being that hop).
- CUDA KV buffer: the copy is launched on the mover's own side streams, ordered after the engine's
  stream by an event; a LOAD also makes the engine's stream wait for the copy, so the engine's later
  kernels see the bytes (a layered LOAD does not: the engine waits per layer, see below). The event
  is recorded at the copy's launch, except for a LOAD of a load stream (``spec.stream``): that one
  is ordered after the stream's *mark*, an event recorded on the engine's stream when the rank
  learnt that the stream began, so it does not wait for the chunks the engine queued since (a
  split's claimed chunks, which never touch the loaded slots). The rank learns it twice, and the
  first mark recorded is kept: at the engine's own announcement (:meth:`RankExecutor.announce_stream`,
  from the engine's thread at the start of the step that carries the stream's id, before that
  step's kernels) or at the manager's STREAM_BEGINS frame (:meth:`RankExecutor.begin_stream`, the
  fallback for engines that do not announce). A stream whose mark this rank lacks (its record
  raised, it was dropped as old, or it was never begun here) has its copies ordered at their
  launch, as before marks: later, never unordered.
  Completion comes through the bridge's waiter threads (no polling). The attached mapping is
  registered with CUDA (pinned + mapped) chunk by chunk in background threads; a spec waits for the
  chunks of its pages only.

A layered LOAD (``spec.layered``) copies layer 0 of every page, then layer 1, ...
(``PageMover.load_layers``); :attr:`RankExecutor.layers` keeps each job's progress for the
engine's rank process (:mod:`aiokv.tp.layers`): CPU layers are marked as they land (and
``on_layers`` is told, from whatever thread copied them). CUDA copies leave one event per layer;
on the STAGING path they are paced as in the single-process cache (``PageMover.start_layers``, fed
on the bridge's copy thread, :mod:`aiokv.tp.paced`): layer ``l`` is ready for the engine once its
event is queued, and ``on_layers`` is told once it completed. A fence stops a paced load between
two units (a CPU layered load between two layers): the layers never queued are never ready.

An engine that carries specs over its own channel can use this class directly:
``report = await executor.execute(spec)`` on each rank, then send ``report`` back itself. To stop
a rank, ``executor.fence()`` then ``await executor.drain()``: only then are its specs over (the
scheduler must not count a spec failed and reuse its slots before the rank's report or its end).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import enum
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import torch

from aiokv.cuda import CompletionBridge, Lane
from aiokv.kernels import PageMover, TransferPath
from aiokv.layout import KVBuffer
from aiokv.pool import MAX_CHUNKS, PageMemory
from aiokv.shm import ChunkResult, prepare_in_background

from .cancels import Cancels, in_thread
from .config import TPConfig
from .layers import LayerProgress, LayerTable
from .paced import feed_layers, stopped_by_request, watch_landed
from .specs import Direction, TransferSpec
from .wire import RankStatus

if TYPE_CHECKING:
    from aiokv.kernels.mover import PacedLayers

log = logging.getLogger(__name__)


class Announced(enum.Enum):
    """What :meth:`RankExecutor.announce_stream` did with an engine's announcement."""

    RECORDED = "recorded"
    """The mark was recorded now: the stream's copies are ordered after it."""
    HELD = "held"
    """A mark of the stream was held already (its frame was read first, or it was announced
    before): that earlier one is kept."""
    STALE = "stale"
    """The stream's frame was read here and its mark is gone (dropped as old, or its record
    failed): nothing to improve, its copies are ordered at their launch."""
    AHEAD = "ahead"
    """More than ``TPConfig.stream_marks`` ids past the newest stream begun here: no stream the
    manager began (ignored; a mark recorded before its stream began would not cover the work the
    engine queues until then)."""
    CLOSING = "closing"
    """The executor is fenced: it starts nothing more."""
    UNTRUSTED = "untrusted"
    """This session's epoch named another pool in an earlier session of the worker (two groups
    given one epoch): an id may name the earlier group's stream, so only frames mark streams."""
    FAILED = "failed"
    """The record raised (a CUDA error): the frame's mark is the fallback."""


@dataclass(frozen=True)
class _Mark:
    event: torch.cuda.Event | None  # None off CUDA (no stream to order)
    announced: bool  # recorded at the engine's announcement, not at the manager's frame


@dataclass(frozen=True)
class RankReport:
    """How one rank's part of a spec ended."""

    status: RankStatus
    text: str = ""


def _classify(exc: BaseException) -> RankReport:
    # The mover validates first and raises ValueError naming the argument: the spec does not fit.
    status = RankStatus.BAD_SPEC if isinstance(exc, ValueError) else RankStatus.COPY_FAILED
    return RankReport(status, f"{type(exc).__name__}: {exc}")


class RankExecutor:
    """Runs specs between ``kv`` (this rank's slice) and the pool pages of ``memory`` (pool ``epoch``).

    ``bridge`` is the worker's completion bridge (it outlives executors across reconnects).
    ``engine_stream``: the stream the engine writes and reads its KV buffer on (CUDA only).
    ``copy_on_loop``: run CPU copies on the driving loop itself; only for a loop that is a thread
    of the worker's own (:class:`~aiokv.tp.RankWorkerThread`), never an engine's or a manager's.
    ``on_layers(job_id, landed)``: called, from the thread that copied them, as layers of a layered
    CPU load land (the worker sends LAYERS frames). ``newest_stream``: the newest stream of this
    epoch whose frame an earlier session read (:meth:`announce_stream` treats ids up to it as
    begun); ``announcements``: False refuses every announcement (UNTRUSTED), see the worker.
    ``first_job``: the manager's first job id of this session (WELCOME): layer waits for earlier
    ids end at once (their specs never come here). One event loop drives it; :meth:`aclose` waits
    for copies in flight, then unmaps the pool.
    """

    def __init__(
        self,
        kv: KVBuffer,
        memory: PageMemory,
        epoch: int,
        bridge: CompletionBridge,
        config: TPConfig | None = None,
        engine_stream: torch.cuda.Stream | None = None,
        path: TransferPath | None = None,
        copy_on_loop: bool = False,
        on_layers: Callable[[int, int], None] | None = None,
        newest_stream: int = 0,
        announcements: bool = True,
        first_job: int = 0,
    ) -> None:
        self.kv = kv
        self.memory = memory
        self.epoch = epoch
        self.config = config or TPConfig()
        self._bridge = bridge
        self._copy_on_loop = copy_on_loop
        self._on_layers = on_layers
        self.layers = LayerTable(epoch, kv.layout.num_layers, first_job)
        """Progress of this session's layered loads, for the engine's per-layer waits."""
        self._cuda = kv.device.type == "cuda"
        if self._cuda and engine_stream is None:
            raise ValueError("a CUDA KV buffer needs the engine's stream")
        self._engine_stream = engine_stream
        # The pool is rank-major ([N, parts, L, T, rows/parts, D]): this rank's part of every page is
        # one contiguous block, so its mover is a whole-row one over a strided view of the pool, and
        # STAGING (one copy-engine memcpy per page) applies instead of the DIRECT kernel.
        if memory.layout != kv.layout.for_tp(kv.tp.size):
            raise ValueError(f"the pool holds {memory.layout.describe()}; rank {kv.tp.rank} of {kv.tp.size} "
                             f"needs {kv.layout.for_tp(kv.tp.size).describe()}")
        pages = memory.pages if memory.layout.parts == 1 else memory.pages[:, kv.tp.part]
        self._mover: PageMover | None = PageMover(kv.rank_part(), pages, path, slot_runs=self.config.offload_runs)
        self._runs_offloaded = 0  # the mover's count, kept once it is dropped
        self._in_flight = 0
        self.layered_loads = 0
        """Layered LOAD specs that reached this executor."""
        self.paced_loads = 0
        """Layered CUDA loads fed a few units at a time (the STAGING path)."""
        self._queued = 0  # copies handed to the bridge's copy thread and not yet back
        layout = kv.layout
        self._slot_bytes = layout.num_layers * kv.rows_local * layout.head_dim * layout.itemsize
        self._idle = asyncio.Event()
        self._idle.set()
        self._drained: list[asyncio.Future[None]] = []  # drained()'s futures, resolved at in_flight 0
        self._closing = False
        # At most MAX_CHUNKS registration chunks, as the pool itself (a tiny register_chunk_bytes
        # would make tens of thousands of tasks holding the GIL from the rank's loop).
        self._pages_per_chunk = max(1, self.config.register_chunk_bytes // kv.layout.page_bytes,
                                    -(-self.memory.num_pages // MAX_CHUNKS))
        self._registering: concurrent.futures.ThreadPoolExecutor | None = None
        self._chunks: list[concurrent.futures.Future[ChunkResult]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._copies: set[asyncio.Future[RankReport]] = set()  # queued on the copy thread, not back yet
        self._feeding: set[PacedLayers] = set()  # paced CUDA loads whose feed has not ended: fence() stops them
        self._unmapped: asyncio.Future[None] | None = None  # the unmap, once aclose() began it
        # Load streams' marks by stream id, oldest first (at most TPConfig.stream_marks): on CUDA an
        # event on the engine's stream recorded when the stream began; None off CUDA (no stream).
        # The lock: the engine announces streams from its own thread (announce_stream) while the
        # driving loop reads frames and executes specs; each takes it to look up, record and insert
        # a mark in one step, so the first mark recorded is the one kept and a spec sees it whole.
        self._marks: collections.OrderedDict[int, _Mark] = collections.OrderedDict()
        self._marks_lock = threading.Lock()
        # The newest stream whose STREAM_BEGINS was read, by this executor or (same epoch) by an
        # earlier session of its worker: an announced id up to it is not a stream about to begin.
        self._newest_begun = newest_stream
        self._announcements = announcements
        self.stream_marks = 0
        """Load streams whose mark this executor recorded."""
        self.stream_marks_failed = 0
        """Load streams whose mark could not be recorded (a CUDA error): their copies are ordered
        after the engine's stream at their launch."""
        self.stream_marks_missed = 0
        """LOAD specs naming a stream whose mark is not held here (its record failed, it was dropped
        as old, or the stream was never announced): ordered after the engine's stream at launch."""
        self.stream_marks_announced = 0
        """Of :attr:`stream_marks`, marks recorded at the engine's announcement (before the frame)."""
        if self._cuda:
            self._register_in_background()

    def _register_in_background(self) -> None:
        # Each process registers its own mapping (registration is per mapping): ~50 ms/GiB when the
        # creator already touched the pages, so it runs chunk by chunk in threads, low pages first.
        page_bytes = self.kv.layout.page_bytes
        ranges = [
            (start * page_bytes, min(self._pages_per_chunk, self.memory.num_pages - start) * page_bytes)
            for start in range(0, self.memory.num_pages, self._pages_per_chunk)
        ]
        self._registering, self._chunks = prepare_in_background(
            self.memory.segment, ranges, True, self.config.register_threads
        )

    # -- running specs --------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Specs started and not yet reported."""
        return self._in_flight

    @property
    def transfer_path(self) -> TransferPath | None:
        """The path this rank's copies take (STAGING on CUDA by default); None once closed."""
        return None if self._mover is None else self._mover.effective_path

    @property
    def runs_offloaded(self) -> int:
        """Pages offloaded by run copies (``TPConfig.offload_runs``: one copy-engine memcpy each)."""
        return self._runs_offloaded if self._mover is None else self._mover.runs_offloaded

    @property
    def registered_chunks(self) -> tuple[int, int]:
        """``(ready, total)`` chunks of the mapping registered with CUDA (``(0, 0)`` off CUDA)."""
        ready = sum(1 for f in self._chunks if f.done() and f.result().error is None)
        return ready, len(self._chunks)

    def begin_stream(self, stream: int) -> None:
        """Load stream ``stream`` began: record its mark now (CUDA: an event on the engine's stream).

        Call when the rank learns of the stream (the worker does, as it reads the manager's
        STREAM_BEGINS frame), before any of the stream's specs is executed, on the driving loop.
        The mark covers all the engine queued on its stream so far; the stream's LOAD specs are
        ordered after it, not after what the engine queues later. A mark the engine announced
        first (:meth:`announce_stream`) is kept instead: recorded earlier, it covers less of the
        engine's later work. Never raises: a mark that cannot be recorded (a CUDA error) is
        counted and logged, and the stream's copies are then ordered at their launch (as without a
        mark); if the error is sticky, their launch fails and they report COPY_FAILED (the manager
        shortens the load and releases its pages). Ignored once fenced.
        """
        with self._marks_lock:
            if self._closing:
                return
            self._newest_begun = max(self._newest_begun, stream)
            held = self._marks.get(stream)
            if held is not None and held.announced:
                return  # the engine's announcement came first: its earlier mark stays
            try:
                event = self._record_mark()
            except Exception as exc:
                self.stream_marks_failed += 1
                log.warning("rank %d: the mark of load stream %d failed (its copies are ordered at their launch): "
                            "%r", self.kv.tp.rank, stream, exc)
                self._marks.pop(stream, None)
                return
            # A stream begun again (only a faulty manager does that) takes the newer mark (it
            # covers more of the engine's work) and is still one stream.
            self._insert(stream, _Mark(event, False))

    def announce_stream(self, stream: int) -> Announced:
        """The engine announces load stream ``stream`` (``TPLoadStream.stream_id``, carried in its
        own step message) at the start of that step, before it queues the step's kernels: record
        the stream's mark now if none is held. Callable from any thread (the engine's), also while
        the loop runs specs; ``stream`` must be a validated id > 0 of this executor's pool epoch
        (:meth:`RankWorker.begin_stream` checks). Never raises; returns what it did.

        Why the earlier of the two marks is the one to keep: each covers everything the engine
        queued before ``start_load`` (the frame is written by ``start_load`` and read later; the
        announcing step is sent after ``start_load`` returned, so the engine's earlier steps are
        queued before it), which is what the copies must land after. Past that, a mark only adds
        the engine's later work (the chunks it queued since, which a split's copies must not wait
        for): the earlier one adds less. So an announcement after the frame was read is ignored
        (HELD), and a frame read after the announcement keeps it.

        A spec of the stream executed before this call takes the frame's mark (the frame precedes
        its specs on the link), never none; a mark is looked up, recorded and inserted under one
        lock, so no spec sees a half-made one. An id more than ``TPConfig.stream_marks`` past the
        newest stream begun here is refused (AHEAD): recorded before its stream began, a mark would
        miss the engine's work queued until then. Ids below it that were never begun cannot be told
        from ones whose frame is still in flight: announcing only ids of streams the scheduler
        started is the engine's part. The worker seeds ``newest_stream`` with what earlier sessions
        of the epoch read, and refuses all (UNTRUSTED) when the epoch had another pool before.
        """
        with self._marks_lock:
            if self._closing:
                return Announced.CLOSING
            held = self._marks.get(stream)
            if held is not None:
                return Announced.HELD
            if stream <= self._newest_begun:
                return Announced.STALE  # its frame was read: the mark failed or was dropped as old
            if not self._announcements:
                return Announced.UNTRUSTED
            if stream > self._newest_begun + self.config.stream_marks:
                return Announced.AHEAD
            try:
                event = self._record_mark()
            except Exception as exc:
                log.warning("rank %d: the announced mark of load stream %d failed (its frame's mark is the "
                            "fallback): %r", self.kv.tp.rank, stream, exc)
                return Announced.FAILED
            self._insert(stream, _Mark(event, True))
            self.stream_marks_announced += 1
            return Announced.RECORDED

    @property
    def newest_stream(self) -> int:
        """The newest stream id whose STREAM_BEGINS this executor (or, as ``newest_stream``, an
        earlier session) read; 0 for none."""
        with self._marks_lock:
            return self._newest_begun

    def _insert(self, stream: int, mark: _Mark) -> None:
        """Hold ``mark`` for ``stream`` (under the lock), dropping the oldest beyond the bound."""
        if stream not in self._marks:
            self.stream_marks += 1
        self._marks[stream] = mark
        self._marks.move_to_end(stream)
        while len(self._marks) > self.config.stream_marks:
            self._marks.popitem(last=False)

    def _record_mark(self) -> torch.cuda.Event | None:
        """An event after everything the engine queued on its stream so far (None off CUDA)."""
        if not self._cuda:
            return None
        assert self._engine_stream is not None
        mark = torch.cuda.Event()  # type: ignore[no-untyped-call]
        mark.record(self._engine_stream)
        return mark

    def _after(self, spec: TransferSpec) -> torch.cuda.Event | None:
        """What a LOAD spec's copy is ordered after: its stream's mark, or None (the engine's
        stream at the copy's launch) for a spec of no stream or of a stream whose mark is not held."""
        if not spec.stream:
            return None
        with self._marks_lock:
            held = self._marks.get(spec.stream)
            if held is None:
                self.stream_marks_missed += 1
                return None
            return held.event

    def execute(self, spec: TransferSpec) -> asyncio.Future[RankReport]:
        """Start ``spec``; the future resolves with this rank's report when its copy is over. Never raises."""
        loop = asyncio.get_running_loop()
        result: asyncio.Future[RankReport] = loop.create_future()
        self._in_flight += 1
        self._idle.clear()
        result.add_done_callback(self._finished)
        try:
            self._dispatch(spec, result)
        except Exception as exc:
            # Counted in flight above: a spec whose future never resolves kept drained() and the
            # close waiting for good (review 212: the copy thread refusing it, its bridge closed or
            # the interpreter shutting down). Nothing ran, or the launch path reported already.
            if not result.done():
                result.set_result(_classify(exc))
        return result

    def _dispatch(self, spec: TransferSpec, result: asyncio.Future[RankReport]) -> None:
        """:meth:`execute`'s body after the count: start ``spec``'s copy, ``result`` its report."""
        loop = asyncio.get_running_loop()
        progress = self.layers.arrived(spec.job_id, spec.layered)
        if progress is not None:
            self.layered_loads += 1
            result.add_done_callback(lambda _: progress.end())
        early = self._precheck(spec)
        # Looked up now, in the order specs arrive: a mark dropped later (as old) still orders this copy.
        after = self._after(spec) if early is None and spec.direction is Direction.LOAD else None
        if early is not None:
            result.set_result(early)
        elif not self._cuda and (self._copy_on_loop or self._inline(spec)):
            result.set_result(self._copy_on_thread(spec, progress, after))
        elif not self._cuda:
            copy = self._bridge.run_cpu(functools.partial(self._copy_on_thread, spec, progress, after))
            self._queued += 1  # after the bridge took it: a refused copy is never dequeued
            self._copies.add(copy)
            copy.add_done_callback(self._dequeued)
            copy.add_done_callback(functools.partial(_forward, result))
        else:
            waiting = self._unregistered(spec.page_ids)
            if waiting is None:
                result.set_result(RankReport(RankStatus.NOT_REGISTERED, "a page lies in a chunk CUDA refused"))
            elif waiting:
                task = loop.create_task(self._launch_when_registered(spec, result, waiting, progress, after))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                task.add_done_callback(functools.partial(_not_launched, result))
            else:
                self._launch_cuda(spec, result, progress, after)

    def _precheck(self, spec: TransferSpec) -> RankReport | None:
        if self._closing or self._mover is None:
            return RankReport(RankStatus.WORKER_CLOSING, "the worker is closing")
        if spec.epoch != self.epoch:
            return RankReport(RankStatus.STALE_EPOCH, f"spec epoch {spec.epoch:#x}, attached {self.epoch:#x}")
        if spec.page_tokens != self.kv.layout.page_tokens:
            tokens = self.kv.layout.page_tokens
            return RankReport(RankStatus.BAD_SPEC, f"spec pages hold {spec.page_tokens} tokens, the layout's {tokens}")
        if spec.direction is Direction.OFFLOAD and not self.kv.tp.writer:
            return RankReport(RankStatus.OK)  # a replica (or MLA rank > 0): the writer of its rows copies
        return None

    def _inline(self, spec: TransferSpec) -> bool:
        """Whether this CPU copy is small enough for the loop, with no earlier copy still queued.

        Never a layered load: its point is that the engine computes while layers land, and an
        engine on this loop could not (the loop would be busy copying until the last layer).
        """
        return (not spec.layered and self._queued == 0
                and len(spec.slots) * self._slot_bytes <= self.config.inline_copy_bytes)

    def _dequeued(self, copy: asyncio.Future[RankReport]) -> None:
        self._queued -= 1
        self._copies.discard(copy)

    def _copy_on_thread(
        self, spec: TransferSpec, progress: LayerProgress | None = None, after: torch.cuda.Event | None = None
    ) -> RankReport:
        """The CPU copy, on the bridge's copy thread (or inline, see :meth:`_inline`); never raises.
        ``after`` (a LOAD's mark) is handed to the mover, which has no stream to order here."""
        mover = self._mover
        assert mover is not None  # dropped only after every copy is over
        try:
            slots = torch.from_numpy(np.array(spec.slots))  # a writable copy: torch refuses read-only arrays
            ids = spec.page_ids.tolist()
            if spec.direction is Direction.OFFLOAD:
                mover.offload(slots, ids)
            elif progress is not None:
                mover.load_layers(ids, slots, spec.skip_first, functools.partial(self._landed, spec.job_id, progress),
                                  after=after)
            else:
                mover.load(ids, slots, spec.skip_first, after=after)
        except _Fenced:
            return RankReport(RankStatus.WORKER_CLOSING, "fenced: the load stopped between two layers")
        except Exception as exc:
            return _classify(exc)
        return RankReport(RankStatus.OK)

    def _landed(self, job_id: int, progress: LayerProgress, layer: int) -> None:
        """A layer of a layered CPU load is in the buffer (called on the copying thread).

        Raises :class:`_Fenced` after it was counted when the executor was fenced meanwhile: the
        load copies no further layer (the engine's waits for them return False).
        """
        progress.mark(layer + 1)
        if self._on_layers is not None:
            self._on_layers(job_id, layer + 1)
        if self._closing and layer + 1 < self.kv.layout.num_layers:
            raise _Fenced

    def _launch_cuda(
        self, spec: TransferSpec, result: asyncio.Future[RankReport], progress: LayerProgress | None = None,
        after: torch.cuda.Event | None = None,
    ) -> None:
        """Queue ``spec``'s copy; a LOAD behind ``after`` (its stream's mark) when given, else behind
        the engine's stream now. A LOAD still makes the engine's stream wait for it (layered: per
        layer, ``wait_layer``) before anything the engine queues from now on reads the slots."""
        mover, stream = self._mover, self._engine_stream
        assert mover is not None and stream is not None
        try:
            slots = torch.from_numpy(np.array(spec.slots))
            ids = spec.page_ids.tolist()
            # The mover orders its side streams after the *current* stream: make that the engine's.
            with torch.cuda.stream(stream):
                if spec.direction is Direction.OFFLOAD:
                    event = mover.offload(slots, ids)
                    lane = Lane.OFFLOAD
                elif progress is not None:
                    # The engine's stream is not made to wait: it waits per layer (wait_layer).
                    paced = mover.start_layers(ids, slots, spec.skip_first, self.config.pace_bytes, after=after)
                    if paced is not None:
                        self.paced_loads += 1
                        fed = feed_layers(paced, progress, self._bridge, self._cuda_landed(spec.job_id))
                        self._feeding.add(paced)
                        fed.add_done_callback(functools.partial(self._fed, paced, result))
                        return
                    events = mover.load_layers(ids, slots, spec.skip_first, after=after)
                    assert events
                    # Queued now, and the engine's stream was not made to wait for them: from here
                    # nothing may reach the except path below, whose event on the engine's stream
                    # does not cover these copies (a COPY_FAILED reported while they wrote slots).
                    progress.launch(events)  # all queued at once (DIRECT, REFERENCE)
                    _watch_layers(self._bridge, events, self._cuda_landed(spec.job_id))
                    event, lane = events[-1], Lane.LOAD
                else:
                    event = mover.load(ids, slots, spec.skip_first, after=after)
                    lane = Lane.LOAD
                    if event is not None:
                        stream.wait_event(event)  # the engine's later kernels read what we wrote
        except Exception as exc:
            # Failed part-way, the mover ordered the engine's stream after what it had queued: report
            # once that is done. Reported at once, the manager aborted the pages (and reused the
            # slots) while copies still wrote them: a reused page could take a late write.
            try:
                queued = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
                queued.record(stream)
                lane = Lane.OFFLOAD if spec.direction is Direction.OFFLOAD else Lane.LOAD
                failed = _wait_event(self._bridge, queued, lane)
            except Exception:
                # The record failed too (a sticky CUDA error): nothing queued will run any more, and
                # execute() must still report (else the close waits for this job for ever).
                if not result.done():
                    result.set_result(_classify(exc))
                return
            failed.add_done_callback(functools.partial(_failed_after_queued, result, _classify(exc)))
            return
        waited = _wait_event(self._bridge, event, lane)
        waited.add_done_callback(functools.partial(_event_done, result))

    def _fed(self, paced: PacedLayers, result: asyncio.Future[RankReport], fed: asyncio.Future[None]) -> None:
        """A paced load's feed ended (every unit it queued is done on the GPU): report it.

        Stopped by :meth:`fence` (nothing else stops the loads of an executor), it is the close's
        doing, not a fault: WORKER_CLOSING. A launch fault or a CUDA error raised meanwhile is still
        COPY_FAILED.
        """
        self._feeding.discard(paced)
        if not result.done() and not fed.cancelled():
            exc = fed.exception()
            if exc is not None and stopped_by_request(paced, exc):
                text = f"fenced: the load stopped between two units ({exc})"
                result.set_result(RankReport(RankStatus.WORKER_CLOSING, text))
                return
        _copied(result, fed)

    def _cuda_landed(self, job_id: int) -> Callable[[int], None] | None:
        """Tells ``on_layers`` (on the loop) how many layers of a CUDA job completed on the GPU."""
        on_layers = self._on_layers
        return None if on_layers is None else functools.partial(on_layers, job_id)

    async def _launch_when_registered(
        self,
        spec: TransferSpec,
        result: asyncio.Future[RankReport],
        waiting: list[concurrent.futures.Future[ChunkResult]],
        progress: LayerProgress | None,
        after: torch.cuda.Event | None,
    ) -> None:
        """Launch ``spec`` once its pages' chunks are registered; the copy settles ``result`` by
        callback. Nothing is awaited after the launch: this task awaited the copy's report, and a
        loop's shutdown (which cancels every task) cancelled that future with it, so the spec was
        reported WORKER_CLOSING while its copy ran and the drain ended under it (review 203).
        Cancelled before the launch, nothing was queued (:func:`_not_launched`)."""
        for chunk in waiting:
            # Shielded: cancelling an asyncio wrapper would cancel the registration work too.
            done = await asyncio.shield(asyncio.wrap_future(chunk))
            if done.error is not None:
                result.set_result(RankReport(RankStatus.NOT_REGISTERED, f"pool chunk {done.index}: {done.error}"))
                return
        if self._closing:
            result.set_result(RankReport(RankStatus.WORKER_CLOSING, "the worker is closing"))
            return
        self._launch_cuda(spec, result, progress, after)

    def _unregistered(self, page_ids: npt.NDArray[np.uint32]) -> list[concurrent.futures.Future[ChunkResult]] | None:
        """Chunk futures the pages still wait for; None when one of them failed to register."""
        chunk_ids = sorted({int(p) // self._pages_per_chunk for p in page_ids.tolist()})
        waiting = []
        for index in chunk_ids:
            if index >= len(self._chunks):
                continue  # out of range: the mover refuses the spec with a clear error
            chunk = self._chunks[index]
            if not chunk.done():
                waiting.append(chunk)
            elif chunk.cancelled() or chunk.result().error is not None:
                return None
        return waiting

    def _finished(self, _: asyncio.Future[RankReport]) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()
            waiting, self._drained = self._drained, []
            for drained in waiting:
                if not drained.done():
                    drained.set_result(None)

    async def drain(self) -> None:
        """Wait until every started spec has reported."""
        await self._idle.wait()

    def drained(self) -> asyncio.Future[None]:
        """A plain future (no task) resolved once every started spec has reported: what a teardown
        awaits through :meth:`Cancels.outlast`. No loop-wide cancel reaches it (a loop's shutdown,
        an application's SIGTERM handler cancel tasks): a drain in a task of its own, run anew three
        times at most (the removed ``Cancels.finish``), ended under a running copy at the third such
        cancel and the session let go of the rank (review 203: wrong KV). Call on the driving loop."""
        drained: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._in_flight == 0:
            drained.set_result(None)
        else:
            self._drained.append(drained)
        return drained

    def fence(self) -> None:
        """Start nothing more: later specs are refused (WORKER_CLOSING), CPU copies still queued on
        the copy thread are withdrawn (reported WORKER_CLOSING, no byte moved), a layered CPU load
        stops after its current layer, a paced CUDA load queues no further unit (one not fed yet
        queues none; what it queued still completes on the GPU before it reports WORKER_CLOSING),
        and a CUDA spec still waiting for its pages' registration is not launched. A stopped load's
        layers never queued are never ready (the engine's waits for them return False). A copy
        already running (or queued on the GPU) ends as it would have: wait for it with
        :meth:`drain`. Idempotent; call on the driving loop.
        """
        with self._marks_lock:  # an announcement racing this records nothing after it
            self._closing = True
        for copy in list(self._copies):
            self._bridge.withdraw(copy)  # False for one running or over: it reports when it ends
        for paced in self._feeding:
            paced.stop()  # any thread; the feed checks it between two units

    # -- lifetime -------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """:meth:`fence`, wait for copies in flight, stop registration, unmap. Idempotent: every call
        returns once the pool is unmapped. Cancelled meanwhile (any number of times), it still runs
        each step to its end, then raises the cancel: a cancel during the drain used to skip the
        unmap (the pool stayed mapped), one during the unmap let a second call return before it.
        """
        self.fence()
        cancels = Cancels()
        await cancels.outlast(self.drained())
        self.layers.close()
        with self._marks_lock:
            self._marks.clear()
        if self._unmapped is None:
            # Nothing may still view the mapping when it is unmapped: drop the mover's page tensors first.
            if self._mover is not None:
                self._runs_offloaded = self._mover.runs_offloaded
            self._mover = None
            # A plain future, no task: a loop's shutdown cancelled the task of a to_thread while
            # the unmap went on, and every later call raised that cancel at once (review 202: the
            # worker's teardown, running the close again, spun through asyncio.run's end for ever).
            self._unmapped = in_thread(self._teardown)
        await cancels.outlast(self._unmapped)
        cancels.raise_if_cancelled()

    def _teardown(self) -> None:
        if self._registering is not None:
            self._registering.shutdown(wait=True, cancel_futures=True)
        self.memory.close()


class _Fenced(Exception):
    """Raised on the copy thread between two layers of a load once the executor was fenced."""


def _forward(result: asyncio.Future[RankReport], source: asyncio.Future[RankReport]) -> None:
    if result.done():
        return
    if source.cancelled():  # withdrawn by fence() before it began: no byte moved
        result.set_result(RankReport(RankStatus.WORKER_CLOSING, "fenced: the copy was withdrawn before it began"))
    elif (exc := source.exception()) is not None:
        result.set_result(_classify(exc))
    else:
        result.set_result(source.result())


def _not_launched(result: asyncio.Future[RankReport], task: asyncio.Future[None]) -> None:
    """``_launch_when_registered`` ended: report it only if it ended before launching (cancelled,
    or failed); a launched copy settles ``result`` itself."""
    if result.done():
        return
    if task.cancelled():  # a cancel lands only at an await, all before the launch
        result.set_result(RankReport(RankStatus.WORKER_CLOSING, "cancelled before its launch: no byte moved"))
    elif (exc := task.exception()) is not None:
        result.set_result(_classify(exc))


def _watch_layers(
    bridge: CompletionBridge, events: Sequence[torch.cuda.Event], on_landed: Callable[[int], None] | None
) -> None:
    """Report each layer of a load queued at once as it lands (LAYERS frames), in order. A closed
    bridge (a teardown) ends the watching: nobody reads LAYERS frames any more, and the job's own
    report still waits for the last event (:func:`_wait_event`)."""
    if on_landed is None:
        return
    for layer, queued in enumerate(events):  # waited in order, before the last
        try:
            watch_landed(bridge, queued, layer, on_landed)
        except RuntimeError:
            return


def _copied(result: asyncio.Future[RankReport], copy: asyncio.Future[None]) -> None:
    if result.done():
        return
    if copy.cancelled():
        result.set_result(RankReport(RankStatus.COPY_FAILED, "the copy was cancelled"))
    elif (exc := copy.exception()) is not None:
        result.set_result(_classify(exc))
    else:
        result.set_result(RankReport(RankStatus.OK))


def _wait_event(bridge: CompletionBridge, event: torch.cuda.Event | None, lane: Lane) -> asyncio.Future[None]:
    """``bridge.wait(event, lane)``; once the bridge is closed (a teardown, interpreter shutdown) a
    thread of its own waits for ``event``. The copy is queued by then: a report before it ends (the
    bridge's RuntimeError reported as COPY_FAILED, review 216) let the manager hand its slots and
    pages to other work while the GPU still wrote them."""
    try:
        return bridge.wait(event, lane)
    except RuntimeError:
        pass
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()
    if event is None:
        future.set_result(None)
        return future

    def settle(error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def wait() -> None:
        error: BaseException | None = None
        try:
            event.synchronize()
        except Exception as exc:
            error = exc
        try:
            loop.call_soon_threadsafe(settle, error)
        except RuntimeError:
            pass  # the loop is closed: nobody waits any more

    try:
        threading.Thread(target=wait, name="aiokv-event-wait", daemon=True).start()
    except RuntimeError:  # no new thread at interpreter shutdown: wait here (the loop is ending)
        event.synchronize()
        future.set_result(None)
    return future


def _failed_after_queued(result: asyncio.Future[RankReport], report: RankReport, _: asyncio.Future[None]) -> None:
    if not result.done():
        result.set_result(report)


def _event_done(result: asyncio.Future[RankReport], waited: asyncio.Future[None]) -> None:
    if result.done():
        return
    if waited.cancelled():
        result.set_result(RankReport(RankStatus.COPY_FAILED, "the completion wait was cancelled"))
    elif (exc := waited.exception()) is not None:
        result.set_result(RankReport(RankStatus.COPY_FAILED, f"CUDA: {type(exc).__name__}: {exc}"))
    else:
        result.set_result(RankReport(RankStatus.OK))
