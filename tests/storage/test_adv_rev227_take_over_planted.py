"""Review 227: a take-over that cannot read the pending-delete record (review 225) unlinks, on its
look's thread, the pages it does not serve, and saves a record naming those it could not unlink.
It took every name its listings saw for a page: a symlink planted under a page's name, another
user's file, a directory. A start (:func:`storage.layoutdir.apply_deletes`) and every other path of
the tier leave such entries alone (counted when listed: not our regular file); the take-over
unlinked the symlink and the other user's file, and named the directory (its unlink refused:
EISDIR) in the record it saved, where every later start and save kept it, never counted.

Real planted entries in the cache's own fan-out directory; the record planted damaged."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, key_of
from follow_helpers import started
from take_over_helpers import exists, planted_take_over, record_deletes, take_over_config, writer_and_follower
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev188_deletes_away import _served

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly

TAG = 0x71
PAGE, LINK, FOREIGN, DIRECTORY = (key_of(i, TAG) for i in range(4))
OTHER_UID = 54321


def _plant(link: Path, foreign: Path, directory: Path, outside: Path, size: int) -> None:
    os.symlink(outside, link)
    foreign.write_bytes(_bytes_of(FOREIGN, size))
    os.chown(foreign, OTHER_UID, OTHER_UID)
    directory.mkdir()


def _left_alone(link: Path, foreign: Path, directory: Path, outside: Path) -> list[str]:
    """What the take-over touched of the planted entries (nothing: an empty list)."""
    touched = []
    if outside.read_bytes() != b"not the cache's":
        touched.append("the symlink's target outside the cache")
    if not os.path.islink(link):
        touched.append("the symlink planted under a page's name (unlinked)")
    if not foreign.exists() or foreign.stat().st_uid != OTHER_UID:
        touched.append("another user's file (unlinked)")
    if not directory.is_dir():
        touched.append("the directory")
    return touched


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_take_over_replacing_a_damaged_record_leaves_entries_that_are_not_our_pages(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    cfg = take_over_config(tmp_path / "disk", backend)
    outside = tmp_path / "outside"
    outside.write_bytes(b"not the cache's")
    async with contextlib.AsyncExitStack() as stack:
        writer, follower, looks = await writer_and_follower(stack, cfg, layout, pool, (PAGE,))
        assert follower.read_only is ReadOnly.LOCKED
        link = Path(writer.files.path(LINK))
        foreign = Path(writer.files.path(FOREIGN))
        directory = Path(writer.files.path(DIRECTORY))
        _plant(link, foreign, directory, outside, size)
        record = await planted_take_over(writer, looks)
        assert not exists(Path(writer.files.path(PAGE))), "the take-over did not unlink the page it does not serve"
        touched = _left_alone(link, foreign, directory, outside)
        assert not touched, f"the take-over touched entries that are no page of ours: {touched}"
        named = record_deletes(record.parent)
        assert not {LINK, FOREIGN, DIRECTORY} & set(named), \
            f"the saved record names entries that are no page of ours: {sorted(k.hex() for k in named)}"
        assert not any(follower.contains(key) for key in (PAGE, LINK, FOREIGN, DIRECTORY))
        assert not await _served(follower, FOREIGN, size)
    # A start over the directory leaves them too (what the take-over now does, as a start).
    async with started(DiskTier(cfg, layout, pool)) as restarted:
        assert restarted.read_only is None
        assert not _left_alone(link, foreign, directory, outside)
    assert_clean(pool)
