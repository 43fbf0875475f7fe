"""Whole-page loads into a KV buffer in host memory, in a few torch calls per launch group.

:func:`~aiokv.kernels.reference.reference_scatter` copies layer by layer and builds its index tensors
and views on every call: ~28 torch calls for a launch group of a 2-layer buffer, ~4 more per layer,
and each call lets the GIL go (the op, and freeing each temporary tensor). Beside an engine thread
that runs Python, the copy thread then waits up to a switch interval (5 ms) to take it back, many
times a group (``tools/bench_gil.py``: a 39-page pool hit of 64 KiB pages 110-220 ms so, ~1 ms
idle). :class:`HostScatter` works out the buffer's geometry once (every layer of a segment as one
strided view where the layers are evenly spaced, as a stacked ``[L, S, rows, D]`` buffer's are)
and copies a group of pages with one ``copy_`` over all layers per segment, run of pool pages and
run of slots: the pool pages of a run are a view, a run of slots is an ``as_strided`` view of the
buffer, other slots one indexed assignment. Bit-exact: every copy goes through a same-size integer
view, as the reference's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aiokv.layout import KVBuffer

from .reference import CHUNK_BYTES
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


def _stacked(views: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """``views`` (same shape and strides) as one ``[L, ...]`` view, or None where the layers are not
    in one storage at one step apart, or would overlap (a copy into overlapping memory in one call
    is undefined)."""
    first = views[0]
    if len(views) == 1:
        return first.unsqueeze(0)
    storage = first.untyped_storage().data_ptr()
    size = first.element_size()
    step_bytes = views[1].data_ptr() - first.data_ptr()
    if step_bytes <= 0 or step_bytes % size:
        return None
    step = step_bytes // size
    span = 1 + sum((n - 1) * s for n, s in zip(first.shape, first.stride(), strict=True))
    if step < span:
        return None
    for i, view in enumerate(views):
        if (view.untyped_storage().data_ptr() != storage or view.stride() != first.stride()
                or view.shape != first.shape or view.data_ptr() != first.data_ptr() + i * step_bytes):
            return None
    return first.as_strided((len(views), *first.shape), (step, *first.stride()), first.storage_offset())


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
        sides = []
        for seg in segments(kv):
            views = tuple(_as_int(t).view(t.shape[0], -1)[:, seg.kv_col : seg.kv_col + seg.width] for t in seg.layers)
            sides.append(_Side(views, _stacked(views), seg.page_col, seg.width,
                               seg.page_col == 0 and seg.width == rows * dim))
        self._sides = tuple(sides)
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
