# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton bodies of the gather/scatter copies. Launch them through :mod:`aiokv.kernels.launch`.

Both kernels move one *segment* of every token row: ``width`` words starting at column ``src_col``
of a KV slot and at column ``dst_col`` of a page's token row (a word is 1, 2, 4 or 8 bytes, chosen
by the launcher so that every offset is whole; the copy is bit-exact whatever the dtype).

The KV side is addressed per layer: ``src_ptr + layer_off[l] + slot * slot_stride[l]``. ``src_ptr``
is the lowest-addressed layer tensor of the segment, so one launch serves a stacked tensor,
per-layer tensors and separate K/V lists alike.

The page side is ``dst_ptr + page * page_stride + l * layer_stride + t * token_stride`` where page
is ``page_ids[i // T]`` (pool pages, direct path) or ``i // T`` itself (a contiguous staging buffer).

Grid: ``(cdiv(tokens, BLOCK_T), L, cdiv(width, BLOCK_W))``.
"""

from __future__ import annotations

import triton
import triton.language as tl

SCATTER_UNSPECIALIZED = ("skip", "first_layer")
"""Scatter arguments Triton must not specialize on their value: by default an int equal to 1 is a
variant of its own (the argument compiled in as a constant) and one divisible by 16 another. Both
vary per call of one plan (a layer-wise load's layers, a load's first token), they buy the kernel
nothing, and a variant per value class is one more binary to compile, load and warm up; and both
wrong-KV sightings on a GPU TP rank (a layer holding another layer's rows, a layer left unwritten)
are what a launch of the ``first_layer == 1`` variant with another layer would write. One variant
for every value removes that exposure whatever its cause (not found: the launch probe saw no launch
of a variant compiled for other values; docs/measurements.md, forty-second session)."""


@triton.jit
def gather_kernel(
    kv_ptr,
    layer_off_ptr,
    slot_stride_ptr,
    slots_ptr,
    page_ptr,
    page_ids_ptr,
    n_tokens,
    kv_col,
    page_col,
    width,
    page_stride,
    layer_stride,
    token_stride,
    T: tl.constexpr,
    PAGE_IDS: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """KV slots ``slots[i]`` -> token ``i`` of the pages (i in [0, n_tokens))."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    layer = tl.program_id(1).to(tl.int64)
    col = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    tmask = tok < n_tokens
    mask = tmask[:, None] & (col < width)[None, :]

    slot = tl.load(slots_ptr + tok, mask=tmask, other=0).to(tl.int64)
    kv_row = tl.load(layer_off_ptr + layer) + slot * tl.load(slot_stride_ptr + layer) + kv_col
    # Every term is a multiple of VEC words (checked by the launcher): lets the compiler vectorise.
    kv_row = tl.multiple_of(kv_row, VEC)

    page = (tok // T).to(tl.int64)
    if PAGE_IDS:
        page = tl.load(page_ids_ptr + page, mask=tmask, other=0).to(tl.int64)
    page_row = page * page_stride + layer * layer_stride + (tok % T).to(tl.int64) * token_stride + page_col
    page_row = tl.multiple_of(page_row, VEC)

    values = tl.load(kv_ptr + kv_row[:, None] + col[None, :], mask=mask)
    tl.store(page_ptr + page_row[:, None] + col[None, :], values, mask=mask)


@triton.jit(do_not_specialize=SCATTER_UNSPECIALIZED)
def scatter_kernel(
    kv_ptr,
    layer_off_ptr,
    slot_stride_ptr,
    slots_ptr,
    page_ptr,
    page_ids_ptr,
    n_tokens,
    skip,
    first_layer,
    kv_col,
    page_col,
    width,
    page_stride,
    layer_stride,
    token_stride,
    T: tl.constexpr,
    PAGE_IDS: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Token ``skip + i`` of the pages -> KV slot ``slots[i]`` (i in [0, n_tokens)), layers
    ``first_layer + program_id(1)`` (a load can run layer by layer)."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    layer = (tl.program_id(1) + first_layer).to(tl.int64)
    col = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    tmask = tok < n_tokens
    mask = tmask[:, None] & (col < width)[None, :]

    slot = tl.load(slots_ptr + tok, mask=tmask, other=0).to(tl.int64)
    kv_row = tl.load(layer_off_ptr + layer) + slot * tl.load(slot_stride_ptr + layer) + kv_col
    kv_row = tl.multiple_of(kv_row, VEC)

    src_tok = tok + skip
    page = (src_tok // T).to(tl.int64)
    if PAGE_IDS:
        page = tl.load(page_ids_ptr + page, mask=tmask, other=0).to(tl.int64)
    page_row = page * page_stride + layer * layer_stride + (src_tok % T).to(tl.int64) * token_stride + page_col
    page_row = tl.multiple_of(page_row, VEC)

    values = tl.load(page_ptr + page_row[:, None] + col[None, :], mask=mask)
    tl.store(kv_ptr + kv_row[:, None] + col[None, :], values, mask=mask)
