"""Review 199: a write in flight when the tier lost its lock, deleted by its caller while following
and published after that delete, whose end came after a take-over where the tier may not write yet
(a read-only file system: ``_follow_held``): the discard was not remembered again
(``_write_discarded`` asked for a lost lock only), the file was left to "unlink once writable", and
the take-over's scan once writable found it newer than the delete and indexed it: the tier served a
page its caller had deleted (stale KV). Remembered at the discard now whenever the tier follows.

The write is held in the kernel by a real ``fsfreeze`` of a loop ext4 across the loss, the delete
and the other writer's close; once thawed the loop is held until the file is published, the file
system is remounted read-only for real and the look takes the directory over; the remount
read-write lets the tier's own next look take it over for writing. Root only."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import started
from fs_helpers import freeze, loop_ext4, remount, thaw
from loop_probes import until_thread
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served
from test_adv_rev194_deleted_while_following import _past_file_clock
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly
from aiokv.storage.follow import look

TAG = 0x6C
THAW_S = 30.0


def _remount_read_only(mount: Path) -> None:
    """``remount,ro``, tried again while a file the write just published is still open (EBUSY). Bounded."""
    deadline = time.monotonic() + 10.0
    while subprocess.run(["mount", "-o", "remount,ro", str(mount)], capture_output=True).returncode:
        assert time.monotonic() < deadline, "remount,ro failed for 10 s"


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_write_deleted_in_flight_that_ends_after_a_read_only_take_over_is_not_served(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    size = layout.page_bytes
    victim = key_of(0, TAG)
    with loop_ext4(tmp_path, 24) as mount:
        cfg = config(mount / "disk", backend, follow_interval_s=3600.0, min_free_bytes=0)
        async with started(DiskTier(cfg, layout, pool)) as a:
            checks = LockChecks(a)
            fan = a.files.layout_dir / f"{TAG:02x}"
            os.unlink(a.files.layout_dir / ".lock")
            b = DiskTier(cfg, layout, pool)
            await b.start()
            try:
                assert b.read_only is None
                watchdog = threading.Timer(THAW_S, thaw, args=(mount,))
                freeze(mount)
                watchdog.start()
                try:
                    store = asyncio.ensure_future(a.write_from(victim, memoryview(_bytes_of(victim, size))))
                    await until_thread(lambda: a.statistics().writes_in_flight > 0, "the write in flight")
                    await checks.next()  # A loses the lock, its write still held in the kernel
                    assert a.read_only is ReadOnly.LOCKED
                    await a.delete(victim)
                    _past_file_clock(tmp_path / "probe")  # the write's data lands after the delete
                    await asyncio.wait_for(b.aclose(), 10.0)  # B lets the directory go
                    state, prepared = a._follow_state, a._dir
                    assert state is not None and prepared is not None
                finally:
                    thaw(mount)
                    watchdog.cancel()
            finally:
                await b.aclose()
            try:
                # The loop held (no completion read) until the write's file is published.
                deadline = time.monotonic() + 10.0
                while not (fan / victim.hex()).exists():
                    assert time.monotonic() < deadline, "the write was not published in 10 s"
                _remount_read_only(mount)
                found = look(state, prepared.dir_fd, list(prepared.fanout), a.files.layout_dir)
                assert found.lock_fd is not None and found.read_only is ReadOnly.FILE_SYSTEM
                try:
                    await a._apply_look(found)  # the take-over, held: the file system is read-only
                finally:
                    found.close()
                assert a.read_only is ReadOnly.FILE_SYSTEM and a._follow_held
                assert not await asyncio.wait_for(store, 10.0)  # discarded: its caller deleted it
            finally:
                await asyncio.to_thread(remount, mount, "rw")
            a._look_soon()  # the tier's own look: it may write now, and takes the directory over
            await until_thread(lambda: a.read_only is None, "the take-over for writing")
            await _settled(a)
            assert not a.contains(victim), "a write deleted in flight was indexed by the take-over"
            assert not await _served(a, victim, size), "the tier served a write its caller deleted"
            assert not (fan / victim.hex()).exists(), "a write deleted in flight stayed on disk"
    assert_clean(pool)
