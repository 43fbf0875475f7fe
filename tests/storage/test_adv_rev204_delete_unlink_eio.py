"""Review 204: a delete whose own unlink fails with a fault other than EROFS (EIO from a failing
disk here; EACCES, EBUSY alike) left the page on disk and named it nowhere: not in the index, not
remembered as deleted, not queued for another unlink. Once the disk answered again nothing removed
it, and a restart's scan indexed and served the page its caller had deleted.

Real: an ext4 on a loop device over a FUSE file whose bytes holding the fan-out directory's block
answer EIO (``test_adv_rev142_bad_blocks``' file system), the page cache dropped so the unlink's
lookup reads that block for real; then the disk good again and a real restart of a tier over the
same directory (after the tier's own lock check, or straight away: the close). A store of the key
after the failed delete is kept: its page is the one served after the restart. Root only."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import Looks, started
from loop_probes import until_thread
from test_adv_rev142_bad_blocks import bad_block_ext4, device_ranges, drop_caches_until
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _old_copy_back, _served
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly

TAG = 0x5A


def _unlink_errno(path: Path) -> int:
    """What a plain lookup of ``path`` answers now (0: found): the fault is real before the tier meets it."""
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno or -1
    return 0


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("then", ["lock_check", "close", "stored_again"])
async def test_a_page_whose_unlink_met_eio_is_never_served_after_a_restart(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, then: str) -> None:
    size = layout.page_bytes
    victim, other = key_of(0, TAG), key_of(1, TAG)
    with bad_block_ext4(tmp_path, 32) as (mount, bad):
        # "close": no lock check before the restart; the close is what may still unlink it.
        cfg = config(mount / "disk", backend, follow_interval_s=0.05 if then == "lock_check" else 3600.0,
                     min_free_bytes=0)
        async with started(DiskTier(cfg, layout, pool)) as a:
            for key in (victim, other):
                assert await a.write_from(key, memoryview(_bytes_of(key, size)))
            await _settled(a)
            fanout = a.files.layout_dir / f"{TAG:02x}"
            page = fanout / victim.hex()
            for start, end in device_ranges(str(fanout), 0, fanout.stat().st_size):  # its blocks
                bad.bad("read", start, end)
            why = await asyncio.to_thread(drop_caches_until, fanout, lambda: _unlink_errno(page) != 0)
            if why is not None:
                pytest.fail(f"the fan-out directory's block was still cached: no EIO to inject ({why})")
            errno_now = await asyncio.to_thread(_unlink_errno, page)
            faults = a.statistics().errors
            checks = LockChecks(a) if then == "lock_check" else None
            await a.delete(victim)  # its unlink's lookup reads the bad block: EIO
            assert a.statistics().errors != faults, "the unlink's EIO was not counted"
            # "lock_check": a check (every 50 ms) during the delete's record save retries the
            # unlink; one still in the kernel when the disk turns good may succeed before the
            # look below (review 218: a failure under load, "the unlink did not fail"). None is
            # in flight once the tier's tasks ended, and none starts before the look (no await).
            await _settled(a)
            bad.good()
            assert page.exists(), f"the unlink did not fail (errno {errno_now} before): nothing to test"
            assert not a.contains(victim) and not await _served(a, victim, size)
            if checks is not None:
                await checks.next()  # the tier's own lock check comes while the disk answers again
                await _settled(a)
                await until_thread(lambda: not page.exists(), "the deleted page unlinked by the lock check")
            if then == "stored_again":
                # Stored again before the unlink was retried: the new page is the one under the
                # name, and the retry at the close must leave it (served after the restart).
                assert await a.write_from(victim, memoryview(_bytes_of(victim, size)))
                assert a.contains(victim) and await _served(a, victim, size)
        async with started(DiskTier(cfg, layout, pool)) as restarted:
            if then == "stored_again":
                assert await _served(restarted, victim, size), "the page stored after the delete was lost"
            else:
                assert not restarted.contains(victim), "a page its caller deleted was indexed by a restart"
                assert not await _served(restarted, victim, size), \
                    "a page its caller deleted was served after a restart"
            assert await _served(restarted, other, size)
        assert page.exists() == (then == "stored_again"), "a deleted page stayed on disk (or a new one was lost)"
    assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("then", ["lock_lost", "moved_back"])
async def test_a_write_deleted_in_flight_whose_unlink_met_eio_is_never_served(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, then: str) -> None:
    """The delete of a key being written is carried out at the write's end (its file published,
    then unlinked): that unlink meets a real EIO. It was then remembered nowhere as deleted
    (delete() had returned): when the lock was lost before the retry, the looks (seeded from the
    index) found the page as new and served it; when its directory was moved away (the retry then
    unlinked under the name, in the directory made again) and put back, its listing indexed it."""
    size = layout.page_bytes
    victim, other = key_of(2, TAG), key_of(3, TAG)
    with bad_block_ext4(tmp_path, 32) as (mount, bad):
        cfg = config(mount / "disk", backend, follow_interval_s=3600.0, min_free_bytes=0)
        async with started(DiskTier(cfg, layout, pool)) as a:
            assert await a.write_from(other, memoryview(_bytes_of(other, size)))
            await _settled(a)
            fanout = a.files.layout_dir / f"{TAG:02x}"
            page = fanout / victim.hex()
            ranges = device_ranges(str(fanout), 0, fanout.stat().st_size)
            real_end = a._end_write
            injected: list[int] = []
            still_cached: list[str | None] = []

            def end_write(job: Any, stored: bool) -> None:
                # The write published its file; its delete's unlink comes next: the block goes bad
                # and the caches are dropped first, so that unlink reads it from the device.
                if job.key == victim and stored and not injected:
                    for start, end in ranges:
                        bad.bad("read", start, end)
                    still_cached.append(drop_caches_until(fanout, lambda: _unlink_errno(page) != 0))
                    injected.append(_unlink_errno(page))
                real_end(job, stored)

            a._end_write = end_write  # type: ignore[method-assign]
            checks = LockChecks(a)
            writing = asyncio.ensure_future(a.write_from(victim, memoryview(_bytes_of(victim, size))))
            for _ in range(100):  # loop turns: the write registers itself before its first I/O
                if victim in a._writing:
                    break
                await asyncio.sleep(0)
            assert victim in a._writing, "the write did not begin"
            await a.delete(victim)  # carried out when the write lands
            await writing
            await _settled(a)
            assert injected and injected[-1], f"no EIO injected at the write's end: {injected} {still_cached}"
            bad.good()
            assert page.exists(), "the unlink at the write's end did not fail: nothing to test"
            assert not a.contains(victim) and not await _served(a, victim, size)
            if then == "moved_back":
                away = mount / "away"
                os.rename(fanout, away)
                await checks.next()  # retired; the retry unlinks under the name (made again, empty)
                await _old_copy_back(a, checks, fanout, away)
                assert a.contains(other), "the directory put back was not listed"
                assert not a.contains(victim), "a page deleted during its write was indexed from its directory put back"
                assert not await _served(a, victim, size), "a page its caller deleted was served"
                await _settled(a)
                assert not page.exists(), "the page deleted stayed on disk after its directory was listed"
            else:
                os.unlink(a.files.layout_dir / ".lock")  # another cache takes the directory
                async with started(DiskTier(cfg, layout, pool)):
                    # (its own start scan indexes the page: the tier keeps no record of deletes on disk)
                    await checks.next()
                    assert a.read_only is ReadOnly.LOCKED
                    looks = Looks(a)
                    await looks.next()
                    assert a.contains(other), "the looks did not follow the directory"
                    assert not a.contains(victim), "a page deleted during its write was indexed after the lock loss"
                    assert not await _served(a, victim, size), "a page its caller deleted was served"
                await looks.next()  # B closed: A takes over, and unlinks the page deleted
                assert a.read_only is None
                await _settled(a)
                assert not page.exists(), "the page deleted stayed on disk after the take-over"
    assert_clean(pool)
