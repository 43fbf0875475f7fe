"""Offload by run copies (``PageMover(slot_runs=True)``, :mod:`aiokv.kernels.slotruns`): a page whose
slots are one ascending run is one 2-D copy straight from the KV buffer.

On a CPU the same copies (addresses, pitches) run with memmove, so the address arithmetic is checked
bit-exact against the reference gather here; the GPU test runs them with cudaMemcpy2DAsync.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from kvcase import DEVICE, POISON, full_kv, poisoned_pool, random_bits, rank_kv, same_bits, triton_usable

from aiokv.kernels import PageMover, TransferPath, reference_gather
from aiokv.kernels.slotruns import memmove_runs, page_run_starts, run_copies, run_geometry
from aiokv.layout import BufferForm, KVBuffer, KVLayout, TPSlice
from aiokv.pool import PagePool

MHA = KVLayout.mha(3, 4, 8, torch.bfloat16, page_tokens=16)
MLA = KVLayout.mla(3, 24, torch.float16, page_tokens=16)
T = 16


def _dense_rank_kv(layout: KVLayout, full: torch.Tensor, tp: TPSlice, per_layer: bool) -> KVBuffer:
    """Rank ``tp``'s heads of ``full`` as a dense stacked buffer (or its per-layer list), on DEVICE."""
    padded = rank_kv(layout, full, BufferForm.STACKED, tp, torch.device("cpu"))
    stacked = torch.stack(list(padded.k_layers)).contiguous().to(DEVICE)
    return KVBuffer.wrap(layout, list(stacked.unbind(0)) if per_layer else stacked, tp)


@pytest.fixture
def tp_pool() -> Iterator[PagePool]:
    with poisoned_pool(MHA.for_tp(2), 10 * MHA.page_bytes // MHA.for_tp(2).page_bytes) as pool:
        yield pool


def test_page_run_starts_needs_every_page_to_be_one_ascending_run() -> None:
    assert page_run_starts(torch.arange(40, 40 + 3 * T), 3, T) == [40, 40 + T, 40 + 2 * T]
    pages = torch.cat([torch.arange(100, 100 + T), torch.arange(5, 5 + T)])  # runs, pages out of order
    assert page_run_starts(pages, 2, T) == [100, 5]
    broken = torch.arange(3 * T)
    broken[T + 3], broken[T + 4] = broken[T + 4].item(), broken[T + 3].item()  # one swap in page 1
    assert page_run_starts(broken, 3, T) is None
    assert page_run_starts(torch.arange(T - 1, -1, -1), 1, T) is None  # descending
    assert page_run_starts(torch.arange(2 * T, dtype=torch.int32), 2, T) == [0, T]


def test_buffers_whose_page_layer_is_not_one_block_have_no_geometry() -> None:
    gen = torch.Generator().manual_seed(1)
    full = full_kv(MHA, 4 * T, gen)
    pages = torch.empty((2, *MHA.page_shape), dtype=MHA.dtype)
    whole = TPSlice.of(MHA)
    # Padded slots (stride > row), split K/V (a K row is half a page row), layers allocated apart.
    assert run_geometry(rank_kv(MHA, full, BufferForm.STACKED, whole, torch.device("cpu")), pages) is None
    assert run_geometry(rank_kv(MHA, full, BufferForm.SPLIT_KV, whole, torch.device("cpu")), pages) is None
    apart = KVBuffer.wrap(MHA, [full[i].clone() for i in range(MHA.num_layers)])
    if apart.k_layers[1].data_ptr() - apart.k_layers[0].data_ptr() != (
        apart.k_layers[2].data_ptr() - apart.k_layers[1].data_ptr()
    ):
        assert run_geometry(apart, pages) is None
    reversed_layers = KVBuffer.wrap(MHA, list(full.contiguous().unbind(0))[::-1])  # a negative step
    assert run_geometry(reversed_layers, pages) is None
    # A rank holding part of each page row (no rank-major pool) is not one block either.
    half = KVBuffer.wrap(MHA, full[:, :, :4].contiguous(), TPSlice.of(MHA, 0, 2))
    assert run_geometry(half, pages) is None
    assert run_geometry(KVBuffer.wrap(MHA, full.contiguous()), pages) is not None


@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked", "per-layer"])
@pytest.mark.parametrize("rank", [0, 1])
def test_run_copies_of_a_rank_part_equal_the_reference_gather(tp_pool: PagePool, rank: int, per_layer: bool) -> None:
    """A TP rank's part of a rank-major pool page, written by run copies (memmove here): bit-exact
    with the reference gather of the same slots, the other rank's part and other pages untouched."""
    if DEVICE.type == "cuda":
        pytest.skip("the memmove form needs the KV buffer in host memory (the GPU test runs the CUDA form)")
    gen = torch.Generator().manual_seed(7 + rank)
    full = full_kv(MHA, 8 * T, gen)
    tp = TPSlice.of(MHA, rank, 2)
    part = _dense_rank_kv(MHA, full, tp, per_layer).rank_part()
    pages = tp_pool.pages[:, tp.part]
    slots = torch.cat([torch.arange(5 * T + 3, 6 * T + 3), torch.arange(T, 2 * T), torch.arange(0, T)])
    ids = [7, 2, 4]
    geometry = run_geometry(part, pages)
    assert geometry is not None
    starts = page_run_starts(slots, len(ids), T)
    assert starts == [5 * T + 3, T, 0]
    before = tp_pool.pages.clone()
    memmove_runs(run_copies(geometry, starts, ids))
    want = torch.empty(pages.shape, dtype=pages.dtype).view(torch.uint8).fill_(POISON).view(pages.dtype)
    reference_gather(part, slots, want, ids)
    assert same_bits(pages, want)
    other = tp_pool.pages[:, 1 - tp.part]
    assert same_bits(other, before[:, 1 - tp.part])


def test_run_copies_of_an_mla_buffer_equal_the_reference_gather() -> None:
    if DEVICE.type == "cuda":
        pytest.skip("the memmove form needs the KV buffer in host memory")
    gen = torch.Generator().manual_seed(3)
    kv = KVBuffer.wrap(MLA, random_bits((MLA.num_layers, 4 * T, 1, MLA.head_dim), MLA.dtype, gen))
    pages = torch.zeros((3, *MLA.page_shape), dtype=MLA.dtype)
    want = pages.clone()
    slots = torch.arange(T, 3 * T)
    geometry = run_geometry(kv, pages)
    starts = page_run_starts(slots, 2, T)
    assert geometry is not None and starts is not None
    memmove_runs(run_copies(geometry, starts, [2, 0]))
    reference_gather(kv, slots, want, [2, 0])
    assert same_bits(pages, want)


@pytest.mark.skipif(not triton_usable(), reason="the STAGING path needs a GPU or Triton's interpreter")
def test_a_mover_copies_run_pages_by_runs_and_gathers_the_rest(tp_pool: PagePool) -> None:
    """``slot_runs``: an offload of run pages takes run copies (counted), one with a page whose
    slots are not a run gathers as before; both bit-exact; without ``slot_runs`` nothing changes."""
    gen = torch.Generator().manual_seed(11)
    full = full_kv(MHA, 8 * T, gen)
    tp = TPSlice.of(MHA, 1, 2)
    part = _dense_rank_kv(MHA, full, tp, per_layer=False).rank_part()
    pages = tp_pool.pages[:, tp.part]
    mover = PageMover(part, pages, TransferPath.STAGING, staging_pages=2, slot_runs=True)
    plain = PageMover(part, pages, TransferPath.STAGING, staging_pages=2)
    want = torch.empty(pages.shape, dtype=pages.dtype).view(torch.uint8).fill_(POISON).view(pages.dtype)
    runs = torch.arange(2 * T, 4 * T)
    scattered = torch.randperm(8 * T, generator=gen)[: 2 * T]
    for m, slots, ids in ((mover, runs, [0, 3]), (mover, scattered, [5, 6]), (plain, runs, [8, 9])):
        event = m.offload(slots, ids)
        if event is not None:
            event.synchronize()
        reference_gather(part, slots, want, ids)
    assert mover.runs_offloaded == 2
    assert plain.runs_offloaded == 0
    assert same_bits(pages, want)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked", "per-layer"])
def test_cuda_run_copies_bit_exact_after_the_callers_stream(tp_pool: PagePool, per_layer: bool) -> None:
    """On the GPU: run copies (cudaMemcpy2DAsync) ordered after the caller's stream: a write the
    caller queued before the offload is what lands; bit-exact with the reference, the other part untouched."""
    gen = torch.Generator().manual_seed(5)
    full = full_kv(MHA, 8 * T, gen)
    tp = TPSlice.of(MHA, 0, 2)
    part = _dense_rank_kv(MHA, full, tp, per_layer).rank_part()
    pages = tp_pool.pages[:, tp.part]
    mover = PageMover(part, pages, TransferPath.STAGING, slot_runs=True)
    before = tp_pool.pages.clone()
    engine = torch.cuda.Stream()
    slots = torch.cat([torch.arange(4 * T, 5 * T), torch.arange(0, 2 * T)])
    with torch.cuda.stream(engine):
        torch.cuda._sleep(20_000_000)  # the caller's stream is busy; then it writes slot 0's rows
        part.k_layers[0][0].fill_(3)
        event = mover.offload(slots, [1, 6, 9])
    assert event is not None
    event.synchronize()
    assert mover.runs_offloaded == 3
    want = torch.empty(pages.shape, dtype=pages.dtype).view(torch.uint8).fill_(POISON).view(pages.dtype)
    host = KVBuffer.wrap(part.layout, [t.cpu() for t in part.k_layers], part.tp) if per_layer else None
    reference_gather(host if host is not None else _host(part), slots, want, [1, 6, 9])
    assert same_bits(pages, want)
    assert same_bits(tp_pool.pages[:, 1], before[:, 1])


def _host(part: KVBuffer) -> KVBuffer:
    stacked = torch.stack([t.cpu() for t in part.k_layers])
    return KVBuffer.wrap(part.layout, stacked, part.tp)


def test_a_layer_stride_beyond_cudas_largest_pitch_gathers() -> None:
    # Review: a stacked rank buffer whose layer is over 2 GiB gave run copies a source pitch the
    # runtime refuses (cudaErrorInvalidPitchValue): every run page's offload failed. The buffer is
    # never touched (lazily allocated), only its geometry is read.
    from aiokv.kernels.slotruns import MAX_PITCH, run_geometry

    layout = KVLayout.mha(2, 8, 128, torch.bfloat16, page_tokens=16)
    tp = TPSlice.of(layout, 0, 2)
    slots = MAX_PITCH // (2 * tp.local_heads * 128 * 2) + 16  # one layer: just over 2 GiB
    kv = torch.empty((layout.num_layers, slots, 2 * tp.local_heads, 128), dtype=torch.bfloat16)
    part = KVBuffer.wrap(layout, kv, tp).rank_part()
    pages = torch.empty((4, *layout.for_tp(2).page_shape), dtype=torch.bfloat16)[:, tp.part]
    assert run_geometry(part, pages) is None
    fits = torch.empty((layout.num_layers, 1024, 2 * tp.local_heads, 128), dtype=torch.bfloat16)
    small = KVBuffer.wrap(layout, fits, tp).rank_part()  # the same form within the limit
    assert run_geometry(small, pages) is not None
