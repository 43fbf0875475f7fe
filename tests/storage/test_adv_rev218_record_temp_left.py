"""Review 218: a crash (SIGKILL, power loss) while the pending-delete record was being saved
(:mod:`storage.deletelog`: written to ``.deletes.new``, fsynced, renamed over ``.deletes``) left
``.deletes.new`` in the layout directory, and a start never removed it: it lay there (up to the
record's size) until this cache's next failed unlink happened to save the record. The start of the
lock holder removes it now, as it removes the temporary page files a crash leaves; a start without
the lock (another cache may be saving it now) leaves it.

Real: the leftover planted as a crash leaves it (a whole record, not yet renamed), a real start."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import started

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly
from aiokv.storage.deletelog import DELETES_NAME, DELETES_TEMP, encode

TAG = 0x5E


def _exists(path: Path) -> bool:
    return os.path.exists(path)


def _plant(path: Path) -> None:
    with open(path, "wb") as f:
        f.write(encode({key_of(0, TAG): 1}))


@pytest.mark.asyncio
async def test_the_lock_holder_removes_a_record_temp_file_a_crash_left(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0, min_free_bytes=0)
    async with started(DiskTier(cfg, layout, pool)) as a:
        layout_dir = a.files.layout_dir
    temp = layout_dir / DELETES_TEMP
    _plant(temp)
    async with started(DiskTier(cfg, layout, pool)) as writer:
        assert writer.read_only is None
        assert not _exists(temp), "the start of the lock holder left the record's temp file a crash left"
        assert not _exists(layout_dir / DELETES_NAME), "the temp file was taken for the record"
        _plant(temp)  # as if the writer were saving it now
        async with started(DiskTier(cfg, layout, pool)) as follower:
            assert follower.read_only is ReadOnly.LOCKED
            assert _exists(temp), "a start without the lock removed the writer's temp file"
    assert_clean(pool)
