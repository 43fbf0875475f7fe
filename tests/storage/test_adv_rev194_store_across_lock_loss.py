"""Review 194: a store of a key with a remembered delete that ends after this tier lost its lock
does not make its own file the only page of the key.

A tier that loses the lock keeps its deletes as "a file no newer than the delete is the page
deleted" (88d2355, dccc23c): the other writer may store the key again. A write of such a key in
flight at the loss (held in the kernel by a real ``fsfreeze``) ended afterwards and remembered
its own file as the key's only page (STORED_SINCE_DELETE), so the other writer's later store of
the key counted as the page deleted: once this tier took the directory over again, a listing of
the directory (moved away and put back) unlinked the other writer's page (a lost page). Root only
(a loop ext4)."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import Looks, started
from fs_helpers import freeze, loop_ext4, thaw
from loop_probes import until_thread
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _indexed, _on_disk, _settled
from test_adv_rev188_deletes_away import _served
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly

TAG = 0x3D
THAW_S = 30.0
"""A watchdog thaws the file system after this long (a failing test must not leave it frozen)."""


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_store_ending_after_the_lock_loss_keeps_the_other_writer_s_page(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    size = layout.page_bytes
    victim, other, again = key_of(0, TAG), key_of(1, TAG), key_of(2, TAG)
    with loop_ext4(tmp_path, 24) as mount:
        cfg = config(mount / "disk", backend, follow_interval_s=3600.0, min_free_bytes=0)
        async with started(DiskTier(cfg, layout, pool)) as a:
            checks, looks = LockChecks(a), Looks(a)
            for key in (victim, other):
                assert await a.write_from(key, memoryview(_bytes_of(key, size)))
            fan = a.files.layout_dir / f"{TAG:02x}"
            os.rename(fan, mount / "away")
            await checks.next()  # retired
            await a.delete(victim)  # remembered
            assert await a.write_from(again, memoryview(_bytes_of(again, size)))  # 3d made again, opened
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
                    assert not store.done()
                finally:
                    thaw(mount)
                    watchdog.cancel()
                assert await store  # (the rename done: stored as far as A knows)
                await looks.next()
                # B, the writer now, stores the key anew: its page to serve.
                assert await b.write_from(victim, memoryview(_bytes_of(victim, size)))
            await looks.next()  # B closed: A takes over
            assert a.read_only is None and a.statistics().took_over == 1
            os.rename(fan, mount / "moved")
            await checks.next()  # retired
            os.rename(mount / "moved", fan)
            await checks.next()  # opened and listed
            await _settled(a)
            assert (fan / victim.hex()).exists(), "the other writer's page, stored after the delete, was unlinked"
            assert await _served(a, victim, size)
            assert _indexed(a) == _on_disk(a.files.layout_dir)
    assert_clean(pool)
