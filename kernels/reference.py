"""Plain-torch gather/scatter (``index_select`` / ``index_copy_``).

The oracle of the kernel tests (a KV buffer in CPU memory offloads and loads through
:mod:`aiokv.kernels.hostcopy`, a few calls a launch group; its offloads come here only where the
pool's pages overlap). Works across devices (GPU KV buffer, CPU pages): data crosses with
``Tensor.to``, synchronously.
"""

from __future__ import annotations

import torch

from aiokv.layout import KVBuffer

from .checks import (
    PageIds,
    check_gather_counts,
    check_layers,
    check_page_ids,
    check_pages,
    check_scatter_counts,
    check_slots,
)
from .segments import segments

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

CHUNK_BYTES = 2 << 20
"""Bytes of one layer's rows that one ``index_select`` gathers at most (whole pages, at least one).
A launch group of many large pages gathered at once made temporaries past glibc's largest mmap
threshold (32 MiB): fresh pages, faulted in on every copy (a CPU pool hit of 39 pages of 2 MiB in
two groups took 3.5x the time it took in 20; ``tools/bench_launch.py``). Chunks this size stay in
the allocator's heap and in cache."""


def _pages_per_chunk(tokens: int, width: int, element_size: int) -> int:
    return max(1, CHUNK_BYTES // (tokens * width * element_size))


def _as_int(t: torch.Tensor) -> torch.Tensor:
    """Same-size integer view: copies stay bit-exact and float8 needs no index kernels of its own."""
    return t.view(_SAME_SIZE_INT[t.element_size()])


def _run_start(index: torch.Tensor) -> int | None:
    """First slot when a CPU ``index`` is one ascending run of consecutive slots, else None.

    Engines often hand out consecutive slots; a slice copy then replaces an index_select or
    index_copy_ (several times faster on the CPU). CUDA indices are not inspected (that would sync).
    """
    n = index.numel()
    if n == 0 or index.is_cuda:
        return None
    first = int(index[0])
    if int(index[-1]) - first != n - 1 or (n > 1 and not bool((index[1:] - index[:-1] == 1).all())):
        return None
    return first


def _token_rows(pages: torch.Tensor) -> torch.Tensor:
    """``[N, L, T, rows * D]`` integer view of the pages (a view, never a copy: writes must land)."""
    n, layers, tokens, rows, dim = pages.shape
    return _as_int(pages).view(n, layers, tokens, rows * dim)


def reference_gather(
    kv: KVBuffer, slots: torch.Tensor, pages: torch.Tensor, page_ids: PageIds | None = None,
    checked: bool = False,
) -> None:
    """KV of ``slots`` -> ``pages[page_ids[i]]`` gets ``slots[i*T:(i+1)*T]``, every layer.

    ``pages``: ``[N, L, T, rows, D]`` of the layout dtype, any device. ``page_ids`` None means
    ``0..P-1``. Only this rank's rows are written; a non-writer rank (TP replica) writes nothing.
    ``checked``: the caller checked the slots (range, duplicates) already. Raises ``ValueError``
    naming the offending argument.
    """
    check_pages(kv, pages)
    if not checked:
        check_slots(kv, slots)
    count = check_gather_counts(kv, slots, None if page_ids is None else len(page_ids))
    ids = list(range(count)) if page_ids is None else check_page_ids(page_ids, pages.shape[0])
    if not kv.tp.writer:
        return
    tokens = kv.layout.page_tokens
    index = slots.to(device=kv.device, dtype=torch.int64)
    dst_index = torch.tensor(ids, dtype=torch.int64, device=pages.device)
    rows = _token_rows(pages)
    start = _run_start(index)
    for seg in segments(kv):
        for layer, tensor in enumerate(seg.layers):
            flat = _as_int(tensor).reshape(tensor.shape[0], -1)
            # index_select takes whole rows of the buffer (every segment's columns), then slices.
            chunk = _pages_per_chunk(tokens, flat.shape[1] if start is None else seg.width, flat.element_size())
            dst = rows[:, layer, :, seg.page_col : seg.page_col + seg.width]
            for lo in range(0, count, chunk):
                hi = min(count, lo + chunk)
                # One run of consecutive slots is a slice: no index_select copy.
                picked = (flat.index_select(0, index[lo * tokens : hi * tokens]) if start is None
                          else flat[start + lo * tokens : start + hi * tokens])
                picked = picked[:, seg.kv_col : seg.kv_col + seg.width].reshape(hi - lo, tokens, seg.width)
                if hi - lo == 1:
                    dst[ids[lo]].copy_(picked[0])
                else:
                    dst.index_copy_(0, dst_index[lo:hi], picked.to(pages.device))


def reference_scatter(
    kv: KVBuffer,
    pages: torch.Tensor,
    slots: torch.Tensor,
    page_ids: PageIds | None = None,
    skip_first: int = 0,
    layers: range | None = None,
    checked: bool = False,
) -> None:
    """Tokens ``[skip_first, P*T)`` of the concatenated ``pages[page_ids]`` -> KV ``slots``.

    ``len(slots) == P*T - skip_first``; ``page_ids`` None means ``0..P-1`` where P follows from the
    slot count; ``layers`` a step-1 range of layers to copy (None: all). Every rank reads its own
    rows. ``checked``: the caller checked the slots (range, duplicates) already. Raises
    ``ValueError`` naming the offending argument.
    """
    wanted = check_layers(kv, layers)
    check_pages(kv, pages)
    if not checked:
        check_slots(kv, slots)
    tokens = kv.layout.page_tokens
    if page_ids is None:
        count = -(-(slots.numel() + skip_first) // tokens)
        ids = list(range(count))
    else:
        ids = check_page_ids(page_ids, pages.shape[0])
        count = len(ids)
    check_scatter_counts(kv, slots, count, skip_first)
    index = slots.to(device=kv.device, dtype=torch.int64)
    src_index = torch.tensor(ids, dtype=torch.int64, device=pages.device)
    rows = _token_rows(pages)
    start = _run_start(index)
    for seg in segments(kv):
        chunk = _pages_per_chunk(tokens, seg.width, pages.element_size())
        for layer, tensor in enumerate(seg.layers):
            if wanted is not None and layer not in wanted:
                continue
            src = rows[:, layer, :, seg.page_col : seg.page_col + seg.width]
            dst = _as_int(tensor).view(tensor.shape[0], -1)[:, seg.kv_col : seg.kv_col + seg.width]
            for lo in range(0, count, chunk):
                hi = min(count, lo + chunk)
                if hi - lo == 1:  # one page: a view of it, no index_select copy
                    picked = src[ids[lo]]
                else:
                    picked = src.index_select(0, src_index[lo:hi]).reshape((hi - lo) * tokens, seg.width)
                # Tokens [skip_first, ...) of the pages: slot positions [a, b) of this chunk.
                a, b = max(0, lo * tokens - skip_first), hi * tokens - skip_first
                picked = picked[skip_first:] if lo == 0 else picked
                if start is not None:  # one run of consecutive slots: a slice copy
                    dst[start + a : start + b].copy_(picked)
                else:
                    dst.index_copy_(0, index[a:b], picked.to(kv.device))
