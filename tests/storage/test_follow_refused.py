"""Reads a following tier refuses (header, checksum): the writer recycling a file under the read is
no corruption, and a key refused once comes back when the writer stores it again.

Before: every refused read of a followed key counted ``corrupt`` (0-23 a round of
test_adv_rev152_follow's drive, all of them the writer recycling files under the reads), and a key
whose file was refused stayed out of the index until the writer's next file under its name had
another inode number: ext4 hands a freed number to the next file made, so a key the writer deleted
and stored again was a miss for good (and after a take-over, a page file outside the budget).
Now the next look tells: a file that changed since it was indexed (recycled, replaced, removed)
counts ``follow_raced`` and what is under the name now is indexed again; one unchanged counts
``corrupt`` when its identity was recorded at least a second after its change time (coarse clocks:
else it is recorded again and indexed again, uncounted, and its next refusal decides), and is
examined again, one ``stat``, only when a listing of its directory finds it under another
identity."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import (
    WRITER_TAG,
    Looks,
    child,
    follow_config,
    read_back,
    receive,
    recycling_writer_child,
    started,
    store_page,
)

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly
from aiokv.storage.pagefile import HEADER_BYTES


def _exists(path: Path) -> bool:
    return path.exists()


def _corrupt(path: Path) -> None:
    """One payload byte flipped in place (what a torn write or bad media leaves)."""
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 7)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 7)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.asyncio
@pytest.mark.parametrize("when", ["before_the_look", "after_it_was_found_corrupt"])
async def test_a_refused_key_stored_again_under_its_inode_number_is_followed(
        when: str, disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """Page 1's file is corrupt when the follower reads it (refused). The writer deletes page 1 and
    stores it again — ext4 gives the new file the freed inode number — before the follower's next
    look, or after the looks found the refused file corrupt. Either way the next look indexes it
    and it is served, bit for bit; a corrupt file left as it was is read twice only (its first
    refusal cannot be told: its identity was recorded within a second of its change time)."""
    async with started(DiskTier(config(disk_dir, backend), layout, pool)) as writer:
        for i in range(3):
            assert await store_page(writer, pool, i)
        path = Path(writer.files.path(key_of(1, WRITER_TAG)))
        _corrupt(path)
        async with started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as follower:
            looks = Looks(follower)
            assert follower.read_only is ReadOnly.LOCKED and follower.contains(key_of(1, WRITER_TAG))
            assert not await read_back(follower, pool, 1)  # refused: out of the index, kept
            assert not follower.contains(key_of(1, WRITER_TAG)) and _exists(path)
            if when == "after_it_was_found_corrupt":
                # Unchanged since indexed, but its identity was recorded within a second of its
                # change time (a change and back within that tick would not show): recorded again,
                # indexed again, counted neither way; its second refusal is counted corrupt.
                await looks.until(lambda: follower.contains(key_of(1, WRITER_TAG)))
                assert (follower.statistics().corrupt, follower.statistics().follow_raced) == (0, 0)
                assert not await read_back(follower, pool, 1)
                await looks.until(lambda: follower.statistics().corrupt == 1)
                reads = follower.statistics().reads
                for _ in range(3):  # nothing changed: never indexed (read) again
                    await looks.next()
                    assert not await read_back(follower, pool, 1)
                assert (follower.statistics().reads, follower.statistics().corrupt) == (reads, 1)
            inode = os.stat(path).st_ino
            await writer.delete(key_of(1, WRITER_TAG))
            assert await store_page(writer, pool, 1)
            reused = os.stat(path).st_ino == inode
            await looks.next()
            assert follower.contains(key_of(1, WRITER_TAG)), f"not followed (same inode number: {reused})"
            assert await read_back(follower, pool, 1)
            stats = follower.statistics()
            # Before the look, the file changed under the read (the look cannot tell a corrupt one
            # replaced from a recycled one): no corruption counted.
            want = (0, 1) if when == "before_the_look" else (1, 0)
            assert (stats.corrupt, stats.follow_raced) == want, stats
            assert not any(stats.errors.values()), stats
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_file_recycled_under_the_read_counts_follow_raced_not_corrupt(
        disk_dir: Path, layout: KVLayout, pool: PagePool, caplog: pytest.LogCaptureFixture) -> None:
    """A writer process recycles page 0's file for page 3: it overwrote the file under page 0's
    name and has not renamed it yet when the follower reads page 0 (page 3's header there:
    refused). Once renamed, the next look counts that read ``follow_raced`` — the writer recycled
    the file, no corruption — and page 3 is served; page 0 is a plain miss."""
    with child(recycling_writer_child, str(disk_dir)) as (conn, _proc):
        assert await receive(conn) == "ready"
        backend = DiskBackend.URING  # the writer's threads rename through a gated os.rename; not ours
        async with started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as follower:
            looks = Looks(follower)
            assert all(follower.contains(key_of(i, WRITER_TAG)) for i in range(3))
            conn.send(("recycle", 3))
            assert await receive(conn) == "held"
            caplog.set_level(logging.WARNING, logger="aiokv.storage.disk")
            assert not await read_back(follower, pool, 0)  # page 3's bytes under page 0's name
            (said,) = [r.getMessage() for r in caplog.records if "refusing page file" in r.getMessage()]
            assert "kept, as the tier is read-only (held by another cache)" in said and "deleted" not in said
            await looks.next()  # mid-recycle: the file changed since it was indexed
            conn.send("go")
            assert await receive(conn) == ("written", True, 1)
            await looks.next()
            stats = follower.statistics()
            assert (stats.corrupt, stats.follow_raced) == (0, 1), stats
            assert not any(stats.errors.values()), stats
            assert not await read_back(follower, pool, 0)
            assert await read_back(follower, pool, 3) and await read_back(follower, pool, 1)
            conn.send("close")
            assert await receive(conn) == "closed"
    assert_clean(pool)
