"""Review 198: a look whose apply comes between the publish of this tier's own write (in flight
when it lost its lock) and the write's end does not index that key: a write deleted meanwhile is
discarded at its end, and its file must not stay indexed (stale KV).

The write is held in the kernel by a real ``fsfreeze`` of a loop ext4 across the loss and the
delete; once thawed the loop is held until the file is published, and the look's apply gets the
loop before the write's completion (io_uring backends: the completion is read from the ring after
the apply's turn). Root only."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import started
from fs_helpers import freeze, loop_ext4, thaw
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

TAG = 0x4E
THAW_S = 30.0


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_look_applied_before_a_deleted_write_ends_does_not_keep_it_indexed(
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
            async with started(DiskTier(cfg, layout, pool)) as b:
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
                    _past_file_clock(tmp_path / "probe")
                    state, prepared = a._follow_state, a._dir
                    assert state is not None and prepared is not None
                finally:
                    thaw(mount)
                    watchdog.cancel()
                # The loop held (no completion read) until the write's file is published.
                deadline = time.monotonic() + 10.0
                while not (fan / victim.hex()).exists():
                    assert time.monotonic() < deadline, "the write was not published in 10 s"
                found = look(state, prepared.dir_fd, list(prepared.fanout), a.files.layout_dir)
                assert victim in found.added
                try:
                    await a._apply_look(found)
                finally:
                    found.close()
                assert not await store
                assert not a.contains(victim), "a write deleted in flight stayed indexed by a look"
                assert not await _served(a, victim, size), "a follower served a write its caller deleted"
    assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_take_over_applied_before_a_write_ends_leaves_its_file_to_it(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """The same window at the take-over (the other writer closed meanwhile): the key left to its
    write is not unlinked by the take-over as a name no look indexed; the write, stored, is
    indexed and served."""
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
                    await asyncio.wait_for(b.aclose(), 10.0)  # B lets the directory go
                    state, prepared = a._follow_state, a._dir
                    assert state is not None and prepared is not None
                finally:
                    thaw(mount)
                    watchdog.cancel()
            finally:
                await b.aclose()
            deadline = time.monotonic() + 10.0
            while not (fan / victim.hex()).exists():
                assert time.monotonic() < deadline, "the write was not published in 10 s"
            found = look(state, prepared.dir_fd, list(prepared.fanout), a.files.layout_dir)
            assert found.lock_fd is not None and victim in found.added
            try:
                await a._apply_look(found)
            finally:
                found.close()
            assert a.read_only is None and a.statistics().took_over == 1
            assert await store
            await _settled(a)
            assert (fan / victim.hex()).exists(), "the take-over unlinked the file of a write in flight"
            assert a.contains(victim) and await _served(a, victim, size)
    assert_clean(pool)
