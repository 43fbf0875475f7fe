"""Review 200: a take-over look's apply (bounded steps of
:data:`~aiokv.storage.followpath.APPLY_PER_TURN` keys) left a key to this tier's own write in flight
since before the lock loss (review 198: its name examined again at the next look). When that write
ended unstored (a real ENOSPC) between two of the apply's steps, the take-over at the apply's end
found the key neither indexed nor being written, and unlinked its name as refused: the page the
other writer had stored there, which the look had found (the write never published), was lost. It
is indexed now.

A writer A loses its unlinked lock to B, which stores the victim; 4,100 other page names (empty
files, newer) in the victim's fan-out directory make the look's apply take two steps, the victim in
the first. A's write of the victim is held by a real ``fsfreeze`` across the loss, B's close and the
look (which only reads), on a file system filled for real; the file system is thawed between the
apply's steps (a gate on the loop's ``sleep(0)``, the scheduler only), and the apply's second step
waits for the write's end. Root only."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from disk_helpers import assert_clean, key_of
from fs_helpers import loop_ext4, thaw
from held_write import fill, followed, full_fs_config, needs_fsfreeze, second_writer, write_held_over_loss, writer
from loop_probes import until_thread
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend
from aiokv.storage.followpath import APPLY_PER_TURN

TAG = 0x5D


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("deleted", [False, True], ids=["kept", "deleted"])
async def test_a_write_ending_unstored_between_two_apply_steps_keeps_the_page_the_look_found(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        monkeypatch: pytest.MonkeyPatch, deleted: bool) -> None:
    """``deleted``: A's caller deletes the victim while its write is in flight (before the thaw):
    the page under its name is then the one deleted (unlinked, never served)."""
    needs_fsfreeze()
    size = layout.page_bytes
    victim = key_of(0, TAG)
    with loop_ext4(tmp_path, 32, inodes=8192) as mount:
        cfg = full_fs_config(mount, backend, size, 8192)
        async with writer(cfg, layout, pool, TAG) as (a, checks, fan):
            async with second_writer(a, cfg, layout, pool) as b:
                assert await b.write_from(victim, memoryview(_bytes_of(victim, size)))
                newer = time.time_ns() + 60 * 1_000_000_000  # after the victim: the apply's second step
                for i in range(1, APPLY_PER_TURN + 5):
                    name = fan / key_of(i, TAG).hex()
                    name.touch()
                    os.utime(name, ns=(newer, newer))
                fill(mount)
                async with write_held_over_loss(mount, a, checks, victim) as store:
                    await asyncio.wait_for(b.aclose(), 10.0)
                    found = followed(a).look()  # reads only
                    assert found.lock_fd is not None and found.added[0] == victim
                    assert len(found.added) > APPLY_PER_TURN
                    real_sleep = asyncio.sleep
                    gated = False

                    async def gate(delay: float, result: object = None) -> object:
                        # The apply's second step: the write thawed and its end run on the loop first.
                        nonlocal gated
                        if not gated and victim in a._follow_forgotten and victim in a._writing:
                            gated = True
                            if deleted:
                                await a.delete(victim)
                            thaw(mount)
                            await until_thread(lambda: victim not in a._writing, "the write's end")
                        return await real_sleep(delay, result)

                    monkeypatch.setattr(asyncio, "sleep", gate)
                    try:
                        await a._apply_look(found)
                    finally:
                        monkeypatch.setattr(asyncio, "sleep", real_sleep)
                        found.close()
                    assert gated, "the apply took one step (test set-up)"
                    assert a.read_only is None and a.statistics().took_over == 1
            assert not await asyncio.wait_for(store, 10.0), "the write was to fail (ENOSPC)"
            await _settled(a)
            if deleted:
                assert not a.contains(victim), "a page the caller deleted was indexed"
                assert not await _served(a, victim, size), "a page the caller deleted was served"
                assert not (fan / victim.hex()).exists(), "a page the caller deleted stayed on disk"
            else:
                assert (fan / victim.hex()).exists(), "the other writer's page, found by the look, was unlinked"
                assert a.contains(victim), "the other writer's page was not indexed"
                assert await _served(a, victim, size)
    assert_clean(pool)
