"""gather/scatter bit for bit: Triton kernels against the torch reference and against the source data.

Runs on the GPU when there is one, else on CPU tensors under the Triton interpreter (small shapes).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from kvcase import (
    ALL_DTYPES,
    DEVICE,
    POISON,
    distinct_slots,
    empty_like_kv,
    full_kv,
    kv_equal,
    kv_rows,
    kv_snapshot,
    page_tokens_rows,
    poisoned_pages,
    random_bits,
    rank_kv,
    rank_rows,
    same_bits,
    triton_usable,
)

from aiokv.kernels import gather, reference_gather, reference_scatter, scatter
from aiokv.layout import BufferForm, KVBuffer, KVKind, KVLayout, TPSlice

needs_triton = pytest.mark.skipif(not triton_usable(), reason="needs CUDA or TRITON_INTERPRET=1")
FORMS = list(BufferForm)
SHAPES = [(16, 1), (16, 3), (16, 7), (64, 3), (256, 7)]
"""(page tokens, pages per call)."""


def _gather_case(
    layout: KVLayout, form: BufferForm, pages: int, tp: TPSlice, seed: int
) -> tuple[torch.Tensor, KVBuffer, torch.Tensor, list[int], int]:
    gen = torch.Generator().manual_seed(seed)
    tokens = layout.page_tokens
    num_slots = pages * tokens + 37
    full = full_kv(layout, num_slots, gen)
    kv = rank_kv(layout, full, form, tp)
    slots = distinct_slots(pages * tokens, num_slots, gen)
    total = pages + 2
    page_ids = torch.randperm(total, generator=gen)[:pages].tolist()
    return full, kv, slots, page_ids, total


def _assert_pages(
    layout: KVLayout,
    got: torch.Tensor,
    full: torch.Tensor,
    slots: torch.Tensor,
    page_ids: list[int],
    tp: TPSlice,
) -> None:
    """Pages ``page_ids`` hold the rank's rows of ``full[:, slots]``; every other byte is still poison."""
    want = rank_rows(layout, full.view(torch.uint8)[:, slots], tp)
    have = page_tokens_rows(got, page_ids)
    assert torch.equal(rank_rows(layout, have, tp), want)
    poison = got.view(torch.uint8).cpu().clone()
    mask = torch.zeros_like(poison, dtype=torch.bool)
    rows = mask[page_ids]
    if layout.kind is KVKind.MLA:
        rows[...] = True
    else:
        heads, lo, hi = layout.num_kv_heads, tp.head_start, tp.head_start + tp.local_heads
        rows[:, :, :, lo:hi] = True
        rows[:, :, :, heads + lo : heads + hi] = True
    mask[page_ids] = rows
    assert bool((poison[~mask] == POISON).all()), "bytes outside the rank's rows of the named pages changed"


@needs_triton
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.value)
def test_gather_bit_exact_every_dtype_and_form(dtype: torch.dtype, form: BufferForm) -> None:
    for index, (tokens, pages) in enumerate(SHAPES):
        layout = KVLayout.mha(2, 2, 8, dtype, page_tokens=tokens)
        tp = TPSlice.of(layout)
        full, kv, slots, page_ids, total = _gather_case(layout, form, pages, tp, seed=index)
        before = kv_snapshot(kv)
        got = poisoned_pages(layout, total)
        gather(kv, slots, got, page_ids)
        want = poisoned_pages(layout, total)
        reference_gather(kv, slots, want, page_ids)
        assert same_bits(got, want)
        _assert_pages(layout, got, full, slots, page_ids, tp)
        assert kv_equal(kv, before), "gather changed its source"


@needs_triton
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.value)
def test_scatter_bit_exact_every_dtype_and_form(dtype: torch.dtype, form: BufferForm) -> None:
    for index, ((tokens, pages), skip) in enumerate(zip(SHAPES, itertools.cycle([0, 5, 1, 0, 255]), strict=False)):
        skip %= tokens
        layout = KVLayout.mha(2, 2, 8, dtype, page_tokens=tokens)
        _check_scatter(layout, form, TPSlice.of(layout), pages, skip, seed=100 + index)


def _check_scatter(layout: KVLayout, form: BufferForm, tp: TPSlice, pages: int, skip: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tokens = layout.page_tokens
    num_slots = pages * tokens + 29
    total = pages + 2
    source = random_bits((total, *layout.page_shape), layout.dtype, gen).to(DEVICE)
    source_before = source.view(torch.uint8).clone()
    page_ids = torch.randperm(total, generator=gen)[:pages].tolist()
    slots = distinct_slots(pages * tokens - skip, num_slots, gen)
    shape_of = rank_kv(layout, full_kv(layout, num_slots, gen), form, tp)

    got = empty_like_kv(shape_of)
    scatter(got, source, slots, page_ids, skip_first=skip)
    want = empty_like_kv(shape_of)
    reference_scatter(want, source, slots, page_ids, skip_first=skip)
    assert kv_equal(got, want)

    rows = kv_rows(got)
    expect = rank_rows(layout, page_tokens_rows(source, page_ids)[:, skip:], tp)
    assert torch.equal(rows[:, slots], expect)
    others = torch.ones(num_slots, dtype=torch.bool)
    others[slots] = False
    assert bool((rows[:, others] == POISON).all()), "scatter wrote slots it was not given"
    assert torch.equal(source.view(torch.uint8), source_before), "scatter changed its source pages"


@needs_triton
@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.value)
@pytest.mark.parametrize("tp_size", [2, 4, 8])
def test_tp_ranks_assemble_pages_and_read_their_slice(form: BufferForm, tp_size: int) -> None:
    layout = KVLayout.mha(2, 4, 8, torch.bfloat16, page_tokens=16)
    gen = torch.Generator().manual_seed(tp_size)
    pages, num_slots = 3, 3 * 16 + 11
    full = full_kv(layout, num_slots, gen)
    slots = distinct_slots(pages * 16, num_slots, gen)
    page_ids = [4, 0, 2]
    got = poisoned_pages(layout, 5)
    writers = 0
    for rank in range(tp_size):
        tp = TPSlice.of(layout, rank, tp_size)
        kv = rank_kv(layout, full, form, tp)
        alone = poisoned_pages(layout, 5)
        gather(kv, slots, alone, page_ids)
        if tp.writer:
            writers += 1
            _assert_pages(layout, alone, full, slots, page_ids, tp)
        else:
            assert bool((alone.view(torch.uint8) == POISON).all()), "a replica that must not write wrote"
        gather(kv, slots, got, page_ids)
    assert writers == min(tp_size, layout.num_kv_heads)
    _assert_pages(layout, got, full, slots, page_ids, TPSlice.of(layout))
    for rank in range(tp_size):
        _check_scatter(layout, form, TPSlice.of(layout, rank, tp_size), pages, skip=3, seed=rank)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("form", [BufferForm.STACKED, BufferForm.PER_LAYER], ids=lambda f: f.value)
def test_mla_written_by_rank_zero_read_by_all(dtype: torch.dtype, form: BufferForm) -> None:
    layout = KVLayout.mla(3, 24, dtype, page_tokens=16)
    for rank in range(2):
        tp = TPSlice.of(layout, rank, 2)
        full, kv, slots, page_ids, total = _gather_case(layout, form, 3, tp, seed=rank)
        got = poisoned_pages(layout, total)
        gather(kv, slots, got, page_ids)
        if rank == 0:
            _assert_pages(layout, got, full, slots, page_ids, tp)
        else:
            assert bool((got.view(torch.uint8) == POISON).all())
        _check_scatter(layout, form, tp, 3, skip=7, seed=rank)


@needs_triton
def test_slot_views_with_odd_alignment_use_narrow_words() -> None:
    # One bf16 element of offset: 2-byte alignment, the launcher must fall back to 2-byte words.
    layout = KVLayout.mha(2, 1, 3, torch.bfloat16, page_tokens=16)
    gen = torch.Generator().manual_seed(5)
    num_slots = 40
    raw = random_bits((2, num_slots * 6 + 1), torch.bfloat16, gen).to(DEVICE)
    stacked = raw[:, 1:].view(2, num_slots, 2, 3)
    kv = KVBuffer.wrap(layout, stacked)
    slots = distinct_slots(32, num_slots, gen)
    got, want = poisoned_pages(layout, 3), poisoned_pages(layout, 3)
    gather(kv, slots, got, [2, 0])
    reference_gather(kv, slots, want, [2, 0])
    assert same_bits(got, want)
    _assert_pages(layout, got, stacked.cpu(), slots, [2, 0], TPSlice.of(layout))


def test_reference_alone_matches_source_for_every_form() -> None:
    # The oracle itself, against the source tensor, on CPU (no Triton involved).
    for form, dtype in itertools.product(FORMS, ALL_DTYPES):
        layout = KVLayout.mha(2, 2, 4, dtype, page_tokens=8)
        tp = TPSlice.of(layout)
        gen = torch.Generator().manual_seed(1)
        full = full_kv(layout, 40, gen)
        kv = rank_kv(layout, full, form, tp, torch.device("cpu"))
        slots = distinct_slots(24, 40, gen)
        pages = poisoned_pages(layout, 4, torch.device("cpu"))
        reference_gather(kv, slots, pages, [3, 1, 0])
        _assert_pages(layout, pages, full, slots, [3, 1, 0], tp)
        back = empty_like_kv(kv)
        reference_scatter(back, pages, slots[2:], [3, 1, 0], skip_first=2)
        assert torch.equal(kv_rows(back)[:, slots[2:]], full.view(torch.uint8)[:, slots[2:]])
