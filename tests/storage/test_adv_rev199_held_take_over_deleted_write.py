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
import subprocess
import time
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from fs_helpers import loop_ext4, remount
from held_write import apply_look, followed, needs_fsfreeze, second_writer, wait_published, write_held_over_loss, writer
from loop_probes import until_thread
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served
from test_adv_rev194_deleted_while_following import _past_file_clock

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, ReadOnly

TAG = 0x6C


def _remount_read_only(mount: Path) -> None:
    """``remount,ro``, tried again while a file the write just published is still open (EBUSY). Bounded."""
    deadline = time.monotonic() + 10.0
    while subprocess.run(["mount", "-o", "remount,ro", str(mount)], capture_output=True).returncode:
        assert time.monotonic() < deadline, "remount,ro failed for 10 s"


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_write_deleted_in_flight_that_ends_after_a_read_only_take_over_is_not_served(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    needs_fsfreeze()
    size = layout.page_bytes
    victim = key_of(0, TAG)
    with loop_ext4(tmp_path, 24) as mount:
        cfg = config(mount / "disk", backend, follow_interval_s=3600.0, min_free_bytes=0)
        async with writer(cfg, layout, pool, TAG) as (a, checks, fan):
            async with (second_writer(a, cfg, layout, pool) as b,
                        write_held_over_loss(mount, a, checks, victim) as store):
                await a.delete(victim)
                _past_file_clock(tmp_path / "probe")  # the write's data lands after the delete
                await asyncio.wait_for(b.aclose(), 10.0)  # B lets the directory go
                following = followed(a)
            try:
                # The loop held (no completion read) until the write's file is published.
                wait_published(fan / victim.hex())
                _remount_read_only(mount)
                found = following.look()
                assert found.lock_fd is not None and found.read_only is ReadOnly.FILE_SYSTEM
                await apply_look(a, found)  # the take-over, held: the file system is read-only
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
