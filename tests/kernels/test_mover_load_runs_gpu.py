"""Loads by run copies on a GPU (cudaMemcpy2DAsync from pinned pool pages), layer-wise and whole:
bit-exact, the path taken, each layer's event alone guaranteeing its layer, paced and stopped
part-way, refused part-way (a real CUDA error) and counted, ordered after the caller's stream, a KV
layer step over the largest pitch. Every test runs with a layer's copies batched
(``cudaMemcpy3DBatchAsync``) and without; a refused batch falls back to 2-D copies. The CPU tests
(memmove) are in ``test_mover_load_runs.py`` and ``test_mover_load_runs_whole.py``, the batch's
packing in ``test_memcpy_batch.py``."""

from __future__ import annotations

import threading

import pytest
import torch
from kvcase import POISON, poisoned_pages, random_bits, same_bits

from aiokv import cuda
from aiokv.cuda import BATCH_MAX_OPS, BatchCopier, batch_parts
from aiokv.kernels import PageMover, TransferPath, reference_gather, reference_scatter
from aiokv.kernels import mover as mover_module
from aiokv.kernels.slotruns import MAX_PITCH
from aiokv.layout import KVBuffer, KVLayout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LAYOUT = KVLayout.mha(4, 8, 128, torch.bfloat16, page_tokens=256)
T = 256
SLOTS = 4096
Case = tuple[KVBuffer, torch.Tensor, list[int], torch.Tensor, KVBuffer]


def _dense(seed: int) -> KVBuffer:
    gen = torch.Generator().manual_seed(seed)
    return KVBuffer.wrap(LAYOUT, random_bits((4, SLOTS, 16, 128), torch.bfloat16, gen).cuda())


def _poisoned() -> KVBuffer:
    return KVBuffer.wrap(LAYOUT, torch.full((4, SLOTS, 16 * 128 * 2), POISON, dtype=torch.uint8, device="cuda")
                         .view(torch.bfloat16).view(4, SLOTS, 16, 128))


def _case(seed: int, skip: int = 3) -> Case:
    """10 pinned pool pages of random bits; slots: runs per page, pages 2-5 consecutive on both sides."""
    gen = torch.Generator().manual_seed(seed)
    pages = poisoned_pages(LAYOUT, 12, torch.device("cpu")).pin_memory()
    reference_gather(KVBuffer.wrap(LAYOUT, random_bits((4, 12 * T, 16, 128), torch.bfloat16, gen)),
                     torch.arange(12 * T), pages, list(range(12)))
    page_ids = [7, 0, 2, 3, 4, 5, 11, 9, 1, 10]
    starts = [13 * T + 1, 15 * T, 0, T, 2 * T, 3 * T, 9 * T, 6 * T, 4 * T, 10 * T]
    parts = [torch.arange(s, s + T) for s in starts]
    parts[0] = parts[0][skip:]
    slots = torch.cat(parts)
    expect = _poisoned()
    reference_scatter(expect, pages, slots, page_ids, skip_first=skip)
    return _dense(seed), pages, page_ids, slots, expect


def _layer_equal(a: KVBuffer, b: KVBuffer, layer: int) -> bool:
    return same_bits(a.k_layers[layer], b.k_layers[layer])


def _all_equal(a: KVBuffer, b: KVBuffer) -> bool:
    return all(_layer_equal(a, b, layer) for layer in range(LAYOUT.num_layers))


@pytest.fixture(autouse=True, params=[False, True], ids=["2d", "batch"])
def batch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> BatchCopier:
    """The process's batch copier for the test: a fresh one, batching or not (the parameter)."""
    torch.cuda.init()
    runtime = cuda._runtime_library()
    assert runtime is not None
    copier = BatchCopier(runtime, enabled=request.param)
    if request.param and not copier.available:
        pytest.skip(f"the CUDA runtime ({copier.version}) has no cudaMemcpy3DBatchAsync")
    monkeypatch.setattr(cuda, "_batch_copier", copier)
    return copier


def _no_staging(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Staged units raise; returns a list that counts the copies queued (2-D copies and the ops of
    batches the runtime took: a refused batch's copies are counted as the 2-D copies they become)."""
    def no_staging(*_: object) -> None:
        raise AssertionError("a load by runs issued a staged unit")

    monkeypatch.setattr(PageMover, "_issue_unit", no_staging)
    copies: list[int] = []
    real = mover_module._cuda.memcpy2d_async

    def counting(*args: object) -> None:
        copies.append(1)
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(mover_module._cuda, "memcpy2d_async", counting)
    real_batch = BatchCopier._issue_batch

    def counting_batch(self: BatchCopier, part: list[object], stream: torch.cuda.Stream) -> int:
        err = real_batch(self, part, stream)  # type: ignore[arg-type]
        if err == 0:
            copies.extend([1] * len(part))
        return err

    monkeypatch.setattr(BatchCopier, "_issue_batch", counting_batch)
    return copies


def test_paced_load_by_runs_is_bit_exact_after_the_callers_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    _, pages, page_ids, slots, expect = _case(31)
    staged = _poisoned()
    plain = PageMover(staged, pages, TransferPath.STAGING, 2, run_pages=12, load_runs=False)
    paced_plain = plain.start_layers(page_ids, slots, 3)
    assert paced_plain is not None and not paced_plain.by_runs
    paced_plain.feed()
    assert _all_equal(staged, expect)

    copies = _no_staging(monkeypatch)
    back = _poisoned()
    mover = PageMover(back, pages, TransferPath.STAGING, 2, run_pages=12)
    engine = torch.cuda.Stream()
    with torch.cuda.stream(engine):
        torch.cuda._sleep(50_000_000)  # the caller's stream is busy, then writes the slots the load fills
        back.k_layers[2][slots[-1].item()].fill_(0)
        paced = mover.start_layers(page_ids, slots, 3, pace_bytes=1)
    assert paced is not None and paced.by_runs
    assert mover.runs_loaded == 0  # counted as copied, not as planned
    issued: list[tuple[int, bool]] = []
    thread = threading.Thread(target=paced.feed, args=(lambda layer, queued: issued.append((layer, queued)),))
    thread.start()
    for layer in range(LAYOUT.num_layers):
        assert paced.wait_issued(layer, timeout=30)
        torch.cuda.current_stream().wait_event(paced.events[layer])
        torch.cuda.current_stream().synchronize()
        assert _layer_equal(back, expect, layer), layer
    thread.join(30)
    assert issued == [(layer, True) for layer in range(LAYOUT.num_layers)]
    # pace_bytes=1: one page a unit (10 a layer), so one copy per page and layer.
    assert paced.issued_units == 10 * LAYOUT.num_layers
    assert len(copies) == 10 * LAYOUT.num_layers
    assert _all_equal(back, expect) and _all_equal(back, staged)
    assert mover._paced_active == 0
    assert mover.runs_loaded == len(page_ids)


def test_paced_load_by_runs_merges_pages_consecutive_on_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    _, pages, page_ids, slots, expect = _case(32)
    copies = _no_staging(monkeypatch)
    back = _poisoned()
    mover = PageMover(back, pages, TransferPath.STAGING, 2, run_pages=12)
    paced = mover.start_layers(page_ids, slots, 3)  # the default pace: one unit a layer
    assert paced is not None and paced.by_runs
    paced.feed()
    # Page 0 (partly needed) alone, pages 2-5 as one copy, the 5 others alone: 7 copies a layer.
    assert paced.issued_units == LAYOUT.num_layers
    assert len(copies) == 7 * LAYOUT.num_layers
    assert _all_equal(back, expect)


def test_paced_load_by_runs_stopped_part_way_orders_everything_it_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    _, pages, page_ids, slots, expect = _case(33)
    _no_staging(monkeypatch)
    back = _poisoned()
    mover = PageMover(back, pages, TransferPath.STAGING, 2, run_pages=12)
    paced = mover.start_layers(page_ids, slots, 3, pace_bytes=1)
    assert paced is not None and paced.by_runs
    reported: dict[int, bool] = {}

    def on_issued(layer: int, queued: bool) -> None:
        reported[layer] = queued
        if layer == 0:
            paced.stop()

    with pytest.raises(RuntimeError, match="stopped after"):
        paced.feed(on_issued)
    assert all(flag.is_set() for flag in paced.issued)
    assert reported == {layer: layer == 0 for layer in range(LAYOUT.num_layers)}
    assert paced.queued == [layer == 0 for layer in range(LAYOUT.num_layers)]
    assert paced.end.query() and paced.events[-1].query()
    assert _layer_equal(back, expect, 0)
    assert mover._paced_active == 0
    assert mover.runs_loaded == 0, "a page of which only layer 0 was copied counted as loaded"
    again = mover.start_layers(page_ids, slots, 3)
    assert again is not None and again.by_runs
    again.feed()
    assert _all_equal(back, expect)
    assert mover.runs_loaded == len(page_ids)
    # A whole-page load after it (by runs too: lanes, not the copy stream), ordered after the paced end.
    event = mover.load(page_ids, slots, 3)
    assert event is not None
    event.synchronize()
    assert _all_equal(back, expect)
    assert mover.runs_loaded == 2 * len(page_ids)


def test_each_layer_event_of_a_load_by_runs_alone_guarantees_its_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    # As the staged test in test_kernels_gpu.py: the copies of layers >= 1 are held back on the
    # host; event 0 completes with layer 0 in place while nothing of the later layers was queued.
    _, pages, page_ids, slots, expect = _case(34, skip=0)
    real = PageMover._issue_run_unit
    gate, layer1 = threading.Event(), threading.Event()

    def held(self: PageMover, plan: object, unit: mover_module.LayerUnit, stream: torch.cuda.Stream | None) -> None:
        if unit.layer >= 1 and not gate.is_set():
            layer1.set()
            assert gate.wait(60), "the test never released the later layers"
        real(self, plan, unit, stream)  # type: ignore[arg-type]

    monkeypatch.setattr(PageMover, "_issue_run_unit", held)
    back = _poisoned()
    mover = PageMover(back, pages, TransferPath.STAGING, 2, run_pages=12)
    out: list[list[torch.cuda.Event] | None] = []
    thread = threading.Thread(target=lambda: out.append(mover.load_layers(page_ids, slots)))
    thread.start()
    try:
        assert layer1.wait(60)
        # Layer 0's event exists only inside load_layers: wait for layer 0's copies via the copy stream.
        staging = mover._layered
        assert staging is not None and staging.copy_stream is not None
        staging.copy_stream.synchronize()
        assert _layer_equal(back, expect, 0)
        assert not _layer_equal(back, expect, 1), "layer 1 landed although none of its copies was queued"
    finally:
        gate.set()
        thread.join(60)
    events = out[0]
    assert events is not None and len(events) == LAYOUT.num_layers
    assert mover.runs_loaded == len(page_ids)
    for layer in range(LAYOUT.num_layers):
        events[layer].synchronize()
        assert _layer_equal(back, expect, layer), layer
    assert _all_equal(back, expect)


def _refusing(monkeypatch: pytest.MonkeyPatch, at: int) -> list[int]:
    """2-D copy number ``at`` (from 0) gets a destination pitch below its width: the runtime refuses
    it (a real CUDA error). Returns the list the copies are counted in."""
    real = mover_module._cuda.memcpy2d_async
    calls: list[int] = []

    def refusing(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
                 stream: torch.cuda.Stream) -> None:
        calls.append(height)
        real(dst, 1 if len(calls) == at + 1 else dpitch, src, spitch, width, height, stream)

    monkeypatch.setattr(mover_module._cuda, "memcpy2d_async", refusing)
    return calls


def _no_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_chunk(*_: object) -> None:
        raise AssertionError("a whole-page load by runs staged a chunk")

    monkeypatch.setattr(PageMover, "_load_chunk", no_chunk)


def test_whole_load_by_runs_is_bit_exact_after_the_callers_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    _, pages, page_ids, slots, expect = _case(35)
    _no_chunks(monkeypatch)
    copies = _no_staging(monkeypatch)
    back = _poisoned()
    mover = PageMover(back, pages, TransferPath.STAGING, 2, run_pages=12)
    engine = torch.cuda.Stream()
    with torch.cuda.stream(engine):
        torch.cuda._sleep(50_000_000)  # the caller's stream is busy, then writes a slot the load fills
        back.k_layers[3][slots[-1].item()].fill_(0)
        event = mover.load(page_ids, slots, 3)
    assert event is not None
    event.synchronize()
    # By page (10 copies of 4 layers) rather than by layer (7 runs: 28 copies).
    assert copies == [1] * 10
    assert mover.runs_loaded == len(page_ids)
    assert _all_equal(back, expect), "the load was overtaken by the caller's earlier write, or wrong"

    # 8 pages consecutive in the pool and in slots: by layer, 4 copies of 8 pages (one a layer).
    copies.clear()
    ids, run = list(range(8)), torch.arange(T, 9 * T)
    want = _poisoned()
    reference_scatter(want, pages, run, ids)
    again = _poisoned()
    loader = PageMover(again, pages, TransferPath.STAGING, 2, run_pages=12)
    event = loader.load(ids, run)
    assert event is not None
    event.synchronize()
    assert len(copies) == LAYOUT.num_layers and loader.runs_loaded == 8
    assert _all_equal(again, want)


def test_whole_load_by_runs_refused_part_way_orders_the_caller_after_its_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The third page's copy is refused: the error propagates, the two pages queued before it are
    counted and land, and the caller's stream is ordered after them (its write to one of their
    slots, queued right after the failure, is not overwritten by the late copy)."""
    _, pages, page_ids, slots, expect = _case(36)
    _no_chunks(monkeypatch)
    _refusing(monkeypatch, 2)
    back = _poisoned()
    mover = PageMover(back, pages, TransferPath.STAGING, 2, run_pages=12)
    engine = torch.cuda.Stream()
    last = slots[T - 3 - 1].item()  # page 0's last row: the end of its copy's last layer
    with torch.cuda.stream(engine):
        torch.cuda._sleep(50_000_000)  # the lanes wait for it, so the copies run after the failure
        with pytest.raises(RuntimeError, match="cudaMemcpy2DAsync"):
            mover.load(page_ids, slots, 3)
        back.k_layers[3][last].fill_(0)
    engine.synchronize()
    assert mover.runs_loaded == 2
    assert bool((back.k_layers[3][last] == 0).all()), "the caller's write was overtaken by the load"
    done = slots[: 2 * T - 3]
    for layer in range(LAYOUT.num_layers):
        got, want = back.k_layers[layer].clone(), expect.k_layers[layer].clone()
        if layer == 3:
            want[last] = 0
        assert same_bits(got[done], want[done]), layer
        assert bool((got[slots[2 * T - 3 :]].view(torch.uint8) == POISON).all()), layer


def test_paced_load_by_runs_refused_in_its_last_layer_counts_the_pages_copied_whole(
    monkeypatch: pytest.MonkeyPatch, batch: BatchCopier,
) -> None:
    if batch.enabled:
        pytest.skip("a refused 2-D copy: batched, a refusal falls back (test_a_refused_batch_...)")
    # A pace of 1 byte: one page a unit, one copy a unit (10 a layer). The copy of the last layer's
    # fifth page is refused: four pages were copied whole (the others lack their last layer).
    _, pages, page_ids, slots, expect = _case(37)
    _no_staging(monkeypatch)  # a staged unit fails the test
    _refusing(monkeypatch, 10 * (LAYOUT.num_layers - 1) + 4)
    back = _poisoned()
    mover = PageMover(back, pages, TransferPath.STAGING, 2, run_pages=12)
    paced = mover.start_layers(page_ids, slots, 3, pace_bytes=1)
    assert paced is not None and paced.by_runs
    with pytest.raises(RuntimeError, match="cudaMemcpy2DAsync"):
        paced.feed()
    assert paced.end.query()
    assert paced.queued == [layer < LAYOUT.num_layers - 1 for layer in range(LAYOUT.num_layers)]
    assert mover.runs_loaded == 4
    whole = slots[: 4 * T - 3]
    for layer in range(LAYOUT.num_layers - 1):
        assert _layer_equal(back, expect, layer), layer
    assert same_bits(back.k_layers[-1][whole], expect.k_layers[-1][whole])


def test_a_kv_layer_step_over_the_largest_pitch_loads_by_runs_layer_by_layer() -> None:
    """Two layers 2 GiB + 64 KiB apart (4 GiB of GPU memory, never initialised): a whole page cannot
    be one copy (the layer step would be its destination pitch, which the runtime refuses), so the
    whole load copies layer by layer; the layer-wise load too. Both by runs, bit-exact; before,
    both staged."""
    layout = KVLayout.mha(2, 8, 128, torch.bfloat16, page_tokens=16)
    tokens = 16
    num_slots = MAX_PITCH // (16 * 128 * 2) + 16
    big = torch.empty((2, num_slots, 16, 128), dtype=torch.bfloat16, device="cuda")
    kv = KVBuffer.wrap(layout, big)
    gen = torch.Generator().manual_seed(38)
    pages = random_bits((6, *layout.page_shape), torch.bfloat16, gen).pin_memory()
    used = big[:, : 16 * tokens]
    used.view(torch.uint8).fill_(POISON)
    want = used.cpu()
    rows = pages.transpose(0, 1).reshape(2, -1, 16, 128)
    mover = PageMover(kv, pages, TransferPath.STAGING, 2)
    layered_ids, layered = [2, 3], torch.arange(10 * tokens, 12 * tokens)
    events = mover.load_layers(layered_ids, layered)
    assert events is not None
    events[-1].synchronize()
    want[:, layered] = torch.cat([rows[:, p * tokens : (p + 1) * tokens] for p in layered_ids], dim=1)
    assert mover.runs_loaded == 2
    assert same_bits(used, want)

    ids, slots = [4, 1, 5], torch.cat([torch.arange(1, tokens), torch.arange(5 * tokens, 7 * tokens)])
    event = mover.load(ids, slots, 1)
    assert event is not None
    event.synchronize()
    want[:, slots] = torch.cat([rows[:, p * tokens : (p + 1) * tokens] for p in ids], dim=1)[:, 1:]
    assert mover.runs_loaded == 5
    assert same_bits(used, want)
    del big, used


def test_offload_of_a_kv_layer_step_over_the_largest_pitch_gathers() -> None:
    """The same buffer offloads by the gather kernel (no run copy), bit-exact: its layer addresses
    are over 2 GiB apart."""
    layout = KVLayout.mha(2, 8, 128, torch.bfloat16, page_tokens=16)
    num_slots = MAX_PITCH // (16 * 128 * 2) + 16
    big = torch.empty((2, num_slots, 16, 128), dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(39)
    big[:, : 64].copy_(random_bits((2, 64, 16, 128), torch.bfloat16, gen).cuda())
    kv = KVBuffer.wrap(layout, big)
    out = torch.zeros((4, *layout.page_shape), dtype=torch.bfloat16).pin_memory()
    mover = PageMover(kv, out, TransferPath.STAGING, 2, slot_runs=True)
    event = mover.offload(torch.arange(16, 48), [3, 0])
    assert event is not None
    event.synchronize()
    assert mover.runs_offloaded == 0
    small = KVBuffer.wrap(layout, big[:, : 64].cpu())
    want = torch.zeros_like(out)
    reference_gather(small, torch.arange(16, 48), want, [3, 0])
    assert same_bits(out, want)
    del big


# -- a layer's copies in batches (cudaMemcpy3DBatchAsync) -------------------------------------------

SMALL = KVLayout.mha(3, 1, 16, torch.bfloat16, page_tokens=4)
"""Small pages: hundreds of runs a layer in a few KiB."""


def _many_runs(seed: int, runs: int, merge: bool, skip: int) -> tuple[torch.Tensor, list[int], torch.Tensor, int]:
    """Pinned pool pages of random bits and a load of ``runs`` runs (each 1-4 pages consecutive in
    the pool and in slots where ``merge``, else one page), in shuffled order: the pages, their ids,
    the slots (page 0 from its row ``skip``) and the KV buffer's slot count."""
    gen = torch.Generator().manual_seed(seed)
    t = SMALL.page_tokens
    lengths = torch.randint(1, 5, (runs,), generator=gen).tolist() if merge else [1] * runs
    pool_at, slot_at = torch.randperm(runs, generator=gen).tolist(), torch.randperm(runs, generator=gen).tolist()
    ids: list[int] = []
    blocks: list[int] = []
    for r, n in enumerate(lengths):
        ids += [4 * pool_at[r] + i for i in range(n)]
        blocks += [4 * slot_at[r] + i for i in range(n)]
    pages = poisoned_pages(SMALL, 4 * runs, torch.device("cpu")).pin_memory()
    source = random_bits((3, 4 * runs * t, 2, 16), torch.bfloat16, gen)
    reference_gather(KVBuffer.wrap(SMALL, source), torch.arange(4 * runs * t), pages, list(range(4 * runs)))
    slots = torch.cat([torch.arange(b * t, (b + 1) * t) for b in blocks])[skip:]
    return pages, ids, slots, 4 * runs * t


def _small_poisoned(num_slots: int) -> KVBuffer:
    return KVBuffer.wrap(SMALL, torch.full((3, num_slots, 2 * 16 * 2), POISON, dtype=torch.uint8, device="cuda")
                         .view(torch.bfloat16).view(3, num_slots, 2, 16))


def _small_equal(a: KVBuffer, b: KVBuffer) -> bool:
    return all(same_bits(a.k_layers[layer], b.k_layers[layer]) for layer in range(SMALL.num_layers))  # K and V rows


@pytest.mark.parametrize(("runs", "merge", "skip"), [
    (1, False, 0), (7, True, 2), (BATCH_MAX_OPS, False, 0), (BATCH_MAX_OPS + 1, False, 1), (150, True, 3),
    (2 * BATCH_MAX_OPS + 22, False, 0),
])
def test_layer_wise_loads_of_many_run_shapes_are_bit_exact(
    monkeypatch: pytest.MonkeyPatch, batch: BatchCopier, runs: int, merge: bool, skip: int
) -> None:
    """Whole layer-wise loads and paced ones, one unit a layer: a layer's copies in batches of at
    most BATCH_MAX_OPS (several calls beyond it; a single copy alone), or one 2-D copy each; the
    same bytes either way."""
    pages, ids, slots, num_slots = _many_runs(40 + runs, runs, merge, skip)
    expect = _small_poisoned(num_slots)
    reference_scatter(expect, pages, slots, ids, skip_first=skip)
    copies = _no_staging(monkeypatch)
    layers = SMALL.num_layers

    back = _small_poisoned(num_slots)
    mover = PageMover(back, pages, TransferPath.STAGING, 2, run_pages=pages.shape[0])
    events = mover.load_layers(ids, slots, skip)
    assert events is not None and len(events) == layers
    events[-1].synchronize()
    assert _small_equal(back, expect)
    assert mover.runs_loaded == len(ids)
    per_layer, rest = divmod(len(copies), layers)
    assert rest == 0 and per_layer >= runs  # page 0 alone when partly needed
    calls = layers * (len(batch_parts(per_layer)) if per_layer > 1 else 0)
    assert batch.batch_calls == (calls if batch.enabled else 0)

    paced_back = _small_poisoned(num_slots)
    paced_mover = PageMover(paced_back, pages, TransferPath.STAGING, 2, run_pages=pages.shape[0])
    paced = paced_mover.start_layers(ids, slots, skip)
    assert paced is not None and paced.by_runs and paced.issued_units == 0
    paced.feed()
    assert paced.issued_units == layers
    assert _small_equal(paced_back, expect)
    assert batch.batch_calls == (2 * calls if batch.enabled else 0)
    assert len(copies) == 2 * per_layer * layers


def test_a_refused_batch_falls_back_to_2d_copies_and_the_load_is_bit_exact(
    monkeypatch: pytest.MonkeyPatch, batch: BatchCopier
) -> None:
    """The second batch call (layer 0's second of three: 150 copies a layer) gets an op of depth 0,
    which the runtime refuses (a real CUDA error): its copies and every later one go by 2-D copies,
    batches stay off, the error is cleared (torch's next launch does not see it), and the load
    lands bit-exact."""
    if not batch.enabled:
        pytest.skip("batches only")
    real_ops = cuda.batch_ops
    packed: list[int] = []

    def refused_second(copies: list[object]) -> object:
        ops = real_ops(copies)  # type: ignore[arg-type]
        packed.append(len(copies))
        if len(packed) == 2:
            ops[len(ops) // 2].extent.depth = 0
        return ops

    monkeypatch.setattr(cuda, "batch_ops", refused_second)
    runs = 2 * BATCH_MAX_OPS + 22
    pages, ids, slots, num_slots = _many_runs(51, runs, False, 0)
    expect = _small_poisoned(num_slots)
    reference_scatter(expect, pages, slots, ids)
    copies = _no_staging(monkeypatch)
    back = _small_poisoned(num_slots)
    mover = PageMover(back, pages, TransferPath.STAGING, 2, run_pages=pages.shape[0])
    events = mover.load_layers(ids, slots)
    assert events is not None
    events[-1].synchronize()
    assert batch.failure is not None and "cudaMemcpy3DBatchAsync" in batch.failure, batch.failure
    assert not batch.available and batch.batch_calls == 1
    assert packed == batch_parts(runs)[:2]  # nothing packed after the refusal
    assert len(copies) == runs * SMALL.num_layers  # 50 in the batch taken, the rest by 2-D copies
    assert _small_equal(back, expect)
    assert torch.ones(4, device="cuda").add_(1).sum().item() == 8  # no CUDA error left behind
