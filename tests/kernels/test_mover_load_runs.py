"""Layer-wise loads by run copies (``PageMover(load_runs=True)``, the default): where every page's
slots are one ascending run, each layer of each page group is copied by the copy engine straight from
the pool pages into the KV slots, no staging and no scatter kernel.

On a CPU the same copies (addresses, pitches, merged runs) run with memmove, so they are checked
bit-exact against the reference scatter and the staged path here; the GPU tests run them with
cudaMemcpy2DAsync (paced, stopped part-way, ordered after the caller's stream).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from kvcase import DEVICE, POISON, poisoned_pool, random_bits, same_bits, triton_usable

from aiokv.kernels import PageMover, TransferPath, reference_gather, reference_scatter
from aiokv.kernels import mover as mover_module
from aiokv.kernels.slotruns import load_page_runs, load_run_starts
from aiokv.layout import KVBuffer, KVLayout, TPSlice
from aiokv.pool import PagePool

# Odd sizes: 3 layers, 3 KV heads of 8, pages of 12 tokens.
MHA = KVLayout.mha(3, 3, 8, torch.bfloat16, page_tokens=12)
MLA = KVLayout.mla(3, 24, torch.float16, page_tokens=12)
T = 12
SLOTS = 16 * T + 7
CPU_ONLY = pytest.mark.skipif(DEVICE.type == "cuda" or not triton_usable(),
                              reason="the memmove form needs host buffers and Triton's interpreter")


def _dense_kv(layout: KVLayout, seed: int, per_layer: bool = False, slots: int = SLOTS,
              device: torch.device = DEVICE) -> KVBuffer:
    """A KV buffer whose slots are exactly the page rows (run copies need that), random bits."""
    gen = torch.Generator().manual_seed(seed)
    stacked = random_bits((layout.num_layers, slots, layout.rows, layout.head_dim), layout.dtype, gen).to(device)
    return KVBuffer.wrap(layout, list(stacked.unbind(0)) if per_layer else stacked)


def _poisoned_like(kv: KVBuffer, per_layer: bool = False) -> KVBuffer:
    stacked = torch.stack(list(kv.k_layers)).view(torch.uint8).clone().fill_(POISON).view(kv.layout.dtype)
    return KVBuffer.wrap(kv.layout, list(stacked.unbind(0)) if per_layer else stacked)


def _layer_equal(a: KVBuffer, b: KVBuffer, layer: int) -> bool:
    return same_bits(a.k_layers[layer], b.k_layers[layer])


def _all_equal(a: KVBuffer, b: KVBuffer) -> bool:
    return all(_layer_equal(a, b, layer) for layer in range(a.layout.num_layers))


@pytest.fixture
def pool() -> Iterator[PagePool]:
    with poisoned_pool(MHA, 14) as pool:
        yield pool


def _filled(pool: PagePool, layout: KVLayout, seed: int) -> None:
    """Every pool page full of random bits (what a load reads)."""
    gen = torch.Generator().manual_seed(seed)
    source = KVBuffer.wrap(layout, random_bits((layout.num_layers, pool.num_pages * T, layout.rows,
                                                layout.head_dim), layout.dtype, gen))
    reference_gather(source, torch.arange(pool.num_pages * T), pool.pages, list(range(pool.num_pages)))


def _runs(starts: list[int], skip: int = 0) -> torch.Tensor:
    """The slots of pages whose runs start at ``starts`` (page 0 from its row ``skip``)."""
    parts = [torch.arange(s, s + T) for s in starts]
    parts[0] = parts[0][skip:]
    return torch.cat(parts)


# -- pure: which runs, which copies -----------------------------------------------------------------


def test_load_run_starts_with_a_partly_needed_first_page() -> None:
    assert load_run_starts(_runs([40, 52, 7]), 3, T, 0) == [40, 52, 7]
    # Page 0 from its row 5: its run starts at the slot of row 5.
    assert load_run_starts(_runs([40, 100], skip=5), 2, T, 5) == [45, 100]
    assert load_run_starts(torch.arange(3, 3 + T - 11), 1, T, 11) == [3]
    broken = _runs([0, T, 2 * T], skip=2)
    broken[4], broken[5] = broken[5].item(), broken[4].item()
    assert load_run_starts(broken, 3, T, 2) is None
    assert load_run_starts(_runs([0, T]), 2, T, 1) is None  # the count does not fit the skip
    assert load_run_starts(_runs([0, T]).flip(0), 2, T, 0) is None  # descending


def test_load_page_runs_merge_only_pages_consecutive_on_both_sides() -> None:
    # Pages 3,4,5 consecutive in the pool and in slots; 9 follows in slots but not in the pool;
    # 10 follows 9 in the pool but not in slots.
    starts = [0, T, 2 * T, 3 * T, 9 * T]
    ids = [3, 4, 5, 9, 10]
    assert load_page_runs(starts, ids, T, 0, 100) == [(0, 3), (3, 1), (4, 1)]
    # A registration of 4 pages (0-3, 4-7): page 3 -> 4 crosses it.
    assert load_page_runs(starts, ids, T, 0, 4) == [(0, 1), (1, 2), (3, 1), (4, 1)]
    # A partly needed page 0 is a run of its own (it copies fewer rows).
    assert load_page_runs([5, T, 2 * T], [3, 4, 5], T, 5, 100) == [(0, 1), (1, 2)]


# -- the mover on a CPU (memmove) -------------------------------------------------------------------


CASES = {
    # name: (page ids, slot run starts, skip): every run of a page.
    "consecutive": ([2, 3, 4, 5, 6], [T, 2 * T, 3 * T, 4 * T, 5 * T], 0),
    "skip-first": ([2, 3, 4, 5, 6], [T, 2 * T, 3 * T, 4 * T, 5 * T], 7),
    "pool-pages-apart": ([9, 1, 12, 5], [0, T, 2 * T, 3 * T], 4),
    "slots-apart": ([3, 4, 5, 6], [10 * T + 3, 2 * T, 7 * T, 0], 0),
    "mixed": ([0, 1, 2, 8, 9, 13], [3, 3 + T, 3 + 2 * T, 15 * T, 4 * T, 5 * T], 11),
}


@CPU_ONLY
@pytest.mark.parametrize("run_pages", [1, 4, 16])  # pool registrations: every page apart, 4 pages, one
@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked", "per-layer"])
@pytest.mark.parametrize("case", list(CASES))
def test_layer_wise_load_by_runs_is_bit_exact_layer_by_layer(
    pool: PagePool, case: str, per_layer: bool, run_pages: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each layer is in place when its readiness fires (and no later one); the result equals the
    reference scatter and the staged path, bit-exact; the staged units never run; counted."""
    ids, starts, skip = CASES[case]
    _filled(pool, MHA, 3)
    slots = _runs(starts, skip)
    shape = _dense_kv(MHA, 0, per_layer)
    want = _poisoned_like(shape, per_layer)
    reference_scatter(want, pool.pages, slots, ids, skip_first=skip)
    staged = _poisoned_like(shape, per_layer)
    plain = PageMover(staged, pool.pages, TransferPath.STAGING, 2, run_pages=run_pages, load_runs=False)
    assert plain.load_layers(ids, slots, skip) is None
    assert plain.runs_loaded == 0
    assert _all_equal(staged, want)

    back = _poisoned_like(shape, per_layer)
    mover = PageMover(back, pool.pages, TransferPath.STAGING, 2, run_pages=run_pages)

    def no_staging(*_: object) -> None:
        raise AssertionError("a load by runs issued a staged unit")

    monkeypatch.setattr(PageMover, "_issue_unit", no_staging)
    seen: list[int] = []

    def on_layer(layer: int) -> None:
        for other in range(MHA.num_layers):
            assert _layer_equal(back, want, other) == (other <= layer), (layer, other)
        seen.append(layer)

    assert mover.load_layers(ids, slots, skip, on_layer) is None
    assert seen == list(range(MHA.num_layers))
    assert mover.runs_loaded == len(ids)
    assert _all_equal(back, want) and _all_equal(back, staged)


@CPU_ONLY
def test_slots_that_are_not_runs_are_staged(pool: PagePool) -> None:
    _filled(pool, MHA, 4)
    ids = [2, 3, 4]
    slots = _runs([0, T, 2 * T])
    slots[T + 3], slots[T + 4] = slots[T + 4].item(), slots[T + 3].item()  # page 1 is not a run
    kv = _dense_kv(MHA, 0)
    back, want = _poisoned_like(kv), _poisoned_like(kv)
    reference_scatter(want, pool.pages, slots, ids)
    mover = PageMover(back, pool.pages, TransferPath.STAGING, 2)
    mover.load_layers(ids, slots)
    assert mover.runs_loaded == 0
    assert _all_equal(back, want)


@CPU_ONLY
def test_runs_that_cost_more_copies_than_staging_are_staged(pool: PagePool) -> None:
    # 13 pages consecutive in the pool, slots runs per page only: 13 copies a layer by runs against
    # one slab copy and one launch a layer staged (a staging of all 13 pages, in one registration).
    _filled(pool, MHA, 5)
    ids = list(range(13))
    slots = _runs([(13 - i) * T for i in range(13)])
    kv = _dense_kv(MHA, 0, slots=15 * T)
    back, want = _poisoned_like(kv), _poisoned_like(kv)
    reference_scatter(want, pool.pages, slots, ids)
    mover = PageMover(back, pool.pages, TransferPath.STAGING, 13, run_pages=16)
    mover.load_layers(ids, slots)
    assert mover.runs_loaded == 0
    assert _all_equal(back, want)
    # The same pages with slots consecutive across pages: one copy a layer.
    runs = _runs([i * T for i in range(13)])
    reference_scatter(want, pool.pages, runs, ids)
    mover.load_layers(ids, runs)
    assert mover.runs_loaded == 13
    assert _all_equal(back, want)


@CPU_ONLY
def test_run_copies_merge_consecutive_pages_into_one_copy(pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Pages 4-7 consecutive on both sides: one 2-D copy (4 rows of one block) per layer.
    _filled(pool, MHA, 6)
    calls: list[list[tuple[int, int]]] = []
    real = mover_module.memmove_runs

    def spying(copies: list[mover_module.RunCopy]) -> None:
        calls.append([(c.height, c.width) for c in copies])
        real(copies)

    monkeypatch.setattr(mover_module, "memmove_runs", spying)
    kv = _dense_kv(MHA, 0)
    back, want = _poisoned_like(kv), _poisoned_like(kv)
    slots = _runs([2 * T, 3 * T, 4 * T, 5 * T], skip=3)
    reference_scatter(want, pool.pages, slots, [4, 5, 6, 7], skip_first=3)
    mover = PageMover(back, pool.pages, TransferPath.STAGING, 2, run_pages=8)
    mover.load_layers([4, 5, 6, 7], slots, 3)
    block = T * MHA.rows * MHA.head_dim * MHA.itemsize
    row = block // T
    assert calls == [[(1, block - 3 * row), (3, block)]] * MHA.num_layers
    assert _all_equal(back, want)


@CPU_ONLY
def test_a_copy_failing_part_way_raises_after_the_layers_before_it(
    pool: PagePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    _filled(pool, MHA, 7)
    real = mover_module.memmove_runs
    calls: list[int] = []

    def refusing(copies: list[mover_module.RunCopy]) -> None:
        calls.append(len(copies))
        if len(calls) == 2:
            raise RuntimeError("cudaMemcpy2DAsync refused (injected)")
        real(copies)

    monkeypatch.setattr(mover_module, "memmove_runs", refusing)
    kv = _dense_kv(MHA, 0)
    back, want = _poisoned_like(kv), _poisoned_like(kv)
    ids, slots = [1, 2, 3], _runs([0, T, 2 * T])
    reference_scatter(want, pool.pages, slots, ids)
    mover = PageMover(back, pool.pages, TransferPath.STAGING, 2)
    seen: list[int] = []
    with pytest.raises(RuntimeError, match="injected"):
        mover.load_layers(ids, slots, 0, seen.append)
    assert seen == [0]
    assert _layer_equal(back, want, 0)
    untouched = torch.stack(list(back.k_layers))[1:].view(torch.uint8)
    assert bool((untouched == POISON).all())
    assert mover.runs_loaded == 0  # no page was copied whole


@CPU_ONLY
def test_layer_wise_load_refused_part_way_counts_only_the_pages_it_copied(
    pool: PagePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: ``runs_loaded`` counted a layer-wise load's pages when it was planned, so a load
    refused part-way counted pages never copied. A pace of 1 byte makes every page a group; the
    copy of the last layer's third group is refused: the two groups before it were copied whole."""
    monkeypatch.setattr(mover_module, "PACE_BYTES", 1)
    real = mover_module.memmove_runs
    calls: list[int] = []
    units = MHA.num_layers * 3

    def refusing(batch: list[mover_module.RunCopy]) -> None:
        calls.append(len(batch))
        if len(calls) == units:
            raise RuntimeError("cudaMemcpy2DAsync refused (injected)")
        real(batch)

    monkeypatch.setattr(mover_module, "memmove_runs", refusing)
    _filled(pool, MHA, 11)
    ids, slots = [1, 2, 3], _runs([0, T, 2 * T])
    kv = _dense_kv(MHA, 0)
    back = _poisoned_like(kv)
    mover = PageMover(back, pool.pages, TransferPath.STAGING, 2)
    with pytest.raises(RuntimeError, match="injected"):
        mover.load_layers(ids, slots)
    assert len(calls) == units  # one unit a page and layer: the fault came at the last one
    assert mover.runs_loaded == 2
    want = _poisoned_like(kv)
    reference_scatter(want, pool.pages, slots[: 2 * T], ids[:2])
    reference_scatter(want, pool.pages, slots[2 * T :], ids[2:], layers=range(MHA.num_layers - 1))
    assert _all_equal(back, want)


@CPU_ONLY
@pytest.mark.parametrize("rank", [0, 1])
def test_a_tp_ranks_part_of_a_rank_major_pool_loads_by_runs(rank: int) -> None:
    """A TP rank (rank-major pool, the rank's part of each page) loads its part by runs, layer-wise
    and whole: bit-exact with the reference scatter of that part."""
    tp = TPSlice.of(MHA, rank, 3)
    pool = PagePool.create(MHA.for_tp(3), 8 * MHA.page_bytes, register_cuda=None)
    pool.wait_ready_blocking()
    try:
        gen = torch.Generator().manual_seed(8)
        pool.pages.view(torch.uint8).copy_(torch.randint(0, 256, pool.pages.view(torch.uint8).shape,
                                                         dtype=torch.uint8, generator=gen))
        pages = pool.pages[:, tp.part]
        stacked = torch.full((MHA.num_layers, SLOTS, 2 * tp.local_heads, MHA.head_dim), 0, dtype=MHA.dtype)
        part = KVBuffer.wrap(MHA, stacked.view(torch.uint8).fill_(POISON).view(MHA.dtype), tp).rank_part()
        want = KVBuffer.wrap(MHA, stacked.clone(), tp).rank_part()
        ids, slots = [6, 7, 2], _runs([5 * T + 1, 6 * T + 1, 0], skip=2)
        mover = PageMover(part, pages, TransferPath.STAGING, 2)
        assert mover.effective_path is TransferPath.STAGING
        mover.load_layers(ids, slots, 2)
        assert mover.runs_loaded == 3
        reference_scatter(want, pages, slots, ids, skip_first=2)
        assert _all_equal(part, want)
        # A whole-page load of the same part: one copy per page (every layer of the rank's part).
        for layer in part.k_layers:
            layer.view(torch.uint8).fill_(POISON)
        mover.load(ids, slots, 2)
        assert mover.runs_loaded == 6
        assert _all_equal(part, want)
    finally:
        pool.close()


@CPU_ONLY
def test_an_mla_buffer_loads_by_runs() -> None:
    gen = torch.Generator().manual_seed(9)
    pages = random_bits((5, *MLA.page_shape), MLA.dtype, gen)
    kv = KVBuffer.wrap(MLA, torch.zeros((MLA.num_layers, 6 * T, 1, MLA.head_dim), dtype=MLA.dtype))
    want = KVBuffer.wrap(MLA, torch.zeros_like(torch.stack(list(kv.k_layers))))
    ids, slots = [4, 0, 1], _runs([3 * T, 0, T], skip=1)
    mover = PageMover(kv, pages, TransferPath.STAGING, 2)
    mover.load_layers(ids, slots, 1)
    assert mover.runs_loaded == 3
    reference_scatter(want, pages, slots, ids, skip_first=1)
    assert _all_equal(kv, want)


def test_load_runs_must_be_a_bool() -> None:
    kv = _dense_kv(MHA, 0, device=torch.device("cpu"))
    pages = torch.empty((2, *MHA.page_shape), dtype=MHA.dtype)
    with pytest.raises(ValueError, match="load_runs must be a bool"):
        PageMover(kv, pages, TransferPath.REFERENCE, load_runs=1)  # type: ignore[arg-type]


@CPU_ONLY
def test_load_runs_switched_off_and_on_between_loads(pool: PagePool) -> None:
    """The A/B switch (tools/bench_cache.py --load-runs-ab): off stages the same load, on takes runs."""
    _filled(pool, MHA, 10)
    kv = _dense_kv(MHA, 0)
    back, want = _poisoned_like(kv), _poisoned_like(kv)
    ids, slots = [3, 4], _runs([0, T])
    reference_scatter(want, pool.pages, slots, ids)
    mover = PageMover(back, pool.pages, TransferPath.STAGING, 2)
    assert mover.load_runs
    mover.load_runs = False
    mover.load_layers(ids, slots)
    assert mover.runs_loaded == 0 and _all_equal(back, want)
    mover.load_runs = True
    mover.load_layers(ids, slots)
    assert mover.runs_loaded == 2 and _all_equal(back, want)
    with pytest.raises(ValueError, match="load_runs must be a bool"):
        mover.load_runs = "yes"  # type: ignore[assignment]
    # Built with both kinds of run copies off, switched on later (review: the switch was ignored).
    off = PageMover(_poisoned_like(kv), pool.pages, TransferPath.STAGING, 2, load_runs=False)
    assert not off.load_runs
    off.load_runs = True
    assert off.load_runs
    off.load_layers(ids, slots)
    assert off.runs_loaded == 2
    padded = PageMover(_poisoned_like(kv, per_layer=True), pool.pages, TransferPath.REFERENCE)
    assert not padded.load_runs  # REFERENCE never stages: nothing to switch on
    padded.load_runs = True
    assert not padded.load_runs


def test_load_run_starts_of_strided_slots() -> None:
    # A caller's slots may be a strided view (every other element of a larger tensor).
    wide = torch.stack([_runs([T, 5 * T], skip=2), torch.zeros(2 * T - 2, dtype=torch.int64)], dim=1).reshape(-1)
    assert load_run_starts(wide[::2], 2, T, 2) == [T + 2, 5 * T]
