"""Review 200: a take-over that found another writer's page under a key its own write (in flight
since before the lock loss) was still writing indexed that key blind when the write ended unstored
(review 199, ``_found_under_write``). If the key's fan-out directory was moved away meanwhile and a
copy put back in its place holding the page the caller had deleted, the key was indexed, and the
name's reopening kept it (an indexed key is not asked against the deletes): the deleted page was
served (stale KV). The take-over's finding is now forgotten when that directory is retired: the
listing of the name's next directory decides (it unlinks the deleted page).

Real: the delete remembered with the old directory moved away; a second writer stores the key
again; the write held by ``fsfreeze`` across the lock loss, the other writer's close and the
take-over look, on a file system filled for real (ENOSPC once thawed); the directories renamed for
real before the write's end runs on the loop, and the writer's own lock check retires the moved one.
Root only."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from fs_helpers import fill_up, freeze, loop_ext4, thaw
from loop_probes import until_thread
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served
from test_adv_rev199_take_over_failed_write import _fill_rest
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly
from aiokv.storage.follow import look
from aiokv.storage.lockwatch import check_writer

TAG = 0x5C
THAW_S = 30.0


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_found_page_s_directory_replaced_before_the_write_fails_serves_no_deleted_page(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    size = layout.page_bytes
    victim, other = key_of(0, TAG), key_of(1, TAG)
    with loop_ext4(tmp_path, 24) as mount:
        cfg = config(mount / "disk", backend, capacity=64 * size, follow_interval_s=3600.0, min_free_bytes=0,
                     enospc_retries=0, free_space_recheck_s=3600.0)
        a = DiskTier(cfg, layout, pool)
        await a.start()
        try:
            checks = LockChecks(a)
            fan, away, newer = a.files.layout_dir / f"{TAG:02x}", mount / "away", mount / "newer"
            assert await a.write_from(victim, memoryview(_bytes_of(victim, size)))  # the page deleted below
            os.rename(fan, away)
            await checks.next()  # retired
            await a.delete(victim)  # remembered: its file is away
            assert victim in a._deleted_away
            assert await a.write_from(other, memoryview(_bytes_of(other, size)))  # the name opened again
            # Its listing of the reopened directory ends first: applied after b's store below (after
            # the freeze), it unlinked b's page as deleted, blocked on the frozen fs until the thaw.
            await _settled(a)
            os.unlink(a.files.layout_dir / ".lock")
            b = DiskTier(cfg, layout, pool)
            await b.start()
            try:
                assert b.read_only is None
                assert await b.write_from(victim, memoryview(_bytes_of(victim, size)))  # stored after the delete
                fill_up(mount / "filler", 0)
                _fill_rest(mount / "filler-rest")
                watchdog = threading.Timer(THAW_S, thaw, args=(mount,))
                freeze(mount)
                watchdog.start()
                try:
                    store = asyncio.ensure_future(a.write_from(victim, memoryview(_bytes_of(victim, size))))
                    await until_thread(lambda: a.statistics().writes_in_flight > 0, "the write in flight")
                    await checks.next()  # A loses the lock, its write still held in the kernel
                    assert a.read_only is ReadOnly.LOCKED
                    await asyncio.wait_for(b.aclose(), 10.0)
                    state, prepared = a._follow_state, a._dir
                    assert state is not None and prepared is not None
                    found = look(state, prepared.dir_fd, list(prepared.fanout), a.files.layout_dir)  # reads only
                    assert found.lock_fd is not None
                    try:
                        await a._apply_look(found)
                    finally:
                        found.close()
                    assert a.read_only is None and a.statistics().took_over == 1
                    assert victim in a._writing, "the write ended before the thaw"
                    assert victim in a._found_under_write, "the take-over did not find the other writer's page"
                finally:
                    thaw(mount)
                    watchdog.cancel()
                # Before the write's end runs on the loop (no await): the directory holding the
                # other writer's page moved away, the one holding the page deleted put back, and
                # A's own lock check retires the name's old descriptor.
                os.rename(fan, newer)
                os.rename(away, fan)
                assert prepared.lock_fd is not None
                checked = check_writer(prepared.dir_fd, prepared.lock_fd, list(prepared.fanout), None,
                                       a.files.layout_dir)
                try:
                    a._apply_lock_check(checked)
                finally:
                    checked.close()
                assert TAG in a._fanouts_away, "the moved directory was not retired"
            finally:
                await b.aclose()
            assert not await asyncio.wait_for(store, 10.0), "the write was to fail (ENOSPC)"
            await _settled(a)
            served = await _served(a, victim, size)
            await _settled(a)
            assert not served, "the page the caller deleted (put back with its directory) was served"
            assert not a.contains(victim), "the page the caller deleted was indexed"
            assert not (fan / victim.hex()).exists(), "the page the caller deleted stayed on disk"
        finally:
            await a.aclose()
    assert_clean(pool)
