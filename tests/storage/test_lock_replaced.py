"""A ``.lock`` removed or replaced under the writer never makes two writers of one layout directory.

The writer holds a ``flock`` on the inode of ``<layout dir>/.lock``. Before: once that name was
unlinked or replaced (an operator's ``rm``, a cleanup script, ``mv``), a cache starting there (or a
follower's take-over) created or opened the new file, locked it and wrote too: two writers, each
evicting by its own budget and unlinking what the other indexed. A ``.lock`` merely removed also
kept a follower from ever taking over once the writer closed (it never creates the file). And a
start that opened ``.lock`` just before it was replaced locked the old inode and wrote beside the
holder of the new one.

Now the writer checks every ``follow_interval_s`` that ``.lock`` still names the file it holds:
gone or replaced, it takes the new one (``lock_retaken``) or, where another cache holds it, stops
writing and follows that cache (``read_only`` ``LOCKED``, ``lock_lost``); a start verifies the
name after its ``flock``. The faults are real: files unlinked and renamed, a second process."""

from __future__ import annotations

import asyncio
import fcntl
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from disk_helpers import assert_clean, page_files
from follow_helpers import (
    WRITER_TAG,
    Looks,
    child,
    follow_config,
    read_back,
    receive,
    started,
    store_page,
    writer_child,
)

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind, ReadOnly, layoutdir
from aiokv.storage.pagefile import HEADER_BYTES

if TYPE_CHECKING:
    from aiokv.storage.lockwatch import LockCheck

FILES = 4
"""Each tier's budget, in page files."""


class LockChecks:
    """Counts the lock checks a writing tier applied and wakes waiters after each."""

    def __init__(self, tier: DiskTier) -> None:
        self.tier = tier
        self.applied = 0
        self.changed = asyncio.Condition()
        real = tier._apply_lock_check

        def counted(found: LockCheck) -> None:
            try:
                real(found)
            finally:
                self.applied += 1
                asyncio.get_running_loop().create_task(self._notify())

        tier._apply_lock_check = counted  # type: ignore[method-assign]

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def next(self, limit_s: float = 30.0) -> None:
        """A check that starts after this call, applied."""
        want = self.applied + 1
        self.tier._check_lock_soon()
        async with asyncio.timeout(limit_s), self.changed:
            await self.changed.wait_for(lambda: self.applied >= want)


def _lock(tier: DiskTier) -> Path:
    return tier.files.layout_dir / ".lock"


def _replace(lock: Path) -> None:
    """``mv`` of a fresh file onto ``.lock`` (nobody holds it)."""
    fresh = lock.with_name("lock.new")
    fresh.write_bytes(b"")
    os.rename(fresh, lock)


def _writers(*tiers: DiskTier) -> int:
    return sum(tier.read_only is None for tier in tiers)


def _cfg(disk_dir: Path, backend: DiskBackend, layout: KVLayout, **overrides: Any) -> Any:
    return follow_config(disk_dir, backend, FILES * (HEADER_BYTES + layout.page_bytes), **overrides)


@pytest.mark.asyncio
async def test_a_start_after_lock_removed_leaves_one_writer(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """``rm .lock`` under writer A, then B starts: B locks a new ``.lock``. A's next check finds
    it held by B: A stops writing and evicting and follows B; B's budget holds, and no page either
    stored is lost or served wrong."""
    async with started(DiskTier(_cfg(disk_dir, backend, layout), layout, pool)) as a:
        checks = LockChecks(a)
        for i in range(FILES):
            assert await store_page(a, pool, i)
        os.unlink(_lock(a))
        async with started(DiskTier(_cfg(disk_dir, backend, layout), layout, pool)) as b:
            looks = Looks(a)
            assert b.read_only is None  # B took the new lock: A must let go at its next check
            await checks.next()
            assert _writers(a, b) == 1, (a.read_only, b.read_only)
            stats = a.statistics()
            assert (stats.read_only, stats.lock_lost, stats.lock_retaken) == (ReadOnly.LOCKED, 1, 0), stats
            assert not await store_page(a, pool, 50)  # refused: A writes no more
            for i in range(FILES, 3 * FILES):  # B evicts alone, within its budget
                assert await store_page(b, pool, i)
            assert len(page_files(a.files.layout_dir)) == FILES
            await looks.next()  # A follows B's pages
            for i in range(2 * FILES, 3 * FILES):
                assert await read_back(a, pool, i), i
                assert await read_back(b, pool, i), i
            assert a.statistics().corrupt == 0 and b.statistics().corrupt == 0
            assert not any(a.statistics().errors.values()), a.statistics()
        # B closed: A takes the directory over at its next look and writes again.
        await looks.next()
        stats = a.statistics()
        assert (stats.read_only, stats.took_over) == (None, 1), stats
        assert await store_page(a, pool, 60)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_lock_replaced_by_a_free_file_is_taken_back(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """``mv`` of a fresh file onto ``.lock`` under writer A: A's check takes the new file, so a
    follower's look finds it held and stays read-only."""
    async with started(DiskTier(_cfg(disk_dir, backend, layout), layout, pool)) as a:
        checks = LockChecks(a)
        assert await store_page(a, pool, 0)
        async with started(DiskTier(_cfg(disk_dir, backend, layout), layout, pool)) as f:
            looks = Looks(f)
            assert f.read_only is ReadOnly.LOCKED
            _replace(_lock(a))
            await checks.next()
            stats = a.statistics()
            assert (stats.read_only, stats.lock_retaken, stats.lock_lost) == (None, 1, 0), stats
            await looks.next()
            assert _writers(a, f) == 1 and f.statistics().took_over == 0, f.statistics()
            assert await store_page(a, pool, 1)
            await looks.next()
            assert await read_back(f, pool, 1)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_follower_that_took_a_replaced_lock_leaves_one_writer(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """``.lock`` replaced under writer A, and a follower's look takes the new file before A's check
    does: at A's check A finds it held and follows; one writer from then on."""
    async with started(DiskTier(_cfg(disk_dir, backend, layout), layout, pool)) as a:
        checks = LockChecks(a)
        for i in range(2):
            assert await store_page(a, pool, i)
        async with started(DiskTier(_cfg(disk_dir, backend, layout), layout, pool)) as f:
            looks = Looks(f)
            _replace(_lock(a))
            await looks.next()
            assert f.statistics().took_over == 1  # the name leads to a file nobody held
            await checks.next()
            assert _writers(a, f) == 1 and a.read_only is ReadOnly.LOCKED, (a.read_only, f.read_only)
            assert a.statistics().lock_lost == 1
            for i in range(2):
                assert await read_back(f, pool, i), i
                assert await read_back(a, pool, i), i
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_removed_lock_is_made_again_for_the_next_writer(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """``rm .lock`` under writer A with nobody else there: A's check makes and takes the name again,
    so once A closes a follower takes over (it never creates the file itself: before, it stayed
    read-only for good)."""
    a = DiskTier(_cfg(disk_dir, backend, layout), layout, pool)
    await a.start()
    try:
        checks = LockChecks(a)
        assert await store_page(a, pool, 0)
        async with started(DiskTier(_cfg(disk_dir, backend, layout), layout, pool)) as f:
            looks = Looks(f)
            os.unlink(_lock(a))
            await checks.next()
            assert (a.read_only, a.statistics().lock_retaken) == (None, 1)
            assert _lock(a).exists()
            await a.aclose()
            await looks.next()
            stats = f.statistics()
            assert (stats.read_only, stats.took_over) == (None, 1), stats
            assert await read_back(f, pool, 0)
    finally:
        await a.aclose()
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_planted_lock_is_refused_and_the_writer_goes_on(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """A symlink planted at ``.lock`` under writer A: A's check never follows it (counted UNSAFE,
    once) and A goes on writing (nobody can lock through it); a start there still refuses it."""
    async with started(DiskTier(_cfg(disk_dir, backend, layout), layout, pool)) as a:
        checks = LockChecks(a)
        target = disk_dir / "elsewhere"
        target.write_bytes(b"")
        os.unlink(_lock(a))
        os.symlink(target, _lock(a))
        await checks.next()
        await checks.next()
        stats = a.statistics()
        assert (stats.read_only, stats.lock_lost, stats.lock_retaken) == (None, 0, 0), stats
        assert stats.errors.get(ErrorKind.UNSAFE) == 2, stats.errors
        assert await store_page(a, pool, 0)
        with pytest.raises(layoutdir.UnsafeDirectoryError):
            await DiskTier(_cfg(disk_dir, backend, layout), layout, pool).start()
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_start_whose_lock_is_replaced_before_its_flock_stays_read_only(
        disk_dir: Path, layout: KVLayout, pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The start opened ``.lock``; before its ``flock``, the file is replaced and another cache
    locks the new one. The start's ``flock`` of the old inode succeeds (nobody holds it): it must
    see that the name leads elsewhere now and start read-only (before: a second writer)."""
    backend = DiskBackend.THREADS
    async with started(DiskTier(_cfg(disk_dir, backend, layout), layout, pool)):
        pass  # the directory and its .lock exist, unheld
    lock = DiskTier(_cfg(disk_dir, backend, layout), layout, pool).files.layout_dir / ".lock"
    old = os.stat(lock).st_ino
    real: Callable[[int, int], None] = fcntl.flock
    other: list[int] = []

    def flock(fd: int, how: int) -> None:
        if not other and os.fstat(fd).st_ino == old:  # the start's: the other cache wins the name first
            _replace(lock)
            other.append(os.open(lock, os.O_RDONLY))
            real(other[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
        real(fd, how)

    monkeypatch.setattr(layoutdir.fcntl, "flock", flock)
    try:
        async with started(DiskTier(_cfg(disk_dir, backend, layout), layout, pool)) as b:
            assert other, "the start never took the lock"
            assert b.read_only is ReadOnly.LOCKED
    finally:
        monkeypatch.undo()
        for fd in other:
            os.close(fd)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_process_started_after_lock_removed_leaves_one_writer(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """As the first test with B in a process of its own: after A's check, B alone writes and A
    serves B's new pages bit for bit."""
    async with started(DiskTier(_cfg(disk_dir, backend, layout), layout, pool)) as a:
        checks = LockChecks(a)
        looks = Looks(a)
        assert await store_page(a, pool, 0, tag=0)
        os.unlink(_lock(a))
        with child(writer_child, str(disk_dir), backend.value, FILES) as (conn, _proc):
            assert await receive(conn) == ("ready", None)
            await checks.next()
            assert a.read_only is ReadOnly.LOCKED and a.statistics().lock_lost == 1
            conn.send(("write", [1, 2]))
            assert await receive(conn) == ("written", [True, True])
            await looks.next()
            for i in (1, 2):
                assert await read_back(a, pool, i, WRITER_TAG), i
            assert await read_back(a, pool, 0, tag=0)
            conn.send("close")
            assert await receive(conn) == "closed"
            conn.send("exit")
        await looks.next()
        assert a.read_only is None and a.statistics().took_over == 1
    assert_clean(pool)
