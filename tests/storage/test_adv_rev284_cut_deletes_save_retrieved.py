"""Review 284 (chaos soak): a save of the pending-delete record whose task a loop-wide cancel ended
(an application's SIGTERM handler cancelling every task) while its thread was held in the kernel —
a frozen file system — and which then failed (EISDIR: a directory planted at ``.deletes``) left its
failure in a job nobody retrieved: asyncio logged "Future exception was never retrieved", an
unhandled exception in the engine's loop (the soak's cache: once, with ``.deletes`` planted as a
directory). The cancelled save waited for its thread (``jobs.wait_uncancelled``) and re-raised,
never reading the outcome; that wait now retrieves it.

Since review 289 a save moves a directory planted at ``.deletes`` out of its way (removed when
empty, else renamed aside): the one planted here is a mount point (a bind mount), which neither
``rmdir`` nor ``rename`` can move (EBUSY), so every save of the record still fails."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config
from fs_helpers import bind_mount, freeze, loop_ext4, thaw
from loop_probes import cancel_every_task_but_nowait, no_loop_reports, waiting_in

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_cut_deletes_saves_failure_is_never_left_unretrieved(tmp_path: Path, layout: KVLayout,
                                                                     pool: PagePool) -> None:
    held = tmp_path / "held"
    held.mkdir()
    with loop_ext4(tmp_path, 32) as mount:
        cfg = config(mount / "disk", DiskBackend.THREADS, min_free_bytes=0)
        async with DiskTier(cfg, layout, pool) as first:  # makes the layout directory
            layout_dir = first.files.layout_dir
        planted = Path(layout_dir) / ".deletes"
        planted.mkdir()
        with bind_mount(held, planted):  # every save of the record fails (EBUSY)
            tier = DiskTier(cfg, layout, pool)
            await tier.start()  # the record cannot be trusted: a save is due (it fails, counted)
            try:
                async with no_loop_reports():  # checked at its end, before the close
                    if tier._deletes_saving is not None:
                        await asyncio.wait({tier._deletes_saving})
                    freeze(mount)
                    try:
                        saving = tier._save_deletes_soon()  # a retry (the periodic one), held in the kernel
                        assert saving is not None
                        for _ in range(3):
                            await asyncio.sleep(0)
                        assert waiting_in(saving, "_save_deletes")
                        cancel_every_task_but_nowait(asyncio.current_task())
                    finally:
                        thaw(mount)
                    with pytest.raises(asyncio.CancelledError):
                        await saving  # it waits for its thread, which fails now
            finally:
                await tier.aclose()
    assert_clean(pool)
