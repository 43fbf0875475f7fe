"""Review 261 of 654fb82 (a write's first try that evicts for a new file waits for the evicted
files' unlinks where the tier's estimate of the free room says less than one more file fits).

The estimate was too hopeful in three cases, each costing what a first try cost before review 250:
an ENOSPC, a second page evicted for the retry (lost for nothing) and the retry.

- The tier's own new files in flight at a free-space look: their room was in ``used`` already, their
  blocks not yet taken, so the look counted them free too (twice).
- Deletes' unlinks in flight: a deleted file's room left ``used`` at once, its blocks only once the
  unlink landed; only evictions' unlinks were counted (``_unfreed_files``).
- A recycle whose victim could not be taken over (here: a file of another owner, refused and
  unlinked) falls back to a new file: it went at once, its victim's unlink in flight. So did a write
  whose spare file could not be taken over (the same fault, the same fallback).

The faults are real: a small ext4 on a loop device (no root reserve: ENOSPC comes where statvfs'
available bytes end), filled by another file (root only). The unlinks that would land late are held
until the write that needs their room ended or met ENOSPC, unless it waits for them (then they go at
once): the late order is certain where the write does not wait."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from disk_helpers import BIG, PER_FILE, assert_clean, config, key_of, ready_pool, write_page
from fs_helpers import fill_up, loop_ext4
from loop_probes import until_thread
from test_disk_fs import late_eviction_unlinks, waits_for_unlinks

from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskConfig, DiskTier, ErrorKind
from aiokv.storage.jobs import WriteJob


@pytest.fixture
def big_pool() -> Iterator[PagePool]:
    with ready_pool(BIG, 8) as pool:
        yield pool


async def _ten_pages_then_filled(cfg: DiskConfig, pool: PagePool, mount: Path, leave: int) -> None:
    """Ten pages stored (the tier closed after), then the disk filled by another program to ``leave``
    bytes free."""
    async with DiskTier(cfg, BIG, pool) as tier:
        for i in range(10):
            ok, _ = await write_page(tier, pool, i)
            assert ok
    fill_up(mount / "ballast", leave=leave)


def _at_its_budget(tier: DiskTier) -> None:
    start = tier.statistics()
    assert start.effective_capacity_bytes == start.capacity_bytes == start.bytes_stored


def _enospc(tier: DiskTier) -> int:
    return tier.statistics().errors[ErrorKind.ENOSPC]


def _hold_unlinks(tier: DiskTier, monkeypatch: pytest.MonkeyPatch,
                  hold: Callable[[str], Callable[[], bool] | None]) -> None:
    """Each unlink the tier starts asks ``hold(name)`` at its start: None, it goes at once; else it
    lands once the condition returned holds."""
    io = tier._io
    assert io is not None
    really_unlink = io.unlink

    async def late_unlink(dir_fd: int, name: str) -> None:
        condition = hold(name)
        if condition is not None:
            await until_thread(condition, f"the release of {name}'s unlink")
        await really_unlink(dir_fd, name)

    monkeypatch.setattr(io, "unlink", late_unlink)


def _until_needed(tier: DiskTier, job: WriteJob) -> Callable[[], bool]:
    """Until ``job`` (a first try that evicts) ended, met ENOSPC, or waits for its unlinks."""
    failed = _enospc(tier)
    return lambda: job.ended or _enospc(tier) > failed or waits_for_unlinks(job)


def _first_try_of(tier: DiskTier, i: int) -> WriteJob | None:
    job = tier._writing.get(key_of(i))
    return job if job is not None and job.attempt == 0 else None


@pytest.mark.root
@pytest.mark.asyncio
async def test_own_new_files_in_flight_at_a_look_are_not_free(
        tmp_path: Path, backend: DiskBackend, big_pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    # A tier at its budget of 10 pages, over a disk with half a file free. Writes A1 and A2 evict one
    # page each and wait for its unlink (the estimate: short), then sit in the backend (their blocks
    # not taken: the publish is held). B's look (due: a first try waited) sees 2.5 files free, of
    # which A1 and A2 will take 2. B evicts one page: before, the estimate said 2.5 - 1 (its unlink)
    # >= 1 file and B went at once; A1 and A2 took their blocks, B met ENOSPC (its unlink held), evicted
    # a fourth page and retried. Now A1 and A2 count as taken at the look: B waits for its unlink.
    with loop_ext4(tmp_path, 24, reserved_percent=0) as mount:
        cfg = config(mount / "disk", backend, capacity=10 * PER_FILE, min_free_bytes=0,
                     free_space_recheck_s=0.0, recycle_files=False)
        await _ten_pages_then_filled(cfg, big_pool, mount, leave=PER_FILE // 2)
        async with DiskTier(cfg, BIG, big_pool) as again:
            _at_its_budget(again)
            io = again._io
            assert io is not None
            really_publish = io.start_publish
            held: list[tuple[Any, ...]] = []
            published: list[object] = []
            let_go = False
            later: list[asyncio.Task[None]] = []

            def counted(done: Callable[[BaseException | None], None], error: BaseException | None) -> None:
                published.append(error)
                done(error)

            def publish_late(*args: Any) -> None:
                # A1's and A2's publishes wait for B's; then they go, and B's once both landed.
                nonlocal let_go
                if let_go:
                    really_publish(*args)
                elif len(held) < 2:
                    held.append(args)
                else:
                    let_go = True
                    for waiting in held:
                        really_publish(*waiting[:-1], lambda error, done=waiting[-1]: counted(done, error))

                    async def after_them() -> None:
                        await until_thread(lambda: len(published) == 2, "A1's and A2's publishes")
                        really_publish(*args)

                    later.append(asyncio.get_running_loop().create_task(after_them()))

            monkeypatch.setattr(io, "start_publish", publish_late)

            def hold(name: str) -> Callable[[], bool] | None:
                job = _first_try_of(again, 12)
                return None if job is None else _until_needed(again, job)

            _hold_unlinks(again, monkeypatch, hold)
            a1 = asyncio.create_task(write_page(again, big_pool, 10))
            await until_thread(lambda: len(held) == 1, "A1 in the backend")
            a2 = asyncio.create_task(write_page(again, big_pool, 11))
            await until_thread(lambda: len(held) == 2, "A2 in the backend")
            assert not published
            ok, _ = await write_page(again, big_pool, 12)
            assert ok
            assert [ok for ok, _ in await asyncio.gather(a1, a2)] == [True, True]
            await asyncio.gather(*later)
            assert published == [None, None]
            stats = again.statistics()
            # Before: (1, 4, 9): an ENOSPC, a fourth page evicted for B's retry.
            assert (_enospc(again), stats.evictions, stats.pages) == (0, 3, 10), stats.errors
            assert sum(stats.errors.values()) == 0, stats.errors
    assert_clean(big_pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_deletes_unlinks_in_flight_are_not_free(
        tmp_path: Path, backend: DiskBackend, big_pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    # A tier at its budget of 10 pages, over a disk with 2.5 files free. Two pages are deleted, their
    # unlinks in flight (held here until the writes ended). Two writes take the deleted pages' room
    # in ``used`` (no eviction) and 2 files of the disk's; a third evicts a page. Before, the
    # estimate counted the deleted files free: 2.5 - 1 (its own unlink) >= 1 file, it went at once
    # and met ENOSPC (0.5 file left), evicted a second page and retried. Now the deletes' unlinks
    # count: it waits for its own unlink, which frees the file it needs.
    with loop_ext4(tmp_path, 24, reserved_percent=0) as mount:
        cfg = config(mount / "disk", backend, capacity=10 * PER_FILE, min_free_bytes=0,
                     free_space_recheck_s=3600.0, recycle_files=False)
        await _ten_pages_then_filled(cfg, big_pool, mount, leave=2 * PER_FILE + PER_FILE // 2)
        st = os.statvfs(mount)
        assert 2 * PER_FILE < st.f_bavail * st.f_frsize < 3 * PER_FILE
        async with DiskTier(cfg, BIG, big_pool) as again:
            _at_its_budget(again)
            deleted = {again.files.name(key_of(i)) for i in (0, 1)}
            writes_done = False
            started: list[str] = []

            def hold(name: str) -> Callable[[], bool] | None:
                if name in deleted:
                    started.append(name)
                    return lambda: writes_done
                job = _first_try_of(again, 12)
                return None if job is None else _until_needed(again, job)

            _hold_unlinks(again, monkeypatch, hold)
            deletes = [asyncio.create_task(again.delete(key_of(i))) for i in (0, 1)]
            await until_thread(lambda: len(started) == 2, "the deletes' unlinks")
            for i in (10, 11, 12):
                ok, _ = await write_page(again, big_pool, i)
                assert ok, f"page {i} was not stored"
            writes_done = True
            await asyncio.gather(*deletes)
            stats = again.statistics()
            # Before: (1, 2, 9): an ENOSPC, a second page evicted for the retry.
            assert (_enospc(again), stats.evictions, stats.pages) == (0, 1, 10), stats.errors
            assert sum(stats.errors.values()) == 0, stats.errors
    assert_clean(big_pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_failed_recycle_waits_for_its_victims_unlink(
        tmp_path: Path, backend: DiskBackend, big_pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    # A recycling tier at its budget of 10 pages, over a disk with half a file free. The least
    # recently used page's file belongs to another owner (chown, after the start): the recycle
    # refuses it (UNSAFE), unlinks it and writes a new file instead. Before, the new file went at
    # once and met ENOSPC (the victim's unlink held), and the retry recycled a second page. Now the
    # new file waits for the victim's unlink where the estimate says the disk nearly full.
    with loop_ext4(tmp_path, 24, reserved_percent=0) as mount:
        cfg = config(mount / "disk", backend, capacity=10 * PER_FILE, min_free_bytes=0,
                     free_space_recheck_s=3600.0)
        await _ten_pages_then_filled(cfg, big_pool, mount, leave=PER_FILE // 2)
        async with DiskTier(cfg, BIG, big_pool) as again:
            _at_its_budget(again)
            os.chown(again.files.path(key_of(0)), 12345, -1)  # another program's file now
            waited = late_eviction_unlinks(again, monkeypatch)
            ok, _ = await write_page(again, big_pool, 10)
            assert ok
            stats = again.statistics()
            assert stats.errors[ErrorKind.UNSAFE] == 1, stats.errors
            # Before: (1, 9) and [False]: an ENOSPC, a second page recycled for the retry.
            assert (_enospc(again), stats.pages) == (0, 10), stats.errors
            assert sum(stats.errors.values()) == 1, stats.errors
            assert waited == [True]
            assert not again.contains(key_of(0)) and again.contains(key_of(1))
    assert_clean(big_pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_refused_spare_waits_for_its_unlink(
        tmp_path: Path, backend: DiskBackend, big_pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    # The same for a spare file the write could not take over (another owner's now): the new file
    # written in its place waits for the spare's unlink where the disk is nearly full. The tier is
    # held below its budget by the disk, so a write looks at the free space first (recheck 0 s):
    # half a file free after another program filled the disk, the spare's blocks taken.
    with loop_ext4(tmp_path, 24, reserved_percent=0) as mount:
        cfg = config(mount / "disk", backend, min_free_bytes=0, free_space_recheck_s=0.0, recycle_files=False)
        async with DiskTier(cfg, BIG, big_pool, spare_files=1) as tier:
            for i in range(10):
                ok, _ = await write_page(tier, big_pool, i)
                assert ok
            await until_thread(lambda: len(tier._spares) == 1 and not tier._spares.making, "a spare in stock")
            (spare,) = (mount / "disk").rglob(".spare-*")
            fill_up(mount / "ballast", leave=PER_FILE // 2)
            os.chown(spare, 12345, -1)  # another program's file now
            waited = late_eviction_unlinks(tier, monkeypatch)
            ok, _ = await write_page(tier, big_pool, 10)
            assert ok
            stats = tier.statistics()
            assert stats.errors[ErrorKind.UNSAFE] == 1, stats.errors
            # Before: (1, 1, 10) and [False]: an ENOSPC, a page evicted for the retry.
            assert (_enospc(tier), stats.evictions, stats.pages) == (0, 0, 11), stats.errors
            assert sum(stats.errors.values()) == 1, stats.errors
            assert waited == [True]
            assert not spare.exists()
    assert_clean(big_pool)
