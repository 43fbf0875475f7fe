"""A follower that takes a directory over on a file system mounted read-only (root: a loop-mounted
ext4 remounted ``ro``) writes there once it is remounted read-write, as a tier that met EROFS does.

Before: the take-over left the tier ``ReadOnly.FILE_SYSTEM`` for good (the looks ended with it):
no page reached the disk until a restart, and the dead writer's temporary files stayed. Now the
tier holds the lock and looks every ``follow_interval_s`` whether it may write; once it may, it
scans as a take-over does (temporary files removed, missing fan-out directories made) and writes;
files it refused meanwhile are unlinked then."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import WRITER_TAG, Looks, follow_config, read_back, started, store_page
from fs_helpers import loop_ext4, remount
from test_adv_cache_fs import remount_read_only

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly
from aiokv.storage.pagefile import HEADER_BYTES

INTERVAL_S = 0.1
BOUND_S = 10.0


def _exists(path: Path) -> bool:
    return path.exists()


def _flip_a_payload_byte(path: Path) -> None:
    """What a torn write or bad media leaves: the file is refused when read."""
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 5)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 5)
        f.write(bytes([byte[0] ^ 0xFF]))


async def _unlinks_done(tier: DiskTier) -> None:
    while tier._moving:
        await asyncio.wait(set(tier._moving.values()))


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_take_over_onto_a_read_only_file_system_writes_once_it_is_read_write(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    with loop_ext4(tmp_path, 24) as mount:
        disk_dir = mount / "disk"
        follower = DiskTier(follow_config(disk_dir, backend, interval=INTERVAL_S, min_free_bytes=0), layout, pool)
        try:
            async with started(DiskTier(config(disk_dir, backend, min_free_bytes=0), layout, pool)) as writer:
                for i in range(3):
                    assert await store_page(writer, pool, i)
                corrupt = Path(writer.files.path(key_of(2, WRITER_TAG)))
                _flip_a_payload_byte(corrupt)
                temp = corrupt.parent / f".tmp-{key_of(5, WRITER_TAG).hex()}-0123456789abcdef0"
                temp.write_bytes(b"a write the writer never finished")
                await follower.start()
                await remount_read_only(mount)  # before the writer lets the directory go
            looks = Looks(follower)
            await looks.until(lambda: follower.statistics().took_over == 1, BOUND_S)
            assert follower.read_only is ReadOnly.FILE_SYSTEM
            assert not await store_page(follower, pool, 3)  # refused
            assert not await read_back(follower, pool, 2)  # refused (corrupt): kept, nothing may go
            for _ in range(3):  # the looks go on, and see it still read-only
                await looks.next()
                assert follower.read_only is ReadOnly.FILE_SYSTEM
            assert _exists(temp) and _exists(corrupt)

            await asyncio.to_thread(remount, mount, "rw")
            await looks.until(lambda: follower.read_only is None, BOUND_S, force=False)  # its own looks
            await _unlinks_done(follower)
            assert not _exists(temp), "the dead writer's temporary file stayed"
            assert not _exists(corrupt), "the file refused while read-only stayed"
            assert await store_page(follower, pool, 3), "no page reached the disk after remount,rw"
            assert _exists(Path(follower.files.path(key_of(3, WRITER_TAG))))
            for i in (0, 1, 3):
                assert await read_back(follower, pool, i)
            stats = follower.statistics()
            assert (stats.took_over, stats.corrupt, stats.temp_files_removed, stats.pages) == (1, 1, 1, 3), stats
            assert not any(stats.errors.values()), stats
            assert follower._follow_task is not None and follower._follow_task.done()  # no more looks
        finally:
            await follower.aclose()
        assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_erofs_after_a_take_over_ends_with_remount_read_write(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """The file system turns read-only after the take-over: the first write meets EROFS, and the
    tier writes again after ``remount,rw`` (as a tier that started writing does)."""
    with loop_ext4(tmp_path, 24) as mount:
        disk_dir = mount / "disk"
        follower = DiskTier(follow_config(disk_dir, backend, interval=INTERVAL_S, min_free_bytes=0,
                                          free_space_recheck_s=INTERVAL_S), layout, pool)
        try:
            async with started(DiskTier(config(disk_dir, backend, min_free_bytes=0), layout, pool)) as writer:
                assert await store_page(writer, pool, 0)
                await follower.start()
            looks = Looks(follower)
            await looks.until(lambda: follower.statistics().took_over == 1, BOUND_S)
            assert follower.read_only is None
            await remount_read_only(mount)
            assert not await store_page(follower, pool, 1)  # EROFS
            assert follower.read_only is ReadOnly.FILE_SYSTEM
            await asyncio.to_thread(remount, mount, "rw")
            async with asyncio.timeout(BOUND_S):
                while follower.read_only is not None:  # noqa: ASYNC110 (rechecked on its own timer)
                    await asyncio.sleep(INTERVAL_S / 4)
            assert await store_page(follower, pool, 2)
            assert await read_back(follower, pool, 0) and await read_back(follower, pool, 2)
        finally:
            await follower.aclose()
        assert_clean(pool)
