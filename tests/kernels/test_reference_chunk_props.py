"""The CPU copies' chunking (``reference.CHUNK_BYTES``) against a per-token loop, every layout.

Review 128's property: reference_gather / reference_scatter, with chunk sizes from one byte to
1 GiB, give the bytes a plain loop over tokens and rows gives, for MHA and MLA, stacked, per-layer
and split-K/V buffers, TP ranks (replicas write nothing), every dtype, consecutive, reversed and
random slots, any first-page skip and layer range; and no ``index_select`` temporary of more than
one page is larger than ``CHUNK_BYTES`` (a TP rank's slice of a row is two segments: the gather's
temporaries hold whole rows).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvcase import ALL_DTYPES, POISON, bits, empty_like_kv, full_kv, poisoned_pages, random_bits, rank_kv

from aiokv.kernels import reference, reference_gather, reference_scatter
from aiokv.layout import BufferForm, KVBuffer, KVKind, KVLayout, TPSlice

CPU = torch.device("cpu")


def _rank_rows(layout: KVLayout, tp: TPSlice) -> list[int]:
    """The rows of a page (K heads, then V heads) this rank holds."""
    if layout.kind is KVKind.MLA:
        return [0]
    heads, start, local = layout.num_kv_heads, tp.head_start, tp.local_heads
    return [*range(start, start + local), *range(heads + start, heads + start + local)]


def _slots(kind: str, count: int, total: int, gen: torch.Generator) -> torch.Tensor:
    first = (total - count) // 2
    if kind == "run":
        return torch.arange(first, first + count)
    if kind == "reversed":
        return torch.arange(first + count - 1, first - 1, -1)
    return torch.randperm(total, generator=gen)[:count]


@st.composite
def _cases(draw: Callable[..., Any]) -> dict[str, Any]:
    dtype = draw(st.sampled_from(ALL_DTYPES))
    layers, tokens, dim = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(1, 6))
    if draw(st.booleans()):
        layout = KVLayout.mla(layers, dim, dtype, page_tokens=tokens)
        tp_size = draw(st.sampled_from([1, 2]))
        form = draw(st.sampled_from([BufferForm.STACKED, BufferForm.PER_LAYER]))
    else:
        heads = draw(st.sampled_from([1, 2, 4]))
        layout = KVLayout.mha(layers, heads, dim, dtype, page_tokens=tokens)
        tp_size = draw(st.sampled_from([s for s in (1, 2, 4, 8) if (s <= heads and heads % s == 0)
                                        or (s > heads and s % heads == 0)]))
        form = draw(st.sampled_from(list(BufferForm)))
    pages = draw(st.integers(1, 9))
    pool_pages = pages + draw(st.integers(0, 3))
    page_layer = tokens * layout.rows * dim * layout.itemsize
    span = None
    if layers > 1 and draw(st.booleans()):
        low = draw(st.integers(0, layers - 1))
        span = range(low, draw(st.integers(low + 1, layers)))
    return {
        "layout": layout, "form": form, "tp": TPSlice.of(layout, draw(st.integers(0, tp_size - 1)), tp_size),
        "pages": pages, "pool_pages": pool_pages,
        "ids": draw(st.permutations(list(range(pool_pages))))[:pages] if draw(st.booleans()) else None,
        "slots": pages * tokens + draw(st.integers(0, 10)),
        "kind": draw(st.sampled_from(["run", "reversed", "random"])),
        "skip": draw(st.integers(0, tokens - 1)), "layers": span, "seed": draw(st.integers(0, 2**31 - 1)),
        "chunk": draw(st.sampled_from([1, page_layer // 2 or 1, page_layer, 2 * page_layer, 3 * page_layer + 1,
                                       1 << 30])),
    }


def _layer_rows(kv: KVBuffer, layer: int, form: BufferForm, layout: KVLayout, tp: TPSlice, total: int) -> torch.Tensor:
    """Layer ``layer`` of ``kv`` as bytes ``[slots, rows, row bytes]``, K rows then V rows."""
    if layout.kind is KVKind.MLA:
        return bits(kv.k_layers[layer]).view(total, 1, -1)
    if form is BufferForm.SPLIT_KV:
        return torch.cat([bits(kv.k_layers[layer]).view(total, tp.local_heads, -1),
                          bits(kv.v_layers[layer]).view(total, tp.local_heads, -1)], 1)
    return bits(kv.k_layers[layer]).view(total, 2 * tp.local_heads, -1)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_chunked_copies_match_a_loop_over_tokens(case: dict[str, Any]) -> None:
    layout, form, tp = case["layout"], case["form"], case["tp"]
    tokens, total, ids, skip = layout.page_tokens, case["slots"], case["ids"], case["skip"]
    page_ids = ids if ids is not None else list(range(case["pages"]))
    gen = torch.Generator().manual_seed(case["seed"])
    rows = _rank_rows(layout, tp)
    saved, index_select = reference.CHUNK_BYTES, torch.Tensor.index_select
    temporaries: list[tuple[str, int, int]] = []  # (copy, pages in it, bytes)
    phase = ["gather"]

    def counted(self: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        out = index_select(self, dim, index)
        held = out.shape[0] // tokens if phase[0] == "gather" else out.shape[0]  # token rows / pages
        temporaries.append((phase[0], held, out.numel() * out.element_size()))
        return out

    reference.CHUNK_BYTES = case["chunk"]
    torch.Tensor.index_select = counted  # type: ignore[method-assign,assignment]
    try:
        full = full_kv(layout, total, gen)
        kv = rank_kv(layout, full, form, tp, CPU)
        pool = poisoned_pages(layout, case["pool_pages"], CPU)
        before = bits(pool).view(case["pool_pages"], *layout.page_shape, layout.itemsize).clone()
        slots = _slots(case["kind"], case["pages"] * tokens, total, gen)
        reference_gather(kv, slots, pool, ids)
        want = before.clone()
        source = bits(full).view(*full.shape, layout.itemsize)
        if tp.writer:
            for i, slot in enumerate(slots.tolist()):
                for row in rows:
                    want[page_ids[i // tokens], :, i % tokens, row] = source[:, slot, row]
        assert torch.equal(bits(pool).view_as(want), want), "gather"

        phase[0] = "scatter"
        pages = pool.clone() if tp.writer else random_bits(tuple(pool.shape), layout.dtype, gen)
        target = empty_like_kv(kv)
        dest = _slots(case["kind"], case["pages"] * tokens - skip, total, gen)
        reference_scatter(target, pages, dest, ids, skip, case["layers"])
        page_bytes = bits(pages).view(case["pool_pages"], *layout.page_shape, layout.itemsize)
        wanted = range(layout.num_layers) if case["layers"] is None else case["layers"]
        for layer in range(layout.num_layers):
            got = _layer_rows(target, layer, form, layout, tp, total)
            expect = torch.full_like(got, POISON)
            if layer in wanted:
                for j, slot in enumerate(dest.tolist()):
                    i = j + skip
                    expect[slot] = page_bytes[page_ids[i // tokens], layer, i % tokens, rows].reshape(len(rows), -1)
            assert torch.equal(got, expect), f"scatter, layer {layer}"
        for copy, held, size in temporaries:
            assert held <= 1 or size <= case["chunk"], (copy, held, size, case["chunk"])
    finally:
        reference.CHUNK_BYTES = saved
        torch.Tensor.index_select = index_select  # type: ignore[method-assign]


@pytest.mark.parametrize("chunk", [1, 1 << 30])
def test_a_chunked_scatter_starts_at_the_skipped_token(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # One byte a chunk (one page at a time) and one chunk: slot 0 gets token 1 of the first page.
    layout = KVLayout.mha(1, 2, 4, torch.float16, page_tokens=4)
    monkeypatch.setattr(reference, "CHUNK_BYTES", chunk)
    kv = KVBuffer.wrap(layout, torch.zeros(1, 16, 4, 4, dtype=torch.float16))
    pool = torch.arange(2 * 16 * 4, dtype=torch.float16).view(2, 1, 4, 4, 4)
    reference_scatter(kv, pool, torch.arange(7), [0, 1], 1)
    assert torch.equal(kv.k_layers[0][0], pool[0, 0, 1])  # slot 0 holds token 1 of page 0


@pytest.mark.parametrize("slots", [[9, 3, 5, 1, 12, 7, 0, 2], [7, 6, 5, 4, 3, 2, 1, 0]])
def test_a_tp_rank_s_gather_temporaries_hold_whole_rows_within_the_chunk(
        slots: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    # A rank's row in its KV buffer is its K heads then its V heads: two segments of a page, one
    # row of the buffer. Chunks counted by a segment's width made temporaries twice CHUNK_BYTES.
    layout = KVLayout.mha(1, 2, 4, torch.float16, page_tokens=2)
    tp = TPSlice.of(layout, 0, 2)
    kv = rank_kv(layout, full_kv(layout, 16, torch.Generator().manual_seed(0)), BufferForm.STACKED, tp, CPU)
    chunk = layout.page_tokens * layout.rows * layout.head_dim * layout.itemsize  # a page's layer: 4 segment-pages
    monkeypatch.setattr(reference, "CHUNK_BYTES", chunk)
    index_select = torch.Tensor.index_select
    sizes: list[int] = []

    def counted(self: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        out = index_select(self, dim, index)
        sizes.append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(torch.Tensor, "index_select", counted)
    pool = poisoned_pages(layout, 4, CPU)
    reference_gather(kv, torch.tensor(slots), pool, None)
    assert sizes and max(sizes) <= chunk, (sizes, chunk)
