"""Review 264: ``.lock`` replaced under a running writer by what is not a lock file of ours — a FIFO,
a directory, another owner's file (the symlink case is ``test_lock_replaced``), and a hard link of
a file outside the cache (a regular file of ours, but not the one the writer holds) — every backend.

What must hold: the writer's lock checks never block (on the FIFO) and never write anything outside;
the writer either goes on writing or stops, but there is never a second writer: a tier started
meanwhile on the directory refuses to start or starts read-only; pages the writer serves are the
bytes written for their keys."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, is_root
from follow_helpers import read_back, started, store_page
from planted_helpers import snapshot as _snapshot
from test_lock_replaced import LockChecks, _cfg, _lock

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind
from aiokv.storage.safefiles import UnsafeDirectoryError


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("planted", ["fifo", "directory", "other-uid", "outside-hardlink"])
async def test_a_lock_replaced_by_what_is_no_lock_of_ours_never_makes_two_writers(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, planted: str) -> None:
    if not is_root():
        pytest.skip("another owner's file needs root")
    disk_dir, outside = tmp_path / "disk", tmp_path / "outside"
    outside.mkdir()
    (outside / "target").write_bytes(b"not ours")
    async with started(DiskTier(_cfg(disk_dir, backend, layout), layout, pool)) as a:
        checks = LockChecks(a)
        assert await store_page(a, pool, 0)
        lock = _lock(a)
        os.unlink(lock)
        if planted == "fifo":
            os.mkfifo(lock, 0o600)
        elif planted == "directory":
            lock.mkdir(mode=0o700)
        elif planted == "other-uid":
            lock.write_bytes(b"")
            os.chown(lock, 12345, 12345)
        else:
            os.link(outside / "target", lock)
        before = _snapshot(outside)
        await checks.next()
        await checks.next()
        stats = a.statistics()
        if planted != "outside-hardlink":
            assert (stats.read_only, stats.lock_lost) == (None, 0), stats
            assert stats.errors[ErrorKind.UNSAFE] >= 1, stats.errors
        a_writes = await store_page(a, pool, 1)
        assert a_writes == (a.statistics().read_only is None)
        assert await read_back(a, pool, 0)
        b = DiskTier(_cfg(disk_dir, backend, layout), layout, pool)
        try:
            await b.start()
        except UnsafeDirectoryError:
            assert planted != "outside-hardlink"
        else:
            try:
                assert not (a_writes and b.read_only is None), "two writers on one directory"
                assert await read_back(b, pool, 0)
            finally:
                await b.aclose()
        assert _snapshot(outside) == before, "something outside the cache directory changed"
    assert _snapshot(outside) == before
    assert_clean(pool)
