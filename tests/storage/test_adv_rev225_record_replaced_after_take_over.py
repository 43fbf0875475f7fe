"""Review 225: a take-over that cannot read the writer's pending-delete record (``.deletes``,
:mod:`storage.deletelog`: damaged) names unknown deletes, so no page found there is served and the
take-over unlinks them all (review 222). A start that finds such a record then replaces it (with
what it could not unlink); the take-over left it as it was: the record on disk stayed damaged while
the new writer stored pages, and the next start over the directory (a restart of that writer, a
new cache) took its deletes for unknown again and served none of those pages (unlinked them all:
the cache lost at every restart, never stale, for good until a failed unlink happened to save the
record). The take-over now unlinks those pages on its look's thread and then replaces the record
with one naming those it could not unlink, as a start does; the loop is told the keys unlinked as
gone (it remembered every key as a delete in one step: beyond 65,536 keys seconds of the engine's
loop); and it removes the record's temporary file a crash left, as a start does (review 218).

Real faults: the record damaged on disk (a byte of it flipped: it fails its checksum), written by
the writer for real (a delete whose unlink fails: the page file made immutable, ``chattr +i``, the
unlink answers EPERM for root too)."""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

import pytest
from disk_helpers import assert_clean, key_of
from follow_helpers import Looks, started
from take_over_helpers import (
    chattr,
    delete_left_on_disk,
    exists,
    flip_last_byte,
    mutable_again,
    planted_take_over,
    record_deletes,
    record_errno,
    take_over_config,
    took_over,
    writer_and_follower,
)
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly
from aiokv.storage.deletelog import DELETES_NAME, DELETES_TEMP, encode

TAG = 0x6F
VICTIM, OTHER, LATER = key_of(0, TAG), key_of(1, TAG), key_of(2, TAG)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_page_stored_after_a_take_over_of_a_damaged_record_survives_a_restart(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    cfg = take_over_config(tmp_path / "disk", backend)
    page: Path | None = None
    try:
        async with contextlib.AsyncExitStack() as stack:
            writer, follower, looks = await writer_and_follower(stack, cfg, layout, pool, (VICTIM, OTHER))
            assert follower.read_only is ReadOnly.LOCKED
            page = Path(writer.files.path(VICTIM))
            record = writer.files.layout_dir / DELETES_NAME
            await delete_left_on_disk(writer, VICTIM, page)  # EPERM: the file stays, named in the record
            assert exists(page) and record_errno(record.parent) == 0, "the unlink did not fail: no test"
            flip_last_byte(record)
            assert record_errno(record.parent) == errno.EBADMSG, "the flipped byte left the record readable"
            await writer.aclose()  # lets the lock go (its last retry fails: the record stays damaged)
            assert record_errno(record.parent) == errno.EBADMSG, "the writer's close replaced the record: no test"
            chattr("-i", page)  # the take-over's unlinks of the pages it does not serve succeed
            await took_over(looks)
            assert not follower.contains(VICTIM) and not follower.contains(OTHER)
            assert await follower.write_from(LATER, memoryview(_bytes_of(LATER, size)))
            await _settled(follower)
            assert await _served(follower, LATER, size)
            await follower.aclose()  # its last retry saves what is unsaved
            assert record_errno(record.parent) == 0, \
                "the take-over left the damaged record on disk: the next start serves none of its pages"
        async with started(DiskTier(cfg, layout, pool)) as restarted:
            assert restarted.read_only is None
            assert await _served(restarted, LATER, size), \
                "a page the new writer stored after the take-over was lost at the restart"
            assert not await _served(restarted, VICTIM, size), "a deleted page was served after the restart"
    finally:
        mutable_again(page)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_take_over_that_unlinked_the_pages_of_a_damaged_record_remembers_no_delete_of_them(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """Each key the look named as deleted was remembered on the loop in one step (beyond 65,536
    keys, pushed into the filter of forgotten deletes: 140,000 pages held the loop 1.2 s, a million
    40 s), also where the take-over had unlinked every file and nothing was left to remember. Now
    the unlinked keys come as gone (applied in bounded steps), and the loop remembers none. A
    planted record (not one this code wrote: it fails its check)."""
    size = layout.page_bytes
    keys = [key_of(i, TAG) for i in range(8)]
    cfg = take_over_config(tmp_path / "disk", backend)
    async with contextlib.AsyncExitStack() as stack:
        writer, follower, looks = await writer_and_follower(stack, cfg, layout, pool, keys)
        assert follower.read_only is ReadOnly.LOCKED
        record = await planted_take_over(writer, looks)
        assert not any(follower.contains(key) for key in keys)
        await _settled(follower)
        assert not any(exists(Path(follower.files.path(key))) for key in keys), "a page left on disk"
        remembered = [key for key in keys if key in follower._deleted_away]
        assert not remembered and follower._forgotten is None, \
            f"the loop remembered {len(remembered)} deletes of pages the take-over unlinked"
        assert record_errno(record.parent) == 0, "the planted record was left"
        assert await follower.write_from(keys[0], memoryview(_bytes_of(keys[0], size)))
        assert await _served(follower, keys[0], size)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_take_over_removes_the_record_temp_file_its_writer_left(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """A writer that crashed while it saved the record left ``.deletes.new`` (planted as such a
    crash leaves it: a whole record, not renamed yet); a start under the lock removes it (review
    218), a take-over left it until its first save of the record. Now removed, and counted as a
    temporary file removed."""
    cfg = take_over_config(tmp_path / "disk", backend)
    async with contextlib.AsyncExitStack() as stack:
        writer = await stack.enter_async_context(started(DiskTier(cfg, layout, pool)))
        follower = await stack.enter_async_context(started(DiskTier(cfg, layout, pool)))
        assert follower.read_only is ReadOnly.LOCKED
        looks = Looks(follower)
        temp = writer.files.layout_dir / DELETES_TEMP
        temp.write_bytes(encode({VICTIM: 1}))
        await writer.aclose()
        removed = follower.statistics().temp_files_removed
        await took_over(looks)
        assert not exists(temp), "the take-over left the record's temp file its writer's crash left"
        assert follower.statistics().temp_files_removed == removed + 1
        assert not exists(temp.parent / DELETES_NAME), "the temp file was taken for the record"
    assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_page_new_to_the_take_over_whose_unlink_fails_is_unlinked_once_it_can_be(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """A page the writer stored after the follower's last look (new to the take-over's listing),
    then deleted (its unlink failed: EPERM, ``chattr +i``), the record then damaged: the take-over
    cannot unlink it either, names it in the record it saves, and leaves it out of the index; the
    tier unlinks it again once it can (here at its close), not only a later start."""
    size = layout.page_bytes
    cfg = take_over_config(tmp_path / "disk", backend)
    page: Path | None = None
    try:
        async with contextlib.AsyncExitStack() as stack:
            writer = await stack.enter_async_context(started(DiskTier(cfg, layout, pool)))
            assert await writer.write_from(OTHER, memoryview(_bytes_of(OTHER, size)))
            follower = await stack.enter_async_context(started(DiskTier(cfg, layout, pool)))
            assert follower.read_only is ReadOnly.LOCKED
            looks = Looks(follower)
            assert await writer.write_from(VICTIM, memoryview(_bytes_of(VICTIM, size)))
            await _settled(writer)
            page = Path(writer.files.path(VICTIM))
            record = writer.files.layout_dir / DELETES_NAME
            await delete_left_on_disk(writer, VICTIM, page)  # EPERM: the file stays, named in the record
            assert exists(page) and record_errno(record.parent) == 0, "the unlink did not fail: no test"
            flip_last_byte(record)
            await writer.aclose()
            assert record_errno(record.parent) == errno.EBADMSG, "the writer's close replaced the record: no test"
            await took_over(looks)
            assert not follower.contains(VICTIM) and not await _served(follower, VICTIM, size)
            await _settled(follower)
            assert exists(page), "the immutable page was unlinked: no test"
            assert VICTIM in record_deletes(record.parent), "the record the take-over saved does not name the page left"
            chattr("-i", page)
            await follower.aclose()  # its last retry of the unlinks that failed
            assert not exists(page), "the take-over never unlinked again a page it left on disk"
    finally:
        mutable_again(page)
    assert_clean(pool)
