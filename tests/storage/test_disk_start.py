"""The tier's start: from a directory descriptor the caller checked (a name swapped after the
check redirects nothing), cancelled mid-way (every descriptor it opened is closed, the lock
released), and without starting a thread on the loop (``Thread.start`` waits there until the new
thread runs). Real directories, real swaps, real descriptors counted in ``/proc/self/fd``."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_helpers import assert_clean, config, fill, key_of, page_files, payload, reserve, thread_starts_on_the_loop

import aiokv.storage.disk as disk_module
import aiokv.storage.memory as memory_module
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind
from aiokv.storage.backends import IOOp
from aiokv.storage.layoutdir import LOCK_NAME, Prepared
from aiokv.storage.pagefile import PageFiles
from aiokv.storage.safefiles import UnsafeDirectoryError

GATE_S = 30.0
"""Longest a gated start-up thread waits for the test to let it go (it never should)."""


def _fds_into(directory: Path) -> list[str]:
    """This process's open descriptors that lead into ``directory`` (its own included)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the listing's own descriptor, closed meanwhile
        if target == str(directory) or target.startswith(f"{directory}/"):
            found.append(target)
    return found


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _lock_is_free(directory: Path, layout: KVLayout) -> bool:
    """Whether an exclusive ``flock`` on the layout directory's lock file can be had right now."""
    fd = os.open(PageFiles(directory, layout).layout_dir / LOCK_NAME, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


async def _round_trip(tier: DiskTier, pool: PagePool, count: int) -> None:
    """Write ``count`` pages, read each back and compare bit for bit."""
    stored = {}
    for i in range(count):
        handle = fill(pool, key_of(i), i)
        stored[i] = payload(pool, handle)
        assert await tier.write(key_of(i), handle)
        pool.table.release(handle)
    for i in range(count):
        into = reserve(pool, key_of(100 + i))
        try:
            assert await tier.read(key_of(i), into)
            assert torch.equal(payload(pool, into), stored[i])
        finally:
            pool.table.abort(into)


# -- a directory descriptor the caller checked -----------------------------------------------


@pytest.mark.asyncio
async def test_a_directory_swapped_after_the_callers_check_redirects_nothing(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """Regression (#11): a caller (an engine adapter) checked its directory, then the tier opened
    it again by name. Swapped in between (renamed away, a symlink to another directory in its
    place; made for real), the tier created its directories and wrote its pages where the link
    points. From the checked descriptor, everything stays in the directory that was checked."""
    directory, outside = tmp_path / "cache", tmp_path / "outside"
    directory.mkdir(mode=0o700)
    outside.mkdir(mode=0o700)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    moved = tmp_path / "cache.moved"
    os.rename(directory, moved)
    os.symlink(outside, directory, target_is_directory=True)
    tier = DiskTier(config(directory, backend), layout, pool)
    try:
        await tier.start(directory_fd=fd)
    finally:
        os.close(fd)  # the caller's: the tier holds a duplicate of its own
    try:
        await _round_trip(tier, pool, 6)
        assert tier.read_only is None
    finally:
        await tier.aclose()
    assert sorted(outside.rglob("*")) == []
    assert len(page_files(moved)) == 6
    assert _fds_into(moved) == []
    assert_clean(pool)


@pytest.mark.asyncio
async def test_the_callers_descriptor_stays_the_callers(tmp_path: Path, layout: KVLayout, pool: PagePool) -> None:
    """The tier closes only its own duplicate: the caller's descriptor is still open (and the same
    directory) after the start and after the close."""
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        before = os.fstat(fd)
        tier = DiskTier(config(directory, DiskBackend.THREADS), layout, pool)
        await tier.start(directory_fd=fd)
        await tier.aclose()
        after = os.fstat(fd)
        assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
    finally:
        os.close(fd)
    assert _fds_into(directory) == []


@pytest.mark.asyncio
async def test_a_bad_directory_descriptor_is_refused_and_changes_nothing(
        tmp_path: Path, layout: KVLayout, pool: PagePool) -> None:
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    closed = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    os.close(closed)
    count = _fd_count()
    for bad, error in [(True, TypeError), ("3", TypeError), (-1, ValueError), (closed, ValueError)]:
        tier = DiskTier(config(directory, DiskBackend.THREADS), layout, pool)
        with pytest.raises(error, match="directory_fd"):
            await tier.start(directory_fd=bad)  # type: ignore[arg-type]
        await tier.aclose()
    assert sorted(directory.iterdir()) == []  # nothing created
    assert _fd_count() == count
    # A descriptor of something that is not a directory: refused as the tier refuses such a root.
    file = tmp_path / "file"
    file.write_bytes(b"")
    fd = os.open(file, os.O_RDONLY)
    try:
        tier = DiskTier(config(directory, DiskBackend.THREADS), layout, pool)
        with pytest.raises(UnsafeDirectoryError, match="is not a directory"):
            await tier.start(directory_fd=fd)
        await tier.aclose()
    finally:
        os.close(fd)
    assert _fd_count() == count


# -- cancelled while the directory is being prepared -----------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("cancels", [1, 2])
@pytest.mark.parametrize("from_fd", [False, True], ids=["by-path", "from-fd"])
async def test_a_cancelled_start_closes_what_it_opened_and_releases_the_lock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: DiskBackend, layout: KVLayout,
        pool: PagePool, cancels: int, from_fd: bool) -> None:
    """A start cancelled (``cancels`` times) while its thread prepares the directory: the thread
    is let go only after the cancellation, so it opens the layout and fan-out directories and
    takes the lock for a caller that is gone. The start waits for it, closes every one of those
    descriptors (counted in /proc/self/fd) and its own duplicate of the caller's, then raises
    ``CancelledError``; the lock is free and the next start writes."""
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    loop = asyncio.get_running_loop()
    entered = asyncio.Event()
    gate = threading.Event()
    real_prepare = disk_module.prepare

    def gated_prepare(*args: Any) -> Prepared:
        loop.call_soon_threadsafe(entered.set)
        assert gate.wait(GATE_S)
        return real_prepare(*args)

    monkeypatch.setattr(disk_module, "prepare", gated_prepare)
    caller_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if from_fd else None
    count = _fd_count()
    tier = DiskTier(config(directory, backend), layout, pool)
    start = asyncio.create_task(tier.start(directory_fd=caller_fd))
    try:
        await entered.wait()
        for _ in range(cancels):
            start.cancel()
            await asyncio.sleep(0)
        assert not start.done()  # it waits for the thread
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await start
    finally:
        gate.set()
    # At most as many as before: another test's thread in this process may close its own meanwhile
    # (2 fewer on a host running 16 test workers); the descriptors into the cache are checked exactly below.
    assert _fd_count() <= count
    if caller_fd is not None:
        os.fstat(caller_fd)  # still the caller's, still open
        os.close(caller_fd)
    assert _fds_into(directory) == []
    assert len(list(PageFiles(directory, layout).layout_dir.iterdir())) == 257  # it did prepare: lock + fan-out
    assert _lock_is_free(directory, layout)
    monkeypatch.undo()
    async with DiskTier(config(directory, backend), layout, pool) as again:
        assert again.read_only is None
        await _round_trip(again, pool, 2)
    assert _fds_into(directory) == []
    assert_clean(pool)


# -- no thread started on the loop -----------------------------------------------------------


@pytest.mark.asyncio
async def test_start_starts_no_thread_on_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """Regression (#11): the directory was prepared through ``asyncio.to_thread``, whose first call
    starts the loop's default executor's thread from the loop, and ``Thread.start`` waits there
    until the new thread runs (ms on a loaded machine). Every ``Thread.start`` made on the loop's
    thread while the tier starts is recorded with the innermost frame of ``storage/`` on its stack:
    none may come from the start-up's own code."""
    started = thread_starts_on_the_loop(monkeypatch)
    tier = DiskTier(config(tmp_path / "cache", backend), layout, pool)
    await tier.start()
    monkeypatch.undo()
    try:
        assert tier.read_only is None
    finally:
        await tier.aclose()
    # ``asyncio.to_thread`` calls ``run_in_executor`` from a task of its own, whose stack holds no
    # frame of ``storage/``: a default-executor thread started there is the start-up's own. Since
    # the threads backend starts its workers off the loop too (9db7c3e), none at all may start.
    assert not started, started


@pytest.mark.asyncio
async def test_a_free_space_check_starts_no_thread_on_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: DiskBackend, layout: KVLayout,
        pool: PagePool) -> None:
    """Regression: the free-space check after an ENOSPC (and the periodic one while the file
    system limits the tier) ran ``fstatvfs`` through ``asyncio.to_thread``, starting the default
    executor's thread from the loop on first use. A real (injected) ENOSPC answer to a write."""
    async with DiskTier(config(tmp_path / "cache", backend, free_space_recheck_s=3600.0), layout, pool) as tier:
        for i in range(2):
            handle = fill(pool, key_of(i), i)
            assert await tier.write(key_of(i), handle)
            pool.table.release(handle)
        started = thread_starts_on_the_loop(monkeypatch)
        tier.backend.faults.inject(IOOp.WRITE, errno.ENOSPC)
        handle = fill(pool, key_of(2), 2)
        assert await tier.write(key_of(2), handle)  # retried after the check, a file evicted
        pool.table.release(handle)
        monkeypatch.undo()
        stats = tier.statistics()
        assert (stats.errors[ErrorKind.ENOSPC], stats.evictions) == (1, 1)
    assert not [s for s in started if s.endswith(("storage/tierbase.py", "storage/disk.py"))], started
    assert_clean(pool)


def test_the_layout_directory_is_checked_like_the_rest(tmp_path: Path) -> None:
    """The public check the adapters share: a directory of ours too open is made 0700."""
    from aiokv.storage.layoutdir import open_private_subdir

    root = tmp_path / "root"
    root.mkdir()
    (root / "sub").mkdir(mode=0o777)
    os.chmod(root / "sub", 0o777)
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = open_private_subdir(root_fd, "sub", root / "sub", create=False)
        os.close(fd)
        assert stat.S_IMODE((root / "sub").stat().st_mode) == 0o700
        (root / "link").symlink_to(root / "sub", target_is_directory=True)
        with pytest.raises(UnsafeDirectoryError, match="a symlink"):
            open_private_subdir(root_fd, "link", root / "link", create=False)
    finally:
        os.close(root_fd)


# -- registering the pool as fixed buffers ---------------------------------------------------


@pytest.mark.asyncio
async def test_fixed_buffer_registration_starts_no_thread_on_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: KVLayout, pool: PagePool) -> None:
    """Regression: a start with ``URING_FIXED`` forced registered the pool and the header slots
    through ``run_in_executor(None, ...)``, the default executor's first use, which started its
    thread from the loop (``Thread.start`` waits there until the new thread runs)."""
    started = thread_starts_on_the_loop(monkeypatch)
    tier = DiskTier(config(tmp_path / "cache", DiskBackend.URING_FIXED), layout, pool)
    await tier.start()
    monkeypatch.undo()
    try:
        assert tier.statistics().backend is DiskBackend.URING_FIXED
        await _round_trip(tier, pool, 2)  # through the registered buffers
    finally:
        await tier.aclose()
    assert not [s for s in started if s.endswith("storage/memory.py")], started
    assert_clean(pool)


@pytest.mark.asyncio
@pytest.mark.parametrize("cancels", [1, 2])
async def test_a_start_cancelled_while_registering_waits_for_the_registration(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: KVLayout, pool: PagePool, cancels: int) -> None:
    """A start cancelled (``cancels`` times) while its thread registers the pool: it waits for that
    thread (the ring must outlive the syscall using it), closes what it opened, releases the lock,
    then raises ``CancelledError``; the next start registers and writes."""
    loop = asyncio.get_running_loop()
    entered = asyncio.Event()
    gate, finished = threading.Event(), threading.Event()
    real = memory_module.populate_then_register

    def gated(*args: Any) -> Any:
        loop.call_soon_threadsafe(entered.set)
        assert gate.wait(GATE_S)
        try:
            return real(*args)
        finally:
            finished.set()

    monkeypatch.setattr(memory_module, "populate_then_register", gated)
    directory = tmp_path / "cache"
    start = asyncio.create_task(DiskTier(config(directory, DiskBackend.URING_FIXED), layout, pool).start())
    try:
        await entered.wait()
        for _ in range(cancels):
            start.cancel()
            await asyncio.sleep(0)
        assert not start.done()  # it waits for the registering thread
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await start
        assert finished.is_set()
    finally:
        gate.set()
    assert _fds_into(directory) == []
    assert _lock_is_free(directory, layout)
    monkeypatch.undo()
    async with DiskTier(config(directory, DiskBackend.URING_FIXED), layout, pool) as again:
        await _round_trip(again, pool, 2)
    assert_clean(pool)
