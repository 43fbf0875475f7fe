"""CPU loads by :class:`HostScatter`: bit-exact against the reference, and a few torch calls a load.

Every torch call lets the GIL go (the op, and freeing each temporary): beside an engine thread that
runs Python, each can cost the copy thread a switch interval. The reference made ~28 per launch
group of a 2-layer buffer and 4 more per layer; these tests pin the count: one copying call per
segment, run of pool pages and run of slots, whatever the number of layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from kvcase import (
    ALL_DTYPES,
    distinct_slots,
    empty_like_kv,
    full_kv,
    kv_snapshot,
    kv_tensors,
    random_bits,
    rank_kv,
    same_bits,
)
from torch.overrides import TorchFunctionMode

from aiokv.kernels import PageMover, reference_scatter
from aiokv.kernels.hostcopy import HostScatter
from aiokv.layout import BufferForm, KVBuffer, KVLayout, TPSlice

FORMS = [BufferForm.STACKED, BufferForm.PER_LAYER, BufferForm.SPLIT_KV]


class _Calls(TorchFunctionMode):
    """Counts torch calls from Python (functions, methods, indexing) by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def _case(layout: KVLayout, form: BufferForm, tp: TPSlice, slots: int, seed: int) -> tuple[KVBuffer, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kv = rank_kv(layout, full_kv(layout, slots, gen), form, tp, torch.device("cpu"))
    pages = random_bits((11, *layout.page_shape), layout.dtype, gen)
    return kv, pages


def _slots(kind: str, count: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "run":
        return torch.arange(7, 7 + count)
    if kind == "strided":  # a view with a stride: the copy must read the right elements
        return distinct_slots(2 * count, num_slots, gen)[::2]
    return distinct_slots(count, num_slots, gen)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.value)
@pytest.mark.parametrize("kind", ["run", "spread", "strided"])
@pytest.mark.parametrize(("ids", "skip"), [([4], 0), ([4], 3), ([2, 3, 4, 5], 0), ([2, 3, 4, 5], 2),
                                            ([9, 1, 5, 6, 0], 1), ([0, 1, 2, 7, 8, 10, 3], 0)])
def test_load_matches_the_reference(dtype: torch.dtype, form: BufferForm, kind: str, ids: list[int], skip: int
                                    ) -> None:
    layout = KVLayout.mha(3, 2, 8, dtype, page_tokens=5)
    kv, pages = _case(layout, form, TPSlice.of(layout), 83, seed=len(ids) * 7 + skip)
    gen = torch.Generator().manual_seed(3)
    slots = _slots(kind, len(ids) * 5 - skip, kv.num_slots, gen)
    expected, got = empty_like_kv(kv), empty_like_kv(kv)
    source = pages.clone()
    reference_scatter(expected, pages, slots, ids, skip, None, True)
    HostScatter(got, pages).load(ids, slots, skip)
    assert all(same_bits(a, b) for a, b in zip(kv_tensors(got), kv_tensors(expected), strict=True))
    assert same_bits(pages, source)  # the pool is only read


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.value)
@pytest.mark.parametrize("layers", [range(0, 1), range(1, 3), range(2, 3)], ids=str)
def test_load_of_some_layers_matches_the_reference(form: BufferForm, layers: range) -> None:
    layout = KVLayout.mha(3, 2, 8, torch.bfloat16, page_tokens=5)
    kv, pages = _case(layout, form, TPSlice.of(layout), 40, seed=5)
    slots = distinct_slots(3 * 5 - 2, kv.num_slots, torch.Generator().manual_seed(1))
    expected, got = empty_like_kv(kv), empty_like_kv(kv)
    reference_scatter(expected, pages, slots, [6, 7, 2], 2, layers, True)
    HostScatter(got, pages).load([6, 7, 2], slots, 2, layers)
    assert all(same_bits(a, b) for a, b in zip(kv_tensors(got), kv_tensors(expected), strict=True))


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.value)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_tp_rank_and_mla_copy_only_their_rows(form: BufferForm, rank: int) -> None:
    mha, mla = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4), KVLayout.mla(2, 16, torch.float16, page_tokens=4)
    for layout in [mha, mla] if form is not BufferForm.SPLIT_KV else [mha]:  # MLA has no V
        tp = TPSlice.of(layout, rank, 2)
        kv, pages = _case(layout, form, tp, 30, seed=rank)
        slots = distinct_slots(3 * 4, kv.num_slots, torch.Generator().manual_seed(rank))
        expected, got = empty_like_kv(kv), empty_like_kv(kv)
        reference_scatter(expected, pages, slots, [3, 8, 9], 0, None, True)
        HostScatter(got, pages).load([3, 8, 9], slots, 0)
        assert all(same_bits(a, b) for a, b in zip(kv_tensors(got), kv_tensors(expected), strict=True))


@pytest.mark.parametrize("num_layers", [2, 32])
@pytest.mark.parametrize("kind", ["run", "spread"])
def test_a_launch_group_is_one_copying_call_whatever_the_layers(num_layers: int, kind: str) -> None:
    # A stacked buffer, pool pages in one run: one copy_ (run of slots) or one indexed assignment
    # (spread slots) for the group, and a handful of views. The reference made 2 copying calls per
    # layer (index_select and copy_) and ~28 calls for 2 layers; at 32 layers ~150.
    layout = KVLayout.mha(num_layers, 2, 8, torch.float16, page_tokens=4)
    kv, pages = _case(layout, BufferForm.STACKED, TPSlice.of(layout), 64, seed=num_layers)
    slots = torch.arange(10, 10 + 6 * 4) if kind == "run" else distinct_slots(6 * 4, 64, torch.Generator())
    host = HostScatter(kv, pages)
    with _Calls() as calls:
        host.load([3, 4, 5, 6, 7, 8], slots, 0)
    copying = [n for n in calls.names if n in ("copy_", "__setitem__", "index_select", "index_copy_", "index_put_")]
    assert copying == (["copy_"] if kind == "run" else ["__setitem__"]), calls.names
    assert len(calls.names) <= 10, calls.names  # views and attributes: tolist, slices, shape, stride, ...
    with _Calls() as ref:
        reference_scatter(empty_like_kv(kv), pages, slots, [3, 4, 5, 6, 7, 8], 0, None, True)
    assert len(ref.names) >= 4 * num_layers  # what the mover no longer does on the CPU


def test_the_mover_loads_through_it_on_the_cpu() -> None:
    layout = KVLayout.mha(4, 2, 8, torch.float16, page_tokens=4)
    kv, pages = _case(layout, BufferForm.STACKED, TPSlice.of(layout), 64, seed=2)
    mover = PageMover(kv, pages)
    before = kv_snapshot(kv)
    expected = empty_like_kv(kv)
    for t, b in zip(kv_tensors(expected), before, strict=True):
        t.view(torch.uint8).copy_(b)
    slots = torch.arange(20, 20 + 4 * 4 - 1)
    reference_scatter(expected, pages, slots, [1, 2, 3, 4], 1, None, True)
    with _Calls() as calls:
        assert mover.load([1, 2, 3, 4], slots, 1, checked=True) is None
    assert "index_select" not in calls.names and calls.names.count("copy_") == 2, calls.names  # head page, rest
    assert all(same_bits(a, b) for a, b in zip(kv_tensors(kv), kv_tensors(expected), strict=True))
