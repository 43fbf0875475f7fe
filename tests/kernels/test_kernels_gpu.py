"""Real shapes on a GPU: an 8B-class MHA layout and an MLA layout, every path, stream ordering.

Skipped without CUDA (the same tests run at small shapes everywhere in the other files).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from kvcase import ALL_DTYPES, POISON, bits, distinct_slots, empty_like_kv, kv_equal, poisoned_pages, random_bits

from aiokv.kernels import PageMover, TransferPath, gather, reference_gather, reference_scatter, scatter
from aiokv.layout import BufferForm, KVBuffer, KVLayout, TPSlice
from aiokv.pool import PagePool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

REAL = {
    "mha-8b": KVLayout.mha(32, 8, 128, torch.bfloat16, page_tokens=256),
    "mla": KVLayout.mla(61, 576, torch.bfloat16, page_tokens=256),
}
SLOTS = 4096
PAGES = 10


@pytest.fixture(params=sorted(REAL))
def real(request: pytest.FixtureRequest) -> Iterator[tuple[KVLayout, PagePool]]:
    layout = REAL[request.param]
    pool = PagePool.create(layout, PAGES * layout.page_bytes)
    pool.wait_ready_blocking()
    try:
        yield layout, pool
    finally:
        pool.close()


def _random_kv(layout: KVLayout, seed: int) -> KVBuffer:
    gen = torch.Generator("cuda").manual_seed(seed)
    shape = (layout.num_layers, SLOTS, layout.rows, layout.head_dim)
    return KVBuffer.wrap(layout, random_bits(shape, layout.dtype, gen))


@pytest.mark.parametrize("path", list(TransferPath), ids=lambda p: p.value)
@pytest.mark.parametrize("count", [1, 3, 7])
def test_real_shapes_every_path(real: tuple[KVLayout, PagePool], path: TransferPath, count: int) -> None:
    layout, pool = real
    tokens = layout.page_tokens
    pool.pages.view(torch.uint8).fill_(POISON)
    kv = _random_kv(layout, count)
    gen = torch.Generator().manual_seed(count)
    slots = distinct_slots(count * tokens, SLOTS, gen)
    page_ids = torch.randperm(PAGES, generator=gen)[:count].tolist()
    mover = PageMover(kv, pool.pages, path)
    event = mover.offload(slots, page_ids)
    assert event is not None
    event.synchronize()
    # The reference and the comparison on the GPU: on the host, 320-610 MiB of pages a case took
    # 15-130 CPU-s under 16 test processes (the pool's bytes are copied to the GPU once instead).
    want = poisoned_pages(layout, PAGES, kv.device)
    reference_gather(kv, slots, want, page_ids)
    # Page by page: the pool is registered with CUDA in chunks, and one copy out of a range that
    # spans two registrations fails ("invalid argument").
    for page in range(PAGES):
        assert torch.equal(bits(pool.pages[page]).to(kv.device), bits(want[page])), page

    skip = 100
    back = empty_like_kv(kv)
    load_slots = distinct_slots(count * tokens - skip, SLOTS, gen)
    event = PageMover(back, pool.pages, path).load(page_ids, load_slots, skip_first=skip)
    assert event is not None
    torch.cuda.current_stream().wait_event(event)
    expect = empty_like_kv(kv)
    reference_scatter(expect, pool.pages, load_slots, page_ids, skip_first=skip)
    assert kv_equal(back, expect)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("form", list(BufferForm), ids=lambda f: f.value)
@pytest.mark.parametrize("tp_size", [1, 2, 16])
def test_kernels_every_dtype_form_tp_at_real_width(dtype: torch.dtype, form: BufferForm, tp_size: int) -> None:
    layout = KVLayout.mha(4, 8, 128, dtype, page_tokens=64)
    tp = TPSlice.of(layout, {1: 0, 2: 1, 16: 14}[tp_size], tp_size)  # a writer with a non-zero head_start
    gen = torch.Generator().manual_seed(tp_size)
    heads = tp.local_heads
    full = random_bits((4, 512, 2 * heads, 128), dtype, gen).cuda()
    kv: KVBuffer
    if form is BufferForm.STACKED:
        kv = KVBuffer.wrap(layout, full, tp)
    elif form is BufferForm.PER_LAYER:
        kv = KVBuffer.wrap(layout, [full[i].clone() for i in range(4)], tp)
    else:
        kv = KVBuffer.wrap(
            layout, ([full[i, :, :heads].clone() for i in range(4)], [full[i, :, heads:].clone() for i in range(4)]), tp
        )
    slots = distinct_slots(5 * 64, 512, gen)
    for device in ("cuda", "pinned"):
        pages = poisoned_pages(layout, 8, torch.device("cuda" if device == "cuda" else "cpu"))
        if device == "pinned":
            pages = pages.pin_memory()
        want = pages.clone()
        gather(kv, slots, pages, [7, 1, 3, 0, 5])
        torch.cuda.synchronize()
        reference_gather(kv, slots, want, [7, 1, 3, 0, 5])
        assert torch.equal(bits(pages), bits(want)), device
        back, expect = empty_like_kv(kv), empty_like_kv(kv)
        scatter(back, pages, slots[17:], [7, 1, 3, 0, 5], skip_first=17)
        torch.cuda.synchronize()
        reference_scatter(expect, pages, slots[17:], [7, 1, 3, 0, 5], skip_first=17)
        assert kv_equal(back, expect), device


@pytest.mark.parametrize("path", [TransferPath.STAGING, TransferPath.DIRECT], ids=lambda p: p.value)
def test_side_stream_waits_for_the_engine_and_copies_host_indices(path: TransferPath) -> None:
    layout = REAL["mha-8b"]
    with PagePool.create(layout, 4 * layout.page_bytes) as pool:
        pool.wait_ready_blocking()
        shape = (layout.num_layers, SLOTS, layout.rows, layout.head_dim)
        kv_tensor = torch.zeros(shape, dtype=layout.dtype, device="cuda")
        kv = KVBuffer.wrap(layout, kv_tensor)
        mover = PageMover(kv, pool.pages, path)
        slots = torch.arange(512, 1024)
        expect_slots = slots.clone()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the engine's stream, then its write
        kv_tensor[:, 512:1024].fill_(3.0)
        event = mover.offload(slots, [2, 0])
        slots.fill_(0)  # the caller reuses its index tensor at once: the mover must have its own copy
        assert event is not None
        event.synchronize()
        assert bool((pool.pages[[2, 0]] == 3.0).all()), "offload read the slots before the engine wrote them"
        del expect_slots

        target = torch.zeros_like(kv_tensor)
        loader = PageMover(KVBuffer.wrap(layout, target), pool.pages, path)
        torch.cuda._sleep(200_000_000)
        target[:, 0:512].fill_(7.0)  # the engine's earlier write to those slots must land first
        event = loader.load([2, 0], torch.arange(512))
        assert event is not None
        torch.cuda.current_stream().wait_event(event)
        assert bool((target[:, 0:512] == 3.0).all()), "load was overtaken by an earlier engine write"
        assert bool((target[:, 512:] == 0).all())


# -- layer-wise loads (STAGING pipeline: copy stream -> layer buffers -> scatter stream) ----------


def _layer_equal(a: KVBuffer, b: KVBuffer, layer: int) -> bool:
    pairs = [(a.k_layers[layer], b.k_layers[layer])] + ([(a.v_layers[layer], b.v_layers[layer])] if a.v_layers else [])
    return all(torch.equal(bits(x), bits(y)) for x, y in pairs)


def test_layer_wise_load_of_registered_pool_pages_at_real_shapes(real: tuple[KVLayout, PagePool]) -> None:
    from aiokv.cuda import raw_memcpy_available

    assert raw_memcpy_available(), "the layer slabs would go through torch's copy_ (host bound)"
    layout, pool = real
    kv = _random_kv(layout, 11)
    gen = torch.Generator().manual_seed(11)
    page_ids = torch.randperm(PAGES, generator=gen)[:9].tolist()
    event = PageMover(kv, pool.pages).offload(distinct_slots(9 * layout.page_tokens, SLOTS, gen), page_ids)
    assert event is not None
    event.synchronize()
    skip = 77
    slots = distinct_slots(9 * layout.page_tokens - skip, SLOTS, gen)
    back = empty_like_kv(kv)
    events = PageMover(back, pool.pages, TransferPath.STAGING, 2).load_layers(page_ids, slots, skip)
    assert events is not None and len(events) == layout.num_layers
    events[-1].synchronize()
    expect = empty_like_kv(kv)
    reference_scatter(expect, pool.pages, slots, page_ids, skip_first=skip)
    assert kv_equal(back, expect)


def test_layer_wise_runs_of_consecutive_pages_as_2d_copies(real: tuple[KVLayout, PagePool]) -> None:
    # Runs of consecutive pool pages go as one cudaMemcpy2DAsync each, never across two pinned
    # registrations (chunks of the pool): pages 0-9 in small chunks, loaded in an order that makes
    # runs, breaks and chunk crossings.
    layout, big = real
    big.close()
    pool = PagePool.create(layout, PAGES * layout.page_bytes, chunk_bytes=3 * layout.page_bytes)
    pool.wait_ready_blocking()
    try:
        assert pool.chunk_pages == 3
        kv = _random_kv(layout, 12)
        gen = torch.Generator().manual_seed(12)
        page_ids = [1, 2, 3, 4, 5, 9, 7, 8, 0]
        event = PageMover(kv, pool.pages).offload(distinct_slots(9 * layout.page_tokens, SLOTS, gen), page_ids)
        assert event is not None
        event.synchronize()
        slots = distinct_slots(9 * layout.page_tokens - 5, SLOTS, gen)
        back = empty_like_kv(kv)
        mover = PageMover(back, pool.pages, TransferPath.STAGING, 8, run_pages=pool.chunk_pages)
        events = mover.load_layers(page_ids, slots, 5)
        assert events is not None
        events[-1].synchronize()
        expect = empty_like_kv(kv)
        reference_scatter(expect, pool.pages, slots, page_ids, skip_first=5)
        assert kv_equal(back, expect)
    finally:
        pool.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int8], ids=str)
@pytest.mark.parametrize("staging_pages", [1, 8])  # one-page groups (37 a layer) and groups of 13
@pytest.mark.parametrize("raw", [True, False], ids=["cudart", "torch-copy"])
def test_layer_wise_load_odd_sizes_many_pages(
    dtype: torch.dtype, staging_pages: int, raw: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not raw:
        monkeypatch.setattr("aiokv.cuda.raw_memcpy_available", lambda: False)
    layout = KVLayout.mha(5, 3, 40, dtype, page_tokens=48)
    gen = torch.Generator().manual_seed(staging_pages)
    count, num_slots = 37, 37 * 48 + 29
    kv = KVBuffer.wrap(layout, random_bits((5, num_slots, 6, 40), dtype, gen).cuda())
    pages = poisoned_pages(layout, 41, torch.device("cpu")).pin_memory()
    page_ids = torch.randperm(41, generator=gen)[:count].tolist()
    reference_gather(kv, distinct_slots(count * 48, num_slots, gen), pages, page_ids)
    skip = 47
    slots = distinct_slots(count * 48 - skip, num_slots, gen)
    back = empty_like_kv(kv)
    events = PageMover(back, pages, TransferPath.STAGING, staging_pages).load_layers(page_ids, slots, skip)
    assert events is not None
    torch.cuda.current_stream().wait_event(events[-1])
    expect = empty_like_kv(kv)
    reference_scatter(expect, pages, slots, page_ids, skip_first=skip)
    assert kv_equal(back, expect)


def test_each_layer_event_alone_guarantees_its_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    # The copies of layers >= 1 are held back on the host (the loading thread blocks before
    # queuing them): event 0 must complete with layer 0 in place while nothing of the later layers
    # was queued, and each later event with its layer. (Holding them on the GPU instead, with a
    # sleep kernel on the copy stream, proves nothing: streams that share a hardware queue with
    # the copy stream then wait behind the sleep too, event 0's among them.)
    import threading

    layout = KVLayout.mha(4, 8, 128, torch.bfloat16, page_tokens=256)
    gen = torch.Generator().manual_seed(3)
    kv = KVBuffer.wrap(layout, random_bits((4, 4096, 16, 128), torch.bfloat16, gen).cuda())
    pages = poisoned_pages(layout, 12, torch.device("cpu")).pin_memory()
    page_ids = torch.randperm(12, generator=gen)[:10].tolist()
    reference_gather(kv, distinct_slots(10 * 256, 4096, gen), pages, page_ids)
    slots = distinct_slots(10 * 256, 4096, gen)
    expect = empty_like_kv(kv)
    reference_scatter(expect, pages, slots, page_ids)
    real_copy, real_done = PageMover._copy_unit, PageMover._layer_done
    gate, layer0, holding = threading.Event(), threading.Event(), threading.Event()
    held: list[int] = []
    published: list[torch.cuda.Event] = []

    def held_copy(self: PageMover, buffer: torch.Tensor, ids: list[int], runs: list[tuple[int, int, int]],
                  layer: int, stream: torch.cuda.Stream | None) -> None:
        if layer >= 1 and not gate.is_set():
            held.append(layer)
            holding.set()
            assert gate.wait(60), "the test never released the later layers"
        real_copy(self, buffer, ids, runs, layer, stream)

    def publishing(streams: list[torch.cuda.Stream], events: list[torch.cuda.Event], on_layer: object,
                   layer: int) -> None:
        real_done(streams, events, on_layer, layer)  # type: ignore[arg-type]
        published.append(events[-1])
        if layer == 0:
            layer0.set()

    monkeypatch.setattr(PageMover, "_copy_unit", held_copy)
    monkeypatch.setattr(PageMover, "_layer_done", staticmethod(publishing))
    back = empty_like_kv(kv)
    mover = PageMover(back, pages, TransferPath.STAGING, 2)
    assert mover.effective_path is TransferPath.STAGING, mover.effective_path
    out: list[list[torch.cuda.Event] | None] = []
    failed: list[BaseException] = []

    def load() -> None:
        try:
            out.append(mover.load_layers(page_ids, slots))
        except BaseException as exc:  # surfaced below
            failed.append(exc)
            gate.set()
            layer0.set()
            holding.set()

    thread = threading.Thread(target=load)
    thread.start()
    try:
        assert layer0.wait(60) and not failed, failed
        # The loading thread reaches layer 1's first copy after publishing layer 0: wait for it to
        # be held there (checking at once raced with it: failed under 16 xdist workers on the H200).
        assert holding.wait(60) and not failed, failed
        published[0].synchronize()
        assert held == [1], "the loading thread is not held before layer 1's first copy"
        assert _layer_equal(back, expect, 0)
        assert not _layer_equal(back, expect, 1), "layer 1 landed although none of its copies was queued"
    finally:
        gate.set()
        thread.join(60)
    assert not failed, failed
    events = out[0]
    assert events is not None and len(events) == 4 and events == published
    for layer in range(1, 4):
        events[layer].synchronize()
        assert _layer_equal(back, expect, layer), layer
    assert kv_equal(back, expect)


# -- paced layer-wise loads (start_layers + feed on a thread: a few units queued at a time) --------


PacedCase = tuple[KVLayout, KVBuffer, torch.Tensor, list[int], torch.Tensor, KVBuffer]


def _paced_case(seed: int, count: int = 10) -> PacedCase:
    layout = KVLayout.mha(4, 8, 128, torch.bfloat16, page_tokens=256)
    gen = torch.Generator().manual_seed(seed)
    kv = KVBuffer.wrap(layout, random_bits((4, 4096, 16, 128), torch.bfloat16, gen).cuda())
    pages = poisoned_pages(layout, 12, torch.device("cpu")).pin_memory()
    page_ids = torch.randperm(12, generator=gen)[:count].tolist()
    reference_gather(kv, distinct_slots(count * 256, 4096, gen), pages, page_ids)
    slots = distinct_slots(count * 256 - 3, 4096, gen)
    expect = empty_like_kv(kv)
    reference_scatter(expect, pages, slots, page_ids, skip_first=3)
    return layout, kv, pages, page_ids, slots, expect


def test_paced_layer_wise_load_is_bit_exact_and_never_runs_far_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from aiokv.kernels import mover as mover_module

    layout, kv, pages, page_ids, slots, expect = _paced_case(21)
    back = empty_like_kv(kv)
    mover = PageMover(back, pages, TransferPath.STAGING, 1)  # one-page groups: 10 units a layer
    waited: list[int] = []
    real_feed = mover_module.feed_paced

    def spying(count: int, window: int, issue, wait, stopped) -> int:  # type: ignore[no-untyped-def]
        def spy_wait(k: int) -> None:
            waited.append(k)
            wait(k)
        return real_feed(count, window, issue, spy_wait, stopped)

    monkeypatch.setattr(mover_module, "feed_paced", spying)
    paced = mover.start_layers(page_ids, slots, 3, pace_bytes=1)
    assert paced is not None and paced.window == mover_module.LAYER_BUFFERS + 1
    assert not paced.issued[0].is_set(), "nothing may be queued before feed()"
    issued: list[tuple[int, bool]] = []
    thread = threading.Thread(target=paced.feed, args=(lambda layer, queued: issued.append((layer, queued)),))
    thread.start()
    for layer in range(layout.num_layers):
        assert paced.wait_issued(layer, timeout=30)
        torch.cuda.current_stream().wait_event(paced.events[layer])
        torch.cuda.current_stream().synchronize()
        assert _layer_equal(back, expect, layer), layer
    thread.join(30)
    assert issued == [(layer, True) for layer in range(layout.num_layers)]
    assert all(paced.queued)
    units = 10 * layout.num_layers
    assert paced.issued_units == units
    half = max(1, paced.window // 2)
    assert waited == sorted(set(waited)) and waited[-1] >= units - paced.window - half, waited
    assert len(waited) <= -(-(units - paced.window) // half), "the feeder woke once per unit"
    assert kv_equal(back, expect)
    assert mover._paced_active == 0


def test_paced_load_stopped_part_way_orders_everything_it_queued() -> None:
    layout, kv, pages, page_ids, slots, expect = _paced_case(22)
    back = empty_like_kv(kv)
    mover = PageMover(back, pages, TransferPath.STAGING, 1)
    paced = mover.start_layers(page_ids, slots, 3, pace_bytes=1)
    assert paced is not None

    reported: dict[int, bool] = {}

    def on_issued(layer: int, queued: bool) -> None:
        reported[layer] = queued
        if layer == 0:
            paced.stop()

    with pytest.raises(RuntimeError, match="stopped after"):
        paced.feed(on_issued)
    assert all(flag.is_set() for flag in paced.issued), "a waiter for a layer never queued would hang"
    # Layer 0 landed; every layer given up is reported so (a waiter must not read it as loaded).
    assert reported == {layer: layer == 0 for layer in range(layout.num_layers)}
    assert paced.queued == [layer == 0 for layer in range(layout.num_layers)]
    assert 10 <= paced.issued_units < 10 * layout.num_layers
    assert paced.end.query() and paced.events[-1].query()
    assert _layer_equal(back, expect, 0)
    assert mover._paced_active == 0
    # The staging is free again: a full paced load after it is bit-exact.
    again = mover.start_layers(page_ids, slots, 3)
    assert again is not None
    again.feed()
    assert kv_equal(back, expect)


def test_whole_page_load_while_a_paced_load_is_queued_reads_the_pool_directly() -> None:
    _, kv, pages, page_ids, slots, expect = _paced_case(23)
    back = empty_like_kv(kv)
    mover = PageMover(back, pages, TransferPath.STAGING, 2)
    paced = mover.start_layers(page_ids[:6], slots[: 6 * 256 - 3], 3)
    assert paced is not None and mover._paced_active == 1
    # Another request's whole-page load meanwhile (its own slots): it must not touch the staging.
    event = mover.load(page_ids[6:], slots[6 * 256 - 3 :])
    assert event is not None
    paced.feed()
    torch.cuda.current_stream().wait_event(event)
    torch.cuda.current_stream().synchronize()
    assert kv_equal(back, expect)
    assert mover._paced_active == 0


def test_discarded_paced_load_frees_the_staging() -> None:
    _, kv, pages, page_ids, slots, expect = _paced_case(24)
    back = empty_like_kv(kv)
    mover = PageMover(back, pages, TransferPath.STAGING, 2)
    paced = mover.start_layers(page_ids, slots, 3)
    assert paced is not None and paced.discard() and not paced.discard()
    assert all(flag.is_set() for flag in paced.issued) and mover._paced_active == 0
    with pytest.raises(RuntimeError, match="runs once"):
        paced.feed()
    events = mover.load_layers(page_ids, slots, 3)  # the staging path again
    assert events is not None
    events[-1].synchronize()
    assert kv_equal(back, expect)


@pytest.mark.asyncio
async def test_a_paced_load_withdrawn_before_it_is_fed_queues_nothing() -> None:
    # quiesce (a cancelled stream) of a paced load still waiting behind other work on the copy
    # thread withdraws it: nothing is ever queued, its layers settle as not landed, the staging is free.
    import threading

    from aiokv.cuda import CompletionBridge
    from aiokv.transfers import LocalTransfers

    _, kv, pages, page_ids, slots, expect = _paced_case(25)
    back = empty_like_kv(kv)
    mover = PageMover(back, pages, TransferPath.STAGING, 1)
    bridge = CompletionBridge()
    bridge.prestart(True)
    transfers = LocalTransfers(mover, bridge, back.device)
    gate = threading.Event()
    try:
        blocker = bridge.run_cpu(lambda: gate.wait(30))  # holds the copy thread
        first = transfers.load_layers(page_ids, slots, 3)
        assert first.paced is not None and mover._paced_active == 1
        await transfers.quiesce([first], offload=False)
        assert first.future.cancelled() and first.paced.issued_units == 0
        assert all(f.done() and f.result() is False for f in first.layer_futures)
        assert mover._paced_active == 0
        gate.set()
        assert await blocker
        second = transfers.load_layers(page_ids, slots, 3)
        assert second.paced is not None
        await second.future
        torch.cuda.current_stream().wait_event(second.paced.end)
        torch.cuda.current_stream().synchronize()
        assert kv_equal(back, expect)
    finally:
        gate.set()
        bridge.close()
