"""Review 229 of eed23ff: a take-over that cannot read the pending-delete record unlinks the pages
it does not serve (review 225) and skips names that hold no regular file of ours (review 227: the
start's test, regular file and owner, no link count). A page file hard-linked from outside the cache
(link count 2, e.g. a ``cp -al`` backup) is still our file. The link changed its change time, so
the look's unlink pass takes it for another file since the listing and leaves it named in the record
it saves; the loop's take-over unlinks the cache's name then. The file outside keeps its name and
bytes, and no cache serves the page, then or after a restart.

Real hard link on the same file system; the record planted damaged."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, key_of
from follow_helpers import started
from take_over_helpers import exists, planted_take_over, record_deletes, take_over_config, writer_and_follower
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly

TAG = 0x7A
PAGE = key_of(0, TAG)


@pytest.mark.asyncio
async def test_a_take_over_unlinks_only_its_own_name_of_a_page_hard_linked_from_outside(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    cfg = take_over_config(tmp_path / "disk", backend)
    outside = tmp_path / "backup-of-a-page"
    async with contextlib.AsyncExitStack() as stack:
        writer, follower, looks = await writer_and_follower(stack, cfg, layout, pool, (PAGE,))
        assert follower.read_only is ReadOnly.LOCKED
        page = Path(writer.files.path(PAGE))
        os.link(page, outside)
        kept = outside.read_bytes()
        record = await planted_take_over(writer, looks)
        await _settled(follower)  # the loop's unlinks of what the look left named
        assert not exists(page), "the take-over left the page it does not serve under the cache's name"
        assert outside.read_bytes() == kept and outside.stat().st_nlink == 1, \
            "the take-over touched the file's name outside the cache"
        named = record_deletes(record.parent)  # the damaged record replaced (it may name the key: see above)
        assert set(named) <= {PAGE}, sorted(key.hex() for key in named)
        assert not follower.contains(PAGE)
        assert not await _served(follower, PAGE, size)
    async with started(DiskTier(cfg, layout, pool)) as restarted:
        assert not await _served(restarted, PAGE, size)
    assert outside.read_bytes() == kept
    assert_clean(pool)
