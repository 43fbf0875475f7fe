"""Review 284 (chaos soak): an unlink on the threads backend whose task a loop-wide cancel ended (an
application's SIGTERM handler cancelling every task) while the unlink was still in the kernel — a
frozen file system holds it there — and which then failed (here EISDIR: a directory planted at the
page's name) left its failure in a future nobody retrieved: asyncio logged "Future exception was
never retrieved" with the traceback, an unhandled exception in the engine's loop. ``asyncio.shield``
forgets its inner future once the outer one is cancelled first, so ``ThreadPageIO._run`` now
retrieves the outcome itself. The soak's cache logged three such errors when a thaw let three
evictions' unlinks end this way."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of, stored_page
from fs_helpers import freeze, loop_ext4, thaw
from loop_probes import cancel_every_task_but_nowait, no_loop_reports, until, until_thread

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.backends import ThreadPageIO


def _directory_instead(page: str) -> None:
    """A directory planted at the page file's name: the page's unlink fails with EISDIR."""
    os.unlink(page)
    os.mkdir(page)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_cut_unlinks_failure_is_never_left_unretrieved(tmp_path: Path, layout: KVLayout,
                                                               pool: PagePool) -> None:
    with loop_ext4(tmp_path, 32) as mount:
        tier = DiskTier(config(mount / "disk", DiskBackend.THREADS, min_free_bytes=0), layout, pool)
        await tier.start()
        try:
            # Checked at the block's end, before the close: the unlink's outcome delivered, then
            # the dropped futures collected.
            async with no_loop_reports():
                await stored_page(tier, pool, 1)
                _directory_instead(tier.files.path(key_of(1)))
                io = tier.backend
                assert isinstance(io, ThreadPageIO)
                freeze(mount)
                try:
                    deleting = asyncio.create_task(tier.delete(key_of(1)))
                    await until(lambda: bool(io._jobs))  # the unlink handed to a thread: held in the kernel
                    cancel_every_task_but_nowait(asyncio.current_task())
                    with pytest.raises(asyncio.CancelledError):
                        await deleting
                finally:
                    thaw(mount)
                await until_thread(lambda: not io._jobs, "the unlink's end after the thaw")
        finally:
            await tier.aclose()
    assert_clean(pool)
