"""Review 188: a key the caller deletes stays deleted when an old copy of its fan-out directory
comes back, whatever the key's state in the tier at the delete.

Before, ``delete`` remembered the key (``followpath.DELETED_KEPT``) only when it was neither
indexed nor being written and its directory had no descriptor or waited to be listed again. Three
ways around that served a deleted page (stale KV) once the old directory was put back:

- the key stored again after its directory was moved away (into the directory made again under
  the name), then deleted: indexed, so dropped and unlinked there, but not remembered, and the old
  directory's copy was indexed when it came back;
- the key deleted while a write of it was in flight (the same, through ``_delete_after_write``);
- the key deleted while the first late listing of its directory ran, that listing then failing
  before the key's name (a real EIO on a directory block of an ext4 over FUSE): the key was added
  to that listing's "gone" set only, and the next listing (the retry at the writer's check)
  indexed it.

Real faults: ``os.rename`` of the fan-out directory out of the layout directory and back,
``os.rmdir`` of the one made in its place; ``listing_fs.py``'s held and failing directory block."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import started
from listing_fs import listing_ext4
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _indexed, _on_disk, _settled
from test_lock_replaced import LockChecks

from aiokv.keys import PageKey
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier

TAG = 0x3A


async def _old_copy_back(tier: DiskTier, checks: LockChecks, fan: Path, away: Path) -> None:
    """The directory made again under ``fan`` (empty by now) removed, the old one put back and
    listed by the writer's check."""
    await _settled(tier)
    os.rmdir(fan)  # raises if anything of the key were left there
    os.rename(away, fan)
    await checks.next()  # the new descriptor retired, the old directory opened and listed
    await _settled(tier)


async def _served(tier: DiskTier, key: PageKey, size: int) -> bool:
    buf = bytearray(size)
    return await tier.read_into(key, memoryview(buf))


@pytest.mark.asyncio
async def test_a_key_stored_again_while_away_then_deleted_stays_deleted(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    keys = [key_of(i, TAG) for i in range(3)]
    victim = keys[0]
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(DiskTier(cfg, layout, pool)) as tier:
        checks = LockChecks(tier)
        for key in keys:
            assert await tier.write_from(key, memoryview(_bytes_of(key, size)))
        fan, away = tier.files.layout_dir / f"{TAG:02x}", tmp_path / "away"
        os.rename(fan, away)
        await checks.next()  # retired
        assert not tier.contains(victim)
        assert await tier.write_from(victim, memoryview(_bytes_of(victim, size)))  # into 3a made again
        assert tier.contains(victim)
        await tier.delete(victim)  # indexed: dropped and unlinked there; the old copy is away
        assert not tier.contains(victim)
        await _old_copy_back(tier, checks, fan, away)
        assert not tier.contains(victim), "the deleted key was indexed from the old directory"
        assert not await _served(tier, victim, size), "a deleted page was served"
        assert not (fan / victim.hex()).exists()
        for key in keys[1:]:
            assert await _served(tier, key, size)
        assert _indexed(tier) == _on_disk(tier.files.layout_dir)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_key_deleted_while_written_with_its_old_directory_away_stays_deleted(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    keys = [key_of(i, TAG) for i in range(3)]
    victim = keys[0]
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(DiskTier(cfg, layout, pool)) as tier:
        checks = LockChecks(tier)
        for key in keys:
            assert await tier.write_from(key, memoryview(_bytes_of(key, size)))
        fan, away = tier.files.layout_dir / f"{TAG:02x}", tmp_path / "away"
        os.rename(fan, away)
        await checks.next()  # retired
        payload = memoryview(_bytes_of(victim, size))
        writing = asyncio.create_task(tier.write_from(victim, payload))

        async def delete_while_written() -> None:
            assert victim in tier._writing, "the write is not in flight: the test is not what it says"
            await tier.delete(victim)

        deleting = asyncio.create_task(delete_while_written())  # runs right after the write's first step
        async with asyncio.timeout(30):
            await deleting
            assert not await writing  # discarded as it landed
        assert not tier.contains(victim)
        await _old_copy_back(tier, checks, fan, away)
        assert not tier.contains(victim), "the deleted key was indexed from the old directory"
        assert not await _served(tier, victim, size), "a deleted page was served"
        assert _indexed(tier) == _on_disk(tier.files.layout_dir)
    assert_clean(pool)


FILES = 1000
BAD = 5
"""``3a``'s directory block that fails (about 10 blocks in all)."""


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_key_deleted_while_a_failing_listing_runs_stays_deleted(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """The start's listing of ``3a`` fails at block ``BAD`` (no descriptor); the writer's check
    opens and lists it again, which waits at that block (held); a key whose name lies past it is
    deleted then; the block answers EIO (the listing fails, listed again later); the block reads
    again and the next check lists ``3a`` whole. Before: that listing indexed the deleted key."""
    size = layout.page_bytes
    with listing_ext4(tmp_path, 128) as fs:
        cfg = config(fs.mount / "disk", backend, follow_interval_s=3600.0, min_free_bytes=0)
        async with started(DiskTier(cfg, layout, pool)) as tier:
            for i in range(FILES):
                assert await tier.write_from(key_of(i, TAG), memoryview(_bytes_of(key_of(i, TAG), size)))
            layout_dir = tier.files.layout_dir
        fan = layout_dir / f"{TAG:02x}"
        fs.cold()
        fs.bad_block(fan, BAD)
        async with started(DiskTier(cfg, layout, pool)) as tier:
            assert tier._dir is not None and tier._dir.fanout[TAG] < 0  # the start's listing failed
            victim = key_of(max(i for i in range(FILES) if not tier.contains(key_of(i, TAG))), TAG)
            checks = LockChecks(tier)
            fs.hold_block(fan, BAD)  # answered EIO once freed (still bad)
            deleting: asyncio.Task[None] | None = None
            try:
                await checks.next()  # 3a opened, its listing on its thread waits at block BAD
                await asyncio.to_thread(fs.wait_held)
                assert tier._listings == {TAG: 1} and TAG not in tier._relist
                deleting = asyncio.create_task(tier.delete(victim))
                await asyncio.sleep(0)  # its first step: the key not indexed, its directory being listed
            finally:
                fs.free_block(fan, BAD)
            async with asyncio.timeout(30):
                await deleting
            await _settled(tier)
            assert TAG in tier._relist  # the listing failed: listed again at a later check
            fs.good()
            await checks.next()
            await _settled(tier)
            assert TAG not in tier._relist
            assert not tier.contains(victim), "the deleted key was indexed by the listing again"
            assert not await _served(tier, victim, size), "a deleted page was served"
            assert not (fan / victim.hex()).exists()
            assert _indexed(tier) == _on_disk(layout_dir)
            assert len(tier._index) == FILES - 1
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_key_deleted_while_away_stays_deleted_in_a_copy_with_fresh_times(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """The directory comes back as a copy whose files got new times (``cp`` without ``-p``, or a
    wall clock stepped back between the page's write and the delete): its deleted key's file looks
    newer than the delete. This tier never stored the key after the delete, so that file is the
    deleted page whatever its time. Before: indexed and served. A key stored after its delete whose
    copy comes back is not served from it either: the copy is of its old file, the page deleted
    (review 193: before, taken for the store after the delete, being newer than it)."""
    size = layout.page_bytes
    keys = [key_of(i, TAG) for i in range(4)]
    deleted, restored, kept = keys[0], keys[1], keys[2:]
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(DiskTier(cfg, layout, pool)) as tier:
        checks = LockChecks(tier)
        for key in keys:
            assert await tier.write_from(key, memoryview(_bytes_of(key, size)))
        fan, away = tier.files.layout_dir / f"{TAG:02x}", tmp_path / "away"
        os.rename(fan, away)
        await checks.next()  # retired
        await tier.delete(deleted)
        await tier.delete(restored)
        assert await tier.write_from(restored, memoryview(_bytes_of(restored, size)))  # into 3a made again
        await _settled(tier)
        copy = tmp_path / "copy"
        shutil.copytree(away, copy, copy_function=shutil.copyfile)  # new files: times of now
        os.rename(fan, tmp_path / "made-again")  # holds the restored key's file
        os.rename(copy, fan)
        await checks.next()  # the copy opened and listed
        await _settled(tier)
        assert not tier.contains(deleted), "the deleted key was indexed from a copy"
        assert not await _served(tier, deleted, size), "a deleted page was served"
        assert not (fan / deleted.hex()).exists()
        assert not tier.contains(restored), "a copy of a deleted page was taken for the store after the delete"
        assert not (fan / restored.hex()).exists()
        for key in kept:
            assert await _served(tier, key, size)
        assert _indexed(tier) == _on_disk(tier.files.layout_dir)
    assert_clean(pool)
