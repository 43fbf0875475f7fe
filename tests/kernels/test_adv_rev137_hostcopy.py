"""Adversarial review of :class:`HostScatter` (helper-137): random geometries against the reference,
every byte outside the requested slots unchanged, guard regions around every storage untouched.

Each buffer is built by ``as_strided`` views of 1-D storages with guard margins on both sides, in the
geometries :meth:`KVBuffer.wrap` lets through: stacked with padded slot/layer strides, slot-major
(layers interleaved), per-layer lists evenly or unevenly spaced, descending, in separate storages,
split K/V lists interleaved in one slot, TP slices (whole-row and rank-major pools), MLA, every
dtype, partial first pages, layer ranges, slots in runs, descending, spread, near the buffer's end.
The same geometry is built three times: once loaded by the reference, once by HostScatter, once as
a mask of the requested slots' elements (computed independently of both).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvcase import ALL_DTYPES

from aiokv.kernels import PageMover, reference_scatter
from aiokv.kernels.hostcopy import HostScatter
from aiokv.layout import BufferForm, KVBuffer, KVKind, KVLayout, TPSlice

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
GUARD = 37
"""Elements of guard margin before and after every storage's used span."""
STYLES = ["even", "uneven", "descending", "separate", "slot_major", "kv_in_slot", "overlap", "same"]
"""``overlap``: layer tensors of a list overlapping the next one (a step shorter than their span);
``same``: every layer tensor at one address. :meth:`KVBuffer.wrap` refuses those whose tensors share
an element (b0090c6: a load into one layer changed another): :func:`refused_aliasing` checks the
refusal by the places, element by element, and a case whose tensors only interleave runs."""


@dataclass(frozen=True)
class Geometry:
    layout: KVLayout
    tp: TPSlice
    form: BufferForm
    style: str
    slots: int
    slot_pad: int
    gaps: tuple[int, ...]
    rank_major: bool

    @property
    def rows(self) -> int:
        if self.layout.kind is KVKind.MLA:
            return 1
        return self.tp.local_heads if self.form is BufferForm.SPLIT_KV else 2 * self.tp.local_heads

    @property
    def tensors(self) -> int:
        return 2 * self.layout.num_layers if self.form is BufferForm.SPLIT_KV else self.layout.num_layers


def _plan(g: Geometry) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Storage sizes (elements, margins included) and, per layer tensor, (storage, offset, slot stride)."""
    row = g.rows * g.layout.head_dim
    n = g.tensors
    style = g.style
    if g.form is BufferForm.STACKED and style not in ("even", "slot_major", "overlap"):
        style = "even"
    if style == "kv_in_slot" and g.form is not BufferForm.SPLIT_KV:
        style = "slot_major"
    if style == "slot_major" or style == "kv_in_slot":
        # Slot-major: slot s of tensor i at s * stride + i * (row + pad): layers interleave.
        cell = row + g.slot_pad
        stride = n * cell + g.gaps[0]
        if style == "kv_in_slot":  # K then V of one layer side by side, layers apart
            order = [i for layer in range(g.layout.num_layers) for i in (layer, g.layout.num_layers + layer)]
            pos = {t: k for k, t in enumerate(order)}
            places = [(0, GUARD + pos[i] * cell, stride) for i in range(n)]
        else:
            places = [(0, GUARD + i * cell, stride) for i in range(n)]
        return [2 * GUARD + g.slots * stride], places
    stride = row + g.slot_pad
    span = (g.slots - 1) * stride + row
    if style == "separate":
        return [2 * GUARD + span + g.gaps[i % len(g.gaps)] for i in range(n)], [(i, GUARD, stride) for i in range(n)]
    if style in ("overlap", "same"):
        step = 0 if style == "same" else max(1, span * (g.gaps[0] + 1) // 8)
        return [2 * GUARD + (n - 1) * step + span], [(0, GUARD + i * step, stride) for i in range(n)]
    offsets, at = [], GUARD
    for i in range(n):
        offsets.append(at)
        gap = g.gaps[0] if style in ("even", "descending") else g.gaps[i % len(g.gaps)]
        at += span + gap
    if style == "descending":
        offsets = offsets[::-1]
    return [at + GUARD], [(0, off, stride) for off in offsets]


def _build(g: Geometry, storages: list[torch.Tensor]) -> KVBuffer:
    """The buffer of geometry ``g`` over ``storages`` (1-D, of the layout's dtype)."""
    layout, d = g.layout, g.layout.head_dim
    _, places = _plan(g)
    shape = (g.slots, g.rows, d)
    tensors = [storages[s].as_strided(shape, (stride, d, 1), off) for s, off, stride in places]
    if g.form is BufferForm.STACKED:
        (s0, off0, stride0), step = places[0], (places[1][1] - places[0][1]) if len(places) > 1 else 1
        stacked = storages[s0].as_strided((layout.num_layers, *shape), (step, stride0, d, 1), off0)
        return KVBuffer.wrap(layout, stacked, g.tp)
    if g.form is BufferForm.SPLIT_KV:
        half = layout.num_layers
        return KVBuffer.wrap(layout, (tensors[:half], tensors[half:]), g.tp)
    return KVBuffer.wrap(layout, tensors, g.tp)


def refused_aliasing(g: Geometry) -> bool:
    """Whether ``g``'s layer tensors share an element (counted from :func:`_plan`'s places, not from
    the library's check); if so, that :meth:`KVBuffer.wrap` refuses the buffer (a case then has
    nothing to copy: the caller returns)."""
    row = g.rows * g.layout.head_dim
    sizes, places = _plan(g)
    owner: dict[tuple[int, int], int] = {}
    shared = False
    for index, (storage, offset, stride) in enumerate(places):
        for slot in range(g.slots):
            start = offset + slot * stride
            for element in range(start, start + row):
                shared |= owner.setdefault((storage, element), index) != index
    if shared:
        storages = [torch.zeros(n, dtype=g.layout.dtype) for n in sizes]
        with pytest.raises(ValueError, match="share memory"):
            _build(g, storages)
    return shared


def _random_storages(g: Geometry, gen: torch.Generator) -> list[torch.Tensor]:
    sizes, _ = _plan(g)
    size = g.layout.itemsize
    return [torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=gen).view(g.layout.dtype) for n in sizes]


@st.composite
def geometries(draw: st.DrawFn) -> Geometry:
    dtype = draw(st.sampled_from(ALL_DTYPES))
    mla = draw(st.booleans())
    layers = draw(st.integers(1, 3))
    tokens = draw(st.integers(1, 4))
    dim = draw(st.integers(1, 5))
    if mla:
        layout = KVLayout.mla(layers, dim, dtype, page_tokens=tokens)
        size = draw(st.sampled_from([1, 2]))
        form = draw(st.sampled_from([BufferForm.STACKED, BufferForm.PER_LAYER]))
    else:
        heads = draw(st.sampled_from([1, 2, 4]))
        layout = KVLayout.mha(layers, heads, dim, dtype, page_tokens=tokens)
        size = draw(st.sampled_from([s for s in (1, 2, 4, 8) if s % heads == 0 or heads % s == 0]))
        form = draw(st.sampled_from(list(BufferForm)))
    tp = TPSlice.of(layout, draw(st.integers(0, size - 1)), size)
    slots = draw(st.integers(tokens, 40))
    gaps = tuple(draw(st.lists(st.integers(0, 6), min_size=1, max_size=4)))
    return Geometry(layout, tp, form, draw(st.sampled_from(STYLES)), slots, draw(st.integers(0, 3)), gaps,
                    draw(st.booleans()) and layout.for_tp(size).parts > 1)


@st.composite
def loads(draw: st.DrawFn, g: Geometry) -> tuple[list[int], torch.Tensor, int, range | None]:
    tokens = g.layout.page_tokens
    pool = 6
    most = min(4, g.slots // tokens, pool)
    count = draw(st.integers(1, most))
    skip = draw(st.integers(0, tokens - 1))
    n = count * tokens - skip
    kind = draw(st.sampled_from(["ids_run", "ids_random", "ids_desc"]))
    if kind == "ids_run":
        first = draw(st.integers(0, pool - count))
        ids = list(range(first, first + count))
    elif kind == "ids_desc":
        first = draw(st.integers(count - 1, pool - 1))
        ids = list(range(first, first - count, -1))
    else:
        ids = draw(st.permutations(range(pool)))[:count]
    how = draw(st.sampled_from(["run", "run_end", "desc", "spread", "pieces", "strided"]))
    if how == "run":
        start = draw(st.integers(0, g.slots - n))
        values = list(range(start, start + n))
    elif how == "run_end":  # the run ends at the buffer's last slot
        values = list(range(g.slots - n, g.slots))
    elif how == "desc":
        start = draw(st.integers(n - 1, g.slots - 1))
        values = list(range(start, start - n, -1))
    elif how == "pieces":  # runs of consecutive slots, in random order, some of length 1
        perm = draw(st.permutations(range(g.slots)))
        cut = sorted(perm[: max(1, n // 3)])
        values = []
        for c in cut:
            values.extend(v for v in range(c, min(g.slots, c + draw(st.integers(1, 4)))) if v not in values)
        values.extend(v for v in perm if v not in values)
        values = values[:n]
    else:
        values = list(draw(st.permutations(range(g.slots)))[:n])
    dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    if how == "strided":
        slots = torch.tensor([x for v in values for x in (v, -1)], dtype=dtype)[::2]
    else:
        slots = torch.tensor(values, dtype=dtype)
    layers = None
    if draw(st.booleans()):
        lo = draw(st.integers(0, g.layout.num_layers - 1))
        layers = range(lo, draw(st.integers(lo + 1, g.layout.num_layers)))
    return ids, slots, skip, layers


def _pool(g: Geometry, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random pool pages (padded page stride) and the pages this rank's buffer is loaded from."""
    layout = g.layout.for_tp(g.tp.size) if g.rank_major else g.layout
    size = layout.itemsize
    page = layout.page_bytes // size + 5
    raw = torch.randint(0, 256, (6, page * size), dtype=torch.uint8, generator=gen).view(layout.dtype)
    pages = raw[:, : layout.payload_bytes // size].view(6, *layout.page_shape)
    return pages, pages[:, g.tp.part] if g.rank_major else pages


def _bytes(storages: list[torch.Tensor]) -> list[torch.Tensor]:
    return [s.view(_INT[s.element_size()]).clone() for s in storages]


def _mask(g: Geometry, slots: torch.Tensor, layers: range | None) -> list[torch.Tensor]:
    """True where the load may write: every element of the requested slots of the requested layers."""
    sizes, _ = _plan(g)
    marks = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    layout = g.layout
    wanted = range(layout.num_layers) if layers is None else layers
    _, places = _plan(g)
    index = slots.to(torch.int64)
    row = g.rows * layout.head_dim
    for i, (s, off, stride) in enumerate(places):
        if i % layout.num_layers not in wanted:
            continue
        view = marks[s].as_strided((g.slots, row), (stride, 1), off)
        view[index] = 1
    return marks


def _case(g: Geometry, ids: list[int], slots: torch.Tensor, skip: int, layers: range | None, seed: int) -> None:
    if refused_aliasing(g):
        return
    gen = torch.Generator().manual_seed(seed)
    before = _random_storages(g, gen)
    full_pages, pages = _pool(g, gen)
    ref_st = [s.clone() for s in before]
    got_st = [s.clone() for s in before]
    ref_kv, got_kv = _build(g, ref_st), _build(g, got_st)
    if g.rank_major:
        ref_kv, got_kv = ref_kv.rank_part(), got_kv.rank_part()
    pool_before = full_pages.view(_INT[full_pages.element_size()]).clone()
    reference_scatter(ref_kv, pages, slots, ids, skip, layers)
    HostScatter(got_kv, pages).load(ids, slots, skip, layers)
    assert torch.equal(full_pages.view(_INT[full_pages.element_size()]), pool_before), "the pool was written"
    mask = _mask(g, slots, layers)
    for b, r, h, m in zip(_bytes(before), _bytes(ref_st), _bytes(got_st), mask, strict=True):
        outside = m == 0
        assert torch.equal(h[outside], b[outside]), "HostScatter wrote outside the requested slots"
        assert torch.equal(r[outside], b[outside]), "the reference wrote outside the requested slots"
        assert torch.equal(h, r), "HostScatter differs from the reference"


@settings(max_examples=350, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_host_scatter_matches_the_reference_and_writes_only_the_slots(data: st.DataObject) -> None:
    g = data.draw(geometries())
    ids, slots, skip, layers = data.draw(loads(g))
    _case(g, ids, slots, skip, layers, seed=data.draw(st.integers(0, 2**31)))


# -- deterministic corners ------------------------------------------------------------------------


def _g(form: BufferForm, style: str, dtype: torch.dtype = torch.float16, slots: int = 12, tp: int = 1,
       rank: int = 0, heads: int = 2, mla: bool = False, tokens: int = 3, layers: int = 3) -> Geometry:
    layout = (KVLayout.mla(layers, 4, dtype, page_tokens=tokens) if mla
              else KVLayout.mha(layers, heads, 2, dtype, page_tokens=tokens))
    return Geometry(layout, TPSlice.of(layout, rank, tp), form, style, slots, 1, (0, 3, 1), False)


@pytest.mark.parametrize("form", list(BufferForm), ids=lambda f: f.value)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_corners_every_form_style_and_dtype(form: BufferForm, style: str, dtype: torch.dtype) -> None:
    g = _g(form, style, dtype, tp=2, rank=1)
    # A run ending at the last slot, across two pages, a partial first page; one layer; spread.
    _case(g, [4, 5], torch.arange(12 - 5, 12), 1, None, seed=1)
    _case(g, [0, 3, 5], torch.tensor([11, 10, 9, 0, 1, 2, 7, 3, 8]), 0, range(1, 3), seed=2)
    _case(g, [2], torch.tensor([11]), 2, range(2, 3), seed=3)


def test_the_mover_loads_a_strided_buffer_in_the_middle_of_a_storage() -> None:
    # Through the public edge (PageMover.load / load_layers, unchecked slots), guard margins kept.
    g = _g(BufferForm.STACKED, "even", torch.bfloat16, slots=20, tokens=4)
    gen = torch.Generator().manual_seed(7)
    before = _random_storages(g, gen)
    _, pages = _pool(g, gen)
    for layered in (False, True):
        ref_st, got_st = [s.clone() for s in before], [s.clone() for s in before]
        ref_kv, got_kv = _build(g, ref_st), _build(g, got_st)
        slots = torch.tensor([19, 18, 17, 16, 1, 2, 3, 4, 5, 6, 7])
        reference_scatter(ref_kv, pages, slots, [1, 2, 3], 1)
        mover = PageMover(got_kv, pages)
        if layered:
            mover.load_layers([1, 2, 3], slots, 1)
        else:
            mover.load([1, 2, 3], slots, 1)
        assert all(torch.equal(a, b) for a, b in zip(_bytes(ref_st), _bytes(got_st), strict=True))


def test_the_aliased_buffers_review_137_copied_by_the_reference_are_refused_now() -> None:
    # Review 137 made HostScatter copy these as the reference does (layer by layer, the last layer
    # wins): layers one element apart (list, and stacked with a layer stride of 1), and split K/V
    # whose V of slot s is K of slot s + 1. Since b0090c6 KVBuffer.wrap refuses a buffer whose
    # layers (or K and V) share memory: a load into one layer changed another.
    layout = KVLayout.mha(2, 1, 4, torch.float32, page_tokens=2)
    store = torch.zeros(81)
    with pytest.raises(ValueError, match="layer tensors 0 and 1 share memory"):
        KVBuffer.wrap(layout, [store[i : i + 80].view(10, 2, 4) for i in range(2)])
    with pytest.raises(ValueError, match="layers 0 and 1 of the KV buffer share memory"):
        KVBuffer.wrap(layout, store.as_strided((2, 10, 2, 4), (1, 8, 4, 1)))
    one = KVLayout.mha(1, 1, 4, torch.float32, page_tokens=2)
    with pytest.raises(ValueError, match="K of layer 0 and V of layer 0 share memory"):
        KVBuffer.wrap(one, ([store[0:40].view(10, 1, 4)], [store[4:44].view(10, 1, 4)]))
