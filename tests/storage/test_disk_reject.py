"""What the tier says when it refuses a corrupt page file: deleted where it may delete, kept where it
is read-only (another cache holds the directory; a read-only mount). Real tiers, real files
corrupted on disk, a real read-only remount of a loop-mounted ext4."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of, reserve, stored_page
from fs_helpers import loop_ext4, remount

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly
from aiokv.storage.pagefile import HEADER_BYTES

LOGGER = "aiokv.storage.disk"


def _flip_payload_byte(path: Path) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes(b ^ 0xFF for b in os.pread(fd, 1, HEADER_BYTES + 100)), HEADER_BYTES + 100)
    finally:
        os.close(fd)


async def _read(tier: DiskTier, pool: PagePool, i: int) -> bool:
    into = reserve(pool, key_of(100 + i))
    try:
        return await tier.read(key_of(i), into)
    finally:
        pool.table.abort(into)


def _exists(path: Path) -> bool:
    return os.path.exists(path)


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "refusing page file" in r.getMessage()]


@pytest.mark.asyncio
async def test_a_corrupt_file_is_logged_as_deleted_or_kept_by_what_happens(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        caplog: pytest.LogCaptureFixture) -> None:
    """Regression: a read-only tier (here: another cache holds the directory's lock) keeps a file
    that fails its checksum, but logged it as "(deleted; ...)". The writable owner deletes it and
    says so."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    async with DiskTier(config(disk_dir, backend), layout, pool) as owner:
        for i in range(2):
            await stored_page(owner, pool, i)
        paths = [Path(owner.files.path(key_of(i))) for i in range(2)]
        for path in paths:
            _flip_payload_byte(path)
        # Not following (follow_interval_s 0): it counts the refusal at once; a follower's looks
        # first tell a corrupt file from one recycled under the read (test_follow_refused.py).
        async with DiskTier(config(disk_dir, backend, follow_interval_s=0), layout, pool) as peer:
            assert peer.read_only is ReadOnly.LOCKED
            assert not await _read(peer, pool, 0)
            (said,) = _refusals(caplog)
            assert str(paths[0]) in said and "payload checksum mismatch" in said
            assert "kept, as the tier is read-only (held by another cache)" in said and "deleted" not in said
            assert _exists(paths[0]) and (peer.statistics().corrupt, peer.contains(key_of(0))) == (1, False)
        caplog.clear()
        assert not await _read(owner, pool, 1)
        (said,) = _refusals(caplog)
        assert str(paths[1]) in said and "(deleted;" in said and "kept" not in said
    assert not _exists(paths[1]) and owner.statistics().corrupt == 1  # closed: its unlink has run
    assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_corrupt_file_on_a_read_only_mount_is_logged_as_kept(
        tmp_path: Path, layout: KVLayout, pool: PagePool, caplog: pytest.LogCaptureFixture) -> None:
    """The same on a file system mounted read-only (a loop-mounted ext4 remounted ``ro``)."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with loop_ext4(tmp_path, 16) as mount:
        cfg = config(mount / "disk", DiskBackend.THREADS, min_free_bytes=0)
        async with DiskTier(cfg, layout, pool) as tier:
            await stored_page(tier, pool, 0)
            path = Path(tier.files.path(key_of(0)))
        _flip_payload_byte(path)
        remount(mount, "ro")
        async with DiskTier(cfg, layout, pool) as tier:
            assert tier.read_only is ReadOnly.FILE_SYSTEM
            assert not await _read(tier, pool, 0)
            assert tier.statistics().corrupt == 1
        (said,) = _refusals(caplog)
        assert "kept, as the tier is read-only (read-only file system)" in said and "deleted" not in said
        assert _exists(path)
    assert_clean(pool)
