"""Property tests of loads by run copies (``PageMover.load_layers`` and ``load``, STAGING, ``load_runs``).

Random cases (layout, dtype, page size, layers, pool page ids, slot runs, ``skip_first``, slot dtype
and stride, buffer form) against two oracles: :func:`reference_scatter` and a plain indexing model
of it. The path taken is predicted from the documented rule (``_run_layers``): run copies where every
page's loaded slots are one ascending run, the layers are evenly spaced (:func:`run_geometry`) and
the copies (one per run of pages consecutive in the pool, within one registration, and in slots;
a partly needed page 0 alone) are no more than the staged copies plus
:data:`RUN_COPIES_PER_LAUNCH` per staged group; else the staged pipeline. A whole-page load takes
runs by the same rule, in the form with fewer copies: one per page (every layer), or one per layer
of each such run of pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from kvcase import DEVICE, POISON, random_bits, same_bits, triton_usable

from aiokv.kernels import PageMover, TransferPath, reference_gather, reference_scatter
from aiokv.kernels import mover as mover_module
from aiokv.kernels.launch import gather as launch_gather
from aiokv.kernels.launch import scatter as launch_scatter
from aiokv.kernels.mover import RUN_COPIES_PER_LAUNCH, layer_groups, slab_runs, split_layer_staging
from aiokv.layout import KVBuffer, KVLayout
from aiokv.pool import PagePool

CPU_ONLY = pytest.mark.skipif(DEVICE.type == "cuda" or not triton_usable(),
                              reason="the memmove form needs host buffers and Triton's interpreter")
POOL_PAGES = 16
FORMS = ("stacked", "per-layer", "uneven")
"""KV buffer forms: one tensor; a list of layers cut from one (evenly spaced); a list of layers at
uneven distances in one allocation (not evenly spaced from 3 layers: no run geometry)."""


@dataclass(frozen=True)
class Case:
    mla: bool
    heads: int
    head_dim: int
    dtype: torch.dtype
    tokens: int
    layers: int
    ids: list[int]
    starts: list[int]
    """Each page's slot run start (row 0 of the page; page 0's first ``skip`` rows are not loaded)."""
    num_slots: int
    skip: int
    slot_dtype: torch.dtype
    strided: bool
    form: str
    run_pages: int
    staging_pages: int
    swap: tuple[int, int] | None
    """Two slot positions swapped: the slots are then not runs."""

    def layout(self) -> KVLayout:
        if self.mla:
            return KVLayout.mla(self.layers, self.head_dim, self.dtype, page_tokens=self.tokens)
        return KVLayout.mha(self.layers, self.heads, self.head_dim, self.dtype, page_tokens=self.tokens)

    def slot_list(self) -> list[int]:
        flat = [s + r for s in self.starts for r in range(self.tokens)][self.skip :]
        if self.swap is not None:
            a, b = self.swap
            flat[a], flat[b] = flat[b], flat[a]
        return flat


@st.composite
def cases(draw: st.DrawFn, chain: bool = False) -> Case:
    """``chain``: each page follows its predecessor in the pool and in slots 7 times in 8, not 1 in 2
    (long runs of pages: whole loads then copy by layer)."""
    follows = st.integers(0, 7).map(bool) if chain else st.booleans()
    mla = draw(st.booleans())
    tokens = draw(st.integers(2, 8))
    count = draw(st.integers(1, 8))
    # Pool pages: each page after the first follows its predecessor (a pool run, which may cross a
    # registration of run_pages) or is any unused page.
    ids = [draw(st.integers(0, POOL_PAGES - 1))]
    for _ in range(count - 1):
        follow = ids[-1] + 1
        if follow < POOL_PAGES and follow not in ids and draw(follows):
            ids.append(follow)
        else:
            ids.append(draw(st.sampled_from([p for p in range(POOL_PAGES) if p not in ids])))
    # Slot runs: each follows its predecessor's run or starts anywhere free (not aligned to pages).
    num_slots = (2 * count + 1) * tokens + draw(st.integers(0, 5))
    used: set[int] = set()
    starts: list[int] = []
    for i in range(count):
        follow = starts[-1] + tokens if starts else -1
        free = [s for s in range(num_slots - tokens + 1) if used.isdisjoint(range(s, s + tokens))]
        start = follow if i and follow in free and draw(follows) else draw(st.sampled_from(free))
        starts.append(start)
        used.update(range(start, start + tokens))
    skip = draw(st.integers(0, tokens - 1))
    loaded = count * tokens - skip
    swap = None
    if loaded >= 2 and draw(st.integers(0, 5)) == 0:  # now and then: slots that are not runs
        a = draw(st.integers(0, loaded - 1))
        b = draw(st.integers(0, loaded - 2))
        swap = (a, b + (b >= a))
    return Case(
        mla=mla,
        heads=draw(st.integers(1, 3)),
        head_dim=draw(st.sampled_from([4, 8] if not mla else [8, 24])),
        dtype=draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32])),
        tokens=tokens,
        layers=draw(st.integers(1, 4)),
        ids=ids,
        starts=starts,
        num_slots=num_slots,
        skip=skip,
        slot_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        strided=draw(st.booleans()),
        form=draw(st.sampled_from(FORMS)),
        run_pages=draw(st.sampled_from([1, 2, 3, 4, 16])),
        staging_pages=draw(st.integers(1, 4)),
        swap=swap,
    )


def _slots(case: Case) -> torch.Tensor:
    values = torch.tensor(case.slot_list(), dtype=case.slot_dtype)
    if not case.strided:
        return values
    # Every other element of a larger tensor; the others name a slot never loaded (in range, so a
    # reader that ignores the stride writes a wrong slot, not past the buffer).
    unused = max(set(range(case.num_slots)) - set(case.slot_list()))
    wide = torch.full((2 * values.numel(),), unused, dtype=case.slot_dtype)
    wide[::2] = values
    return wide[::2]


GUARD = 64
"""Poisoned elements before and after the KV buffer's memory: no copy may write there."""


def _kv(layout: KVLayout, case: Case) -> tuple[KVBuffer, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """A poisoned KV buffer of ``case.form``, its layers ``[S, rows, D]``, the memory holding them
    (with guards) and a mask of that memory's elements outside every layer."""
    shape = (case.num_slots, layout.rows, layout.head_dim)
    per = case.num_slots * layout.rows * layout.head_dim
    # Uneven: gaps of 1, 2, 3, ... layers' worth of elements between layers (distances 2, 3, 4, ...).
    step = [i * (i + 3) // 2 if case.form == "uneven" else i for i in range(case.layers)]
    offsets = [GUARD + per * k for k in step]
    store = torch.empty(offsets[-1] + per + GUARD, dtype=layout.dtype)
    store.view(torch.uint8).fill_(POISON)
    outside = torch.ones(store.numel(), dtype=torch.bool)
    for o in offsets:
        outside[o : o + per] = False
    layers = [store[o : o + per].view(shape) for o in offsets]
    if case.form == "stacked":
        kv = KVBuffer.wrap(layout, store[GUARD : GUARD + case.layers * per].view(case.layers, *shape))
    else:
        kv = KVBuffer.wrap(layout, layers)
    return kv, layers, store, outside


def _model(pages: torch.Tensor, layout: KVLayout, case: Case) -> list[torch.Tensor]:
    """What the load must leave: poison, then row r of page i's layer l at the slot of that row."""
    want = torch.empty((case.layers, case.num_slots, layout.rows, layout.head_dim), dtype=layout.dtype)
    want.view(torch.uint8).fill_(POISON)
    rows = pages[case.ids].transpose(0, 1).reshape(case.layers, -1, layout.rows, layout.head_dim)
    want[:, torch.tensor(case.slot_list())] = rows[:, case.skip :]
    return list(want.unbind(0))


def _model_runs(case: Case) -> int | None:
    """Runs of pages one copy per layer loads (consecutive in the pool, within one registration, and
    in slots; a partly needed page 0 alone), None where the slots or the buffer allow no run copies."""
    if case.swap is not None or (case.form == "uneven" and case.layers >= 3):
        return None
    runs = 0
    for i, (page, start) in enumerate(zip(case.ids, case.starts, strict=True)):
        joins = (i > 0 and not (i == 1 and case.skip) and page == case.ids[i - 1] + 1
                 and page // case.run_pages == case.ids[i - 1] // case.run_pages
                 and start == case.starts[i - 1] + case.tokens)
        runs += not joins
    return runs


def _model_copies(case: Case) -> int | None:
    """Copies per layer the rule predicts (one segment: a full-width row), None where it stages."""
    runs = _model_runs(case)
    if runs is None:
        return None
    _, capacity = split_layer_staging(case.staging_pages * case.layers)
    groups = layer_groups(len(case.ids), capacity)
    budget = sum(len(slab_runs(case.ids[g.start : g.stop], case.run_pages)) + RUN_COPIES_PER_LAUNCH
                 for g in groups)
    return runs if runs <= budget else None


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Counts of the run copies issued per call of memmove_runs and of staged units issued."""
    seen: dict[str, list[int]] = {"runs": [], "staged": [], "chunks": []}
    real_runs, real_unit, real_chunk = mover_module.memmove_runs, PageMover._issue_unit, PageMover._load_chunk

    def runs(copies: list[mover_module.RunCopy]) -> None:
        seen["runs"].append(len(copies))
        real_runs(copies)

    def unit(self: PageMover, *args: object) -> None:
        seen["staged"].append(1)
        real_unit(self, *args)  # type: ignore[arg-type]

    def chunk(self: PageMover, *args: object) -> None:
        seen["chunks"].append(1)
        real_chunk(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(mover_module, "memmove_runs", runs)
    monkeypatch.setattr(PageMover, "_issue_unit", unit)
    monkeypatch.setattr(PageMover, "_load_chunk", chunk)
    return seen


@CPU_ONLY
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(case=cases())
def test_layer_wise_load_by_runs_matches_the_reference(case: Case, spies: dict[str, list[int]]) -> None:
    spies["runs"].clear()
    spies["staged"].clear()
    layout = case.layout()
    pool = PagePool.create(layout, POOL_PAGES * layout.page_bytes, register_cuda=None)
    try:
        pool.wait_ready_blocking()
        gen = torch.Generator().manual_seed(len(case.ids) * 1000 + case.tokens)
        pool.pages.copy_(random_bits(tuple(pool.pages.shape), layout.dtype, gen))
        before = pool.pages.clone()
        slots = _slots(case)

        # The two oracles agree: the reference scatter and plain indexing.
        ref, *_ = _kv(layout, case)
        reference_scatter(ref, pool.pages, slots, case.ids, skip_first=case.skip)
        want = _model(pool.pages, layout, case)
        assert all(same_bits(a, b) for a, b in zip(ref.k_layers, want, strict=True))

        copies = _model_copies(case)
        event("path: " + ("staged" if copies is None else f"runs, {copies} copies a layer"))
        kv, layers, store, outside = _kv(layout, case)
        mover = PageMover(kv, pool.pages, TransferPath.STAGING, case.staging_pages, run_pages=case.run_pages)
        assert mover.load_runs == (case.form != "uneven" or case.layers < 3)
        seen: list[int] = []

        def on_layer(layer: int) -> None:
            # Layer `layer` is in place (and every one before it); later ones are still poison.
            for other in range(case.layers):
                done = same_bits(layers[other], want[other])
                assert done == (other <= layer), (layer, other)
            seen.append(layer)

        assert mover.load_layers(case.ids, slots, case.skip, on_layer) is None
        assert seen == list(range(case.layers))
        assert all(same_bits(a, b) for a, b in zip(layers, want, strict=True))  # untouched slots: poison
        assert bool((store[outside].view(torch.uint8) == POISON).all())  # nothing written around them
        assert torch.equal(pool.pages.view(torch.uint8), before.view(torch.uint8))

        if copies is None:  # staged: no run copy, a unit per layer and group
            assert mover.runs_loaded == 0
            assert spies["runs"] == [] and spies["staged"]
        else:
            assert mover.runs_loaded == len(case.ids)
            assert spies["staged"] == []
            assert spies["runs"] == [copies] * case.layers
    finally:
        pool.close()


@CPU_ONLY
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(case=st.one_of(cases(), cases(chain=True)))
def test_whole_load_by_runs_matches_the_reference(case: Case, spies: dict[str, list[int]]) -> None:
    """``load`` (whole pages): bit-exact with both oracles, guards and untouched slots poisoned,
    the pool unchanged, the path and the copies the rule predicts, the pages counted."""
    for seen in spies.values():
        seen.clear()
    layout = case.layout()
    pool = PagePool.create(layout, POOL_PAGES * layout.page_bytes, register_cuda=None)
    try:
        pool.wait_ready_blocking()
        gen = torch.Generator().manual_seed(len(case.ids) * 1000 + case.tokens + 1)
        pool.pages.copy_(random_bits(tuple(pool.pages.shape), layout.dtype, gen))
        before = pool.pages.clone()
        slots = _slots(case)
        ref, *_ = _kv(layout, case)
        reference_scatter(ref, pool.pages, slots, case.ids, skip_first=case.skip)
        want = _model(pool.pages, layout, case)
        assert all(same_bits(a, b) for a, b in zip(ref.k_layers, want, strict=True))

        runs = _model_runs(case)
        count = len(case.ids)
        # Fewer copies wins, by page on a tie: one of L rows per page, or L per run (one a layer).
        groups = None if runs is None else [1] * count if count <= runs * case.layers else [case.layers] * runs
        event("whole: " + ("staged" if groups is None else "by page" if groups == [1] * count else "by layer"))
        kv, layers, store, outside = _kv(layout, case)
        mover = PageMover(kv, pool.pages, TransferPath.STAGING, case.staging_pages, run_pages=case.run_pages)
        assert mover.load(case.ids, slots, case.skip) is None
        assert all(same_bits(a, b) for a, b in zip(layers, want, strict=True))
        assert bool((store[outside].view(torch.uint8) == POISON).all())
        assert torch.equal(pool.pages.view(torch.uint8), before.view(torch.uint8))
        if groups is None:
            assert mover.runs_loaded == 0 and spies["runs"] == [] and spies["chunks"]
        else:
            assert mover.runs_loaded == count and spies["chunks"] == []
            assert spies["runs"] == groups
    finally:
        pool.close()


@CPU_ONLY
@pytest.mark.parametrize("path", [TransferPath.STAGING, TransferPath.DIRECT])
@pytest.mark.parametrize("operation", ["load_layers", "load", "offload", "one-shot scatter", "one-shot gather"])
def test_a_strided_int64_slot_view_is_read_by_its_values(operation: str, path: TransferPath) -> None:
    """Regression, found by the property test: the kernels read an index as contiguous, and an int64
    view (every other element of [0, 3, 1, 3], i.e. slots [0, 1]) went to them as it was: token 1
    landed in slot 3 (with other values, out of bounds: a heap corruption). int32 slots were
    converted, hence contiguous, and the run copies honour the stride."""
    layout = KVLayout.mha(1, 1, 4, torch.float32, page_tokens=2)
    pages = torch.arange(2 * 16, dtype=torch.float32).view(2, *layout.page_shape)
    slots = torch.tensor([0, 3, 1, 3])[::2]
    assert not slots.is_contiguous()
    source = torch.arange(100, 100 + 4 * 2 * 4, dtype=torch.float32).view(1, 4, 2, 4)
    kv = KVBuffer.wrap(layout, source.clone() if operation.endswith("gather") or operation == "offload"
                       else torch.zeros((1, 4, 2, 4)))
    if operation in ("offload", "one-shot gather"):
        got = torch.zeros_like(pages)
        want = torch.zeros_like(pages)
        reference_gather(KVBuffer.wrap(layout, source.clone()), slots.contiguous(), want, [1])
        if operation == "offload":
            PageMover(kv, got, path, 2, load_runs=False).offload(slots, [1])
        else:
            launch_gather(kv, slots, got, [1])
        assert torch.equal(got, want)
        return
    want_kv = KVBuffer.wrap(layout, torch.zeros((1, 4, 2, 4)))
    reference_scatter(want_kv, pages, slots.contiguous(), [1])
    if operation == "load_layers":
        PageMover(kv, pages, path, 2, load_runs=False).load_layers([1], slots)
    elif operation == "load":
        PageMover(kv, pages, path, 2, load_runs=False).load([1], slots)
    else:
        launch_scatter(kv, pages, slots, [1])
    assert torch.equal(kv.k_layers[0], want_kv.k_layers[0])
