"""Review 264: ``delete(key)`` while a write-behind of ``key`` is still queued (handed over with
``write_behind_nowait``, ownership taken, no worker has taken it yet) does not discard that write:
the worker takes it after the delete returned, stores the page, and the tier serves it — also
after a restart — although the caller's last word on the key was the delete. ``delete``'s
docstring: "a write in flight for it is discarded when it lands"; only writes already registered
(``TierBase._writing``) are (``storage/disk.py`` ``DiskTier.delete``: ``if key in self._writing``);
a queued write-behind is not there until a worker takes it (``storage/writebehind.py``
``WriteBehind._worker``).

Found by ``test_adv_rev264_sigkill_mix.py`` (seeds 1 and 3: a page deleted before the kill served
after the restart). Fixed: a delete discards the key's entries queued so far when a worker takes
them (``storage/disk.py`` ``_QueuedKeys``); a write-behind queued after the delete is written.
No sleep: the delete runs in the same loop turn as the hand-over, before any worker runs
(``put_nowait`` only wakes them; ``write_behind`` with room returns without a loop turn)."""

from __future__ import annotations

from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, fill, key_of, payload, reserve, seed_of

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier

KEY = key_of(7, 0x64)


async def _served(tier: DiskTier, pool: PagePool) -> bool:
    into = reserve(pool, KEY)
    try:
        ok = await tier.read(KEY, into)
        if ok:  # whatever the verdict on the delete, never other bytes
            want = fill(pool, key_of(7, 0x65), seed_of(KEY))
            assert bytes(payload(pool, into).numpy()) == bytes(payload(pool, want).numpy())
            pool.table.release(want)
            pool.table.discard(key_of(7, 0x65))
        return ok
    finally:
        pool.table.abort(into)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["nowait", "wait"])
@pytest.mark.parametrize("stored_before", [False, True], ids=["new", "stored"])
async def test_a_delete_discards_a_queued_write_behind_of_its_key(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, stored_before: bool,
        how: str) -> None:
    cfg = config(tmp_path / "disk", backend)
    async with DiskTier(cfg, layout, pool) as tier:
        if stored_before:
            h = fill(pool, KEY, seed_of(KEY))
            assert await tier.write(KEY, h)
            pool.table.release(h)
            pool.table.discard(KEY)
        h = fill(pool, KEY, seed_of(KEY))
        if how == "nowait":
            assert tier.write_behind_nowait(KEY, h)  # ownership handed over: queued
        else:
            await tier.write_behind(KEY, h)  # (room in the queue: returns without a loop turn)
        pool.table.discard(KEY)  # (the pool's copy is the caller's business; the tier holds a reference)
        await tier.delete(KEY)  # the caller's last word on the key
        await tier.flush()
        pool.table.evict(pool.num_pages)
        in_run = tier.contains(KEY) or await _served(tier, pool)
    async with DiskTier(cfg, layout, pool) as tier:
        after_restart = tier.contains(KEY) or await _served(tier, pool)
    assert (in_run, after_restart) == (False, False), "a page deleted after its write-behind was queued was served"
    assert_clean(pool)



@pytest.mark.asyncio
@pytest.mark.parametrize("again", ["nowait", "wait"])
async def test_a_write_behind_queued_after_the_delete_is_written(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, again: str) -> None:
    """Two write-behinds of the key queued (two references on its pool page), the key deleted, a
    third queued (one more): the delete discards the first two only (each reference released
    once: ``assert_clean``), the third is written and served, also after a restart."""
    cfg = config(tmp_path / "disk", backend)
    async with DiskTier(cfg, layout, pool) as tier:
        h = fill(pool, KEY, seed_of(KEY))
        assert tier.write_behind_nowait(KEY, h)
        again_h = pool.table.acquire(KEY)
        assert again_h is not None
        assert tier.write_behind_nowait(KEY, again_h)
        await tier.delete(KEY)
        last = pool.table.acquire(KEY)
        assert last is not None
        if again == "nowait":
            assert tier.write_behind_nowait(KEY, last)
        else:
            await tier.write_behind(KEY, last)
        await tier.flush()
        assert tier.statistics().write_behind_queued == 0
        assert pool.table.discard(KEY)  # every reference the queue took given back
        assert tier.contains(KEY), "the write-behind queued after the delete was not written"
        assert await _served(tier, pool)
    async with DiskTier(cfg, layout, pool) as tier:
        assert await _served(tier, pool), "not served after a restart"
    assert_clean(pool)
