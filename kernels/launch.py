"""Typed launch wrappers around the Triton bodies in :mod:`aiokv.kernels._jit`.

:class:`CopyPlan` binds one KV buffer to one page tensor (the pool, or a GPU staging buffer): it
picks the word size, builds the per-layer address tables once, and launches on the current stream.
:func:`gather` and :func:`scatter` are checked one-shot forms of the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from aiokv.layout import KVBuffer

from . import _jit
from .checks import (
    PageIds,
    check_gather_counts,
    check_layers,
    check_page_ids,
    check_pages,
    check_scatter_counts,
    check_slots,
)
from .paths import interpreting
from .segments import Segment, segments

_WORDS: dict[int, torch.dtype] = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_VECTOR_BYTES = 16
_BLOCK_ELEMS = 4096
"""Words one program moves at most: 32 KiB of int64, enough to hide latency, few enough registers."""


def _word_view(tensor: torch.Tensor, word: int) -> torch.Tensor:
    """1-D tensor of ``word``-byte ints starting at ``tensor``'s first element (to the storage's end)."""
    storage = tensor.untyped_storage()
    offset = tensor.data_ptr() - storage.data_ptr()
    count = (storage.nbytes() - offset) // word
    view = torch.empty(0, dtype=_WORDS[word], device=tensor.device)
    return view.set_(storage, offset // word, (count,), (1,))


def _pow2_divisor(value: int, limit: int) -> int:
    """Largest power of two <= ``limit`` that divides ``value`` (``limit`` when value is 0)."""
    best = 1
    while best < limit and value % (best * 2) == 0:
        best *= 2
    return best


@dataclass(frozen=True)
class _SegmentLaunch:
    """Everything one segment's launch needs, in words."""

    kv_base: torch.Tensor
    layer_off: torch.Tensor
    slot_stride: torch.Tensor
    kv_col: int
    page_col: int
    width: int
    vec: int
    block_t: int
    block_w: int


class CopyPlan:
    """Launches gather/scatter between ``kv`` and one page tensor ``pages`` ``[N, L, T, rows, D]``.

    ``pages`` must be reachable by the kernels: on the KV buffer's GPU, or host memory registered
    with CUDA as mapped (the pool), or anything under the Triton interpreter. Launches go on the
    current stream of the KV device; index tensors must already be int64 on that device.
    """

    def __init__(self, kv: KVBuffer, pages: torch.Tensor) -> None:
        check_pages(kv, pages)
        if kv.device.type != "cuda" and not interpreting():
            raise ValueError(
                f"kv is on {kv.device}: Triton kernels need a CUDA KV buffer (or TRITON_INTERPRET=1)"
            )
        if kv.device.type == "cuda" and pages.device.type != "cuda" and not pages.is_pinned():
            raise ValueError("pages must be on the GPU or in pinned, device-mapped host memory")
        self.kv = kv
        self.pages = pages
        self.tokens = kv.layout.page_tokens
        itemsize = kv.layout.itemsize
        segs = segments(kv)
        page_strides = [pages.stride(i) * itemsize for i in range(3)]
        # One word size for the whole plan: the widest that divides every address and offset.
        common = math.gcd(pages.data_ptr(), *page_strides)
        for seg in segs:
            common = math.gcd(common, seg.kv_col * itemsize, seg.page_col * itemsize, seg.width * itemsize)
            for tensor in seg.layers:
                common = math.gcd(common, tensor.data_ptr(), tensor.stride(0) * itemsize)
        self.word = _pow2_divisor(common, 8)
        self.page_words = _word_view(pages, self.word)
        self.page_strides = [s // self.word for s in page_strides]
        self._launches = [self._segment(seg, common) for seg in segs]

    def _segment(self, seg: Segment, common: int) -> _SegmentLaunch:
        word, itemsize = self.word, self.kv.layout.itemsize
        base = min(seg.layers, key=lambda t: t.data_ptr())
        offsets = [(t.data_ptr() - base.data_ptr()) // word for t in seg.layers]
        strides = [t.stride(0) * itemsize // word for t in seg.layers]
        device = self.kv.device
        width = seg.width * itemsize // word
        block_w = min(triton.next_power_of_2(width), _BLOCK_ELEMS)
        return _SegmentLaunch(
            kv_base=_word_view(base, word),
            layer_off=torch.tensor(offsets, dtype=torch.int64, device=device),
            slot_stride=torch.tensor(strides, dtype=torch.int64, device=device),
            kv_col=seg.kv_col * itemsize // word,
            page_col=seg.page_col * itemsize // word,
            width=width,
            vec=_pow2_divisor(common // word, max(1, _VECTOR_BYTES // word)),
            block_t=max(1, min(64, _BLOCK_ELEMS // block_w)),
            block_w=block_w,
        )

    def _grid(self, launch: _SegmentLaunch, n_tokens: int, layers: int | None = None) -> tuple[int, int, int]:
        return (
            triton.cdiv(n_tokens, launch.block_t),
            self.kv.layout.num_layers if layers is None else layers,
            triton.cdiv(launch.width, launch.block_w),
        )

    def gather(self, slots: torch.Tensor, page_ids: torch.Tensor | None) -> None:
        """``slots`` (int64, KV device) -> pages ``page_ids`` (int64 on the KV device; None: 0..P-1).

        Unchecked: callers validated the values. A non-writer rank writes nothing.
        """
        if not self.kv.tp.writer:
            return
        ids = slots if page_ids is None else page_ids
        for launch in self._launches:
            _jit.gather_kernel[self._grid(launch, slots.numel())](
                launch.kv_base,
                launch.layer_off,
                launch.slot_stride,
                slots,
                self.page_words,
                ids,
                slots.numel(),
                launch.kv_col,
                launch.page_col,
                launch.width,
                *self.page_strides,
                T=self.tokens,
                PAGE_IDS=page_ids is not None,
                VEC=launch.vec,
                BLOCK_T=launch.block_t,
                BLOCK_W=launch.block_w,
            )

    def scatter(
        self, page_ids: torch.Tensor | None, slots: torch.Tensor, skip_first: int, layers: range | None = None
    ) -> None:
        """Tokens ``[skip_first, skip_first + len(slots))`` of pages ``page_ids`` -> ``slots``, for
        ``layers`` (a step-1 range; None: all). Unchecked."""
        ids = slots if page_ids is None else page_ids
        first, count = (0, None) if layers is None else (layers.start, len(layers))
        if count == 0:
            return
        for launch in self._launches:
            _jit.scatter_kernel[self._grid(launch, slots.numel(), count)](
                launch.kv_base,
                launch.layer_off,
                launch.slot_stride,
                slots,
                self.page_words,
                ids,
                slots.numel(),
                skip_first,
                first,
                launch.kv_col,
                launch.page_col,
                launch.width,
                *self.page_strides,
                T=self.tokens,
                PAGE_IDS=page_ids is not None,
                VEC=launch.vec,
                BLOCK_T=launch.block_t,
                BLOCK_W=launch.block_w,
            )


def _index(values: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int64).to(device=device, dtype=torch.int64)


def gather(kv: KVBuffer, slots: torch.Tensor, pages: torch.Tensor, page_ids: PageIds | None = None) -> None:
    """Triton gather on the current stream: KV of ``slots`` -> ``pages[page_ids[i]]`` gets ``slots[i*T:(i+1)*T]``.

    ``pages``: ``[N, L, T, rows, D]`` of the layout dtype, on the GPU or pinned + mapped host memory;
    ``page_ids`` None means ``0..P-1``. Only this rank's rows are written; a non-writer TP replica
    writes nothing. Raises ``ValueError`` naming the offending argument.
    """
    plan = CopyPlan(kv, pages)
    check_slots(kv, slots)
    check_gather_counts(kv, slots, None if page_ids is None else len(page_ids))
    ids = None if page_ids is None else _index(check_page_ids(page_ids, pages.shape[0]), kv.device)
    plan.gather(_index(slots, kv.device), ids)


def scatter(
    kv: KVBuffer,
    pages: torch.Tensor,
    slots: torch.Tensor,
    page_ids: PageIds | None = None,
    skip_first: int = 0,
    layers: range | None = None,
) -> None:
    """Triton scatter on the current stream: tokens ``[skip_first, P*T)`` of ``pages[page_ids]`` -> ``slots``.

    ``len(slots) == P*T - skip_first`` with ``0 <= skip_first < T``; ``layers``: a step-1 range of
    layers to copy (None: all). Raises ``ValueError`` naming the offending argument.
    """
    layers = check_layers(kv, layers)
    plan = CopyPlan(kv, pages)
    check_slots(kv, slots)
    tokens = kv.layout.page_tokens
    if page_ids is None:
        count = -(-(slots.numel() + skip_first) // tokens)
        ids = None
    else:
        id_list = check_page_ids(page_ids, pages.shape[0])
        count = len(id_list)
        ids = _index(id_list, kv.device)
    check_scatter_counts(kv, slots, count, skip_first)
    plan.scatter(ids, _index(slots, kv.device), skip_first, layers)
