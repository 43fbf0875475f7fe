"""Review 232, of 174d014: a follower's looks that cannot read the writer's pending-delete record
withhold every page until a look reads it again, and that look indexes again every page the record
does not name. A follower that *started* while the record could not be read recovered never: its
start took every page found for deleted at the start's time (as a start must: its deletes
unknown), and those deletes, remembered, kept every such page out of its index for as long as it
ran, also once the record read again (the cache lost on that follower). Now a following start
withholds as the looks do: nothing indexed, nothing remembered, and the first look that reads the
record indexes what it does not name.

Real faults: the deleted page's file made immutable (``chattr +i``: the writer's unlink answers
EPERM) so the record names it; the record's last byte flipped on disk and back (a loop ext4);
writer and follower two tiers over the directory (a real flock). Root only (loop device, chattr)."""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

import pytest
from disk_helpers import assert_clean, key_of
from follow_helpers import Looks, started
from fs_helpers import loop_ext4
from take_over_helpers import delete_recorded, flip_last_byte, mutable_again, record_errno, take_over_config
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev188_deletes_away import _served

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly
from aiokv.storage.deletelog import DELETES_NAME

VICTIM = key_of(1, 0x21)
OTHER = key_of(2, 0x22)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_follower_started_while_the_record_was_unreadable_serves_once_it_reads(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    page: Path | None = None
    with loop_ext4(tmp_path, 64) as mount:
        cfg = take_over_config(mount / "disk", backend)
        try:
            async with contextlib.AsyncExitStack() as stack:
                writer = await stack.enter_async_context(started(DiskTier(cfg, layout, pool)))
                for key in (VICTIM, OTHER):
                    assert await writer.write_from(key, memoryview(_bytes_of(key, size)))
                layout_dir = writer.files.layout_dir
                page = Path(writer.files.path(VICTIM))
                await delete_recorded(writer, VICTIM, page)  # EPERM: the file stays, named in the record
                record = layout_dir / DELETES_NAME
                flip_last_byte(record)
                assert record_errno(layout_dir) == errno.EBADMSG
                follower = await stack.enter_async_context(started(DiskTier(cfg, layout, pool)))
                assert follower.read_only is ReadOnly.LOCKED
                looks = Looks(follower)
                assert not follower.contains(OTHER) and not follower.contains(VICTIM), "served: no test"
                await looks.next()  # still unreadable: nothing served
                assert not follower.contains(OTHER) and not follower.contains(VICTIM)
                flip_last_byte(record)  # back, as the writer's next save would
                assert record_errno(layout_dir, VICTIM) == 0
                await looks.next()
                assert not follower.contains(VICTIM) and not await _served(follower, VICTIM, size), \
                    "the page the record names was served"
                assert await _served(follower, OTHER, size), \
                    "a follower started while the record was unreadable never served a page again"
        finally:
            mutable_again(page)
    assert_clean(pool)
