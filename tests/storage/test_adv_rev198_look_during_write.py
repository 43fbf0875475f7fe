"""Review 198: a look whose apply comes between the publish of this tier's own write (in flight
when it lost its lock) and the write's end does not index that key: a write deleted meanwhile is
discarded at its end, and its file must not stay indexed (stale KV).

The write is held in the kernel by a real ``fsfreeze`` of a loop ext4 across the loss and the
delete; once thawed the loop is held until the file is published, and the look's apply gets the
loop before the write's completion (io_uring backends: the completion is read from the ring after
the apply's turn). Root only."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from fs_helpers import loop_ext4
from held_write import apply_look, followed, needs_fsfreeze, second_writer, wait_published, write_held_over_loss, writer
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served
from test_adv_rev194_deleted_while_following import _past_file_clock

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend

TAG = 0x4E


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_look_applied_before_a_deleted_write_ends_does_not_keep_it_indexed(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    needs_fsfreeze()
    size = layout.page_bytes
    victim = key_of(0, TAG)
    with loop_ext4(tmp_path, 24) as mount:
        cfg = config(mount / "disk", backend, follow_interval_s=3600.0, min_free_bytes=0)
        async with writer(cfg, layout, pool, TAG) as (a, checks, fan), second_writer(a, cfg, layout, pool):
            async with write_held_over_loss(mount, a, checks, victim) as store:
                await a.delete(victim)
                _past_file_clock(tmp_path / "probe")
                following = followed(a)
            # The loop held (no completion read) until the write's file is published.
            wait_published(fan / victim.hex())
            found = following.look()
            assert victim in found.added
            await apply_look(a, found)
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
    needs_fsfreeze()
    size = layout.page_bytes
    victim = key_of(0, TAG)
    with loop_ext4(tmp_path, 24) as mount:
        cfg = config(mount / "disk", backend, follow_interval_s=3600.0, min_free_bytes=0)
        async with writer(cfg, layout, pool, TAG) as (a, checks, fan):
            async with (second_writer(a, cfg, layout, pool) as b,
                        write_held_over_loss(mount, a, checks, victim) as store):
                await asyncio.wait_for(b.aclose(), 10.0)  # B lets the directory go
                following = followed(a)
            wait_published(fan / victim.hex())
            found = following.look()
            assert found.lock_fd is not None and victim in found.added
            await apply_look(a, found)
            assert a.read_only is None and a.statistics().took_over == 1
            assert await store
            await _settled(a)
            assert (fan / victim.hex()).exists(), "the take-over unlinked the file of a write in flight"
            assert a.contains(victim) and await _served(a, victim, size)
    assert_clean(pool)
