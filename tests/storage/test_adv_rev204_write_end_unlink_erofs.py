"""Review 204: a write deleted in flight is discarded at its end (its file published, then
unlinked). When that unlink met the read-only file system (EROFS: remounted read-only since the
write published), the tier turned read-only, but the key was named nowhere: not in the names to
unlink once writable, not remembered as deleted (95a6d81 covered only a delete's own unlink). Once
writable again nothing unlinked the page, outside the index and the budget, and a restart indexed
and served the page its caller deleted.

Real: a loop ext4 remounted read-only as the write ends (after its file was published) and
read-write again, the tier's own writability check, a real restart. Root only."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import started
from fs_helpers import loop_ext4, remount
from loop_probes import until_thread
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served
from test_adv_rev199_held_take_over_deleted_write import _remount_read_only

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly

TAG = 0x5B


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_write_deleted_in_flight_whose_unlink_met_erofs_is_never_served_again(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    victim, other = key_of(0, TAG), key_of(1, TAG)
    with loop_ext4(tmp_path, 24) as mount:
        cfg = config(mount / "disk", backend, follow_interval_s=3600.0, free_space_recheck_s=0.05, min_free_bytes=0)
        async with started(DiskTier(cfg, layout, pool)) as a:
            assert await a.write_from(other, memoryview(_bytes_of(other, size)))
            await _settled(a)
            page = a.files.layout_dir / f"{TAG:02x}" / victim.hex()
            real_end = a._end_write
            remounted: list[bool] = []

            def end_write(job: Any, stored: bool) -> None:
                # The write published its file; the delete's unlink comes next and meets EROFS.
                if job.key == victim and stored and not remounted:
                    _remount_read_only(mount)
                    remounted.append(True)
                real_end(job, stored)

            a._end_write = end_write  # type: ignore[method-assign]
            writing = asyncio.ensure_future(a.write_from(victim, memoryview(_bytes_of(victim, size))))
            for _ in range(100):  # loop turns: the write registers itself before its first I/O
                if victim in a._writing:
                    break
                await asyncio.sleep(0)
            assert victim in a._writing, "the write did not begin"
            try:
                await a.delete(victim)  # carried out when the write lands
                await writing
                await _settled(a)
                assert remounted, "the write did not publish: nothing to test"
                assert a.read_only is ReadOnly.FILE_SYSTEM, "the unlink at the write's end did not meet EROFS"
                assert page.exists()
                assert not a.contains(victim) and not await _served(a, victim, size)
            finally:
                await asyncio.to_thread(remount, mount, "rw")
            await until_thread(lambda: a.read_only is None, "writes resumed")  # the tier's own check
            await _settled(a)
            assert not page.exists(), "a page deleted during its write stayed on disk once writable again"
        async with started(DiskTier(cfg, layout, pool)) as restarted:
            assert not await _served(restarted, victim, size), "a deleted page was served after a restart"
            assert await _served(restarted, other, size)
    assert_clean(pool)
