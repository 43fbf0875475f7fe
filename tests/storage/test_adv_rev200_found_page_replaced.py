"""Review 200: a take-over that found another writer's page under a key its own write (in flight
since before the lock loss) was still writing indexed that key blind when the write ended unstored
(review 199, ``_found_under_write``): a copy of the page the caller had deleted, restored under the
name meanwhile (its times kept), was indexed and served (stale KV). The file under the name is now
asked against the deletes again at the write's end.

Real: the delete remembered with the old directory moved away; a second writer stores the key
again; the write held by ``fsfreeze`` across the lock loss, the other writer's close and the
take-over look, on a file system filled for real (ENOSPC once thawed); the old copy renamed over
the name for real before the write's end runs on the loop. Root only."""

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

TAG = 0x5E
THAW_S = 30.0


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_found_page_replaced_by_a_deleted_copy_before_the_write_fails_is_not_served(
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
            fan, away = a.files.layout_dir / f"{TAG:02x}", mount / "away"
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
                # A second link to it: renamed over, its blocks stay taken (the write still fails).
                os.link(fan / victim.hex(), mount / "kept")
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
                # Before the write's end runs on the loop (no await): the copy of the page deleted
                # (its times kept) restored over the other writer's page.
                os.rename(away / victim.hex(), fan / victim.hex())
            finally:
                await b.aclose()
            assert not await asyncio.wait_for(store, 10.0), "the write was to fail (ENOSPC)"
            await _settled(a)
            served = await _served(a, victim, size)
            await _settled(a)
            assert not served, "the page the caller deleted (restored under its name) was served"
            assert not a.contains(victim), "the page the caller deleted was indexed"
            assert not (fan / victim.hex()).exists(), "the page the caller deleted stayed on disk"
        finally:
            await a.aclose()
    assert_clean(pool)
