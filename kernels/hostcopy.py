"""Whole-page copies between a KV buffer in host memory and the pool, in a few torch calls per launch group.

:func:`~aiokv.kernels.reference.reference_scatter` copies layer by layer and builds its index tensors
and views on every call: ~28 torch calls for a launch group of a 2-layer buffer, ~4 more per layer,
and each call lets the GIL go (the op, and freeing each temporary tensor). Beside an engine thread
that runs Python, the copy thread then waits up to a switch interval (5 ms) to take it back, many
times a group (``tools/bench_gil.py``: a 39-page pool hit of 64 KiB pages 110-220 ms so, ~1 ms
idle). :class:`HostScatter` (loads) and :class:`HostGather` (offloads) work out the buffer's
geometry once (every layer of a segment as one strided view where the layers are evenly spaced, as
a stacked ``[L, S, rows, D]`` buffer's are) and copy a group of pages with one call over all layers
per segment, run of pool pages and run of slots: the pool pages of a run are a view, a run of slots
is an ``as_strided`` view of the buffer, other slots one indexed assignment (loads) or
``index_select`` (offloads). Bit-exact: every copy goes through a same-size integer view, as the
reference's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aiokv.layout import KVBuffer

from .reference import CHUNK_BYTES, reference_gather
from .segments import segments

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_int(t: torch.Tensor) -> torch.Tensor:
    return t.view(_SAME_SIZE_INT[t.element_size()])


@dataclass(frozen=True, slots=True)
class _Side:
    """One segment's KV side: ``layers`` (``[S, width]`` integer views, the segment's columns from
    ``kv_col``), and ``stacked`` (``[L, S, width]``, all of them) where they are evenly spaced in one
    storage without overlapping, else None."""

    layers: tuple[torch.Tensor, ...]
    stacked: torch.Tensor | None
    page_col: int
    width: int
    whole: bool
    """The segment is the page's whole token row (no column slice of the pool side)."""


def _stacked(views: tuple[torch.Tensor, ...], reads: bool = False) -> torch.Tensor | None:
    """``views`` (same shape and strides) as one ``[L, ...]`` view, or None where the layers are not
    in one storage at one step apart, or would overlap (a copy into overlapping memory in one call
    is undefined). ``reads``: the view is only read (an offload's source): layers may overlap, or be
    one (a step of 0)."""
    first = views[0]
    if len(views) == 1:
        return first.unsqueeze(0)
    storage = first.untyped_storage().data_ptr()
    size = first.element_size()
    step_bytes = views[1].data_ptr() - first.data_ptr()
    if step_bytes < 0 or (step_bytes == 0 and not reads) or step_bytes % size:
        return None
    step = step_bytes // size
    span = 1 + sum((n - 1) * s for n, s in zip(first.shape, first.stride(), strict=True))
    if step < span and not reads:
        return None
    for i, view in enumerate(views):
        if (view.untyped_storage().data_ptr() != storage or view.stride() != first.stride()
                or view.shape != first.shape or view.data_ptr() != first.data_ptr() + i * step_bytes):
            return None
    return first.as_strided((len(views), *first.shape), (step, *first.stride()), first.storage_offset())


def _sides(kv: KVBuffer, row: int, reads: bool) -> tuple[_Side, ...]:
    """The segments of rank ``kv.tp`` as :class:`_Side` views; ``row``: a page's token row in elements
    (``rows * D``); ``reads``: the buffer is only read (see :func:`_stacked`)."""
    sides = []
    for seg in segments(kv):
        views = tuple(_as_int(t).view(t.shape[0], -1)[:, seg.kv_col : seg.kv_col + seg.width] for t in seg.layers)
        sides.append(_Side(views, _stacked(views, reads), seg.page_col, seg.width,
                           seg.page_col == 0 and seg.width == row))
    return tuple(sides)


def _disjoint(pages: torch.Tensor) -> bool:
    """Whether no two (page, layer) blocks of ``pages`` ``[N, L, T, rows, D]`` (token rows contiguous,
    checked by the mover) share memory: then copies into them land the same in any order."""
    _, _, tokens, rows, dim = pages.shape
    extent = tokens * rows * dim
    for stride, size in sorted((pages.stride(i), pages.shape[i]) for i in (0, 1) if pages.shape[i] > 1):
        if stride < extent:
            return False
        extent += (size - 1) * stride
    return True


def _runs(values: list[int]) -> list[tuple[int, int]]:
    """``values`` as maximal runs of consecutive ascending values: ``(index of the first, length)``."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            runs.append((start, i - start))
            start = i
    return runs


class HostScatter:
    """Pool pages -> slots of a KV buffer in host memory (``kv`` and ``pages`` both on the CPU).

    ``pages``: the pool tensor ``[N, L, T, rows, D]`` (checked by the mover). Only this rank's rows
    are copied (:func:`~aiokv.kernels.segments.segments`).
    """

    def __init__(self, kv: KVBuffer, pages: torch.Tensor) -> None:
        layout = kv.layout
        self._tokens = layout.page_tokens
        n, layers, tokens, rows, dim = pages.shape
        self._rows = _as_int(pages).view(n, layers, tokens, rows * dim)
        """``[N, L, T, rows * D]``: a view, writes through it would land in the pool."""
        self._sides = _sides(kv, rows * dim, reads=False)
        self._chunk = max(1, CHUNK_BYTES // (layers * tokens * rows * dim * pages.element_size()))
        """Pages of one gathered temporary at most (see :data:`~aiokv.kernels.reference.CHUNK_BYTES`)."""

    def load(self, page_ids: list[int], slots: torch.Tensor, skip_first: int = 0, layers: range | None = None) -> None:
        """Tokens ``[skip_first, len(page_ids) * T)`` of the concatenated pool pages ``page_ids`` ->
        ``slots`` (a 1-D CPU integer tensor, checked by the caller), in ``layers`` (None: all).

        A partial first page is a piece of its own; then one piece per run of pool pages consecutive
        in the pool and run of consecutive slots (pages spread over more runs than that saves are
        gathered into a temporary first, chunks of :data:`CHUNK_BYTES`, one call each). One copy per
        segment and piece (and layer, where the layers are not one view), in the reference's order:
        segment, layer, piece.
        """
        tokens = self._tokens
        values = slots.tolist()  # no torch call: the slots' runs are found in Python
        pieces: list[tuple[torch.Tensor, int, torch.Tensor | None]] = []
        if skip_first:
            head = tokens - skip_first
            self._pieces(pieces, page_ids[:1], values[:head], slots[:head], skip_first, layers)
            page_ids, values, slots = page_ids[1:], values[head:], slots[head:]
        if page_ids:
            self._pieces(pieces, page_ids, values, slots, 0, layers)
        # Segment by segment, layer by layer, as the reference: where the engine's layers (or its K
        # and V) overlap in memory, the same one ends there (the reference's last), whatever the runs.
        first = 0 if layers is None else layers.start
        for side in self._sides:
            cols = [(src if side.whole else src[..., side.page_col : side.page_col + side.width], start, at)
                    for src, start, at in pieces]
            stacked = side.stacked
            if stacked is not None:
                for src, start, at in cols:
                    self._copy_layers(stacked, first, src, start, at)
                continue
            for i in range(cols[0][0].shape[1]):
                dst = side.layers[first + i].unsqueeze(0)
                for src, start, at in cols:
                    self._copy_layers(dst, 0, src[:, i : i + 1], start, at)

    def _pieces(self, out: list[tuple[torch.Tensor, int, torch.Tensor | None]], ids: list[int], values: list[int],
                slots: torch.Tensor, skip: int, layers: range | None) -> None:
        """Tokens ``[skip, T)`` of each page ``ids`` (``skip`` only with one page) -> ``slots``, as
        ``(pages [count, L', T', cols], first slot of a run, or None, slots [count, T'] or None)``
        appended to ``out``."""
        per_page = self._tokens - skip
        rows = self._rows
        if layers is not None or skip:
            lo_layer = 0 if layers is None else layers.start
            rows = rows[:, lo_layer : rows.shape[1] if layers is None else layers.stop, skip:]
        runs = _runs(ids)
        # A run of pages is a view of the pool; many runs are fewer calls gathered (2 per chunk).
        pieces: list[tuple[torch.Tensor, int, int]] = []  # (pages [n, L', T', cols], first page, count)
        if len(runs) > 2 * -(-len(ids) // self._chunk):
            for lo in range(0, len(ids), self._chunk):
                hi = min(len(ids), lo + self._chunk)
                pieces.append((rows.index_select(0, torch.tensor(ids[lo:hi], dtype=torch.int64)), lo, hi - lo))
        else:
            pieces = [(rows[ids[first] : ids[first] + count], first, count) for first, count in runs]
        for src, first, count in pieces:
            a, b = first * per_page, (first + count) * per_page
            part = values[a:b]
            run = part[-1] - part[0] == len(part) - 1 and part == list(range(part[0], part[-1] + 1))
            at = None if run else slots[a:b].reshape(count, per_page)
            if at is not None and at.dtype != torch.int64:
                at = at.to(torch.int64)
            out.append((src, part[0], at))

    def _copy_layers(self, dst: torch.Tensor, layer: int, src: torch.Tensor, start: int, at: torch.Tensor | None
                     ) -> None:
        """``src`` ``[count, L', T', width]`` -> layers ``[layer, layer + L')`` of ``dst``
        (``[L, S, width]``) at the slots ``at``, or the run from ``start`` where ``at`` is None."""
        count, span, per_page, width = src.shape
        layer_stride, slot_stride, col_stride = dst.stride()
        if at is None:
            # The run's slots of those layers as [count, L', T', width], the source's shape.
            dst.as_strided((count, span, per_page, width), (per_page * slot_stride, layer_stride, slot_stride,
                           col_stride), dst.storage_offset() + layer * layer_stride + start * slot_stride).copy_(src)
        else:
            view = dst if layer == 0 and span == dst.shape[0] else dst[layer : layer + span]
            view[:, at] = src.permute(1, 0, 2, 3)


@dataclass(frozen=True, slots=True)
class _Plane:
    """One copy's two sides, every layer of it at once: ``src`` ``[L', S, width]`` (engine slots) and
    ``dst`` ``[L', N, T, width]`` (pool pages, a view: writes land in the pool); ``src``'s shape,
    strides and offset read once (each read is a call)."""

    src: torch.Tensor
    dst: torch.Tensor
    shape: tuple[int, int]
    """``(L', width)``."""
    strides: tuple[int, int, int]
    """``src``'s (layer, slot, column) strides in elements."""
    offset: int

    @classmethod
    def of(cls, src: torch.Tensor, dst: torch.Tensor) -> _Plane:
        layer_stride, slot_stride, col_stride = src.stride()
        return cls(src, dst, (src.shape[0], src.shape[2]), (layer_stride, slot_stride, col_stride),
                   int(src.storage_offset()))


@dataclass(frozen=True, slots=True)
class _Piece:
    """``count`` pages of an offload: to pool pages ``first ...`` (a run) or ``index``, from the
    slots ``start ...`` (a run) or ``at`` (``[count * T]`` int64)."""

    first: int
    index: torch.Tensor | None
    start: int
    at: torch.Tensor | None
    count: int


class HostGather:
    """Slots of a KV buffer in host memory -> pool pages (``kv`` and ``pages`` both on the CPU).

    ``pages``: the pool tensor ``[N, L, T, rows, D]`` (checked by the mover). Only this rank's rows
    are written (:func:`~aiokv.kernels.segments.segments`); a TP replica that does not write
    (``tp.writer`` False) writes nothing. The buffer is only read, so its layers may overlap in
    memory; a pool whose pages or layers overlap each other (a view :func:`check_pages` lets
    through, not a :class:`~aiokv.pool.PagePool`'s) goes by the reference, whose order then decides.
    """

    def __init__(self, kv: KVBuffer, pages: torch.Tensor) -> None:
        self._kv, self._pages = kv, pages
        self._tokens = kv.layout.page_tokens
        self._writer = kv.tp.writer
        self._disjoint = _disjoint(pages)
        n, layers, tokens, rows, dim = pages.shape
        pool = _as_int(pages).view(n, layers, tokens, rows * dim).permute(1, 0, 2, 3)
        planes = []
        for side in _sides(kv, rows * dim, reads=True):
            cols = pool if side.whole else pool[..., side.page_col : side.page_col + side.width]
            if side.stacked is not None:
                planes.append(_Plane.of(side.stacked, cols))
            else:
                planes.extend(_Plane.of(v.unsqueeze(0), cols[i : i + 1]) for i, v in enumerate(side.layers))
        self._planes = tuple(planes)
        """Views made once: each call costs only its copies (every view call lets the GIL go)."""
        self._chunk = max(1, CHUNK_BYTES // (layers * tokens * rows * dim * pages.element_size()))
        """Pages of one gathered temporary at most (spread slots; see :data:`CHUNK_BYTES`)."""

    def offload(self, slots: torch.Tensor, page_ids: list[int]) -> None:
        """KV of ``slots`` (a 1-D CPU integer tensor of ``len(page_ids) * T``, checked by the caller) ->
        pool pages ``page_ids`` (distinct, checked): page ``page_ids[i]`` gets ``slots[i*T:(i+1)*T]``,
        every layer.

        One call per plane (a segment's layers as one view, or one layer) and piece: a run of pool
        pages consecutive in the pool (a view) or, where they are in more runs than that saves, all
        of them by one indexed assignment; from a run of consecutive slots (a view, then ``copy_``)
        or other slots, read by one ``index_select`` per :data:`CHUNK_BYTES` of pages (a temporary).
        """
        if not self._writer:
            return
        if not self._disjoint:
            reference_gather(self._kv, slots, self._pages, page_ids, True)  # checked
            return
        pieces = self._pieces(page_ids, slots)
        tokens = self._tokens
        for plane in self._planes:
            src, dst = plane.src, plane.dst
            span, width = plane.shape
            layer_stride, slot_stride, col_stride = plane.strides
            for p in pieces:
                if p.at is None:  # [L', count, T, width] of the run's slots
                    value = src.as_strided((span, p.count, tokens, width), (layer_stride, tokens * slot_stride,
                                           slot_stride, col_stride), plane.offset + p.start * slot_stride)
                else:  # index_select: ~2x an indexed read (src[:, at]) on the CPU
                    value = src.index_select(1, p.at).view(span, p.count, tokens, width)
                if p.index is None:
                    dst[:, p.first : p.first + p.count].copy_(value)
                else:
                    dst[:, p.index] = value

    def _pieces(self, ids: list[int], slots: torch.Tensor) -> list[_Piece]:
        """The offload's pages as pieces (see :meth:`offload`): the pool pages' runs, or one piece by
        index where there are more runs than 2 a chunk; pieces whose slots are no run cut to chunks."""
        tokens, chunk = self._tokens, self._chunk
        values = slots.tolist()  # no torch call: the runs are found in Python
        runs = _runs(ids)
        spans: list[tuple[int, int, bool]] = []  # pages [lo, hi), by index
        if len(runs) > 2 * -(-len(ids) // chunk):
            spans.append((0, len(ids), True))
        else:
            spans.extend((lo, lo + count, False) for lo, count in runs)
        pieces = []
        for lo, hi, indexed in spans:
            part = values[lo * tokens : hi * tokens]
            if part[-1] - part[0] == len(part) - 1 and part == list(range(part[0], part[-1] + 1)):
                cuts = [(lo, hi, part[0])]
            else:  # read into a temporary: at most a chunk of pages each
                cuts = [(a, min(hi, a + chunk), None) for a in range(lo, hi, chunk)]
            for a, b, start in cuts:
                index = torch.tensor(ids[a:b], dtype=torch.int64) if indexed else None
                at = None
                if start is None:
                    at = slots[a * tokens : b * tokens]
                    if at.dtype != torch.int64:
                        at = at.to(torch.int64)
                pieces.append(_Piece(ids[a], index, 0 if start is None else start, at, b - a))
        return pieces
