"""Review 231: a follower's look that could not read the writer's pending-delete record
(``.deletes``: EIO, damaged) and did not take the directory over left its deletes empty and went
on indexing: a page the writer had deleted whose unlink failed (the file still there, named only
in the record) stayed indexed and was served (stale KV), and so was any page listed meanwhile. A
start treats such a record as naming unknown deletes (no page found is served), and so does a
take-over (review 222); now such a look does too: the follower serves none of its pages, and
indexes none, until a look reads the record again (``follow_withheld`` counts them); that look
indexes again every page the record does not name.

Real faults: the deleted page's file made immutable (``chattr +i``: the writer's unlink answers
EPERM, for root too) so it stays on disk named in the record; the record then made unreadable for
real: its block answering EIO (an ext4 on a loop device over a FUSE file, the page cache dropped),
or a byte of it flipped on disk; made readable again (the blocks good again, the byte flipped
back). Writer and follower are two tiers over the directory (a real flock), the follower's looks
real. Root only (FUSE, loop device, chattr)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
from pathlib import Path

import pytest
from disk_helpers import assert_clean, key_of
from take_over_helpers import (
    delete_left_on_disk,
    delete_recorded,
    exists,
    flip_last_byte,
    follower_indexed,
    mutable_again,
    take_over_config,
    writer_and_follower,
)
from test_adv_rev142_bad_blocks import bad_block_ext4
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served
from test_adv_rev222_record_unreadable_take_over import OTHER, VICTIM, _drop_caches, _make_unreadable, _read_errno

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, ReadOnly
from aiokv.storage.deletelog import DELETES_NAME

LATER = key_of(2, 0x6E)
"""Stored by the writer while the record is unreadable."""


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["eio", "damaged"])
async def test_a_follower_serves_no_page_while_the_record_cannot_be_read(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, how: str) -> None:
    size = layout.page_bytes
    page: Path | None = None
    with bad_block_ext4(tmp_path, 32) as (mount, bad):
        cfg = take_over_config(mount / "disk", backend)
        try:
            async with contextlib.AsyncExitStack() as stack:
                writer, follower, looks = await follower_indexed(stack, cfg, layout, pool, (VICTIM, OTHER))
                page = Path(writer.files.path(VICTIM))
                record = writer.files.layout_dir / DELETES_NAME
                await delete_recorded(writer, VICTIM, page)  # EPERM: the file stays, named in the record
                await asyncio.to_thread(_make_unreadable, how, record, bad)
                assert await writer.write_from(LATER, memoryview(_bytes_of(LATER, size)))
                await _settled(writer)
                errors = sum(follower.statistics().errors.values())
                await looks.next()
                assert follower.read_only is ReadOnly.LOCKED
                assert not await _served(follower, VICTIM, size), \
                    f"a follower served a page its writer deleted (the record {how}, no take-over)"
                # As at a start: the deletes are unknown, so no page is served until it reads again.
                for key in (OTHER, LATER):
                    assert not follower.contains(key) and not await _served(follower, key, size), key.hex()
                stats = follower.statistics()
                assert stats.follow_withheld == 2, stats
                assert sum(stats.errors.values()) == errors + 1, "the unreadable record was not counted once"
                await looks.next()  # still unreadable: nothing indexed, nothing counted again
                stats = follower.statistics()
                assert stats.follow_withheld == 2 and sum(stats.errors.values()) == errors + 1, stats
                assert not follower.contains(LATER)
                if how == "eio":
                    bad.good()
                    await asyncio.to_thread(_drop_caches)
                else:
                    flip_last_byte(record)  # back
                assert _read_errno(record.parent) == 0, "the record did not read again: no test"
                await looks.next()
                assert not await _served(follower, VICTIM, size), "the page the record names was served again"
                for key in (OTHER, LATER):
                    assert await _served(follower, key, size), f"{key.hex()} not served once the record read again"
                assert _read_errno(record.parent) != errno.EIO
        finally:
            bad.good()
            mutable_again(page)
    assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_take_over_after_withheld_looks_indexes_what_the_record_does_not_name(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """Looks that withheld every page (the record damaged), the record readable again (the writer
    saved it anew, as it does at its next save: here the byte flipped back), and the writer closes:
    the take-over's look finds every page anew (the looks' knowledge was dropped), so the pages the
    record does not name are indexed and served by the new writer, not left on disk outside its
    index and budget; the one it names is not."""
    size = layout.page_bytes
    page: Path | None = None
    with bad_block_ext4(tmp_path, 32) as (mount, bad):
        cfg = take_over_config(mount / "disk", backend)
        try:
            async with contextlib.AsyncExitStack() as stack:
                writer, follower, looks = await writer_and_follower(stack, cfg, layout, pool, (VICTIM, OTHER))
                page = Path(writer.files.path(VICTIM))
                record = writer.files.layout_dir / DELETES_NAME
                await delete_left_on_disk(writer, VICTIM, page)  # EPERM: the file stays, named in the record
                assert exists(page), "the unlink did not fail: no test"
                await asyncio.to_thread(_make_unreadable, "damaged", record, bad)
                await looks.next()
                assert follower.statistics().follow_withheld == 2, follower.statistics()
                flip_last_byte(record)
                assert _read_errno(record.parent) == 0
                await writer.aclose()
                await looks.next()
                assert follower.read_only is None, "the follower did not take the directory over"
                assert follower.contains(OTHER) and await _served(follower, OTHER, size), \
                    "the take-over left a page nobody deleted unindexed"
                assert not follower.contains(VICTIM) and not await _served(follower, VICTIM, size)
        finally:
            bad.good()
            mutable_again(page)
    assert_clean(pool)
