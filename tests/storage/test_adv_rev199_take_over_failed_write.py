"""Review 199: a take-over that left a key to this tier's own write in flight since before the lock
was lost (review 198, c4ebb16: ``_listed_under_write``) unlinked the key's name when that write
ended unstored (a real ENOSPC on a full loop ext4): the name still held the page the other writer
had stored (the write never published), a valid page the take-over's scan had found, so that page
was lost. It is indexed now, unless the caller deleted the key meanwhile (then unlinked, not served).

The write is held in the kernel by a real ``fsfreeze`` across the loss, the other writer's close
and the take-over look (which only reads); the file system is full (filled for real) before it, so
the write answers ENOSPC once thawed. Root only."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import threading
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from fs_helpers import fill_up, freeze, loop_ext4, thaw
from loop_probes import until_thread
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskConfig, DiskTier, ReadOnly
from aiokv.storage.follow import look

TAG = 0x5B
THAW_S = 30.0


def _fill_rest(path: Path) -> None:
    """What :func:`fill_up`'s 64 KiB chunks left free, filled by 4 KiB ones (a page file fits in less)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        while True:
            try:
                os.write(fd, bytes(4096))
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
        os.fsync(fd)
    finally:
        os.close(fd)


async def _take_over_during_failed_write(mount: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
                                         delete_after: bool) -> tuple[DiskTier, Path, bool]:
    """A stores nothing of ``victim``; B (a second writer on A's unlinked lock) stores it; the file
    system is filled; A's write of the key is held by a freeze while A loses the lock, B closes and
    A's look takes the directory over; thawed, the write fails ENOSPC. ``delete_after``: A's caller
    deletes the key after the take-over, before the write ends. Returns A (still open: the caller
    closes it), the key's file and what the write answered."""
    size = layout.page_bytes
    cfg = config(mount / "disk", backend, capacity=64 * size, follow_interval_s=3600.0, min_free_bytes=0,
                 enospc_retries=0, free_space_recheck_s=3600.0)
    a = DiskTier(cfg, layout, pool)
    await a.start()
    try:
        return await _drive(a, mount, cfg, layout, pool, delete_after)
    except BaseException:
        await a.aclose()
        raise


async def _drive(a: DiskTier, mount: Path, cfg: DiskConfig, layout: KVLayout, pool: PagePool,
                 delete_after: bool) -> tuple[DiskTier, Path, bool]:
    size = layout.page_bytes
    victim = key_of(0, TAG)
    checks = LockChecks(a)
    fan = a.files.layout_dir / f"{TAG:02x}"
    os.unlink(a.files.layout_dir / ".lock")
    b = DiskTier(cfg, layout, pool)
    await b.start()
    try:
        assert b.read_only is None
        assert await b.write_from(victim, memoryview(_bytes_of(victim, size)))
        fill_up(mount / "filler", 0)
        _fill_rest(mount / "filler-rest")
        watchdog = threading.Timer(THAW_S, thaw, args=(mount,))
        freeze(mount)
        watchdog.start()
        try:
            store = asyncio.ensure_future(a.write_from(victim, memoryview(_bytes_of(victim, size))))
            await until_thread(lambda: a.statistics().writes_in_flight > 0, "the write in flight")
            await checks.next()  # A loses the lock, its write still held in the kernel
            assert a.read_only is ReadOnly.LOCKED
            await asyncio.wait_for(b.aclose(), 10.0)  # B lets the directory go
            state, prepared = a._follow_state, a._dir
            assert state is not None and prepared is not None
            found = look(state, prepared.dir_fd, list(prepared.fanout), a.files.layout_dir)  # reads only
            assert found.lock_fd is not None and victim in found.added
            try:
                await a._apply_look(found)
            finally:
                found.close()
            assert a.read_only is None and a.statistics().took_over == 1
            assert victim in a._writing, "the write ended before the thaw"
            if delete_after:
                await a.delete(victim)
        finally:
            thaw(mount)
            watchdog.cancel()
    finally:
        await b.aclose()
    stored = await asyncio.wait_for(store, 10.0)
    await _settled(a)
    return a, fan / victim.hex(), stored


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_take_over_keeps_the_other_writer_s_page_when_the_write_left_to_it_fails(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    size = layout.page_bytes
    with loop_ext4(tmp_path, 24) as mount:
        a, path, stored = await _take_over_during_failed_write(mount, backend, layout, pool, delete_after=False)
        try:
            assert not stored, "the write was to fail (ENOSPC)"
            assert path.exists(), "the other writer's page, found by the take-over, was unlinked at the write's end"
            assert a.contains(key_of(0, TAG)), "the other writer's page was not indexed"
            assert await _served(a, key_of(0, TAG), size)
        finally:
            await a.aclose()
    assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_take_over_does_not_index_a_page_deleted_while_the_write_left_to_it_fails(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """The same, the key deleted by A's caller after the take-over: the page under its name is the
    one deleted (unlinked, never served)."""
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    size = layout.page_bytes
    with loop_ext4(tmp_path, 24) as mount:
        a, path, stored = await _take_over_during_failed_write(mount, backend, layout, pool, delete_after=True)
        try:
            assert not stored
            assert not a.contains(key_of(0, TAG)), "a page deleted by the caller was indexed"
            assert not await _served(a, key_of(0, TAG), size), "a page deleted by the caller was served"
            assert not path.exists(), "a page deleted by the caller stayed on disk"
        finally:
            await a.aclose()
    assert_clean(pool)
