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
from disk_helpers import assert_clean, config, key_of
from follow_helpers import Looks, started
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served
from test_adv_rev222_record_unreadable_take_over import _exists

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly
from aiokv.storage.deletelog import DELETES_NAME, load_deletes

TAG = 0x7A
PAGE = key_of(0, TAG)


@pytest.mark.asyncio
async def test_a_take_over_unlinks_only_its_own_name_of_a_page_hard_linked_from_outside(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0, min_free_bytes=0)
    outside = tmp_path / "backup-of-a-page"
    async with contextlib.AsyncExitStack() as stack:
        writer = await stack.enter_async_context(started(DiskTier(cfg, layout, pool)))
        assert await writer.write_from(PAGE, memoryview(_bytes_of(PAGE, size)))
        await _settled(writer)
        follower = await stack.enter_async_context(started(DiskTier(cfg, layout, pool)))
        assert follower.read_only is ReadOnly.LOCKED
        looks = Looks(follower)
        page = Path(writer.files.path(PAGE))
        os.link(page, outside)
        kept = outside.read_bytes()
        record = writer.files.layout_dir / DELETES_NAME
        record.write_bytes(b"not a pending-delete record, planted")
        await writer.aclose()
        await looks.next()
        assert follower.read_only is None, "the follower did not take the directory over"
        await _settled(follower)  # the loop's unlinks of what the look left named
        assert not _exists(page), "the take-over left the page it does not serve under the cache's name"
        assert outside.read_bytes() == kept and outside.stat().st_nlink == 1, \
            "the take-over touched the file's name outside the cache"
        fd = os.open(record.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            named = load_deletes(fd)  # the damaged record replaced (it may name the key: see above)
            assert set(named) <= {PAGE}, sorted(key.hex() for key in named)
        finally:
            os.close(fd)
        assert not follower.contains(PAGE)
        assert not await _served(follower, PAGE, size)
    async with started(DiskTier(cfg, layout, pool)) as restarted:
        assert not await _served(restarted, PAGE, size)
    assert outside.read_bytes() == kept
    assert_clean(pool)
