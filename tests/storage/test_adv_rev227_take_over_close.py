"""Review 227: a take-over that cannot read the pending-delete record unlinks, on its look's
thread, the pages it does not serve (review 225). The tier's close stops the look in progress
(:attr:`storage.follow.FollowState.stop`) and waits for its thread; those unlinks asked the flag
only between two fan-out directories, so a directory of many pages held the close until every one
was unlinked (a listing asks it every ``STOP_EVERY`` entries). Now asked as often; stopped there,
the damaged record stays, and the next start serves none of what is left (unlinks it).

Real files planted in one fan-out directory (as a writer's pages are named), the record planted
damaged. The test waits for the first unlink (the directory's modification time changes: nothing
else changes it after the take-over's listing), then closes the tier and counts what is left."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import started

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly
from aiokv.storage.deletelog import DELETES_NAME, load_deletes

TAG = 0x72
PLANTED = 16384


def _mtime(path: Path) -> int:
    return os.stat(path).st_mtime_ns


@pytest.mark.asyncio
async def test_the_close_stops_the_take_overs_unlinks_within_a_directory(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0, min_free_bytes=0)
    async with contextlib.AsyncExitStack() as stack:
        writer = await stack.enter_async_context(started(DiskTier(cfg, layout, pool)))
        follower = await stack.enter_async_context(started(DiskTier(cfg, layout, pool)))
        assert follower.read_only is ReadOnly.LOCKED
        fanout = Path(writer.files.path(key_of(0, TAG))).parent
        for i in range(PLANTED):
            os.close(os.open(writer.files.path(key_of(i, TAG)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        record = writer.files.layout_dir / DELETES_NAME
        record.write_bytes(b"not a pending-delete record, planted")
        await writer.aclose()
        before = _mtime(fanout)
        follower._look_soon()
        deadline = time.monotonic() + 30.0
        while _mtime(fanout) == before:  # the take-over's first unlink
            assert follower._follow_task is not None and not follower._follow_task.done(), "the looks ended"
            assert time.monotonic() < deadline, "the take-over unlinked nothing in 30 s"
            await asyncio.sleep(0)
        await follower.aclose()
        left = len(os.listdir(fanout))
        assert left >= PLANTED // 2, \
            f"the close waited for the take-over to unlink {PLANTED - left} of {PLANTED} pages in one directory"
        fd = os.open(record.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with pytest.raises(OSError, match="not a pending-delete record"):
                load_deletes(fd)  # stopped before its save: the damaged record stays
        finally:
            os.close(fd)
    async with started(DiskTier(cfg, layout, pool)) as restarted:
        assert restarted.read_only is None
        assert not any(restarted.contains(key_of(i, TAG)) for i in range(PLANTED))
        assert not os.listdir(fanout), "a start left pages of unknown deletes on disk"
    assert_clean(pool)
