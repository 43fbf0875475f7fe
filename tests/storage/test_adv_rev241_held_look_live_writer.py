"""Review 241: a held look (the tier took the directory over where it could not write, a read-only
file system: ``_follow_held``) scans as a take-over does once the file system is writable again,
and that scan removes the temporary files it finds (a crash's leftovers under the lock). It asked
whether ``.lock`` still names the lock the tier holds only after the scan, for the record's
temporary file. Once ``.lock`` was removed from outside and another cache took the new one (a
writer in another process), the scan removed that writer's temporary file with its page write in
flight (its rename then fails; the write is made again once, and lost when it was already the
second try), and the tier switched to writing beside it until its next lock check. Now a held look
takes over only while ``.lock`` names the lock the tier holds, asked before the scan, and asks the
tier's lock check at once otherwise: it finds the lock lost and the tier follows; or, ``.lock``
removed and nobody holding another, takes it again, and the next look (asked at once) takes over.

Real: a loop ext4 over a FUSE file (``fuse_gate.py``) remounted read-only (the take-over held) and
read-write again, ``.lock`` unlinked, the other writer a child process whose O_DIRECT page write is
held in the gate (its temporary file made, not yet renamed) while the held look runs. Root only.
The second test: a plain loop ext4, ``.lock`` removed and nobody else there."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import WRITER_TAG, Looks, child, receive, started, writer_child
from fs_helpers import loop_ext4, remount
from gate_helpers import BOUND_S, gated_ext4
from loop_probes import until_thread
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev188_deletes_away import _served
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly
from aiokv.storage.pagefile import TEMP_PREFIX

TAG = 0x6F
FS_MIB = 384
"""Room for the other writer's second page beside ``min_free_bytes`` (256 MiB, ``writer_child``'s
default): with less it recycles its first page's file (no temporary name) for the second."""


def _remount_read_only(mount: Path) -> None:
    """``remount,ro``, tried again while a file just published is still open (EBUSY). Bounded."""
    deadline = time.monotonic() + BOUND_S
    while subprocess.run(["mount", "-o", "remount,ro", str(mount)], capture_output=True).returncode:
        assert time.monotonic() < deadline, f"remount,ro failed for {BOUND_S} s"


def _temps(directory: Path) -> list[str]:
    return [name for name in os.listdir(directory) if name.startswith(TEMP_PREFIX)]


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_held_look_leaves_a_live_writers_temporary_file(tmp_path: Path, layout: KVLayout,
                                                                 pool: PagePool) -> None:
    size = layout.page_bytes
    with gated_ext4(tmp_path, FS_MIB) as (mount, gate):
        cfg = config(mount / "disk", DiskBackend.THREADS, follow_interval_s=3600.0, free_space_recheck_s=3600.0,
                     min_free_bytes=0)
        writer = DiskTier(cfg, layout, pool)
        await writer.start()
        try:
            page = key_of(0, TAG)
            assert await writer.write_from(page, memoryview(_bytes_of(page, size)))
            async with started(DiskTier(cfg, layout, pool)) as a:
                assert a.read_only is ReadOnly.LOCKED
                looks, checks = Looks(a), LockChecks(a)
                await writer.aclose()
                await asyncio.to_thread(_remount_read_only, mount)
                try:
                    await looks.next()  # the writer closed: A takes the directory over, held (read-only)
                    assert a._follow_held and a.read_only is ReadOnly.FILE_SYSTEM
                finally:
                    await asyncio.to_thread(remount, mount, "rw")
                os.unlink(a.files.layout_dir / ".lock")  # from outside
                with child(writer_child, str(cfg.directory), DiskBackend.THREADS.value, 64) as (conn, _proc):
                    assert await receive(conn) == ("ready", None), "the other cache does not write: no test"
                    conn.send(("write", [1]))  # its fan-out directory made, its blocks read
                    assert await receive(conn) == ("written", [True])
                    fan = a.files.layout_dir / f"{WRITER_TAG:02x}"
                    # A failing test never hangs the fs. Past the waits below (BOUND_S each), not within them:
                    # fired early (the GPU host's 16 workers), it let the write end and its rename take the
                    # temporary file away, which read as the look removing it.
                    watchdog = threading.Timer(4 * BOUND_S, gate.release)
                    gate.hold()
                    watchdog.start()
                    try:
                        conn.send(("write", [2]))
                        # Its temporary file made, its page write waiting in the gate.
                        await asyncio.to_thread(gate.wait_held)
                        await until_thread(lambda: bool(_temps(fan)), "the other writer's temporary file", BOUND_S)
                        temps = _temps(fan)
                        assert len(temps) == 1, f"no write in flight: no test ({temps})"
                        removed, checked = a.statistics().temp_files_removed, checks.applied
                        looks_before = a._follow_looks
                        a._look_soon()  # the file system is writable now: the held look
                        await until_thread(lambda: a._follow_looks > looks_before, "the held look", BOUND_S)
                        assert a.statistics().temp_files_removed == removed, "the held look removed a temporary file"
                        assert watchdog.is_alive(), "the watchdog let the write go before the look: no test"
                        assert _temps(fan) == temps, "the held look removed the other writer's temporary file"
                    finally:
                        gate.release()
                        watchdog.cancel()
                    assert await receive(conn) == ("written", [True])
                    await until_thread(lambda: looks.applied > 0 and a._follow_looks == a._follow_started,
                                       "the held look applied", BOUND_S)
                    assert a.read_only is not None, "the tier writes beside the cache that holds .lock"
                    # The look asked the lock check at once: the other cache holds .lock, A follows it.
                    await until_thread(lambda: checks.applied > checked, "the lock check the look asked for", BOUND_S)
                    assert a.read_only is ReadOnly.LOCKED and a._dir is not None and a._dir.lock_fd is None
                    assert a.statistics().took_over == 1
                    conn.send("close")
                    assert await receive(conn) == "closed"
                    conn.send("exit")
                await looks.next()  # the other cache closed: A takes over, writable now
                assert a.read_only is None
        finally:
            await writer.aclose()
    assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_held_look_where_lock_was_removed_takes_over_once_the_check_took_it(
        tmp_path: Path, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    with loop_ext4(tmp_path, 24) as mount:
        cfg = config(mount / "disk", DiskBackend.THREADS, follow_interval_s=3600.0, free_space_recheck_s=3600.0,
                     min_free_bytes=0)
        writer = DiskTier(cfg, layout, pool)
        await writer.start()
        try:
            page = key_of(0, TAG)
            assert await writer.write_from(page, memoryview(_bytes_of(page, size)))
            async with started(DiskTier(cfg, layout, pool)) as a:
                looks, checks = Looks(a), LockChecks(a)
                await writer.aclose()
                await asyncio.to_thread(_remount_read_only, mount)
                try:
                    await looks.next()
                    assert a._follow_held and a.read_only is ReadOnly.FILE_SYSTEM
                finally:
                    await asyncio.to_thread(remount, mount, "rw")
                os.unlink(a.files.layout_dir / ".lock")  # from outside; nobody takes another
                checked = checks.applied
                await looks.next()  # not ours: no take-over; the lock check asked
                await until_thread(lambda: a.read_only is None, "the take-over after the lock check", BOUND_S)
                assert checks.applied > checked and a.statistics().lock_retaken == 1
                assert a.statistics().took_over == 1 and a._dir is not None and a._dir.lock_fd is not None
                other = key_of(1, TAG)
                assert await a.write_from(other, memoryview(_bytes_of(other, size)))
                assert await _served(a, page, size)
        finally:
            await writer.aclose()
    assert_clean(pool)
