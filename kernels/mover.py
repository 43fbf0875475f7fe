"""`PageMover`: moves whole pages between the engine's KV buffer and the pool, on side streams.

Offload (GPU -> pool), STAGING path: the Triton gather fills a GPU staging buffer, then one
copy-engine memcpy per page writes the pinned pool page. Load reverses it: memcpy into staging,
then the Triton scatter. The kernels hold the SMs ~0.02 ms per 32 MiB page; PCIe is the limit.

Work is split over two *lanes* per direction, each a side stream with its own share of the
staging buffer, chunks dealt round-robin: lane A's memcpy overlaps lane B's kernel, and a lane
never overwrites its staging before its own memcpy has read it (stream order). Every lane first
waits on an event recorded on the caller's current stream; the call returns one event after all
of its lanes, recorded on the first lane's stream.

Layer-wise loads (:meth:`PageMover.load_layers`, STAGING) run as a pipeline over two streams: a
copy stream moves layer l of a group of pages (each page's layer is one contiguous slab of the
pool page ``[L, T, rows, D]``) into one of a few staging buffers, and the scatter stream (the
first load lane's) moves it into the KV buffer, then marks layer l ready. The copy engine waits
for a scatter only to reuse its buffer, so PCIe stays busy; the buffers are carved out of the
load lanes' staging (no extra GPU memory). See :func:`layer_schedule`.

Where every page's slots are one ascending run and the buffer's shape allows it (``load_runs``,
:mod:`aiokv.kernels.slotruns`), a layer-wise load skips staging and scatter: each unit is layer l of
a group of pages, copied by the copy engine straight from the pool pages into the KV slots (one 2-D
copy per run of pages consecutive in both, a unit's in ``cudaMemcpy3DBatchAsync`` calls of at most
:data:`aiokv.cuda.BATCH_MAX_OPS` ops each where the runtime has it and ``AIOKV_MEMCPY_BATCH=1``
asks for it, else one ``cudaMemcpy2DAsync`` each: :class:`aiokv.cuda.BatchCopier`), its layer
event recorded on the copy stream. A feeding thread then issues a few runtime calls per layer
instead of a few per group plus a Triton launch (an engine's model thread shares the GIL with it).
A whole-page load of such pages is run copies too, dealt over the load lanes: one per page (every
layer) or one per layer of a run of pages, whichever is fewer (:func:`~aiokv.kernels.slotruns.whole_load_copies`).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from aiokv import cuda as _cuda
from aiokv.layout import KVBuffer

from .checks import (
    PageIds,
    check_gather_counts,
    check_page_ids,
    check_pages,
    check_scatter_counts,
    check_slots,
)
from .hostcopy import HostGather, HostScatter
from .paths import DEFAULT_STAGING_PAGES, TransferPath, interpreting
from .slotruns import (
    LayerCopy,
    PageCopies,
    RunCopy,
    RunGeometry,
    load_copies,
    load_run_starts,
    memmove_runs,
    page_run_starts,
    run_copies,
    run_geometry,
    whole_load_copies,
)

if TYPE_CHECKING:
    from .launch import CopyPlan
from .reference import reference_gather, reference_scatter

LAYER_BUFFERS = 3
"""Staging buffers of a layer-wise load: the copy engine fills one while a scatter reads another;
the third absorbs a scatter delayed behind the engine's own kernels without stalling PCIe."""


PACE_BYTES = 256 << 20
"""How far a paced layer-wise load (:meth:`PageMover.start_layers`) runs ahead of the GPU: the
feeding thread queues a unit only once the unit this many staged bytes earlier has been scattered
(at least ``LAYER_BUFFERS + 1`` units). CUDA maps streams onto a few hardware queues
(``CUDA_DEVICE_MAX_CONNECTIONS``, 8 by default; SGLang sets 8): a stream of the engine that shares
one with the copy stream runs nothing queued after a load's copies until they are done. Queued all
at once, a 32K-token hit (4 GiB) held the engine's tail prefill until the whole load had landed
(H200: 137 ms against a floor of 79); paced, such a stream waits for at most this many bytes."""


RUN_COPIES_PER_LAUNCH = 8
"""A layer-wise load goes by run copies only if its copies per layer are at most the staged path's
slab copies plus this many per staged unit (a unit: a Triton launch and ~4 stream/event calls): an
estimate of host costs (a launch holds the GIL tens of µs, a ctypes 2-D copy a few µs without it),
not a measurement. It bounds the worst case (slots that are runs per page only, pool pages in one
run: one copy per page and layer against one slab copy per group). A whole-page load likewise: its
copies at most one per page (the staged memcpys) plus this many per staged chunk (a scatter launch);
only copies by layer (a KV layer step over the largest pitch) can exceed that."""


def pace_window(unit_bytes: int, pace_bytes: int = PACE_BYTES) -> int:
    """Units a paced load keeps queued: ``pace_bytes`` worth, at least one more than the buffers."""
    if unit_bytes < 1:
        raise ValueError(f"unit_bytes must be positive, got {unit_bytes}")
    return max(LAYER_BUFFERS + 1, pace_bytes // unit_bytes)


def feed_paced(
    count: int,
    window: int,
    issue: Callable[[int], None],
    wait_issued_unit: Callable[[int], None],
    stopped: Callable[[], bool],
) -> int:
    """Issue units ``0..count-1`` in order, each only once unit ``k - window`` is done on the GPU;
    stop early when ``stopped()``. Returns how many were issued (the feeding loop of
    :class:`PacedLayers`, separate so that its order is tested without a GPU).

    With ``window`` units queued it waits (``wait_issued_unit``, a host wait that releases the GIL)
    until half of them are done, then queues that many in one go: the feeding thread takes the GIL
    back once per half window, not once per unit (each time can cost an engine thread's switch
    interval, 5 ms, while the GPU drains what is queued)."""
    half = max(1, window // 2)
    done = -1  # the last unit known done on the GPU
    for k in range(count):
        if stopped():
            return k
        if k - window > done:
            done = min(k - 1, k - window + half)
            wait_issued_unit(done)
            if stopped():
                return k
        issue(k)
    return count


def _new_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


def _new_event(blocking: bool = False) -> torch.cuda.Event:
    """A CUDA event; ``blocking``: a host waiting on it sleeps (``cudaEventBlockingSync``).

    Events a host thread waits on (a copy's end, layer events) are blocking: the bridge's waiter
    threads would otherwise busy-wait a core each in ``cudaEventSynchronize`` for as long as
    copies are in flight. The unit events a paced load's feeder waits on are not: it waits for half
    a window at a time, and with every event blocking hits streamed slower (H200, one trial: median
    57.1 vs 40.7 ms).
    """
    return torch.cuda.Event(blocking=blocking)  # type: ignore[no-untyped-call]


@dataclass
class _Lane:
    stream: torch.cuda.Stream | None
    staging: torch.Tensor | None
    plan: CopyPlan | None


@dataclass(frozen=True)
class _Chunk:
    """Pages ``first..first+len(ids)`` of a call, with the slot range they exchange."""

    first: int
    ids: list[int]
    slot_begin: int
    slot_end: int
    skip: int


@dataclass(frozen=True)
class LayerUnit:
    """One step of a layer-wise load: layer ``layer`` of the pages of group ``group``, copied into
    staging buffer ``buffer`` and scattered from it."""

    layer: int
    group: int
    buffer: int
    reuse: bool
    """The buffer served an earlier unit of this call: its copy must wait for that unit's scatter."""
    ends_layer: bool
    """The last unit of its layer: once it is scattered, layer ``layer`` is in the KV buffer."""


def layer_groups(count: int, capacity: int) -> list[range]:
    """Pages ``[0, count)`` of a call in the fewest consecutive groups of at most ``capacity``
    pages, their sizes within one of each other (no short tail group paying a whole launch)."""
    if count < 1 or capacity < 1:
        raise ValueError(f"count and capacity must be positive, got {count} and {capacity}")
    n = -(-count // capacity)
    base, extra = divmod(count, n)
    groups, start = [], 0
    for i in range(n):
        size = base + (i < extra)
        groups.append(range(start, start + size))
        start += size
    return groups


def slab_runs(page_ids: Sequence[int], run_pages: int) -> list[tuple[int, int, int]]:
    """``(first slab, first page, count)`` runs of ``page_ids``: consecutive page ids that lie in
    one registration of ``run_pages`` pages (registrations start at page 0), so each run is one 2-D
    copy; 1 makes every page its own run."""
    runs: list[tuple[int, int, int]] = []
    for j, page in enumerate(page_ids):
        if runs:
            first_slab, first_page, count = runs[-1]
            if page == first_page + count and page // run_pages == first_page // run_pages:
                runs[-1] = (first_slab, first_page, count + 1)
                continue
        runs.append((j, page, 1))
    return runs


def layer_schedule(layers: int, groups: int, buffers: int) -> list[LayerUnit]:
    """Issue order of a layer-wise load: layer 0 of every group in page order, then layer 1, ...

    Unit k uses buffer ``k % buffers``, so the copy of unit k waits only for the scatter of unit
    ``k - buffers``: the copy engine runs up to ``buffers - 1`` units ahead of the scatters.
    """
    units: list[LayerUnit] = []
    for layer in range(layers):
        for group in range(groups):
            k = len(units)
            units.append(LayerUnit(layer, group, k % buffers, k >= buffers, group == groups - 1))
    return units


def split_layer_staging(slabs: int, buffers: int = LAYER_BUFFERS) -> tuple[int, int]:
    """``(buffer count, slabs per buffer)`` for a staging area of ``slabs`` layer slabs: up to
    ``buffers`` equal buffers, fewer when there are fewer slabs than that."""
    count = max(1, min(buffers, slabs))
    return count, slabs // count


@dataclass
class _LayerStaging:
    """The staging of layer-wise loads: buffers carved out of the load lanes' staging area."""

    copy_stream: torch.cuda.Stream | None
    buffers: list[torch.Tensor]
    """Each ``[capacity, T, rows, D]``: slab j holds one layer of the group's page j."""
    plans: list[CopyPlan]
    """One per buffer, over it viewed as ``[capacity, L, T, rows, D]`` with layer stride 0."""
    copied: list[torch.cuda.Event]
    """Per buffer: recorded on the copy stream after its slabs were queued (re-recorded per use)."""
    freed: list[torch.cuda.Event]
    """Per buffer: recorded on the scatter stream after the scatter that read it."""

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[0]


@dataclass(frozen=True)
class _StagedLayers:
    """What a STAGING layer-wise load issues: its page groups, their device slots and slab runs."""

    groups: list[_Chunk]
    indices: list[torch.Tensor]
    runs: list[list[tuple[int, int, int]]]
    units: list[LayerUnit]


@dataclass(frozen=True)
class _RunLayers:
    """What a layer-wise load by run copies issues: per group of pages, the copies of one layer."""

    copies: list[list[LayerCopy]]
    pages: list[int]
    """Per group: its page count (a group's pages are loaded once its last layer's copies are queued)."""
    units: list[LayerUnit]
    """:func:`layer_schedule` with one buffer (``buffer`` and ``reuse`` mean nothing here)."""
    unit_bytes: int
    """Bytes of the largest unit (the pacing's measure)."""


class PacedLoadStopped(RuntimeError):
    """:meth:`PacedLayers.feed` ended early because :meth:`PacedLayers.stop` was called (what it
    queued has completed); any other exception out of ``feed`` is a launch or CUDA fault."""


class PacedLayers:
    """A layer-wise STAGING load whose units a thread queues a few at a time (:meth:`feed`).

    Made by :meth:`PageMover.start_layers`, which ordered it after the caller's stream. ``events[l]``
    completes once layers ``0..l`` are in the KV buffer, but exists on the GPU only once
    ``issued[l]`` is set: wait for that (``wait_issued``) before making a stream wait on it.
    """

    def __init__(self, mover: PageMover, plan: _StagedLayers | _RunLayers, window: int) -> None:
        layers = mover.kv.layout.num_layers
        self._mover = mover
        self._plan = plan
        self.window = window
        self.by_runs = isinstance(plan, _RunLayers)
        """The load goes by run copies (copy engine only), not through staging and scatters."""
        # Blocking: hosts wait on these (the bridge, a TP rank's landed-layer watch); the feeder
        # waits on its own unit events, which stay default.
        self.events = [_new_event(blocking=True) for _ in range(layers)]
        self.issued = [threading.Event() for _ in range(layers)]
        self.end = _new_event(blocking=True)
        """Recorded after everything this load queued (whether it completed, stopped or failed)."""
        self.issued_units = 0
        self.queued = [False] * layers
        """Per layer: its copies were queued (it lands); False for a layer given up (stop, fault)."""
        self._stop = threading.Event()
        self._fed = False
        self._fed_lock = threading.Lock()

    def stop(self) -> None:
        """Queue no further unit (from any thread); the layers not queued are then marked issued
        with events that complete after everything queued, and the load counts as failed."""
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def discard(self) -> bool:
        """Give up a load that was never fed (its feeding job was withdrawn or could not be queued):
        it queues nothing, its layers count as issued, the mover's staging is free again. False (and
        nothing changes) once :meth:`feed` started."""
        with self._fed_lock:
            if self._fed:
                return False
            self._fed = True
        self._stop.set()
        for ready in self.issued:
            ready.set()
        self._mover._paced_done(None)
        return True

    def wait_issued(self, layer: int, timeout: float | None = None) -> bool:
        """Block until layer ``layer``'s event exists on the GPU (or ``timeout`` passed)."""
        return self.issued[layer].wait(timeout)

    def feed(self, on_issued: Callable[[int, bool], None] | None = None) -> None:
        """Queue every unit, at most :attr:`window` ahead of the GPU, then wait until the GPU is done.

        Runs on a thread of the caller's choosing, once. ``on_issued(l, True)`` is called as layer
        ``l``'s event is queued; ``on_issued(l, False)`` for every layer given up when the load stops
        or fails (its event completes after everything queued, but the layer is not loaded). Raises
        ``RuntimeError`` when stopped before the end, or what failed, after the GPU finished what
        was queued.
        """
        with self._fed_lock:
            if self._fed:
                raise RuntimeError("PacedLayers.feed() runs once (or the load was discarded)")
            self._fed = True
        mover, plan = self._mover, self._plan
        staging = mover._layered
        assert staging is not None and staging.copy_stream is not None
        scatter_lane = mover._load_lanes[0]
        scatter_stream = scatter_lane.stream
        assert scatter_stream is not None
        scattered = [_new_event() for _ in plan.units]
        # A unit is done once its scatter is (staged), or its copies (runs: the copy stream alone).
        done_stream = staging.copy_stream if isinstance(plan, _RunLayers) else scatter_stream
        error: BaseException | None = None
        with torch.cuda.device(mover.kv.device):
            try:
                def issue(k: int) -> None:
                    unit = plan.units[k]
                    if isinstance(plan, _RunLayers):
                        mover._issue_run_unit(plan, unit, done_stream)
                    else:
                        mover._issue_unit(staging, plan, unit)
                    scattered[k].record(done_stream)
                    self.issued_units = k + 1
                    if unit.ends_layer:
                        self.events[unit.layer].record(done_stream)
                        self.queued[unit.layer] = True
                        self.issued[unit.layer].set()
                        if on_issued is not None:
                            on_issued(unit.layer, True)

                issued = feed_paced(len(plan.units), self.window, issue, lambda k: scattered[k].synchronize(),
                                    self._stop.is_set)
                if issued < len(plan.units):
                    error = PacedLoadStopped(f"layer-wise load stopped after {issued} of {len(plan.units)} units")
            except BaseException as exc:  # a launch fault: what was queued still completes
                error = exc
            finally:
                # Copies may be queued whose scatters never were: the end waits for both streams.
                copies = _new_event()
                copies.record(staging.copy_stream)
                scatter_stream.wait_event(copies)
                self.end.record(scatter_stream)
                for layer, ready in enumerate(self.issued):
                    if not ready.is_set():
                        self.events[layer].record(scatter_stream)
                        ready.set()
                        if on_issued is not None:
                            on_issued(layer, False)
                mover._paced_done(self.end)
            self.end.synchronize()
        if error is not None:
            raise error


class PageMover:
    """Offload/load of whole pages between one KV buffer and one pool tensor.

    ``pages``: the pool tensor ``[N, L, T, rows, D]`` (``PagePool.pages``); with a CUDA KV buffer
    the pages used must lie in chunks the pool has registered (pinned + mapped). ``path`` None picks
    STAGING on CUDA and REFERENCE on CPU. ``staging_pages``: GPU staging per direction, in pages.
    ``run_pages``: the pool is pinned in registrations of this many pages, the first at page 0
    (``PagePool.chunk_pages``); one copy may cover consecutive pages within one registration.

    A rank that holds only part of each page's rows (tensor parallelism) moves them through the
    DIRECT path even when STAGING is asked for: its rows are strided in the page, and one contiguous
    memcpy per page would overwrite the other ranks' rows. :attr:`effective_path` says which runs.
    Raises ``ValueError`` for a path that cannot serve this buffer or a bad argument.

    Each copy checks its slots (range, duplicates: a pass over the indices) unless the caller says
    it did with ``checked=True``: ``KVCache`` checks them once per call at its public edge and
    launches a long transfer in many groups.

    ``slot_runs`` (STAGING): an offload whose pages' slots are each one ascending run (CPU slots)
    copies every page with one 2-D copy-engine memcpy straight from the KV buffer, no kernel and no
    staging (:mod:`aiokv.kernels.slotruns`), where the buffer's shape allows it; other offloads
    gather as before. :attr:`runs_offloaded` counts the pages it copied so.

    ``load_runs`` (STAGING, on by default): a load (:meth:`load`, :meth:`load_layers`,
    :meth:`start_layers`) whose pages' slots are each one ascending run goes by the copy engine alone
    in the same way (module docstring), where the buffer's shape allows it and the copies are few
    enough (:data:`RUN_COPIES_PER_LAUNCH`); :attr:`runs_loaded` counts the pages it copied so.
    """

    def __init__(
        self,
        kv: KVBuffer,
        pages: torch.Tensor,
        path: TransferPath | None = None,
        staging_pages: int = DEFAULT_STAGING_PAGES,
        run_pages: int = 1,
        slot_runs: bool = False,
        load_runs: bool = True,
    ) -> None:
        if not isinstance(kv, KVBuffer):
            raise ValueError(f"kv must be a KVBuffer (KVBuffer.wrap), got {type(kv).__name__}")
        check_pages(kv, pages)
        self._cuda = kv.device.type == "cuda"
        if path is None:
            path = TransferPath.STAGING if self._cuda else TransferPath.REFERENCE
        if not isinstance(path, TransferPath):
            raise ValueError(f"path must be a TransferPath, got {path!r}")
        if path is not TransferPath.REFERENCE and not self._cuda and not interpreting():
            raise ValueError(f"path {path.value} needs a CUDA KV buffer; kv is on {kv.device}")
        if isinstance(staging_pages, bool) or not isinstance(staging_pages, int) or staging_pages < 1:
            raise ValueError(f"staging_pages must be a positive int, got {staging_pages!r}")
        self.kv = kv
        self.pages = pages
        self.path = path
        self.effective_path = (
            TransferPath.DIRECT if path is TransferPath.STAGING and kv.is_partial else path
        )
        self.staging_pages = staging_pages
        self._direct: CopyPlan | None = None
        self._layered: _LayerStaging | None = None
        self._raw_memcpy = self._cuda and _cuda.raw_memcpy_available()
        if isinstance(run_pages, bool) or not isinstance(run_pages, int) or run_pages < 1:
            raise ValueError(f"run_pages must be a positive int, got {run_pages!r}")
        self.run_pages = run_pages
        self._layered_done: torch.cuda.Event | None = None
        """The last layer-wise load's end: later whole-page loads on other lanes reuse its staging."""
        self._paced_active = 0
        """Paced layer-wise loads still queuing units (their staging is in use: other loads go DIRECT)."""
        self._paced_lock = threading.Lock()
        self._host: HostScatter | None = None
        self._host_gather: HostGather | None = None
        if self.effective_path is TransferPath.REFERENCE and not self._cuda and pages.device.type == "cpu":
            # A few torch calls a launch group (each lets the GIL go), not the reference's per layer.
            self._host = HostScatter(kv, pages)
            self._host_gather = HostGather(kv, pages)
        staged = self.effective_path is TransferPath.STAGING
        if not isinstance(slot_runs, bool):
            raise ValueError(f"slot_runs must be a bool, got {slot_runs!r}")
        if not isinstance(load_runs, bool):
            raise ValueError(f"load_runs must be a bool, got {load_runs!r}")
        # Off CUDA (Triton's interpreter) the same copies run with memmove; on CUDA they need the runtime.
        copyable = staged and (self._raw_memcpy or not self._cuda)
        # Worked out even with both off: load_runs may be switched on later (an A/B switch). Loads can
        # step layers by address (layer_pitch=False); an offload copies a whole page (pitch checked).
        geometry = run_geometry(kv, pages, layer_pitch=False) if copyable else None
        self._runs = geometry if slot_runs and geometry is not None and geometry.layer_pitch_fits else None
        self._run_geometry = geometry
        self._load_runs: RunGeometry | None = geometry if load_runs else None
        self.runs_offloaded = 0
        """Pages offloaded by run copies (``slot_runs``), not gathered."""
        self.runs_loaded = 0
        """Pages loaded by run copies (``load_runs``), not staged and scattered: counted once every copy
        of the page (every layer) is queued, so a load that fails or stops part-way counts only the
        pages it copied whole. Layer-wise loads count as their last layer is queued."""
        self._count_lock = threading.Lock()  # a paced load's feeding thread counts too
        lanes = min(2, staging_pages) if staged else 1
        shares = [staging_pages // lanes + (i < staging_pages % lanes) for i in range(lanes)]
        if not staged:
            self._offload_lanes = [self._lane(None) for _ in shares]
            self._load_lanes = [self._lane(None) for _ in shares]
            return
        self._offload_lanes = [self._lane(self._staging_area(share)) for share in shares]
        # One area for the load lanes, so layer-wise loads can carve their buffers out of it.
        area = self._staging_area(staging_pages).view(-1)
        starts = [0, *itertools.accumulate(shares)]
        page_elems = area.numel() // staging_pages
        self._load_lanes = [
            self._lane(area[a * page_elems : b * page_elems].view(b - a, *kv.layout.page_shape))
            for a, b in itertools.pairwise(starts)
        ]
        self._layered = self._layer_staging(area)
        self._keep_until_idle(area, [lane.stream for lane in self._load_lanes] + [self._layered.copy_stream])
        for lane in self._offload_lanes:
            assert lane.staging is not None
            self._keep_until_idle(lane.staging, [lane.stream])

    def _staging_area(self, pages: int) -> torch.Tensor:
        layout = self.kv.layout
        return torch.empty((pages, *layout.page_shape), dtype=layout.dtype, device=self.kv.device)

    @staticmethod
    def _keep_until_idle(staging: torch.Tensor, streams: Sequence[torch.cuda.Stream | None]) -> None:
        # A mover dropped with copies in flight must not hand its staging to the allocator early:
        # marked as used by the side streams, the memory is reused only after their queued work.
        for stream in streams:
            if stream is not None:
                staging.record_stream(stream)

    def _lane(self, staging: torch.Tensor | None) -> _Lane:
        stream = _new_stream(self.kv.device) if self._cuda else None
        if staging is None:
            return _Lane(stream, None, None)
        from .launch import CopyPlan  # Triton loads only for a path that launches kernels

        return _Lane(stream, staging, CopyPlan(self.kv, staging))

    def _layer_staging(self, area: torch.Tensor) -> _LayerStaging:
        """Buffers of one layer of several pages each, views of the load lanes' ``area``."""
        from .launch import CopyPlan

        layout = self.kv.layout
        tokens, rows, dim = layout.page_tokens, layout.rows, layout.head_dim
        slab = tokens * rows * dim
        count, capacity = split_layer_staging(area.numel() // slab)
        buffers = [area[i * capacity * slab : (i + 1) * capacity * slab].view(capacity, tokens, rows, dim)
                   for i in range(count)]
        # The scatter kernel addresses page * page_stride + layer * layer_stride: a layer stride of
        # 0 makes every layer of "page" j the buffer's slab j, so one plan serves every layer.
        shape = (capacity, layout.num_layers, tokens, rows, dim)
        plans = [CopyPlan(self.kv, b.as_strided(shape, (slab, 0, rows * dim, dim, 1))) for b in buffers]
        return _LayerStaging(
            copy_stream=_new_stream(self.kv.device) if self._cuda else None,
            buffers=buffers,
            plans=plans,
            copied=[_new_event() for _ in buffers] if self._cuda else [],
            freed=[_new_event() for _ in buffers] if self._cuda else [],
        )

    @property
    def load_runs(self) -> bool:
        """Whether loads may go by run copies (the buffer's shape allows it and
        ``load_runs`` is on). Settable between loads (an A/B switch); on where the shape never allows
        it stays False."""
        return self._load_runs is not None

    @load_runs.setter
    def load_runs(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"load_runs must be a bool, got {value!r}")
        self._load_runs = self._run_geometry if value else None

    @property
    def staging_bytes(self) -> int:
        """GPU memory held for staging, both directions."""
        lanes = self._offload_lanes + self._load_lanes
        return sum(lane.staging.numel() * lane.staging.element_size() for lane in lanes if lane.staging is not None)

    # -- public ---------------------------------------------------------------------------------

    def offload(
        self, slots: torch.Tensor, page_ids: Sequence[int], ready: torch.cuda.Event | None = None,
        *, checked: bool = False,
    ) -> torch.cuda.Event | None:
        """KV of ``slots`` -> pool pages ``page_ids``; page i gets ``slots[i*T:(i+1)*T]``.

        ``slots``: 1-D int tensor (any device; CPU avoids a blocking read for the checks) of
        ``len(page_ids) * T`` distinct slots. CUDA: queued behind the caller's current stream, or
        behind ``ready`` when given (an event the caller recorded earlier: a launch deferred by
        pacing still copies what the engine had written by then); returns the event to await
        before committing the pages. If queuing fails part-way, the caller's current stream is made
        to wait for what was queued before the error propagates. CPU: synchronous, returns None; so
        does a TP replica that must not write (``tp.writer`` False), which moves nothing.
        """
        ids = self._check(slots, page_ids, checked)
        check_gather_counts(self.kv, slots, len(ids))
        if not self.kv.tp.writer:
            return None
        tokens = self.kv.layout.page_tokens
        if self._host_gather is not None and not slots.is_cuda:
            self._host_gather.offload(slots, ids)
            return None
        if self.effective_path is TransferPath.REFERENCE:
            lanes = self._offload_lanes[:1]
            with self._ordered_on_failure(lanes), self._on_side(lanes, ready) as streams:
                reference_gather(self.kv, slots, self.pages, ids, True)  # checked
            return self._finish(streams)
        if self.effective_path is TransferPath.DIRECT:
            lane = self._offload_lanes[0]
            with self._ordered_on_failure([lane]), self._on_side([lane], ready) as streams:
                self._direct_plan().gather(self._index(slots, lane), self._index(ids, lane))
            return self._finish(streams)
        if self._runs is not None and (starts := page_run_starts(slots, len(ids), tokens)) is not None:
            event = self._offload_runs(run_copies(self._runs, starts, ids), ready)
            self.runs_offloaded += len(ids)
            return event
        chunks = self._chunks(len(ids), ids, skip_first=0, tokens=tokens)
        plan = self._deal(chunks, self._offload_lanes)
        lanes = [lane for lane, _ in plan]
        with self._ordered_on_failure(lanes), self._on_side(lanes, ready) as streams:
            for lane, chunk, index in self._issue_order(plan, slots):
                self._offload_chunk(lane, chunk, index)
        return self._finish(streams)

    def _offload_runs(self, copies: list[RunCopy], ready: torch.cuda.Event | None) -> torch.cuda.Event | None:
        """The run copies, dealt round-robin to the offload lanes (a gap between two copies of one
        stream is covered by the other's); one event after all of them. If queuing fails part-way,
        the caller's stream waits for what was queued (it reads the slots) before the error propagates."""
        lanes = self._offload_lanes[: len(copies)]
        with self._ordered_on_failure(lanes), self._on_side(lanes, ready) as streams:
            for i, lane in enumerate(lanes):
                mine = copies[i :: len(lanes)]
                if lane.stream is None:
                    memmove_runs(mine)  # Triton's interpreter: host memory on both sides
                    continue
                with self._stream(lane):
                    for c in mine:
                        _cuda.memcpy2d_async(c.dst, c.dpitch, c.src, c.spitch, c.width, c.height, lane.stream)
        return self._finish(streams)

    def load(
        self, page_ids: Sequence[int], slots: torch.Tensor, skip_first: int = 0, *, checked: bool = False,
        after: torch.cuda.Event | None = None,
    ) -> torch.cuda.Event | None:
        """Tokens ``[skip_first, len(page_ids)*T)`` of the concatenated pool pages -> ``slots``.

        ``len(slots) == len(page_ids) * T - skip_first``, ``0 <= skip_first < T``. CUDA: queued
        behind the caller's current stream (or behind ``after``, an event recorded on it earlier,
        where the work queued since never touches ``slots``); returns the completion event: make
        the compute stream wait on it, and keep the pool pages alive until it completes. CPU:
        synchronous, returns None.
        Where every page's loaded slots are one ascending run (host slots), by run copies
        (``load_runs``: no staging, no kernel). If queuing fails part-way, the caller's current
        stream is made to wait for what was queued before the error propagates.
        """
        ids = self._check(slots, page_ids, checked)
        check_scatter_counts(self.kv, slots, len(ids), skip_first)
        tokens = self.kv.layout.page_tokens
        if self._host is not None and not slots.is_cuda:
            self._host.load(ids, slots, skip_first)
            return None
        if self.effective_path is TransferPath.REFERENCE:
            lanes = self._load_lanes[:1]
            with self._ordered_on_failure(lanes), self._on_side(lanes, after) as streams:
                reference_scatter(self.kv, self.pages, slots, ids, skip_first, None, True)  # checked
            return self._finish(streams)
        groups = self._whole_runs(ids, slots, skip_first)
        if groups is not None:
            # No staging used: while a paced load queues (its scatter stream is the first lane), only
            # the last lane, as the direct reads below.
            lanes = self._load_lanes[-1:] if self._paced_active else self._load_lanes
            return self._load_runs_whole(groups, lanes, after)
        if self._paced_active:
            # A paced layer-wise load is still queuing into the staging: read the pool directly,
            # on the last lane (the first is that load's scatter stream).
            lane = self._load_lanes[-1]
            with self._ordered_on_failure([lane]), self._on_side([lane], after) as streams:
                self._direct_plan().scatter(self._index(ids, lane), self._index(slots, lane), skip_first)
            return self._finish(streams)
        if self.effective_path is TransferPath.DIRECT:
            lane = self._load_lanes[0]
            with self._ordered_on_failure([lane]), self._on_side([lane], after) as streams:
                self._direct_plan().scatter(self._index(ids, lane), self._index(slots, lane), skip_first)
            return self._finish(streams)
        chunks = self._chunks(len(ids), ids, skip_first=skip_first, tokens=tokens)
        plan = self._deal(chunks, self._load_lanes)
        lanes = [lane for lane, _ in plan]
        with self._ordered_on_failure(lanes), self._on_side(lanes, after) as streams:
            self._after_layered(lanes)
            for lane, chunk, index in self._issue_order(plan, slots):
                self._load_chunk(lane, chunk, index)
        return self._finish(streams)

    def _after_layered(self, lanes: list[_Lane]) -> None:
        """``lanes`` wait for the last layer-wise load's end: it used the staging and wrote KV slots.
        The first load lane (its scatter stream, or where its copies were joined) is ordered after
        it already."""
        if self._layered_done is None:
            return
        for lane in lanes:
            if lane is not self._load_lanes[0] and lane.stream is not None:
                lane.stream.wait_event(self._layered_done)

    def _whole_runs(self, ids: list[int], slots: torch.Tensor, skip_first: int) -> list[PageCopies] | None:
        """The run copies of a whole-page load, or None where it stages (``load_runs`` off, a buffer of
        another shape, CUDA slots, a page whose slots are not one run, too many copies)."""
        geometry, tokens = self._load_runs, self.kv.layout.page_tokens
        if geometry is None or (starts := load_run_starts(slots, len(ids), tokens, skip_first)) is None:
            return None
        groups = whole_load_copies(geometry, starts, ids, tokens, skip_first, self.run_pages)
        budget = len(ids) + RUN_COPIES_PER_LAUNCH * self._staged_chunks(len(ids))
        return groups if sum(len(g.copies) for g in groups) <= budget else None

    def _staged_chunks(self, count: int) -> int:
        """Chunks (scatter launches) of a staged whole-page load of ``count`` pages (:meth:`_deal`)."""
        sizes = [0 if lane.staging is None else lane.staging.shape[0] for lane in self._load_lanes]
        chunks = done = 0
        while done < count:
            done += max(1, sizes[chunks % len(sizes)])
            chunks += 1
        return chunks

    def _load_runs_whole(
        self, groups: list[PageCopies], lanes: list[_Lane], after: torch.cuda.Event | None = None
    ) -> torch.cuda.Event | None:
        """A whole-page load by run copies (:func:`whole_load_copies`), dealt round-robin to ``lanes``
        in page order, behind the caller's stream; one event after all of them. If queuing fails
        part-way, the caller's stream waits for what was queued (it writes the caller's slots)
        before the error propagates; only the pages whose copies were all queued are counted."""
        loaded = 0
        with self._ordered_on_failure(lanes), self._on_side(lanes, after) as streams:
            self._after_layered(lanes)
            try:
                turn = 0
                for group in groups:
                    if not streams:
                        memmove_runs(group.copies)  # Triton's interpreter: host memory on both sides
                    else:
                        for c in group.copies:
                            stream = lanes[turn % len(lanes)].stream
                            assert stream is not None
                            _cuda.memcpy2d_async(c.dst, c.dpitch, c.src, c.spitch, c.width, c.height, stream)
                            turn += 1
                    loaded += group.pages
            finally:
                self._count_runs_loaded(loaded)
        return self._finish(streams)

    def load_layers(
        self,
        page_ids: Sequence[int],
        slots: torch.Tensor,
        skip_first: int = 0,
        on_layer: Callable[[int], None] | None = None,
        *,
        checked: bool = False,
        after: torch.cuda.Event | None = None,
    ) -> list[torch.cuda.Event] | None:
        """:meth:`load`, layer by layer: layer 0 of every page first, then layer 1, ...

        CUDA: queued behind the caller's current stream (or ``after``, as in :meth:`load`) on side
        streams; returns one event per layer (event ``l`` completes once layers ``0..l`` are in the
        KV buffer; the last one ends the whole load). The caller's stream is NOT made to wait: wait
        on event ``l`` before reading layer ``l``. STAGING pipelines the layer slabs' copies and the scatters over two
        streams (module docstring). CPU: synchronous, calls ``on_layer(l)`` as each layer lands,
        returns None. If queuing fails part-way, the caller's stream is made to wait for what was
        queued before the error propagates.
        """
        ids = self._check(slots, page_ids, checked)
        check_scatter_counts(self.kv, slots, len(ids), skip_first)
        layers = self.kv.layout.num_layers
        events: list[torch.cuda.Event] = []
        path = self.effective_path
        lane = self._load_lanes[0]
        if self._paced_active and path is TransferPath.STAGING:
            path, lane = TransferPath.DIRECT, self._load_lanes[-1]  # as in load()
        with self._ordered_on_failure([lane]), self._on_side([lane], after) as streams:
            if path is TransferPath.REFERENCE:
                host = self._host if not slots.is_cuda else None
                for layer in range(layers):
                    if host is not None:
                        host.load(ids, slots, skip_first, range(layer, layer + 1))
                    else:
                        reference_scatter(self.kv, self.pages, slots, ids, skip_first, range(layer, layer + 1),
                                          True)  # checked
                    self._layer_done(streams, events, on_layer, layer)
            elif path is TransferPath.DIRECT:
                page_index, slot_index = self._index(ids, lane), self._index(slots, lane)
                for layer in range(layers):
                    self._direct_plan().scatter(page_index, slot_index, skip_first, range(layer, layer + 1))
                    self._layer_done(streams, events, on_layer, layer)
            else:
                self._load_layers_staged(ids, slots, skip_first, on_layer, streams, events)
        return events or None

    def start_layers(
        self, page_ids: Sequence[int], slots: torch.Tensor, skip_first: int = 0, pace_bytes: int = PACE_BYTES,
        *, checked: bool = False, after: torch.cuda.Event | None = None,
    ) -> PacedLayers | None:
        """:meth:`load_layers` queued a few units at a time by a thread of the caller's (STAGING on CUDA).

        Checks the arguments and orders the load after the caller's current stream now (or after
        ``after``, as in :meth:`load`); nothing is
        copied until the returned load's :meth:`PacedLayers.feed` runs (once, on any thread). Each
        stream sharing a hardware queue with the copy stream then waits for at most ``pace_bytes``
        of queued copies (see :data:`PACE_BYTES`), not for the whole load. None where this mover does
        not stage (DIRECT, REFERENCE, CPU): use :meth:`load_layers`. Paced loads of one mover must be
        fed in the order they were started, one after the other (one feeding thread).
        """
        ids = self._check(slots, page_ids, checked)
        check_scatter_counts(self.kv, slots, len(ids), skip_first)
        if isinstance(pace_bytes, bool) or not isinstance(pace_bytes, int) or pace_bytes < 1:
            raise ValueError(f"pace_bytes must be a positive int, got {pace_bytes!r}")
        staging = self._layered
        if self.effective_path is not TransferPath.STAGING or staging is None or staging.copy_stream is None:
            return None
        lane = self._load_lanes[0]
        runs = self._run_layers(staging, ids, slots, skip_first, pace_bytes)
        plan: _StagedLayers | _RunLayers
        with self._on_side([lane], after):
            if runs is not None:
                self._order_copies_after_loads(staging)
                plan = runs
                unit_bytes = runs.unit_bytes
            else:
                plan = self._staged_plan(staging, ids, slots, skip_first)
                layout = self.kv.layout
                unit_bytes = (staging.capacity * layout.page_tokens * layout.rows * layout.head_dim
                              * self.pages.element_size())
        with self._paced_lock:
            self._paced_active += 1
        return PacedLayers(self, plan, pace_window(unit_bytes, pace_bytes))

    def _paced_done(self, end: torch.cuda.Event | None) -> None:
        """A paced load queued its last unit (the feeding thread): later loads order after ``end``
        (None: it queued nothing)."""
        with self._paced_lock:
            if end is not None:
                self._layered_done = end
            self._paced_active -= 1

    def _staged_plan(
        self, staging: _LayerStaging, ids: list[int], slots: torch.Tensor, skip_first: int
    ) -> _StagedLayers:
        """Groups, device slots and slab runs of a STAGING layer-wise load; orders the copy stream
        after the load lanes. Runs inside :meth:`_on_side` of the first load lane."""
        scatter_lane = self._load_lanes[0]
        groups = self._layer_chunks(ids, skip_first, staging.capacity, self.kv.layout.page_tokens)
        index = self._index(slots, scatter_lane)  # on the scatter stream, which alone reads it
        self._order_copies_after_loads(staging)
        return _StagedLayers(
            groups=groups,
            indices=[index[g.slot_begin : g.slot_end] for g in groups],
            runs=[slab_runs(group.ids, self.run_pages) for group in groups],  # the same for every layer
            units=layer_schedule(self.kv.layout.num_layers, len(groups), len(staging.buffers)),
        )

    def _order_copies_after_loads(self, staging: _LayerStaging) -> None:
        """The copy stream waits for everything queued on the load lanes. Staged: the buffers are
        the load lanes' staging, the first copy waits until every load queued there (layer-wise
        scatters included) has read it. Runs: the copies write KV slots an earlier load may still
        write. The first lane already waits for the caller's stream, so this also orders the
        copies after the caller. Runs inside :meth:`_on_side` of the first load lane."""
        copy_stream = staging.copy_stream
        if copy_stream is None:
            return
        for other in self._load_lanes:
            if other.stream is not None:
                mark = _new_event()
                mark.record(other.stream)
                copy_stream.wait_event(mark)

    def _run_layers(
        self, staging: _LayerStaging, ids: list[int], slots: torch.Tensor, skip_first: int, pace_bytes: int
    ) -> _RunLayers | None:
        """The run copies of a layer-wise load, or None where it stages (``load_runs`` off, a buffer
        of another shape, CUDA slots, a page whose slots are not one run, too many copies).

        A unit is one layer of a group of pages, at most ``pace_bytes / (LAYER_BUFFERS + 1)`` bytes:
        a paced load keeps about ``pace_bytes`` queued, as the staged one does."""
        geometry = self._load_runs
        tokens = self.kv.layout.page_tokens
        if geometry is None or (starts := load_run_starts(slots, len(ids), tokens, skip_first)) is None:
            return None
        page_layer = sum(seg.block for seg in geometry.segments)
        capacity = max(1, pace_bytes // ((LAYER_BUFFERS + 1) * page_layer))
        groups = layer_groups(len(ids), capacity)
        copies = [
            load_copies(geometry, starts[g.start : g.stop], ids[g.start : g.stop], tokens,
                        skip_first if g.start == 0 else 0, self.run_pages)
            for g in groups
        ]
        staged = layer_groups(len(ids), staging.capacity)
        budget = sum(len(slab_runs(ids[g.start : g.stop], self.run_pages)) + RUN_COPIES_PER_LAUNCH for g in staged)
        if sum(len(c) for c in copies) > budget:
            return None
        return _RunLayers(
            copies=copies,
            pages=[len(g) for g in groups],
            units=layer_schedule(self.kv.layout.num_layers, len(groups), 1),
            unit_bytes=max(len(g) for g in groups) * page_layer,
        )

    def _issue_run_unit(self, plan: _RunLayers, unit: LayerUnit, stream: torch.cuda.Stream | None) -> None:
        """Queue one unit's copies on ``stream`` (the copy stream; None: memmove, Triton's interpreter);
        a unit of the last layer completes its group's pages (:attr:`runs_loaded`)."""
        copies = plan.copies[unit.group]
        if stream is None:
            memmove_runs([c.at(unit.layer) for c in copies])
        else:
            _cuda.memcpy2d_batch_async([c.at(unit.layer) for c in copies], stream)
        if unit.layer == self.kv.layout.num_layers - 1:
            self._count_runs_loaded(plan.pages[unit.group])

    def _count_runs_loaded(self, pages: int) -> None:
        with self._count_lock:
            self.runs_loaded += pages

    def _load_layers_runs(
        self,
        staging: _LayerStaging,
        plan: _RunLayers,
        on_layer: Callable[[int], None] | None,
        events: list[torch.cuda.Event],
    ) -> None:
        """A layer-wise load by run copies, all queued now on the copy stream (each layer's event
        recorded after its copies); runs inside :meth:`_on_side` of the first load lane. Whatever
        happens, the first lane (which the caller's stream waits for on failure, and later loads
        order after) ends up waiting for every copy queued."""
        copy_stream, lane = staging.copy_stream, self._load_lanes[0].stream
        self._order_copies_after_loads(staging)
        try:
            for unit in plan.units:
                self._issue_run_unit(plan, unit, copy_stream)
                if unit.ends_layer:
                    if copy_stream is not None:
                        event = _new_event(blocking=True)  # the bridge's waiter may sleep on it
                        event.record(copy_stream)
                        events.append(event)
                    elif on_layer is not None:
                        on_layer(unit.layer)
        finally:
            if copy_stream is not None and lane is not None:
                copies = _new_event()
                copies.record(copy_stream)
                lane.wait_event(copies)
                ended = _new_event()
                ended.record(lane)
                self._layered_done = ended

    @staticmethod
    def _layer_chunks(ids: list[int], skip_first: int, capacity: int, tokens: int) -> list[_Chunk]:
        """The page groups of a STAGING layer-wise load (:func:`layer_groups`) with their slot ranges."""
        return [
            _Chunk(
                first=g.start,
                ids=ids[g.start : g.stop],
                slot_begin=max(g.start * tokens - skip_first, 0),
                slot_end=g.stop * tokens - skip_first,
                skip=skip_first if g.start == 0 else 0,
            )
            for g in layer_groups(len(ids), capacity)
        ]

    def _load_layers_staged(
        self,
        ids: list[int],
        slots: torch.Tensor,
        skip_first: int,
        on_layer: Callable[[int], None] | None,
        streams: list[torch.cuda.Stream],
        events: list[torch.cuda.Event],
    ) -> None:
        """The STAGING layer-wise pipeline (or run copies where they serve); runs inside
        :meth:`_on_side` of the first load lane."""
        staging = self._layered
        assert staging is not None
        runs = self._run_layers(staging, ids, slots, skip_first, PACE_BYTES)
        if runs is not None:
            self._load_layers_runs(staging, runs, on_layer, events)
            return
        scatter_lane = self._load_lanes[0]
        copy_stream = staging.copy_stream
        plan = self._staged_plan(staging, ids, slots, skip_first)
        try:
            for unit in plan.units:
                self._issue_unit(staging, plan, unit)
                if unit.ends_layer:
                    self._layer_done(streams, events, on_layer, unit.layer)
        except BaseException:
            if copy_stream is not None and scatter_lane.stream is not None:
                # Copies may be queued whose scatters never were: the scatter stream (which the
                # caller and later whole-page loads are ordered after) waits for them too.
                copies = _new_event()
                copies.record(copy_stream)
                scatter_lane.stream.wait_event(copies)
                ended = _new_event()
                ended.record(scatter_lane.stream)
                self._layered_done = ended
            raise
        if events:
            self._layered_done = events[-1]

    def _issue_unit(self, staging: _LayerStaging, plan: _StagedLayers, unit: LayerUnit) -> None:
        """Queue one unit of :func:`layer_schedule`: its copy on the copy stream, its scatter on the
        first load lane's stream (the caller records layer events after a unit that ends a layer)."""
        copy_stream, scatter_lane = staging.copy_stream, self._load_lanes[0]
        group, buffer = plan.groups[unit.group], unit.buffer
        with self._on_stream(copy_stream):
            if copy_stream is not None and unit.reuse:
                copy_stream.wait_event(staging.freed[buffer])
            self._copy_unit(staging.buffers[buffer], group.ids, plan.runs[unit.group], unit.layer, copy_stream)
            if copy_stream is not None:
                staging.copied[buffer].record(copy_stream)
        with self._stream(scatter_lane):
            if scatter_lane.stream is not None:
                scatter_lane.stream.wait_event(staging.copied[buffer])
            layer = range(unit.layer, unit.layer + 1)
            staging.plans[buffer].scatter(None, plan.indices[unit.group], group.skip, layer)
            if scatter_lane.stream is not None:
                staging.freed[buffer].record(scatter_lane.stream)

    def _copy_unit(
        self, buffer: torch.Tensor, page_ids: list[int], runs: list[tuple[int, int, int]], layer: int,
        stream: torch.cuda.Stream | None,
    ) -> None:
        """Layer ``layer`` of pool pages ``page_ids`` -> slabs ``0..`` of ``buffer``, on ``stream``.

        One copy per run of ``runs`` (:func:`slab_runs` of ``page_ids``): a page's layer is
        contiguous, consecutive pages' are a page apart (one 2-D copy for a run). On
        CUDA through the runtime directly where it can (torch's ``copy_`` costs ~10 µs of host time
        per call, thousands of calls per long prefix).
        """
        if stream is not None and self._raw_memcpy:
            pages = self.pages
            itemsize = pages.element_size()
            slab = buffer[0].numel() * itemsize
            dst = buffer.data_ptr()
            src = pages.data_ptr() + layer * pages.stride(1) * itemsize
            page_stride = pages.stride(0) * itemsize
            for j, page, count in runs:
                if count == 1:
                    _cuda.memcpy_async(dst + j * slab, src + page * page_stride, slab, stream)
                else:
                    _cuda.memcpy2d_async(dst + j * slab, slab, src + page * page_stride, page_stride, slab, count,
                                         stream)
            return
        for j, page in enumerate(page_ids):
            buffer[j].copy_(self.pages[page, layer], non_blocking=True)

    @staticmethod
    def _layer_done(
        streams: list[torch.cuda.Stream], events: list[torch.cuda.Event],
        on_layer: Callable[[int], None] | None, layer: int,
    ) -> None:
        if streams:
            event = _new_event(blocking=True)  # the bridge's waiter may sleep on it (the last one)
            event.record(streams[0])
            events.append(event)
        elif on_layer is not None:
            on_layer(layer)

    # -- staging path ---------------------------------------------------------------------------

    def _issue_order(
        self, plan: list[tuple[_Lane, list[_Chunk]]], slots: torch.Tensor
    ) -> Iterator[tuple[_Lane, _Chunk, torch.Tensor]]:
        """Each chunk with its lane and device slots, in page order: every lane starts at once."""
        indices = []
        for lane, chunks in plan:
            if slots.is_cuda and lane.stream is not None:
                slots.record_stream(lane.stream)
            with self._stream(lane):
                index = self._index(torch.cat([slots[c.slot_begin : c.slot_end] for c in chunks]), lane)
            indices.append([index[a:b] for a, b in self._lane_slices(chunks)])
        for step in range(max(len(chunks) for _, chunks in plan)):
            for (lane, chunks), lane_indices in zip(plan, indices, strict=True):
                if step < len(chunks):
                    yield lane, chunks[step], lane_indices[step]

    @staticmethod
    def _lane_slices(chunks: list[_Chunk]) -> list[tuple[int, int]]:
        """Where each of a lane's chunks lies in the lane's one index tensor (its chunks' slots in order)."""
        offsets = [0]
        for chunk in chunks:
            offsets.append(offsets[-1] + chunk.slot_end - chunk.slot_begin)
        return list(itertools.pairwise(offsets))

    def _offload_chunk(self, lane: _Lane, chunk: _Chunk, index: torch.Tensor) -> None:
        """Gather into the lane's staging, then one memcpy per page, all on the lane's stream."""
        assert lane.plan is not None and lane.staging is not None
        with self._stream(lane):
            lane.plan.gather(index, None)
            for j, page in enumerate(chunk.ids):
                self.pages[page].copy_(lane.staging[j], non_blocking=True)

    def _load_chunk(self, lane: _Lane, chunk: _Chunk, index: torch.Tensor) -> None:
        """One memcpy per page into the lane's staging, then the scatter, on the lane's stream."""
        assert lane.plan is not None and lane.staging is not None
        with self._stream(lane):
            for j, page in enumerate(chunk.ids):
                lane.staging[j].copy_(self.pages[page], non_blocking=True)
            lane.plan.scatter(None, index, chunk.skip)

    @staticmethod
    def _chunks(count: int, ids: list[int], skip_first: int, tokens: int) -> list[_Chunk]:
        """Consecutive single pages; the lanes group them by their staging capacity."""
        return [
            _Chunk(
                first=i,
                ids=[ids[i]],
                slot_begin=max(i * tokens - skip_first, 0),
                slot_end=(i + 1) * tokens - skip_first,
                skip=skip_first if i == 0 else 0,
            )
            for i in range(count)
        ]

    @staticmethod
    def _deal(pages: list[_Chunk], lanes: list[_Lane]) -> list[tuple[_Lane, list[_Chunk]]]:
        """Group consecutive pages into chunks of each lane's staging size, dealt round-robin."""
        work: list[list[_Chunk]] = [[] for _ in lanes]
        i = turn = 0
        while i < len(pages):
            lane = lanes[turn % len(lanes)]
            size = 0 if lane.staging is None else lane.staging.shape[0]
            group = pages[i : i + size]
            work[turn % len(lanes)].append(
                _Chunk(
                    first=group[0].first,
                    ids=[p for c in group for p in c.ids],
                    slot_begin=group[0].slot_begin,
                    slot_end=group[-1].slot_end,
                    skip=group[0].skip,
                )
            )
            i += size
            turn += 1
        return [(lane, mine) for lane, mine in zip(lanes, work, strict=True) if mine]

    # -- streams and indices --------------------------------------------------------------------

    def _check(self, slots: torch.Tensor, page_ids: PageIds, checked: bool) -> list[int]:
        """Checks ``slots`` unless the caller did (``checked``: a pass over the indices, once per call
        at the public edge, not again per launch group), and always the page ids (a short list)."""
        if not checked:
            check_slots(self.kv, slots)
        return check_page_ids(page_ids, self.pages.shape[0])

    def _direct_plan(self) -> CopyPlan:
        # Built on first use: the pool registers its memory in the background after creation.
        if self._direct is None:
            from .launch import CopyPlan

            self._direct = CopyPlan(self.kv, self.pages)
        return self._direct

    def _stream(self, lane: _Lane) -> contextlib.AbstractContextManager[object]:
        if lane.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(lane.stream)

    @staticmethod
    def _on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)

    @contextlib.contextmanager
    def _ordered_on_failure(self, lanes: list[_Lane]) -> Iterator[None]:
        """If the body raises, the caller's current stream waits for whatever ``lanes`` queued.

        A load that fails part-way (a refused copy, a launch error) has already queued scatters
        into the caller's slots; ordering the caller's stream after them keeps the contract that
        nothing the caller does next (reusing the slots) is overtaken by a late write.
        """
        try:
            yield
        except BaseException:
            caller = torch.cuda.current_stream(self.kv.device) if self._cuda else None
            for lane in lanes:
                if caller is not None and lane.stream is not None:
                    queued = _new_event()
                    queued.record(lane.stream)
                    caller.wait_event(queued)
            raise

    @contextlib.contextmanager
    def _on_side(
        self, lanes: list[_Lane], ready: torch.cuda.Event | None = None
    ) -> Iterator[list[torch.cuda.Stream]]:
        """Make ``lanes`` wait for the caller's current stream (or ``ready``, recorded on it
        earlier); run the body on the first lane."""
        streams = [lane.stream for lane in lanes if lane.stream is not None]
        if streams:
            if ready is None:
                ready = _new_event()
                ready.record(torch.cuda.current_stream(self.kv.device))
            for stream in streams:
                stream.wait_event(ready)
        with self._stream(lanes[0]):
            yield streams

    def _finish(self, streams: list[torch.cuda.Stream]) -> torch.cuda.Event | None:
        """One event after the work of every stream in ``streams`` (None off CUDA)."""
        if not streams:
            return None
        first = streams[0]
        for other in streams[1:]:
            joined = _new_event()
            joined.record(other)
            first.wait_event(joined)
        done = _new_event(blocking=True)  # the bridge's waiter sleeps on it
        done.record(first)
        return done

    def _index(self, values: torch.Tensor | list[int], lane: _Lane) -> torch.Tensor:
        """int64 copy of ``values`` on the KV device, ordered on ``lane``'s stream.

        A host index goes through a fresh pinned buffer: torch's host allocator keeps it until the
        copy on this stream is done, so the caller may reuse its tensor at once. A caller's CUDA
        tensor is marked as used by this stream so its memory outlives the copy.
        """
        # contiguous(): the kernels read an index as contiguous; an int64 strided view (a column of a
        # block table, slots[::2]) passed through as_tensor/to unchanged and was read at the wrong
        # elements: wrong slots, or out of bounds (found by the property test).
        if lane.stream is None:
            return torch.as_tensor(values, dtype=torch.int64).to(self.kv.device).contiguous()
        with torch.cuda.stream(lane.stream):
            if isinstance(values, torch.Tensor) and values.is_cuda:
                values.record_stream(lane.stream)
                return values.to(torch.int64).contiguous()
            host = torch.as_tensor(values, dtype=torch.int64)
            pinned = torch.empty(host.shape, dtype=torch.int64, pin_memory=True)
            pinned.copy_(host)
            return pinned.to(self.kv.device, non_blocking=True)
