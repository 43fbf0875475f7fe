"""Review of #14's edge checks (write/read check their handle once, the write's job uses its own
reference's page without a second table check), on every backend.

- A released, committed, aborted or recycled handle is refused with ``ValueError`` before anything
  changes (no file, no index entry, no counter, no reference taken), also when the recycled handle's
  page now holds another key's READY page (same page id, new generation).
- The caller may release (or be cancelled and drop) its handle at any point after ``write``
  started: the job's own reference keeps the page from being evicted and reused, so the file holds
  the bytes of the page as written, never those of a page that took its place in the pool.
- A read cancelled at any loop step, its reservation aborted and the page reused at once for
  another key, never has I/O land in that page afterwards.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from disk_helpers import assert_clean, fill, key_of, page_files, payload, reserve, spin

from aiokv.pagetable import PageHandle
from aiokv.pool import PagePool
from aiokv.storage import DiskTier


def _snapshot(tier: DiskTier, disk_dir: Path) -> tuple[object, ...]:
    stats = tier.statistics()
    return (stats.pages, stats.writes, stats.reads, stats.hits, stats.misses, stats.dropped,
            stats.errors, len(page_files(disk_dir)))


@pytest.mark.asyncio
async def test_stale_handles_are_refused_before_anything_changes(tier: DiskTier, pool: PagePool,
                                                                 disk_dir: Path) -> None:
    before = _snapshot(tier, disk_dir)
    refs_before = pool.table.statistics().referenced

    released = fill(pool, key_of(1), 1)
    pool.table.release(released)
    # Page 1 freed, then taken by another key: a handle with the same page id, older generation.
    pool.table.evict(pool.num_pages)
    recycled_owner = fill(pool, key_of(2), 2)
    assert recycled_owner.page == released.page  # the freed page was taken again (last freed, first taken)
    reservation = reserve(pool, key_of(3))
    aborted = reserve(pool, key_of(4))
    pool.table.abort(aborted)
    committed = reserve(pool, key_of(5))
    held = pool.table.commit(committed, keep=True)
    assert held is not None

    for handle in (released, aborted, committed, reservation):
        with pytest.raises(ValueError, match=r"released|recycled|reservation"):
            await tier.write(key_of(1), handle)
        with pytest.raises(ValueError, match=r"released|recycled|reservation"):
            tier.write_behind_nowait(key_of(1), handle)
    for handle in (released, aborted, committed, held, recycled_owner):
        with pytest.raises(ValueError, match=r"released|recycled|not a reservation"):
            await tier.read(key_of(1), handle)
    assert _snapshot(tier, disk_dir) == before
    # Only the live handles of this test hold references (none leaked by a refused call).
    assert pool.table.statistics().referenced == refs_before + 2
    assert not tier.contains(key_of(1))
    pool.table.release(recycled_owner)
    pool.table.release(held)
    pool.table.abort(reservation)
    assert_clean(pool)


def _churn(pool: PagePool, start: int) -> list[PageHandle]:
    """Evict what can be evicted and fill every page the pool gives out with other keys' bytes."""
    pool.table.evict(pool.num_pages)
    taken: list[PageHandle] = []
    for n in range(pool.num_pages):
        (res,) = pool.reserve([key_of(start + n, 9)])
        if res.handle is None:
            break
        pool.memory.page_view(res.handle.page)[:] = bytes([0xA5]) * pool.layout.page_bytes
        taken.append(res.handle)
    return taken


@pytest.mark.asyncio
async def test_caller_drops_its_handle_at_every_step_the_job_keeps_the_page(tier: DiskTier,
                                                                            pool: PagePool) -> None:
    """Cancel ``write`` after 0, 1, 2, ... loop steps, release the caller's handle at once and churn
    the pool (evict all, overwrite every free page): the stored file is the page's original bytes."""
    stored = 0
    for step in range(40):
        key = key_of(100 + step)
        h = fill(pool, key, step)
        want = payload(pool, h)
        task = asyncio.create_task(tier.write(key, h))
        await spin(step)
        task.cancel()
        writing = key in tier._writing  # the job has not ended: its reference holds the page
        pool.table.release(h)  # the caller lets go: only the job's reference holds the page now
        churned = _churn(pool, 1000 * step)
        if writing:
            for c in churned:
                assert c.page != h.page, f"step {step}: a page a write still reads was handed out again"
        try:
            await task
        except asyncio.CancelledError:
            pass
        await tier.flush()
        for c in churned:
            pool.table.abort(c)
        pool.table.evict(pool.num_pages)
        if tier.contains(key):
            stored += 1
            into = reserve(pool, key_of(50_000 + step))
            assert await tier.read(key, into)
            assert torch.equal(payload(pool, into), want), f"step {step}: the file holds other bytes"
            pool.table.abort(into)
    assert stored > 0
    assert tier.statistics().in_flight == 0
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_cancelled_read_never_writes_into_the_page_once_it_returned(tier: DiskTier,
                                                                            pool: PagePool) -> None:
    """Cancel ``read`` after 0, 1, 2, ... loop steps; once it raised, abort the reservation, take the
    page again for another key and fill it: no late I/O or checksum pass may land there."""
    h = fill(pool, key_of(1), 1)
    assert await tier.write(key_of(1), h)
    pool.table.release(h)
    pool.table.evict(pool.num_pages)
    pattern = bytes([0x5A]) * pool.layout.page_bytes
    finished = 0
    for step in range(41):
        into = reserve(pool, key_of(10_000 + step))
        task = asyncio.create_task(tier.read(key_of(1), into))
        if step < 40:
            await spin(step)
        else:  # the last step lets the read end first (loop steps alone do not, on a loaded machine)
            await asyncio.wait({task}, timeout=30)
        task.cancel()
        try:
            await task
            finished += 1
        except asyncio.CancelledError:
            pass
        page = into.page
        pool.table.abort(into)
        (res,) = pool.reserve([key_of(20_000 + step)])
        assert res.handle is not None and res.handle.page == page  # the same memory, another owner
        view = pool.memory.page_view(page)
        view[:] = pattern
        await spin(20)
        await asyncio.sleep(0.01)
        assert bytes(view) == pattern, f"step {step}: I/O landed in a page after its read returned"
        pool.table.abort(res.handle)
    assert finished > 0  # (at least the last step's read completed)
    assert tier.statistics().in_flight == 0
    assert_clean(pool)
