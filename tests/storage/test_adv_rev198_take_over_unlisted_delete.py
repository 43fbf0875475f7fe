"""Review 198: a take-over whose listing of a fan-out directory failed part-way (``Look.unlisted``)
does not unlink, under the name of a key its caller deleted while following, the page the other
writer stored after that delete.

Follower B deletes a key (it unlinks nothing: remembered as "a file no newer than the delete", and
the name left to unlink once B may write). Writer A then stores the key again (its page, newer than
B's delete) and closes. B's look takes the directory over, but its listing of the key's directory
fails (EIO): the new file is not seen, and the take-over unlinked the name, A's page with it — a
page lost that 23ea014's listing again would have indexed (the delete is asked there, by the
file's time). Now the name of such a key in a directory the take-over could not list is left to
that listing again, which unlinks the file only if it is the page deleted.

The fault is real: an ext4 whose directory block 5 of ``3b`` answers EIO (``listing_fs.py``: a
loop device over a FUSE file). Root only (FUSE, loop device)."""

from __future__ import annotations

from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import Looks, started
from listing_fs import dir_blocks, listing_ext4
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _indexed, _on_disk, _settled
from test_adv_rev194_deleted_while_following import _past_file_clock
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind, ReadOnly

TAG = 0x3B
FILES = 1000
"""Page files of ``3b``: about 10 blocks of a directory without an index."""
BAD = 5


def _again(key: bytes, size: int) -> bytes:
    """Bytes of A's second page of ``key`` (told apart from the first)."""
    return bytes(b ^ 0x5A for b in _bytes_of(key, size))


@pytest.mark.root
@pytest.mark.asyncio
async def test_the_take_over_keeps_a_page_stored_after_the_follower_s_delete_in_a_directory_it_listed_in_part(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    victim = key_of(7, TAG)
    with listing_ext4(tmp_path, 128) as fs:
        cfg = config(fs.mount / "disk", backend, follow_interval_s=3600.0, min_free_bytes=0)
        async with started(DiskTier(cfg, layout, pool)) as a:
            for i in range(FILES):
                assert await a.write_from(key_of(i, TAG), memoryview(_bytes_of(key_of(i, TAG), size)))
            b = DiskTier(cfg, layout, pool)
            await b.start()
            try:
                assert a.read_only is None and b.read_only is ReadOnly.LOCKED
                looks = Looks(b)
                assert b.contains(victim)
                await b.delete(victim)  # B's caller: the page is no longer valid
                assert not b.contains(victim)
                await a.delete(victim)
                _past_file_clock(fs.mount / "probe")  # A's next file is newer than B's delete
                assert await a.write_from(victim, memoryview(_again(victim, size)))  # after B's delete
                layout_dir = a.files.layout_dir
                fan = layout_dir / f"{TAG:02x}"
                assert dir_blocks(fan) > BAD + 2
            except BaseException:
                await b.aclose()
                raise
        # A closed: B's next look takes the directory over, its listing of 3b failing at block 5.
        try:
            fs.cold()
            fs.bad_block(fan, BAD)
            await looks.next()
            assert b.read_only is None and b.statistics().took_over == 1
            assert b.statistics().errors[ErrorKind.EIO] >= 1
            await _settled(b)
            fs.good()  # first: the name's own lookup may read the bad block (the directory's hash seed is random)
            assert (fan / victim.hex()).exists(), "the take-over unlinked the page A stored after B's delete"
            checks = LockChecks(b)
            await checks.next()  # lists 3b again
            await _settled(b)
            assert b.contains(victim), "the page A stored after B's delete was not indexed"
            buf = bytearray(size)
            assert await b.read_into(victim, memoryview(buf)) and buf == _again(victim, size)
            assert _indexed(b) == _on_disk(layout_dir)
        finally:
            await b.aclose()
    assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_the_take_over_s_listing_again_unlinks_the_page_the_follower_deleted(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """The other side: the file under the name is still the page B deleted (A stored nothing
    since): the listing again leaves it out of the index and unlinks it."""
    size = layout.page_bytes
    victim = key_of(7, TAG)
    with listing_ext4(tmp_path, 128) as fs:
        cfg = config(fs.mount / "disk", backend, follow_interval_s=3600.0, min_free_bytes=0)
        async with started(DiskTier(cfg, layout, pool)) as a:
            for i in range(FILES):
                assert await a.write_from(key_of(i, TAG), memoryview(_bytes_of(key_of(i, TAG), size)))
            b = DiskTier(cfg, layout, pool)
            await b.start()
            try:
                looks = Looks(b)
                await b.delete(victim)
                layout_dir = a.files.layout_dir
                fan = layout_dir / f"{TAG:02x}"
            except BaseException:
                await b.aclose()
                raise
        try:
            fs.cold()
            fs.bad_block(fan, BAD)
            await looks.next()
            assert b.read_only is None and b.statistics().took_over == 1
            fs.good()
            checks = LockChecks(b)
            await checks.next()  # lists 3b again
            await _settled(b)
            assert not b.contains(victim), "the page B deleted was indexed by the listing again"
            assert not (fan / victim.hex()).exists(), "the page B deleted was left on disk"
            assert b.contains(key_of(8, TAG))
            assert _indexed(b) == _on_disk(layout_dir)
        finally:
            await b.aclose()
    assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_the_take_over_keeps_a_page_stored_after_the_follower_s_delete_in_a_directory_opened_not_listed(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """The same for a directory the take-over opened late (moved away and back while B followed:
    its descriptor retired) whose listing failed: it is closed again (no descriptor), and the
    take-over's unlink of the key's name opened it and unlinked the other writer's page."""
    size = layout.page_bytes
    victim = key_of(7, TAG)
    with listing_ext4(tmp_path, 128) as fs:
        cfg = config(fs.mount / "disk", backend, follow_interval_s=3600.0, min_free_bytes=0)
        async with started(DiskTier(cfg, layout, pool)) as a:
            for i in range(FILES):
                assert await a.write_from(key_of(i, TAG), memoryview(_bytes_of(key_of(i, TAG), size)))
            b = DiskTier(cfg, layout, pool)
            await b.start()
            try:
                looks = Looks(b)
                await b.delete(victim)
                await a.delete(victim)
                _past_file_clock(fs.mount / "probe")
                assert await a.write_from(victim, memoryview(_again(victim, size)))
                layout_dir = a.files.layout_dir
                fan = layout_dir / f"{TAG:02x}"
                away = fs.mount / "away"
                fan.rename(away)
                await looks.next()  # B retires its descriptor
                assert b._dir is not None and b._dir.fanout[TAG] < 0
            except BaseException:
                await b.aclose()
                raise
        try:
            away.rename(fan)
            fs.cold()
            fs.bad_block(fan, BAD)
            await looks.next()  # takes over: opens 3b, its listing fails
            assert b.read_only is None and b.statistics().took_over == 1
            assert b.statistics().errors[ErrorKind.EIO] >= 1
            await _settled(b)
            fs.good()
            assert (fan / victim.hex()).exists(), "the take-over unlinked the page A stored after B's delete"
            checks = LockChecks(b)
            await checks.next()  # opens and lists 3b
            await _settled(b)
            assert b.contains(victim), "the page A stored after B's delete was not indexed"
            buf = bytearray(size)
            assert await b.read_into(victim, memoryview(buf)) and buf == _again(victim, size)
            assert _indexed(b) == _on_disk(layout_dir)
        finally:
            await b.aclose()
    assert_clean(pool)
