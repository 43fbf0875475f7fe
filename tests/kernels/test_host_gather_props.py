"""CPU offloads by :class:`HostGather` against :func:`reference_gather`, on random geometries.

The buffers are helper-137's (``test_adv_rev137_hostcopy``: every form and style :meth:`KVBuffer.wrap`
lets through, strided, slot-major, uneven, descending, separate storages, K/V in one slot,
overlapping and aliased layers, every dtype, TP slices, MLA). The pool is built here: pages with a
padded page stride in one storage with guard margins, rank-major where drawn, filled with random
bytes (the sentinel). Each case runs the reference and HostGather on copies of the same bytes and
asserts: the same pool bytes, every byte outside this rank's rows of the written pages (guard
margins and padding included) unchanged, the engine buffer unchanged (it is only read). Slots:
runs, runs ending at the buffer's end, descending, spread, one run a page (a block table), with
duplicates (an unchecked caller's: a gather only reads them), strided views, int32 and int64; pool
pages in runs, spread, descending; chunks of one page up to all (the temporaries of spread slots).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvcase import ALL_DTYPES
from test_adv_rev137_hostcopy import STYLES, Geometry, _build, _bytes, _random_storages, geometries, refused_aliasing

from aiokv.kernels import PageMover, reference_gather
from aiokv.kernels import hostcopy as hostcopy_module
from aiokv.kernels.hostcopy import HostGather
from aiokv.layout import BufferForm, KVBuffer, KVKind, KVLayout, TPSlice

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
GUARD = 29
"""Elements of guard margin before and after the pool's pages."""
POOL = 9
"""Pool pages."""
PAD = 3
"""Elements of padding after each page (a page stride longer than the page)."""


def _pool_layout(g: Geometry) -> KVLayout:
    return g.layout.for_tp(g.tp.size) if g.rank_major else g.layout


def _pool(g: Geometry, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's storage (1-D, random bytes) and the ``[POOL, L, T, rows, D]`` pages this rank writes."""
    layout = _pool_layout(g)
    shape = (POOL, *layout.page_shape)
    page = layout.payload_bytes // layout.itemsize
    storage = torch.randint(0, 256, ((2 * GUARD + POOL * (page + PAD)) * layout.itemsize,), dtype=torch.uint8,
                            generator=gen).view(layout.dtype)
    inner = torch.empty(shape[1:]).stride()
    pages = storage.as_strided(shape, (page + PAD, *inner), GUARD)
    return storage, pages[:, g.tp.part] if g.rank_major else pages


def _written(g: Geometry, ids: list[int]) -> torch.Tensor:
    """1 where the offload may write the pool's storage: this rank's rows of pages ``ids``, every
    layer and token (worked out from the TP slice, apart from the code under test)."""
    storage, pages = _pool(g, torch.Generator().manual_seed(0))
    marks = torch.zeros(storage.numel(), dtype=torch.uint8)
    if not g.tp.writer:
        return marks
    view = marks.as_strided(pages.shape, pages.stride(), pages.storage_offset())
    if g.rank_major or g.layout.kind is KVKind.MLA:
        cols = [slice(None)]  # the rank's part (or the replicated latent) is its whole row
    else:
        h, start, heads = g.tp.local_heads, g.tp.head_start, g.layout.num_kv_heads
        cols = [slice(start, start + h), slice(heads + start, heads + start + h)]
    for i in ids:
        for c in cols:
            view[i, :, :, c] = 1
    return marks


@st.composite
def offloads(draw: st.DrawFn, g: Geometry) -> tuple[list[int], torch.Tensor]:
    tokens = g.layout.page_tokens
    count = draw(st.integers(1, min(6, g.slots // tokens)))
    n = count * tokens
    kind = draw(st.sampled_from(["run", "random", "desc", "two_runs"]))
    if kind == "run":
        first = draw(st.integers(0, POOL - count))
        ids = list(range(first, first + count))
    elif kind == "desc":
        first = draw(st.integers(count - 1, POOL - 1))
        ids = list(range(first, first - count, -1))
    elif kind == "two_runs":
        cut = draw(st.integers(0, count))
        ids = list(range(POOL - cut, POOL)) + list(range(count - cut))
    else:
        ids = list(draw(st.permutations(range(POOL)))[:count])
    how = draw(st.sampled_from(["run", "run_end", "desc", "spread", "blocks", "duplicates", "strided"]))
    if how == "run":
        start = draw(st.integers(0, g.slots - n))
        values = list(range(start, start + n))
    elif how == "run_end":
        values = list(range(g.slots - n, g.slots))
    elif how == "desc":
        start = draw(st.integers(n - 1, g.slots - 1))
        values = list(range(start, start - n, -1))
    elif how == "blocks":  # each page's slots one run, the pages' runs apart (a block table)
        blocks = list(draw(st.permutations(range(g.slots // tokens)))[:count])
        values = [b * tokens + t for b in blocks for t in range(tokens)]
    elif how == "duplicates":
        values = [draw(st.integers(0, g.slots - 1)) for _ in range(n)]
    else:
        values = list(draw(st.permutations(range(g.slots)))[:n])
    dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    if how == "strided":
        return ids, torch.tensor([x for v in values for x in (v, -1)], dtype=dtype)[::2]
    return ids, torch.tensor(values, dtype=dtype)


def _case(g: Geometry, ids: list[int], slots: torch.Tensor, seed: int, chunk_bytes: int | None = None) -> None:
    if refused_aliasing(g):
        return
    gen = torch.Generator().manual_seed(seed)
    engine = _random_storages(g, gen)
    before, pages = _pool(g, gen)
    engine_before = _bytes(engine)
    pools = []
    for gather in (True, False):
        storage = before.clone()
        kv = _build(g, engine)
        kv = kv.rank_part() if g.rank_major else kv
        view = storage.as_strided(pages.shape, pages.stride(), pages.storage_offset())
        if gather:
            with mock.patch.object(hostcopy_module, "CHUNK_BYTES", chunk_bytes or hostcopy_module.CHUNK_BYTES):
                host = HostGather(kv, view)
            host.offload(slots, ids)
        else:
            reference_gather(kv, slots, view, ids, True)  # checked: duplicated slots allowed through
        pools.append(storage.view(_INT[storage.element_size()]))
        unread = all(torch.equal(a, b) for a, b in zip(_bytes(engine), engine_before, strict=True))
        assert unread, "the buffer was written"
    got, ref = pools
    untouched = _written(g, ids) == 0
    old = before.view(_INT[before.element_size()])
    assert torch.equal(ref[untouched], old[untouched]), "the reference wrote outside the pages' rows"
    assert torch.equal(got[untouched], old[untouched]), "HostGather wrote outside the pages' rows"
    assert torch.equal(got, ref), "HostGather differs from the reference"


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_host_gather_matches_the_reference_and_writes_only_the_pages(data: st.DataObject) -> None:
    g = data.draw(geometries())
    ids, slots = data.draw(offloads(g))
    page_bytes = _pool_layout(g).payload_bytes
    chunk = data.draw(st.sampled_from([None, 1, page_bytes, 2 * page_bytes + 1]))
    _case(g, ids, slots, data.draw(st.integers(0, 2**31)), chunk)


# -- deterministic corners ------------------------------------------------------------------------


def _g(form: BufferForm, style: str, dtype: torch.dtype, tp: int = 2, rank: int = 1, rank_major: bool = False,
       mla: bool = False) -> Geometry:
    layout = KVLayout.mla(3, 4, dtype, page_tokens=3) if mla else KVLayout.mha(3, 2, 2, dtype, page_tokens=3)
    return Geometry(layout, TPSlice.of(layout, rank, tp), form, style, 20, 1, (0, 3, 1), rank_major)


@pytest.mark.parametrize("form", list(BufferForm), ids=lambda f: f.value)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_corners_every_form_style_and_dtype(form: BufferForm, style: str, dtype: torch.dtype) -> None:
    for g in (_g(form, style, dtype), _g(form, style, dtype, rank_major=True), _g(form, style, dtype, tp=4, rank=3)):
        _case(g, [7, 8], torch.arange(20 - 6, 20), seed=1)  # a run of pages and of slots to the last slot
        _case(g, [8, 0, 4, 2], torch.tensor([19, 18, 17, 0, 1, 2, 9, 3, 12, 6, 7, 8]), seed=2, chunk_bytes=1)
        strided = torch.stack([torch.arange(19, 7, -1), torch.zeros(12, dtype=torch.int64)], 1)[:, 0]
        _case(g, [3, 5, 1, 6], strided, seed=3)  # descending, a strided view
    if form is not BufferForm.SPLIT_KV:
        _case(_g(form, style, dtype, mla=True), [5, 4, 3], torch.arange(2, 11), seed=4)


def test_a_pool_of_overlapping_pages_goes_by_the_reference() -> None:
    # Pages a token row apart: layer 1 of page 1 is layer 0 of page 3. The reference writes layer 0
    # of every page, then layer 1 (page 1's wins); runs of pages copied every layer at once would
    # leave page 3's layer 0 there. Such a pool (no PagePool's) goes by the reference.
    layout = KVLayout.mha(2, 1, 2, torch.float32, page_tokens=2)
    kv = KVBuffer.wrap(layout, list(torch.randn(2, 10, 2, 2, generator=torch.Generator().manual_seed(5))))
    ref, got = torch.zeros(40), torch.zeros(40)
    shape, stride = (4, *layout.page_shape), (4, 8, 4, 2, 1)
    reference_gather(kv, torch.arange(6), ref.as_strided(shape, stride), [0, 1, 3])
    HostGather(kv, got.as_strided(shape, stride)).offload(torch.arange(6), [0, 1, 3])
    assert torch.equal(got, ref), (got != ref).nonzero().flatten().tolist()


def test_the_mover_offloads_through_it_on_the_cpu() -> None:
    g = _g(BufferForm.STACKED, "even", torch.bfloat16, tp=1, rank=0)
    gen = torch.Generator().manual_seed(7)
    engine = _random_storages(g, gen)
    before, pages = _pool(g, gen)
    kv = _build(g, engine)
    slots = torch.tensor([19, 18, 17, 1, 2, 3, 4, 5, 6])
    expected = before.clone()
    reference_gather(kv, slots, expected.as_strided(pages.shape, pages.stride(), pages.storage_offset()), [4, 5, 0])
    storage = before.clone()
    mover = PageMover(kv, storage.as_strided(pages.shape, pages.stride(), pages.storage_offset()))
    with mock.patch.object(hostcopy_module, "reference_gather", side_effect=AssertionError("the reference ran")):
        assert mover.offload(slots, [4, 5, 0]) is None
    assert torch.equal(_bytes([storage])[0], _bytes([expected])[0])
