"""Review 264: ``delete(key)`` while a write-behind of ``key`` is still queued (handed over with
``write_behind_nowait``, ownership taken, no worker has taken it yet) does not discard that write:
the worker takes it after the delete returned, stores the page, and the tier serves it — also
after a restart — although the caller's last word on the key was the delete. ``delete``'s
docstring: "a write in flight for it is discarded when it lands"; only writes already registered
(``TierBase._writing``) are (``storage/disk.py`` ``DiskTier.delete``: ``if key in self._writing``);
a queued write-behind is not there until a worker takes it (``storage/writebehind.py``
``WriteBehind._worker``).

Found by ``test_adv_rev264_sigkill_mix.py`` (seeds 1 and 3: a page deleted before the kill served
after the restart). disk.py is being edited by another helper: the fix is left to it, this test
marked xfail(strict) until then. No sleep: the delete runs in the same loop turn as the hand-over,
before any worker runs (``put_nowait`` only wakes them)."""

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


@pytest.mark.xfail(strict=True, reason="review 264: delete() does not discard a queued write-behind of its key "
                                       "(storage/disk.py DiskTier.delete checks only self._writing)")
@pytest.mark.asyncio
@pytest.mark.parametrize("stored_before", [False, True], ids=["new", "stored"])
async def test_a_delete_discards_a_queued_write_behind_of_its_key(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, stored_before: bool) -> None:
    cfg = config(tmp_path / "disk", backend)
    async with DiskTier(cfg, layout, pool) as tier:
        if stored_before:
            h = fill(pool, KEY, seed_of(KEY))
            assert await tier.write(KEY, h)
            pool.table.release(h)
            pool.table.discard(KEY)
        h = fill(pool, KEY, seed_of(KEY))
        assert tier.write_behind_nowait(KEY, h)  # ownership handed over: queued
        pool.table.discard(KEY)  # (the pool's copy is the caller's business; the tier holds a reference)
        await tier.delete(KEY)  # the caller's last word on the key
        await tier.flush()
        pool.table.evict(pool.num_pages)
        in_run = tier.contains(KEY) or await _served(tier, pool)
    async with DiskTier(cfg, layout, pool) as tier:
        after_restart = tier.contains(KEY) or await _served(tier, pool)
    assert (in_run, after_restart) == (False, False), "a page deleted after its write-behind was queued was served"
    assert_clean(pool)
