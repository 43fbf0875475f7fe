"""Whole-page loads by run copies (``PageMover.load`` with ``load_runs``): bit-exact, the form with
fewer copies, the rule for staging instead, a copy refused part-way (what ``runs_loaded`` counts).

On a CPU the copies run with memmove (Triton's interpreter); the GPU cases (cudaMemcpy2DAsync) are
in ``test_mover_load_runs_gpu.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from kvcase import DEVICE, POISON, poisoned_pool, random_bits, same_bits, triton_usable

from aiokv.kernels import PageMover, TransferPath, reference_gather, reference_scatter
from aiokv.kernels import mover as mover_module
from aiokv.kernels.slotruns import RunCopy
from aiokv.layout import KVBuffer, KVLayout
from aiokv.pool import PagePool

pytestmark = pytest.mark.skipif(DEVICE.type == "cuda" or not triton_usable(),
                                reason="the memmove form needs host buffers and Triton's interpreter")

MHA = KVLayout.mha(3, 3, 8, torch.bfloat16, page_tokens=12)
T = 12
SLOTS = 16 * T + 7


def _kv(per_layer: bool = False) -> KVBuffer:
    stacked = torch.full((MHA.num_layers, SLOTS, MHA.rows, MHA.head_dim * 2), POISON, dtype=torch.uint8)
    stacked = stacked.view(MHA.dtype)
    return KVBuffer.wrap(MHA, list(stacked.unbind(0)) if per_layer else stacked)


def _all_equal(a: KVBuffer, b: KVBuffer) -> bool:
    return all(same_bits(x, y) for x, y in zip(a.k_layers, b.k_layers, strict=True))


def _runs(starts: list[int], skip: int = 0) -> torch.Tensor:
    parts = [torch.arange(s, s + T) for s in starts]
    parts[0] = parts[0][skip:]
    return torch.cat(parts)


@pytest.fixture
def pool() -> Iterator[PagePool]:
    with poisoned_pool(MHA, 14) as pool:
        gen = torch.Generator().manual_seed(1)
        source = KVBuffer.wrap(MHA, random_bits((MHA.num_layers, 14 * T, MHA.rows, MHA.head_dim), MHA.dtype, gen))
        reference_gather(source, torch.arange(14 * T), pool.pages, list(range(14)))
        yield pool


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[list[RunCopy]]:
    """The copies of each memmove_runs call (a whole load: one call per group of pages); a staged
    whole-page chunk fails the test."""
    calls: list[list[RunCopy]] = []
    real = mover_module.memmove_runs

    def spying(batch: list[RunCopy]) -> None:
        calls.append(list(batch))
        real(batch)

    def no_staging(*_: object) -> None:
        raise AssertionError("a whole-page load by runs staged a chunk")

    monkeypatch.setattr(mover_module, "memmove_runs", spying)
    monkeypatch.setattr(PageMover, "_load_chunk", no_staging)
    return calls


L = MHA.num_layers
BY_PAGE = [L]
"""A group of one page by page: one copy of L rows (one per layer)."""

# name: (page ids, slot run starts, skip, run_pages, per group of pages the heights of its copies)
CASES = {
    # One run of 5 pages: 3 copies (one a layer, 5 pages high) against 5 by page.
    "one-run": ([2, 3, 4, 5, 6], [T, 2 * T, 3 * T, 4 * T, 5 * T], 0, 16, [[5] * L]),
    # Registrations of 4 pages split it (2-3 | 4-6): 6 copies by layer, 5 by page.
    "split-by-registration": ([2, 3, 4, 5, 6], [T, 2 * T, 3 * T, 4 * T, 5 * T], 0, 4, [BY_PAGE] * 5),
    # A partly needed page 0 alone, then 7 pages in one run: 6 copies by layer, 8 by page.
    "skip-then-run": (list(range(8)), [i * T for i in range(8)], 3, 16, [[1] * L, [7] * L]),
    "pool-pages-apart": ([9, 1, 12, 5], [0, T, 2 * T, 3 * T], 4, 16, [BY_PAGE] * 4),
    "slots-apart": ([3, 4, 5, 6], [10 * T + 3, 2 * T, 7 * T, 0], 0, 16, [BY_PAGE] * 4),
}


@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked", "per-layer"])
@pytest.mark.parametrize("case", list(CASES))
def test_whole_load_by_runs_is_bit_exact(
    pool: PagePool, copies: list[list[RunCopy]], case: str, per_layer: bool
) -> None:
    """Bit-exact with the reference scatter, no staging, the form with fewer copies, counted; the
    pool unchanged; slots not loaded keep their poison."""
    ids, starts, skip, run_pages, groups = CASES[case]
    slots = _runs(starts, skip)
    want = _kv(per_layer)
    reference_scatter(want, pool.pages, slots, ids, skip_first=skip)
    before = pool.pages.clone()
    back = _kv(per_layer)
    mover = PageMover(back, pool.pages, TransferPath.STAGING, 2, run_pages=run_pages)
    assert mover.load(ids, slots, skip) is None
    assert [[c.height for c in batch] for batch in copies] == groups
    assert mover.runs_loaded == len(ids)
    assert _all_equal(back, want)
    assert torch.equal(pool.pages.view(torch.uint8), before.view(torch.uint8))


def test_whole_load_with_load_runs_off_or_slots_not_runs_stages(pool: PagePool) -> None:
    ids, slots = [3, 4, 8], _runs([0, T, 5 * T], 2)
    want = _kv()
    reference_scatter(want, pool.pages, slots, ids, skip_first=2)
    back = _kv()
    mover = PageMover(back, pool.pages, TransferPath.STAGING, 2, load_runs=False)
    mover.load(ids, slots, 2)
    assert mover.runs_loaded == 0 and _all_equal(back, want)
    swapped = slots.clone()
    swapped[3], swapped[4] = slots[4].item(), slots[3].item()  # page 0 is no longer one run
    reference_scatter(want, pool.pages, swapped, ids, skip_first=2)
    mover.load_runs = True
    mover.load(ids, swapped, 2)
    assert mover.runs_loaded == 0 and _all_equal(back, want)
    mover.load(ids, slots, 2)
    reference_scatter(want, pool.pages, slots, ids, skip_first=2)
    assert mover.runs_loaded == 3 and _all_equal(back, want)


@pytest.mark.parametrize(("case", "fail_at", "loaded"), [("pool-pages-apart", 2, 2), ("skip-then-run", 1, 1)])
def test_whole_load_refused_part_way_counts_only_the_pages_it_copied(
    pool: PagePool, monkeypatch: pytest.MonkeyPatch, case: str, fail_at: int, loaded: int
) -> None:
    """The copy of group ``fail_at`` is refused: the error propagates, the groups before it landed
    and are counted, nothing after it was written."""
    ids, starts, skip, run_pages, _ = CASES[case]
    real = mover_module.memmove_runs
    calls: list[int] = []

    def refusing(batch: list[RunCopy]) -> None:
        calls.append(len(batch))
        if len(calls) == fail_at + 1:
            raise RuntimeError("cudaMemcpy2DAsync refused (injected)")
        real(batch)

    monkeypatch.setattr(mover_module, "memmove_runs", refusing)
    slots = _runs(starts, skip)
    back = _kv()
    mover = PageMover(back, pool.pages, TransferPath.STAGING, 2, run_pages=run_pages)
    with pytest.raises(RuntimeError, match="injected"):
        mover.load(ids, slots, skip)
    assert mover.runs_loaded == loaded
    done = loaded * T - skip
    want = _kv()
    reference_scatter(want, pool.pages, slots[:done], ids[:loaded], skip_first=skip)
    assert _all_equal(back, want)
