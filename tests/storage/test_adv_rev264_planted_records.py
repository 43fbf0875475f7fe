"""Review 264: the layout directory's own files planted between restarts, on every backend — the
pending-delete record ``.deletes`` as a directory (with a file in it), as a hard link of a valid
record outside the cache, as a valid record of another owner; its temporary name ``.deletes.new``
as a directory, a symlink to a file outside, a FIFO (beside a damaged record, so that the start
has a record to replace). What must hold (the planted-record cases ``test_adv_rev213`` does not
cover): the start neither hangs nor raises, serves no page the record may name (a miss each, never
wrong bytes: every page served is checked against the bytes written for its key), writes and
serves new pages, and nothing outside the cache directory changes (names, sizes, contents,
modification times of an outside directory's files, and the file the planted links lead to).

Also ``.lock`` planted before a start: a directory, another owner's file, a hard link of a file
outside: the start refuses the directory (``UnsafeDirectoryError``) or starts; nothing outside
changes."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, is_root, key_of
from planted_helpers import WAIT_S, bytes_of, served, snapshot, started

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.deletelog import DELETES_NAME, DELETES_TEMP, PLANTED_PREFIX, encode
from aiokv.storage.safefiles import UnsafeDirectoryError

TAG = 0x64
KEYS = [key_of(i, TAG) for i in range(4)]


def _plant(layout_dir: Path, outside: Path, planted: str) -> None:
    record, temp = layout_dir / DELETES_NAME, layout_dir / DELETES_TEMP
    valid = encode({KEYS[3]: 1})  # names a key never stored
    if planted.startswith("temp-"):
        record.write_bytes(b"AIOKVDL1" + os.urandom(64))  # damaged: the start replaces it
    if planted == "deletes-dir":
        record.mkdir(mode=0o700)
        (record / "inside").write_bytes(b"x")
    elif planted == "deletes-hardlink":
        (outside / "record").write_bytes(valid)
        os.link(outside / "record", record)
    elif planted == "deletes-other-uid":
        record.write_bytes(valid)
        os.chown(record, 12345, 12345)
    elif planted == "temp-dir":
        temp.mkdir(mode=0o700)
        (temp / "inside").write_bytes(b"x")
    elif planted == "temp-symlink":
        temp.symlink_to(outside / "target")
    elif planted == "temp-fifo":
        os.mkfifo(temp, 0o600)
    else:
        raise AssertionError(planted)


PLANTED = ["deletes-dir", "deletes-hardlink", "deletes-other-uid", "temp-dir", "temp-symlink", "temp-fifo"]


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("planted", PLANTED)
async def test_a_planted_record_serves_no_page_it_may_name_and_touches_nothing_outside(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, planted: str) -> None:
    if not is_root():
        pytest.skip("another owner's file needs root")
    size = layout.page_bytes
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "target").write_bytes(b"not ours")
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(cfg, layout, pool) as tier:
        for key in KEYS[:2]:
            assert await tier.write_from(key, memoryview(bytes_of(key, size)))
        layout_dir = tier.files.layout_dir
    _plant(layout_dir, outside, planted)
    before = snapshot(outside)
    async with started(cfg, layout, pool) as tier:
        for key in KEYS[:2]:
            assert not await served(tier, key, size), f"a page the planted record ({planted}) may name was served"
        assert await tier.write_from(KEYS[2], memoryview(bytes_of(KEYS[2], size)))
        assert await served(tier, KEYS[2], size)
    assert snapshot(outside) == before, "something outside the cache directory changed"
    async with started(cfg, layout, pool) as tier:
        for key in KEYS[:2]:
            assert not await served(tier, key, size)
        assert await served(tier, KEYS[2], size), "the page stored after the planted record was lost"
        if planted in ("deletes-dir", "temp-dir"):
            # A directory in the record's way is renamed aside, its content as it was (review 289:
            # it stayed, the record was never replaced, and this start served no page).
            aside = [p for p in layout_dir.iterdir() if p.name.startswith(PLANTED_PREFIX)]
            assert len(aside) == 1, aside
            assert (aside[0] / "inside").read_bytes() == b"x", "a planted directory's contents were touched"
    assert snapshot(outside) == before, "something outside the cache directory changed"
    assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("planted", ["directory", "other-uid", "hardlink"])
async def test_a_planted_lock_file_is_refused_or_harmless(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, planted: str) -> None:
    if not is_root():
        pytest.skip("another owner's file needs root")
    size = layout.page_bytes
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "target").write_bytes(b"not ours")
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(cfg, layout, pool) as tier:
        assert await tier.write_from(KEYS[0], memoryview(bytes_of(KEYS[0], size)))
        lock = tier.files.layout_dir / ".lock"
    lock.unlink()
    if planted == "directory":
        lock.mkdir(mode=0o700)
    elif planted == "other-uid":
        lock.write_bytes(b"")
        os.chown(lock, 12345, 12345)
    else:
        os.link(outside / "target", lock)
    before = snapshot(outside)
    tier = DiskTier(cfg, layout, pool)
    try:
        async with asyncio.timeout(WAIT_S):
            await tier.start()
    except UnsafeDirectoryError:
        assert planted != "hardlink"
    else:
        try:
            assert planted == "hardlink", f"a start over a planted .lock ({planted}) went on"
            assert await served(tier, KEYS[0], size)
            assert await tier.write_from(KEYS[1], memoryview(bytes_of(KEYS[1], size)))
        finally:
            await tier.aclose()
    assert snapshot(outside) == before, "something outside the cache directory changed"
    assert_clean(pool)
