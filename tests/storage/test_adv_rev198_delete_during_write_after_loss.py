"""Review 198: a write in flight when this tier lost its lock, deleted by the caller before it
landed, is not indexed by the looks that follow the other writer.

A delete during a write discards the write when it lands (the file is to be unlinked). Without the
lock, the file is kept until this tier may write again (``_unlink_when_writable``), and the delete
is remembered as "a file no newer than the delete" (ee6ad0a). But the write's data landed after
the delete: its file is newer, so the next look indexed it and the follower served the page its
caller had deleted (stale KV), and kept it after the take-over; so did a delete that came before
the loss (not remembered at all: the directory was never away). Now the discarded write is
remembered as a delete at its end: its file, published before, is no newer.

The write is held in the kernel by a real ``fsfreeze`` of a loop ext4 across the loss and the
delete; a real ``unlink`` of ``.lock``; a second writer. Root only."""

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
from test_adv_rev194_deleted_while_following import _past_file_clock
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly

TAG = 0x4D
THAW_S = 30.0
"""A watchdog thaws the file system after this long (a failing test must not leave it frozen)."""


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("delete_first", [False, True], ids=["deleted_after_the_loss", "deleted_before_the_loss"])
async def test_a_write_deleted_before_it_landed_after_the_lock_loss_is_not_indexed(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, delete_first: bool) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    size = layout.page_bytes
    victim, other = key_of(0, TAG), key_of(1, TAG)
    with loop_ext4(tmp_path, 24) as mount:
        cfg = config(mount / "disk", backend, follow_interval_s=3600.0, min_free_bytes=0)
        async with started(DiskTier(cfg, layout, pool)) as a:
            checks, looks = LockChecks(a), Looks(a)
            assert await a.write_from(other, memoryview(_bytes_of(other, size)))
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
                    if delete_first:
                        await a.delete(victim)  # while A still writes: not remembered (never away)
                    await checks.next()  # A loses the lock, its write still held in the kernel
                    assert a.read_only is ReadOnly.LOCKED
                    assert not store.done()
                    if not delete_first:
                        await a.delete(victim)  # the caller: this page is no longer valid
                    _past_file_clock(tmp_path / "probe")  # the write's data lands later than the delete
                finally:
                    thaw(mount)
                    watchdog.cancel()
                assert not await store, "a write deleted before it landed counted as stored"
                assert (fan / victim.hex()).exists()  # published, kept: A may not unlink now
                await looks.next()
                await looks.next()
                assert a.contains(other)
                assert not a.contains(victim), "a follower indexed the write its caller deleted"
                assert not await _served(a, victim, size), "a follower served the write its caller deleted"
            await looks.next()  # B closed: A takes over
            assert a.read_only is None and a.statistics().took_over == 1
            await _settled(a)
            assert not a.contains(victim)
            assert not (fan / victim.hex()).exists(), "the write deleted was left on disk outside the index"
            assert await _served(a, other, size)
            assert _indexed(a) == _on_disk(a.files.layout_dir)
    assert_clean(pool)
