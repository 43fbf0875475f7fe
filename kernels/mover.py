"""`PageMover`: moves whole pages between the engine's KV buffer and the pool, on side streams.

Offload (GPU -> pool), STAGING path: the Triton gather fills a GPU staging buffer, then one
copy-engine memcpy per page writes the pinned pool page. Load reverses it: memcpy into staging,
then the Triton scatter. The kernels hold the SMs ~0.02 ms per 32 MiB page; PCIe is the limit.

Work is split over two *lanes* per direction, each a side stream with its own share of the
staging buffer, chunks dealt round-robin: lane A's memcpy overlaps lane B's kernel, and a lane
never overwrites its staging before its own memcpy has read it (stream order). Every lane first
waits on an event recorded on the caller's current stream; the call returns one event after all
of its lanes, recorded on the first lane's stream.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from aiokv.layout import KVBuffer

from .checks import (
    PageIds,
    check_gather_counts,
    check_page_ids,
    check_pages,
    check_scatter_counts,
    check_slots,
)
from .paths import TransferPath, interpreting

if TYPE_CHECKING:
    from .launch import CopyPlan
from .reference import reference_gather, reference_scatter

DEFAULT_STAGING_PAGES = 2
"""Pages of GPU staging per direction (two lanes of one page each): 64 MiB per direction for an 8B model."""


def _new_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


def _new_event() -> torch.cuda.Event:
    return torch.cuda.Event()  # type: ignore[no-untyped-call]


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


class PageMover:
    """Offload/load of whole pages between one KV buffer and one pool tensor.

    ``pages``: the pool tensor ``[N, L, T, rows, D]`` (``PagePool.pages``); with a CUDA KV buffer
    the pages used must lie in chunks the pool has registered (pinned + mapped). ``path`` None picks
    STAGING on CUDA and REFERENCE on CPU. ``staging_pages``: GPU staging per direction, in pages.

    A rank that holds only part of each page's rows (tensor parallelism) moves them through the
    DIRECT path even when STAGING is asked for: its rows are strided in the page, and one contiguous
    memcpy per page would overwrite the other ranks' rows. :attr:`effective_path` says which runs.
    Raises ``ValueError`` for a path that cannot serve this buffer or a bad argument.
    """

    def __init__(
        self,
        kv: KVBuffer,
        pages: torch.Tensor,
        path: TransferPath | None = None,
        staging_pages: int = DEFAULT_STAGING_PAGES,
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
        staged = self.effective_path is TransferPath.STAGING
        lanes = min(2, staging_pages) if staged else 1
        shares = [staging_pages // lanes + (i < staging_pages % lanes) for i in range(lanes)]
        self._offload_lanes = [self._lane(share if staged else 0) for share in shares]
        self._load_lanes = [self._lane(share if staged else 0) for share in shares]

    def _lane(self, staging_pages: int) -> _Lane:
        stream = _new_stream(self.kv.device) if self._cuda else None
        if staging_pages == 0:
            return _Lane(stream, None, None)
        staging = torch.empty(
            (staging_pages, *self.kv.layout.page_shape), dtype=self.kv.layout.dtype, device=self.kv.device
        )
        from .launch import CopyPlan  # Triton loads only for a path that launches kernels

        return _Lane(stream, staging, CopyPlan(self.kv, staging))

    @property
    def staging_bytes(self) -> int:
        """GPU memory held for staging, both directions."""
        lanes = self._offload_lanes + self._load_lanes
        return sum(lane.staging.numel() * lane.staging.element_size() for lane in lanes if lane.staging is not None)

    # -- public ---------------------------------------------------------------------------------

    def offload(self, slots: torch.Tensor, page_ids: Sequence[int]) -> torch.cuda.Event | None:
        """KV of ``slots`` -> pool pages ``page_ids``; page i gets ``slots[i*T:(i+1)*T]``.

        ``slots``: 1-D int tensor (any device; CPU avoids a blocking read for the checks) of
        ``len(page_ids) * T`` distinct slots. CUDA: queued behind the caller's current stream;
        returns the event to await before committing the pages. CPU: synchronous, returns None; so
        does a TP replica that must not write (``tp.writer`` False), which moves nothing.
        """
        ids = self._check(slots, page_ids)
        check_gather_counts(self.kv, slots, len(ids))
        if not self.kv.tp.writer:
            return None
        tokens = self.kv.layout.page_tokens
        if self.effective_path is TransferPath.REFERENCE:
            with self._on_side(self._offload_lanes[:1]) as streams:
                reference_gather(self.kv, slots, self.pages, ids)
            return self._finish(streams)
        if self.effective_path is TransferPath.DIRECT:
            lane = self._offload_lanes[0]
            with self._on_side([lane]) as streams:
                self._direct_plan().gather(self._index(slots, lane), self._index(ids, lane))
            return self._finish(streams)
        chunks = self._chunks(len(ids), ids, skip_first=0, tokens=tokens)
        plan = self._deal(chunks, self._offload_lanes)
        with self._on_side([lane for lane, _ in plan]) as streams:
            for lane, chunk, index in self._issue_order(plan, slots):
                self._offload_chunk(lane, chunk, index)
        return self._finish(streams)

    def load(self, page_ids: Sequence[int], slots: torch.Tensor, skip_first: int = 0) -> torch.cuda.Event | None:
        """Tokens ``[skip_first, len(page_ids)*T)`` of the concatenated pool pages -> ``slots``.

        ``len(slots) == len(page_ids) * T - skip_first``, ``0 <= skip_first < T``. CUDA: queued
        behind the caller's current stream; returns the completion event: make the compute stream
        wait on it, and keep the pool pages alive until it completes. CPU: synchronous, returns None.
        """
        ids = self._check(slots, page_ids)
        check_scatter_counts(self.kv, slots, len(ids), skip_first)
        tokens = self.kv.layout.page_tokens
        if self.effective_path is TransferPath.REFERENCE:
            with self._on_side(self._load_lanes[:1]) as streams:
                reference_scatter(self.kv, self.pages, slots, ids, skip_first)
            return self._finish(streams)
        if self.effective_path is TransferPath.DIRECT:
            lane = self._load_lanes[0]
            with self._on_side([lane]) as streams:
                self._direct_plan().scatter(self._index(ids, lane), self._index(slots, lane), skip_first)
            return self._finish(streams)
        chunks = self._chunks(len(ids), ids, skip_first=skip_first, tokens=tokens)
        plan = self._deal(chunks, self._load_lanes)
        with self._on_side([lane for lane, _ in plan]) as streams:
            for lane, chunk, index in self._issue_order(plan, slots):
                self._load_chunk(lane, chunk, index)
        return self._finish(streams)

    def load_layers(
        self,
        page_ids: Sequence[int],
        slots: torch.Tensor,
        skip_first: int = 0,
        on_layer: Callable[[int], None] | None = None,
    ) -> list[torch.cuda.Event] | None:
        """:meth:`load`, layer by layer: layer 0 of every page first, then layer 1, ...

        CUDA: queued behind the caller's current stream on one side stream; returns one event per
        layer (event ``l`` completes once layers ``0..l`` are in the KV buffer; the last one ends
        the whole load). The caller's stream is NOT made to wait: wait on event ``l`` before
        reading layer ``l``. CPU: synchronous, calls ``on_layer(l)`` as each layer lands, returns None.
        """
        ids = self._check(slots, page_ids)
        check_scatter_counts(self.kv, slots, len(ids), skip_first)
        layers = self.kv.layout.num_layers
        events: list[torch.cuda.Event] = []
        path = self.effective_path
        lane = self._load_lanes[0]
        with self._on_side([lane]) as streams:
            if path is TransferPath.REFERENCE:
                for layer in range(layers):
                    reference_scatter(self.kv, self.pages, slots, ids, skip_first, range(layer, layer + 1))
                    self._layer_done(streams, events, on_layer, layer)
            elif path is TransferPath.DIRECT:
                page_index, slot_index = self._index(ids, lane), self._index(slots, lane)
                for layer in range(layers):
                    self._direct_plan().scatter(page_index, slot_index, skip_first, range(layer, layer + 1))
                    self._layer_done(streams, events, on_layer, layer)
            else:
                assert lane.plan is not None and lane.staging is not None
                tokens = self.kv.layout.page_tokens
                chunks = self._deal(self._chunks(len(ids), ids, skip_first, tokens), [lane])[0][1]
                if slots.is_cuda and lane.stream is not None:
                    slots.record_stream(lane.stream)
                indices = [self._index(slots[c.slot_begin : c.slot_end], lane) for c in chunks]
                for layer in range(layers):
                    with self._stream(lane):
                        for chunk, index in zip(chunks, indices, strict=True):
                            for j, page in enumerate(chunk.ids):
                                lane.staging[j, layer].copy_(self.pages[page, layer], non_blocking=True)
                            lane.plan.scatter(None, index, chunk.skip, range(layer, layer + 1))
                    self._layer_done(streams, events, on_layer, layer)
        return events or None

    @staticmethod
    def _layer_done(
        streams: list[torch.cuda.Stream], events: list[torch.cuda.Event],
        on_layer: Callable[[int], None] | None, layer: int,
    ) -> None:
        if streams:
            event = _new_event()
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
            offsets = [0]
            for chunk in chunks:
                offsets.append(offsets[-1] + chunk.slot_end - chunk.slot_begin)
            indices.append([index[a:b] for a, b in itertools.pairwise(offsets)])
        for step in range(max(len(chunks) for _, chunks in plan)):
            for (lane, chunks), lane_indices in zip(plan, indices, strict=True):
                if step < len(chunks):
                    yield lane, chunks[step], lane_indices[step]

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

    def _check(self, slots: torch.Tensor, page_ids: PageIds) -> list[int]:
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

    @contextlib.contextmanager
    def _on_side(self, lanes: list[_Lane]) -> Iterator[list[torch.cuda.Stream]]:
        """Make ``lanes`` wait for the caller's current stream; run the body on the first lane."""
        streams = [lane.stream for lane in lanes if lane.stream is not None]
        if streams:
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
        done = _new_event()
        done.record(first)
        return done

    def _index(self, values: torch.Tensor | list[int], lane: _Lane) -> torch.Tensor:
        """int64 copy of ``values`` on the KV device, ordered on ``lane``'s stream.

        A host index goes through a fresh pinned buffer: torch's host allocator keeps it until the
        copy on this stream is done, so the caller may reuse its tensor at once. A caller's CUDA
        tensor is marked as used by this stream so its memory outlives the copy.
        """
        if lane.stream is None:
            return torch.as_tensor(values, dtype=torch.int64).to(self.kv.device)
        with torch.cuda.stream(lane.stream):
            if isinstance(values, torch.Tensor) and values.is_cuda:
                values.record_stream(lane.stream)
                return values.to(torch.int64)
            host = torch.as_tensor(values, dtype=torch.int64)
            pinned = torch.empty(host.shape, dtype=torch.int64, pin_memory=True)
            pinned.copy_(host)
            return pinned.to(self.kv.device, non_blocking=True)
