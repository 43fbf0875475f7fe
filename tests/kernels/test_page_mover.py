"""PageMover over a real PagePool: every path, chunking over the staging lanes, checks before launch."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from kvcase import (
    DEVICE,
    POISON,
    distinct_slots,
    empty_like_kv,
    full_kv,
    kv_equal,
    kv_rows,
    page_tokens_rows,
    poisoned_pages,
    poisoned_pool,
    rank_kv,
    rank_rows,
    triton_usable,
)

from aiokv.kernels import PageMover, TransferPath, gather, reference_gather, reference_scatter, scatter
from aiokv.layout import BufferForm, KVBuffer, KVLayout, TPSlice
from aiokv.pool import PagePool

LAYOUT = KVLayout.mha(2, 2, 8, torch.bfloat16, page_tokens=16)
PATHS = [TransferPath.REFERENCE] + ([TransferPath.STAGING, TransferPath.DIRECT] if triton_usable() else [])


@pytest.fixture
def pool() -> Iterator[PagePool]:
    with poisoned_pool(LAYOUT, 12) as pool:
        yield pool


def _finish(event: torch.cuda.Event | None) -> None:
    if DEVICE.type == "cuda":
        assert event is not None
        event.synchronize()
    else:
        assert event is None


# staging_pages only shapes the staging path: 1 (one lane), 2 (two lanes of one page), 3 (lanes of 2 and 1).
ROUND_TRIPS = [(path, 2) for path in PATHS] + [(TransferPath.STAGING, n) for n in (1, 3) if triton_usable()]


@pytest.mark.parametrize(("path", "staging_pages"), ROUND_TRIPS, ids=lambda v: getattr(v, "value", str(v)))
@pytest.mark.parametrize("form", [BufferForm.STACKED, BufferForm.SPLIT_KV], ids=lambda f: f.value)
def test_offload_then_load_round_trip(pool: PagePool, path: TransferPath, staging_pages: int, form: BufferForm) -> None:
    gen = torch.Generator().manual_seed(staging_pages)
    num_slots = 7 * 16 + 21
    full = full_kv(LAYOUT, num_slots, gen)
    kv = rank_kv(LAYOUT, full, form, TPSlice.of(LAYOUT))
    mover = PageMover(kv, pool.pages, path, staging_pages)
    assert mover.effective_path is path
    slots = distinct_slots(7 * 16, num_slots, gen)
    page_ids = [9, 2, 5, 0, 11, 3, 7]
    _finish(mover.offload(slots, page_ids))
    assert torch.equal(page_tokens_rows(pool.pages, page_ids), full.view(torch.uint8)[:, slots])
    untouched = sorted(set(range(pool.num_pages)) - set(page_ids))
    assert bool((pool.pages.view(torch.uint8)[untouched] == POISON).all())

    back = empty_like_kv(kv)
    loader = PageMover(back, pool.pages, path, staging_pages)
    skip = 5
    load_slots = distinct_slots(7 * 16 - skip, num_slots, gen)
    _finish(loader.load(page_ids, load_slots, skip_first=skip))
    want = empty_like_kv(kv)
    reference_scatter(want, pool.pages, load_slots, page_ids, skip_first=skip)
    assert kv_equal(back, want)
    rows = kv_rows(back)
    assert torch.equal(rows[:, load_slots], page_tokens_rows(pool.pages, page_ids)[:, skip:])


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.value)
def test_tp_ranks_share_pages(pool: PagePool, path: TransferPath) -> None:
    layout = LAYOUT
    gen = torch.Generator().manual_seed(3)
    num_slots = 64
    full = full_kv(layout, num_slots, gen)
    slots = distinct_slots(48, num_slots, gen)
    page_ids = [1, 8, 4]
    for rank in range(4):  # tp 4 > 2 heads: ranks 0 and 2 write, 1 and 3 are replicas
        tp = TPSlice.of(layout, rank, 4)
        mover = PageMover(rank_kv(layout, full, BufferForm.PER_LAYER, tp), pool.pages, path)
        if path is TransferPath.STAGING:
            assert mover.effective_path is TransferPath.DIRECT
        event = mover.offload(slots, page_ids)
        if tp.writer:
            _finish(event)
        else:
            assert event is None
    assert torch.equal(page_tokens_rows(pool.pages, page_ids), full.view(torch.uint8)[:, slots])
    for rank in range(4):
        tp = TPSlice.of(layout, rank, 4)
        back = empty_like_kv(rank_kv(layout, full, BufferForm.PER_LAYER, tp))
        _finish(PageMover(back, pool.pages, path).load(page_ids, slots))
        assert torch.equal(kv_rows(back)[:, slots], rank_rows(layout, full.view(torch.uint8)[:, slots], tp))


def test_default_path_follows_the_device(pool: PagePool) -> None:
    kv = rank_kv(LAYOUT, full_kv(LAYOUT, 32, torch.Generator().manual_seed(0)), BufferForm.STACKED, TPSlice.of(LAYOUT))
    mover = PageMover(kv, pool.pages)
    assert mover.path is (TransferPath.STAGING if DEVICE.type == "cuda" else TransferPath.REFERENCE)


# -- checks before launch ---------------------------------------------------------------------


def _setup() -> tuple[KVBuffer, torch.Tensor]:
    kv = rank_kv(LAYOUT, full_kv(LAYOUT, 40, torch.Generator().manual_seed(0)), BufferForm.STACKED, TPSlice.of(LAYOUT))
    return kv, poisoned_pages(LAYOUT, 4)


def _ok_slots() -> torch.Tensor:
    return torch.arange(16)


CASES: list[tuple[str, Callable[[KVBuffer, torch.Tensor], object], str]] = [
    ("negative", lambda kv, p: reference_gather(kv, torch.arange(-1, 15), p, [0]), "slots holds a negative"),
    ("out of range", lambda kv, p: reference_gather(kv, torch.arange(30, 46), p, [0]), "slots holds slot 45"),
    ("duplicated", lambda kv, p: reference_gather(kv, torch.zeros(16, dtype=torch.int64), p, [0]), "duplicated slots"),
    ("not whole pages", lambda kv, p: reference_gather(kv, torch.arange(15), p, None), "not a multiple of the page"),
    ("page count", lambda kv, p: reference_gather(kv, _ok_slots(), p, [0, 1]), "page_ids names 2 pages"),
    ("float slots", lambda kv, p: reference_gather(kv, _ok_slots().float(), p, [0]), "slots must have an integer"),
    ("2-D slots", lambda kv, p: reference_gather(kv, _ok_slots().view(4, 4), p, [0]), "slots must be 1-D"),
    ("page out of range", lambda kv, p: reference_gather(kv, _ok_slots(), p, [4]), "page_ids holds page 4"),
    ("page negative", lambda kv, p: reference_gather(kv, _ok_slots(), p, [-1]), "page_ids holds a negative"),
    ("page duplicated", lambda kv, p: reference_gather(kv, torch.arange(32), p, [1, 1]), "page_ids holds duplicated"),
    ("pages dtype", lambda kv, p: reference_gather(kv, _ok_slots(), p.view(torch.int16), [0]), "pages has dtype"),
    ("pages shape", lambda kv, p: reference_gather(kv, _ok_slots(), p[:, :1], [0]), "pages must have shape"),
    ("skip too big", lambda kv, p: reference_scatter(kv, p, torch.arange(16), [0, 1], skip_first=16), "skip_first"),
    ("scatter count", lambda kv, p: reference_scatter(kv, p, torch.arange(12), [0], skip_first=2), "need 14"),
    ("mover path", lambda kv, p: PageMover(kv, p, "staging"), "path must be a TransferPath"),
    ("mover staging", lambda kv, p: PageMover(kv, p, TransferPath.STAGING, 0), "staging_pages"),
    ("mover run_pages 0", lambda kv, p: PageMover(kv, p, run_pages=0), "run_pages"),
    ("mover run_pages bool", lambda kv, p: PageMover(kv, p, run_pages=True), "run_pages"),
    ("mover load count", lambda kv, p: PageMover(kv, p).load([0, 1], _ok_slots()), "need 32"),
    ("mover offload dup", lambda kv, p: PageMover(kv, p).offload(torch.zeros(16, dtype=torch.int32), [0]),
     "duplicated slots"),
]


@pytest.mark.parametrize(("what", "call", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_inputs_raise_value_error_naming_the_argument(
    what: str, call: Callable[[KVBuffer, torch.Tensor], object], message: str
) -> None:
    kv, pages = _setup()
    before = pages.view(torch.uint8).clone()
    with pytest.raises(ValueError, match=message):
        call(kv, pages)
    assert torch.equal(pages.view(torch.uint8), before), f"{what}: pages changed before the check failed"


@pytest.mark.skipif(not triton_usable(), reason="needs CUDA or TRITON_INTERPRET=1")
def test_triton_wrappers_check_too() -> None:
    kv, pages = _setup()
    with pytest.raises(ValueError, match="slots holds duplicated"):
        gather(kv, torch.zeros(16, dtype=torch.int64), pages, [0])
    with pytest.raises(ValueError, match="page_ids holds page 9"):
        scatter(kv, pages, _ok_slots(), [9])
    with pytest.raises(ValueError, match="pages has dtype"):
        gather(kv, _ok_slots(), pages.view(torch.int16), [0])


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.value)
@pytest.mark.parametrize("form", [BufferForm.STACKED, BufferForm.SPLIT_KV], ids=lambda f: f.value)
def test_load_layer_by_layer_lands_each_layer_in_order(pool: PagePool, path: TransferPath, form: BufferForm) -> None:
    # Layer l is complete when its readiness fires (CPU: the callback; CUDA: the event), and the
    # whole load equals the all-layers load, bit-exact.
    gen = torch.Generator().manual_seed(5)
    num_slots = 5 * 16 + 9
    full = full_kv(LAYOUT, num_slots, gen)
    kv = rank_kv(LAYOUT, full, form, TPSlice.of(LAYOUT))
    page_ids = [4, 1, 10, 6]
    PageMover(kv, pool.pages, path, 2).offload(distinct_slots(4 * 16, num_slots, gen), page_ids)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    skip = 3
    load_slots = distinct_slots(4 * 16 - skip, num_slots, gen)
    want = empty_like_kv(kv)
    reference_scatter(want, pool.pages, load_slots, page_ids, skip_first=skip)
    back = empty_like_kv(kv)
    seen: list[int] = []

    def on_layer(layer: int) -> None:
        # Every layer up to this one is in place; later ones are still empty.
        for other in range(LAYOUT.num_layers):
            landed = kv_equal_layer(back, want, other)
            assert landed == (other <= layer), (layer, other)
        seen.append(layer)

    events = PageMover(back, pool.pages, path, 2).load_layers(page_ids, load_slots, skip, on_layer)
    if DEVICE.type == "cuda":
        assert events is not None and len(events) == LAYOUT.num_layers
        events[0].synchronize()
        assert kv_equal_layer(back, want, 0)
        events[-1].synchronize()
    else:
        assert events is None and seen == list(range(LAYOUT.num_layers))
    assert kv_equal(back, want)


def kv_equal_layer(a: KVBuffer, b: KVBuffer, layer: int) -> bool:
    """Whether layer ``layer`` of two KV buffers holds the same bytes."""
    pairs = [(a.k_layers[layer], b.k_layers[layer])]
    if a.v_layers:
        pairs.append((a.v_layers[layer], b.v_layers[layer]))
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in pairs)


STAGED = [TransferPath.STAGING] if triton_usable() else []


def _loaded_pool(pool: PagePool, page_ids: list[int], num_slots: int, seed: int) -> KVBuffer:
    """A stacked KV buffer of random bits whose slots were offloaded into ``page_ids``."""
    gen = torch.Generator().manual_seed(seed)
    kv = rank_kv(LAYOUT, full_kv(LAYOUT, num_slots, gen), BufferForm.STACKED, TPSlice.of(LAYOUT))
    _finish(PageMover(kv, pool.pages, TransferPath.REFERENCE).offload(
        distinct_slots(len(page_ids) * LAYOUT.page_tokens, num_slots, gen), page_ids))
    return kv


@pytest.mark.parametrize("path", STAGED, ids=lambda p: p.value)
@pytest.mark.parametrize("staging_pages", [1, 3])  # buffers of 1 slab (11 groups), of 2 slabs (6 groups)
def test_layer_pipeline_over_many_groups_is_bit_exact(pool: PagePool, path: TransferPath, staging_pages: int) -> None:
    page_ids = [11, 0, 5, 3, 9, 1, 7, 2, 10, 4, 6]
    kv = _loaded_pool(pool, page_ids, 11 * 16 + 7, staging_pages)
    gen = torch.Generator().manual_seed(9)
    skip = 11
    load_slots = distinct_slots(11 * 16 - skip, kv.num_slots, gen)
    want = empty_like_kv(kv)
    reference_scatter(want, pool.pages, load_slots, page_ids, skip_first=skip)
    back = empty_like_kv(kv)
    seen: list[int] = []

    def on_layer(layer: int) -> None:
        assert [kv_equal_layer(back, want, other) for other in range(LAYOUT.num_layers)] == [
            other <= layer for other in range(LAYOUT.num_layers)
        ]
        seen.append(layer)

    events = PageMover(back, pool.pages, path, staging_pages).load_layers(page_ids, load_slots, skip, on_layer)
    if DEVICE.type == "cuda":
        assert events is not None
        events[-1].synchronize()
    else:
        assert seen == list(range(LAYOUT.num_layers))
    assert kv_equal(back, want)


@pytest.mark.parametrize("path", STAGED, ids=lambda p: p.value)
def test_layered_and_whole_page_loads_share_staging_without_mixing(pool: PagePool, path: TransferPath) -> None:
    # Layer-wise buffers are carved out of the load lanes' staging: back-to-back loads of both
    # kinds on one mover, no host wait in between, each lands its own pages' bytes.
    page_ids = [3, 8, 1, 10, 6, 0]
    kv = _loaded_pool(pool, page_ids, 200, 4)
    gen = torch.Generator().manual_seed(4)
    slots = distinct_slots(6 * 16, kv.num_slots, gen)
    parts = [(page_ids[0:3], slots[0:48]), (page_ids[3:5], slots[48:80]), (page_ids[5:6], slots[80:96])]
    back = empty_like_kv(kv)
    mover = PageMover(back, pool.pages, path, 2)
    done = [mover.load_layers(*parts[0]), mover.load(*parts[1]), mover.load_layers(*parts[2])]
    if DEVICE.type == "cuda":
        whole = done[1]
        assert isinstance(whole, torch.cuda.Event)
        torch.cuda.current_stream().wait_event(whole)
        for events in (done[0], done[2]):
            assert isinstance(events, list)
            torch.cuda.current_stream().wait_event(events[-1])
    want = empty_like_kv(kv)
    for ids, part in parts:
        reference_scatter(want, pool.pages, part, ids)
    assert kv_equal(back, want)


@pytest.mark.parametrize("path", STAGED, ids=lambda p: p.value)
def test_a_copy_failing_mid_load_raises_after_the_layers_before_it(
    pool: PagePool, path: TransferPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The 6th of 8 units (layer 1, group 1) is refused: the error propagates, layer 0 landed whole
    # and was reported, layer 1 was not reported. On CUDA the caller's stream is then ordered
    # after what was queued (its later writes to the slots are not overtaken).
    page_ids = [2, 7, 4, 9]
    kv = _loaded_pool(pool, page_ids, 100, 6)
    load_slots = distinct_slots(4 * 16, kv.num_slots, torch.Generator().manual_seed(6))
    want = empty_like_kv(kv)
    reference_scatter(want, pool.pages, load_slots, page_ids)
    back = empty_like_kv(kv)
    mover = PageMover(back, pool.pages, path, 2)  # 4 slabs: 3 buffers of one page, 4 groups a layer
    real = PageMover._copy_unit
    calls: list[int] = []

    def refusing(self: PageMover, buffer: torch.Tensor, ids: list[int], runs: list[tuple[int, int, int]],
                 layer: int, stream: torch.cuda.Stream | None) -> None:
        calls.append(layer)
        if len(calls) == 6:
            raise RuntimeError("cudaMemcpyAsync refused (injected)")
        if stream is not None and len(calls) == 5:
            torch.cuda._sleep(100_000_000)  # the scatters queued before the fault run late
        real(self, buffer, ids, runs, layer, stream)

    monkeypatch.setattr(PageMover, "_copy_unit", refusing)
    seen: list[int] = []
    with pytest.raises(RuntimeError, match="injected"):
        mover.load_layers(page_ids, load_slots, 0, seen.append)
    assert calls == [0, 0, 0, 0, 1, 1]
    if DEVICE.type == "cuda":
        # The caller's stream waits for the queued scatters: its own write lands after them.
        k = back.k_layers[1]
        k[load_slots[:16].to(DEVICE)] = 0
        torch.cuda.synchronize()
        assert bool((k[load_slots[:16].to(DEVICE)].view(torch.uint8) == 0).all())
    else:
        assert seen == [0]
    assert kv_equal_layer(back, want, 0)
