"""The kernel warm-up launches every Triton variant the mover's real copies launch, and touches nothing.

Variants are compared by :func:`aiokv.kernels.launch.launch_key` (Triton's own specialization of
each argument). Most tests record keys with ``launch=False``: the real copies and the warm-up run
all their planning and reach the launch point with their real arguments, but nothing is launched
(the interpreter is slow, and keys do not depend on the kernels running). One test runs the
warm-up's launches for real, under the interpreter on CPU (on the GPU it compiles them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from kvcase import DEVICE, full_kv, kv_equal, kv_snapshot, rank_kv, triton_usable

from aiokv.kernels import PageMover, TransferPath
from aiokv.kernels import warmup as warmup_module
from aiokv.kernels.launch import LaunchKey, TwinLaunches, record_launches, specialization
from aiokv.kernels.paths import interpreting
from aiokv.kernels.warmup import skip_values, warm_up
from aiokv.layout import BufferForm, KVBuffer, KVLayout, TPSlice

pytestmark = pytest.mark.skipif(not triton_usable(), reason="needs CUDA or TRITON_INTERPRET=1")
COMPILED = DEVICE.type == "cuda" and not interpreting()
"""Compiled kernels stay loaded: a later warm-up in this process launches only the others."""


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test warms up as a fresh process would (on a GPU, earlier tests loaded the same variants)."""
    monkeypatch.setattr(warmup_module, "_loaded", {})


def _pages(layout: KVLayout, count: int) -> torch.Tensor:
    """``[count, L, T, rows, D]`` pool-like pages (page stride padded) on the test device."""
    page_elems = layout.page_bytes // layout.itemsize
    raw = torch.zeros((count, page_elems), dtype=layout.dtype, device=DEVICE)
    return raw[:, : layout.payload_bytes // layout.itemsize].view(count, *layout.page_shape)


def _real_copies(mover: PageMover, pages: int, skips: range) -> list[tuple[str, int, int]]:
    """Every copy an engine can ask of ``mover`` for 1..``pages`` pages: offloads, whole-page and
    layer-wise loads at every skip, and the loads that go DIRECT while a paced load is in flight."""
    tokens = mover.kv.layout.page_tokens
    done = []
    for count in range(1, pages + 1):
        ids = list(range(count))
        mover.offload(torch.arange(count * tokens), ids)
        done.append(("offload", count, 0))
        for skip in skips:
            slots = torch.arange(count * tokens - skip)
            mover.load(ids, slots, skip)
            mover.load_layers(ids, slots, skip)
            done.append(("load", count, skip))
            if mover.effective_path is TransferPath.STAGING:
                mover._paced_active += 1  # a paced layer-wise load holds the staging (CUDA only)
                try:
                    mover.load(ids, slots, skip)
                    mover.load_layers(ids, slots, skip)
                finally:
                    mover._paced_active -= 1
    return done


def _warm_keys(mover: PageMover) -> tuple[set[LaunchKey], set[LaunchKey]]:
    """Keys of a dry warm-up: all of them, and those launched before it reported page-aligned calls ready."""
    ready: list[int] = []
    with record_launches(launch=False) as record:
        result = warm_up(mover, on_ready=lambda: ready.append(len(record.keys)))
    assert not result.stopped and ready == [result.ready_variants]
    assert len(record.keys) == len(set(record.keys)) == result.variants  # each variant launched once
    return set(record.keys), set(record.keys[: ready[0]])


def _keys_of(run: Callable[[], object]) -> set[LaunchKey]:
    with record_launches(launch=False) as record:
        run()
    return set(record.keys)


MHA = KVLayout.mha(3, 2, 8, torch.float16, page_tokens=3)
CASES = [
    # (id, layout, form, tp rank/size, path, staging pages)
    ("odd-T-staging-1", MHA, BufferForm.STACKED, (0, 1), TransferPath.STAGING, 1),
    ("odd-T-staging-3", MHA, BufferForm.SPLIT_KV, (0, 1), TransferPath.STAGING, 3),
    ("T20-staging-2", KVLayout.mha(3, 1, 8, torch.bfloat16, page_tokens=20), BufferForm.PER_LAYER, (0, 1),
     TransferPath.STAGING, 2),
    ("direct", MHA, BufferForm.STACKED, (0, 1), TransferPath.DIRECT, 2),
    ("tp-partial", MHA, BufferForm.STACKED, (1, 2), TransferPath.STAGING, 2),  # runs DIRECT, two segments
    ("mla-T1-int8", KVLayout.mla(2, 24, torch.int8, page_tokens=1), BufferForm.STACKED, (0, 1),
     TransferPath.STAGING, 2),
]


@pytest.mark.slow(seconds=10)
@pytest.mark.parametrize(("layout", "form", "tp", "path", "staging"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_warm_up_launches_every_variant_the_real_copies_launch(
    layout: KVLayout, form: BufferForm, tp: tuple[int, int], path: TransferPath, staging: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    kv = rank_kv(layout, full_kv(layout, 256, gen), form, TPSlice.of(layout, *tp))
    pool = _pages(layout, 32)
    mover = PageMover(kv, pool, path, staging)
    warm, ready = _warm_keys(mover)
    tokens = layout.page_tokens
    pages = min(32, 256 // tokens, 4 * 3 * staging + 3)  # past every shape the warm-up enumerates here
    real = _keys_of(lambda: _real_copies(mover, pages, range(tokens)))
    assert real, "the real copies launched nothing"
    assert real <= warm, f"variants the warm-up missed: {sorted(real - warm, key=str)}"
    aligned = _keys_of(lambda: _real_copies(mover, pages, range(1)))
    assert aligned <= ready, f"page-aligned variants not warm at on_ready: {sorted(aligned - ready, key=str)}"


@pytest.mark.slow(seconds=17)
def test_warm_up_of_a_kv_buffer_with_odd_addresses_matches_their_alignment() -> None:
    # A buffer starting 2 bytes into its storage: the plan moves 2-byte words and its KV pointer is
    # not 16-byte aligned; the twins' scratch must reproduce that (a 16-aligned scratch compiles
    # another variant, and the real first copy would compile its own on the loop).
    layout = MHA
    store = torch.zeros(layout.num_layers * 64 * layout.rows * layout.head_dim + 1, dtype=layout.dtype, device=DEVICE)
    tensor = store[1:].view(layout.num_layers, 64, layout.rows, layout.head_dim)
    kv = KVBuffer.wrap(layout, tensor, TPSlice.of(layout))
    mover = PageMover(kv, _pages(layout, 16), TransferPath.STAGING, 2)
    warm, _ = _warm_keys(mover)
    real = _keys_of(lambda: _real_copies(mover, 8, range(layout.page_tokens)))
    assert any(arg == ("*i16", "") for key in real for arg in key[1]), "the case lost its unaligned pointer"
    assert real <= warm, sorted(real - warm, key=str)


def test_skip_values_stand_for_every_skip() -> None:
    # A skip enters a launch as an int argument, in the token count (mod 16, and == 1 for the last
    # token alone) and in slot offsets (parity): each skip's combination is a listed skip's.
    for tokens in range(1, 70):
        listed = {(specialization(s), s % 16, s == tokens - 1) for s in skip_values(tokens)}
        for skip in range(tokens):
            assert (specialization(skip), skip % 16, skip == tokens - 1) in listed, (tokens, skip)
        assert max(skip_values(tokens)) < tokens


@pytest.mark.slow(seconds=11)
def test_warm_up_runs_its_launches_and_touches_only_scratch() -> None:
    layout = MHA
    gen = torch.Generator().manual_seed(1)
    kv = rank_kv(layout, full_kv(layout, 64, gen), BufferForm.STACKED, TPSlice.of(layout))
    pool = _pages(layout, 8)
    pool.view(torch.uint8).copy_(torch.randint(0, 256, pool.view(torch.uint8).shape, dtype=torch.uint8,
                                               generator=gen).to(DEVICE))
    mover = PageMover(kv, pool, TransferPath.STAGING, 2)
    staging = [lane.staging for lane in mover._offload_lanes + mover._load_lanes if lane.staging is not None]
    for area in staging:
        area.view(torch.uint8).fill_(0x5A)
    kv_before, pool_before = kv_snapshot(kv), pool.clone()
    staging_before = [area.clone() for area in staging]
    with record_launches() as record:  # launched for real: interpreted on CPU, compiled on a GPU
        result = warm_up(mover)
    assert result.variants > 0 and len(record.keys) == result.variants
    assert kv_equal(kv, kv_before), "the warm-up wrote the engine's KV buffer"
    assert torch.equal(pool.view(torch.uint8), pool_before.view(torch.uint8)), "the warm-up wrote the pool"
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(staging, staging_before,
                                                                                     strict=True))
    # And the mover still copies right afterwards.
    ids = [3, 1]
    mover.offload(torch.arange(2 * layout.page_tokens), ids)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    rows = kv.k_layers[0][: 2 * layout.page_tokens]
    assert torch.equal(pool[ids, 0].reshape(rows.shape).view(torch.uint8), rows.view(torch.uint8))


def test_stop_ends_the_warm_up_between_launches() -> None:
    gen = torch.Generator().manual_seed(2)
    kv = rank_kv(MHA, full_kv(MHA, 64, gen), BufferForm.STACKED, TPSlice.of(MHA))
    mover = PageMover(kv, _pages(MHA, 8), TransferPath.STAGING, 2)
    stop = threading.Event()
    with record_launches(launch=False) as record:
        result = warm_up(mover, stop, on_ready=stop.set)  # asked to stop once aligned calls are warm
    assert result.stopped
    assert result.variants == result.ready_variants == len(record.keys) > 0
    full, _ = _warm_keys(mover)
    assert len(full) > result.variants  # the rest was never launched


def test_reference_path_has_nothing_to_warm() -> None:
    kv = rank_kv(MHA, full_kv(MHA, 64, torch.Generator().manual_seed(3)), BufferForm.STACKED, TPSlice.of(MHA))
    mover = PageMover(kv, _pages(MHA, 4), TransferPath.REFERENCE)
    ready: list[bool] = []
    with record_launches(launch=False) as record:
        result = warm_up(mover, on_ready=lambda: ready.append(True))
    assert (result.variants, result.stopped, ready, record.keys) == (0, False, [True], [])


def test_a_second_warm_up_launches_only_what_this_process_has_not_loaded() -> None:
    gen = torch.Generator().manual_seed(4)
    kv = rank_kv(MHA, full_kv(MHA, 64, gen), BufferForm.STACKED, TPSlice.of(MHA))
    with record_launches(launch=False):  # suppressed launches load nothing: they must not count
        dry = warm_up(PageMover(kv, _pages(MHA, 8), TransferPath.DIRECT, 2))
    first = warm_up(PageMover(kv, _pages(MHA, 8), TransferPath.DIRECT, 2))
    assert first.variants == dry.variants > 0 and first.skipped == 0
    second = warm_up(PageMover(kv, _pages(MHA, 8), TransferPath.DIRECT, 2))
    if COMPILED:  # loaded on this device by the first
        assert (second.variants, second.skipped) == (0, first.variants)
    else:  # the interpreter keeps nothing loaded: every warm-up launches all
        assert (second.variants, second.skipped) == (first.variants, 0)


def test_a_twin_counts_as_launched_only_what_it_really_launched() -> None:
    kv = rank_kv(MHA, full_kv(MHA, 64, torch.Generator().manual_seed(5)), BufferForm.STACKED, TPSlice.of(MHA))
    plan = PageMover(kv, _pages(MHA, 4), TransferPath.DIRECT, 2)._direct_plan()
    slots = torch.zeros(MHA.page_tokens, dtype=torch.int64, device=DEVICE)
    suppressed = TwinLaunches()
    with record_launches(launch=False) as record:
        plan.scratch_twin(suppressed, 1).gather(slots, None)
    assert suppressed.keys == record.keys != [] and suppressed.launched == []
    launched = TwinLaunches()
    plan.scratch_twin(launched, 1).gather(slots, None)
    assert launched.launched == launched.keys == suppressed.keys
    named = TwinLaunches(launch=False)  # enumeration: names its variants, launches and records nothing
    with record_launches(launch=False) as record:
        plan.scratch_twin(named, 1, torch.device("cpu")).gather(slots.cpu(), None)
    assert named.keys == suppressed.keys and named.launched == [] and record.keys == []
