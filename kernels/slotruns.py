"""Offload by the copy engine alone: a page whose slots are one ascending run is one 2-D memcpy.

When a page's ``T`` slots are ``s, s+1, ..., s+T-1`` and a KV slot is exactly the page's token row
(the segment covers the whole row on both sides), layer ``l`` of the page is one contiguous block on
both sides: ``T`` slots from ``s`` in the KV buffer, ``T`` token rows in the page. With the layers
evenly spaced (a stacked buffer; a per-layer list allocated in one piece), the whole page is one
``cudaMemcpy2DAsync``: ``L`` rows of ``T * row`` bytes, source pitch the KV layer stride,
destination pitch the page's. No kernel, no staging, no index upload: nothing competes for the SMs
(two rank processes sharing a GPU time-slice the SMs between their contexts, not PCIe).

:func:`run_geometry` says once per mover whether the buffer has that shape; :func:`page_run_starts`
says per call whether every page's slots are a run; :func:`run_copies` makes the copies.

Loads copy the other way (:func:`load_run_starts`): layer-wise, one copy per layer of a run of pages
(:func:`load_copies`); whole pages, either that for every layer or one copy per page as above
(:func:`whole_load_copies`, the fewer copies).

Pitches (``cudaMemcpy2DAsync`` refuses either over :data:`MAX_PITCH`): a whole page as one copy
steps from layer to layer by a pitch, the KV layer step on the KV side (an offload's source, a
load's destination) and the page's layer stride on the pool side; a copy of one layer steps from page
to page by the pool's page stride and the block, and from layer to layer by address. So a KV buffer
whose layers are over 2 GiB apart still loads by runs, by layer.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from aiokv.layout import KVBuffer

from .segments import segments


@dataclass(frozen=True)
class RunCopy:
    """``height`` rows of ``width`` bytes: row i from ``src + i * spitch`` to ``dst + i * dpitch``."""

    dst: int
    dpitch: int
    src: int
    spitch: int
    width: int
    height: int


@dataclass(frozen=True)
class RunSegment:
    """One segment's part of every page run copy (addresses and strides in bytes)."""

    kv_base: int
    """Address of slot 0 of layer 0 (at the segment's KV column)."""
    slot_bytes: int
    """KV slot stride: slot ``s`` starts ``s * slot_bytes`` after slot 0."""
    layer_step: int
    """KV bytes from one layer's tensor to the next (the same for every layer)."""
    page_col: int
    """Byte offset of the segment in a page's token row."""
    block: int
    """Bytes of one layer of one page: ``T`` token rows."""


MAX_PITCH = 2**31 - 1
"""Largest pitch ``cudaMemcpy2DAsync`` takes (``cudaDevAttrMaxPitch`` on every NVIDIA GPU so far), for
the source and the destination alike: a KV layer step beyond it (a rank's layer over 2 GiB) offloads
by gathering and loads by layer (module docstring)."""


@dataclass(frozen=True)
class RunGeometry:
    """What a mover needs to copy page runs of one KV buffer to one page tensor."""

    segments: tuple[RunSegment, ...]
    page_base: int
    page_stride: int
    """Bytes from page ``n`` to page ``n + 1`` of the page tensor."""
    layer_stride: int
    """Bytes from one layer to the next inside a page."""
    layers: int

    @property
    def layer_pitch_fits(self) -> bool:
        """A whole page can be one copy: the KV layer steps and the page's layer stride, its pitches,
        are within :data:`MAX_PITCH`."""
        return self.layer_stride <= MAX_PITCH and all(seg.layer_step <= MAX_PITCH for seg in self.segments)


def run_geometry(kv: KVBuffer, pages: torch.Tensor, *, layer_pitch: bool = True) -> RunGeometry | None:
    """The run copies' geometry of ``kv`` against ``pages`` (``[N, L, T, rows, D]``, checked by the
    mover), or None where a page's layer is not one block on both sides or the layers are not
    evenly spaced (the mover then gathers).

    ``layer_pitch``: the copies take a whole page at once (offloads), so the layers' distances are
    pitches: None too where one is over :data:`MAX_PITCH` (the runtime refuses it with
    ``cudaErrorInvalidPitchValue``). False for loads, which check
    :attr:`RunGeometry.layer_pitch_fits` themselves (they can copy layer by layer)."""
    layout = kv.layout
    itemsize = layout.itemsize
    row = layout.rows * layout.head_dim  # elements of a page's token row
    if pages.stride(2) != row or layout.num_layers < 1:
        return None
    parts = []
    for seg in segments(kv):
        first = seg.layers[0]
        slot = first.stride(0)
        # The segment must be the whole KV slot and the whole page row: T slots, T rows, one block.
        if seg.kv_col != 0 or seg.width != slot or seg.width != row:
            return None
        if any(t.stride(0) != slot for t in seg.layers):
            return None
        step = seg.layers[1].data_ptr() - first.data_ptr() if len(seg.layers) > 1 else 0
        if any(t.data_ptr() != first.data_ptr() + i * step for i, t in enumerate(seg.layers)):
            return None
        block = layout.page_tokens * row * itemsize
        if len(seg.layers) > 1 and step < block:  # a pitch below the row width: overlapping layers
            return None
        parts.append(RunSegment(first.data_ptr(), slot * itemsize, step or block, seg.page_col * itemsize, block))
    geometry = RunGeometry(
        segments=tuple(parts),
        page_base=pages.data_ptr(),
        page_stride=pages.stride(0) * itemsize,
        layer_stride=pages.stride(1) * itemsize,
        layers=layout.num_layers,
    )
    if layer_pitch and not geometry.layer_pitch_fits:
        return None
    return geometry


def page_run_starts(slots: torch.Tensor, count: int, tokens: int) -> list[int] | None:
    """First slot of each of ``count`` pages when every page's ``tokens`` slots are one ascending
    run (``s, s+1, ...``), else None. ``slots``: a checked 1-D CPU integer tensor of
    ``count * tokens`` slots."""
    if slots.is_cuda or slots.numel() != count * tokens:
        return None
    grid = slots.reshape(count, tokens).to(torch.int64)  # reshape: a strided view of the caller's
    first = grid[:, :1]
    if not torch.equal(grid - first, torch.arange(tokens, dtype=torch.int64).expand(count, tokens)):
        return None
    return first.view(-1).tolist()


def run_copies(geometry: RunGeometry, starts: list[int], page_ids: list[int]) -> list[RunCopy]:
    """One 2-D copy per page and segment: page ``page_ids[i]`` gets the run from ``starts[i]``."""
    copies = []
    for start, page in zip(starts, page_ids, strict=True):
        page_at = geometry.page_base + page * geometry.page_stride
        for seg in geometry.segments:
            copies.append(RunCopy(
                dst=page_at + seg.page_col, dpitch=geometry.layer_stride,
                src=seg.kv_base + start * seg.slot_bytes, spitch=seg.layer_step,
                width=seg.block, height=geometry.layers,
            ))
    return copies


def memmove_runs(copies: list[RunCopy]) -> None:
    """Run ``copies`` with the CPU (a KV buffer and pages in host memory: Triton's interpreter)."""
    for c in copies:
        for i in range(c.height):
            ctypes.memmove(c.dst + i * c.dpitch, c.src + i * c.spitch, c.width)


# -- loads ------------------------------------------------------------------------------------------


def load_run_starts(slots: torch.Tensor, count: int, tokens: int, skip_first: int) -> list[int] | None:
    """Slot of each page's first loaded token row when every page's loaded slots are one ascending
    run, else None. A load of ``count`` pages from token ``skip_first`` (``0 <= skip_first < tokens``)
    has ``count * tokens - skip_first`` slots; page 0's run starts at its row ``skip_first``."""
    if slots.is_cuda or count < 1 or not 0 <= skip_first < tokens or slots.numel() != count * tokens - skip_first:
        return None
    flat = slots.reshape(-1).to(torch.int64)
    if skip_first:
        # Page 0's skipped rows as the run's virtual start (never copied): one shape for the check.
        lead = flat[:1] - skip_first + torch.arange(skip_first, dtype=torch.int64)
        flat = torch.cat([lead, flat])
    starts = page_run_starts(flat, count, tokens)
    if starts is not None:
        starts[0] += skip_first
    return starts


@dataclass(frozen=True)
class LayerCopy:
    """One copy of a layer-wise load by runs, at layer 0; layer ``l`` shifts the source by
    ``l * src_step`` and the destination by ``l * dst_step``."""

    copy: RunCopy
    dst_step: int
    src_step: int

    def at(self, layer: int) -> RunCopy:
        c = self.copy
        return RunCopy(c.dst + layer * self.dst_step, c.dpitch, c.src + layer * self.src_step, c.spitch, c.width,
                       c.height)


def load_page_runs(
    starts: list[int], page_ids: list[int], tokens: int, skip_first: int, run_pages: int
) -> list[tuple[int, int]]:
    """``(first page index, count)`` of the pages one 2-D copy loads: consecutive pages whose pool
    pages are consecutive within one registration of ``run_pages`` (one host range per copy) and
    whose slot runs follow each other. A partly needed page 0 (``skip_first``) copies fewer rows:
    it is a run of its own."""
    runs: list[tuple[int, int]] = []
    for i, (start, page) in enumerate(zip(starts, page_ids, strict=True)):
        if runs and not (i == 1 and skip_first):
            first, count = runs[-1]
            last = i - 1
            if (page == page_ids[last] + 1 and page // run_pages == page_ids[first] // run_pages
                    and start == starts[last] + tokens):
                runs[-1] = (first, count + 1)
                continue
        runs.append((i, 1))
    return runs


def load_copies(
    geometry: RunGeometry, starts: list[int], page_ids: list[int], tokens: int, skip_first: int, run_pages: int
) -> list[LayerCopy]:
    """The copies loading one layer of pool pages ``page_ids`` into the KV slot runs from ``starts``
    (:func:`load_run_starts`): per segment, one per :func:`load_page_runs` run, ``height`` pages of
    one block each (source pitch the pool's page stride, destination pitch the block)."""
    return [c for _, copies in _layer_copies_by_run(geometry, starts, page_ids, tokens, skip_first, run_pages)
            for c in copies]


def _layer_copies_by_run(
    geometry: RunGeometry, starts: list[int], page_ids: list[int], tokens: int, skip_first: int, run_pages: int
) -> list[tuple[int, list[LayerCopy]]]:
    """:func:`load_copies` per :func:`load_page_runs` run, in page order, with the run's page count."""
    if geometry.page_stride > MAX_PITCH:
        run_pages = 1  # a pitch the runtime refuses: every page alone (its pitch is then unused)
    runs = []
    for first, count in load_page_runs(starts, page_ids, tokens, skip_first, run_pages):
        skip = skip_first if first == 0 else 0
        copies = []
        for seg in geometry.segments:
            row = seg.block // tokens
            copy = RunCopy(
                dst=seg.kv_base + starts[first] * seg.slot_bytes, dpitch=seg.block,
                src=geometry.page_base + page_ids[first] * geometry.page_stride + seg.page_col + skip * row,
                spitch=geometry.page_stride if count > 1 else seg.block,
                width=seg.block - skip * row, height=count,
            )
            copies.append(LayerCopy(copy, seg.layer_step, geometry.layer_stride))
        runs.append((count, copies))
    return runs


@dataclass(frozen=True)
class PageCopies:
    """Copies that together load ``pages`` consecutive pages of a call, every layer of them."""

    pages: int
    copies: list[RunCopy]


def whole_load_copies(
    geometry: RunGeometry, starts: list[int], page_ids: list[int], tokens: int, skip_first: int, run_pages: int
) -> list[PageCopies]:
    """The copies loading whole pool pages ``page_ids`` into the KV slot runs from ``starts``
    (:func:`load_run_starts`), in page order, in the form with fewer copies (the first on a tie):

    - by page (where :attr:`RunGeometry.layer_pitch_fits`): per page and segment one copy of ``L``
      rows, a block each (source pitch the page's layer stride, destination pitch the KV layer step;
      an offload's copy reversed);
    - by layer: per :func:`load_page_runs` run and segment one copy per layer (:func:`load_copies`).
    """
    by_layer = [PageCopies(count, [c.at(layer) for c in copies for layer in range(geometry.layers)])
                for count, copies in _layer_copies_by_run(geometry, starts, page_ids, tokens, skip_first, run_pages)]
    if not geometry.layer_pitch_fits or sum(len(p.copies) for p in by_layer) < len(page_ids) * len(geometry.segments):
        return by_layer
    by_page = []
    for i, (start, page) in enumerate(zip(starts, page_ids, strict=True)):
        skip = skip_first if i == 0 else 0
        copies = []
        for seg in geometry.segments:
            row = seg.block // tokens
            copies.append(RunCopy(
                dst=seg.kv_base + start * seg.slot_bytes, dpitch=seg.layer_step,
                src=geometry.page_base + page * geometry.page_stride + seg.page_col + skip * row,
                spitch=geometry.layer_stride, width=seg.block - skip * row, height=geometry.layers,
            ))
        by_page.append(PageCopies(1, copies))
    return by_page
