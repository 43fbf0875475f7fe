"""The scene of the review 198-200 tests: a writer A's own write held in the kernel by a real
``fsfreeze`` of a loop ext4 while A loses its lock (its lock file unlinked, a second writer B on
the directory), then the look that follows it or takes the directory over. Root only (loop
mounts, fsfreeze). Each test keeps its own twist and its own assertions; this module builds the
scene and asserts only what every scene needs to hold (B writes, A lost the lock, A follows)."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from disk_helpers import config, key_of
from follow_helpers import started
from fs_helpers import fill_up, freeze, thaw
from loop_probes import until_thread
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served
from test_lock_replaced import LockChecks

from aiokv.keys import PageKey
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskConfig, DiskTier, ReadOnly
from aiokv.storage.follow import FollowState, Look, look
from aiokv.storage.layoutdir import Prepared

THAW_S = 30.0
"""A watchdog thaws the file system after this long (a failing test must not leave it frozen)."""


def needs_fsfreeze() -> None:
    """Skips the test where ``fsfreeze`` is not installed."""
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")


def full_fs_config(mount: Path, backend: DiskBackend, page_bytes: int, pages: int) -> DiskConfig:
    """A writer's config under ``mount / "disk"`` for a file system about to be filled: its write
    fails ENOSPC at once (no retry, no recheck of the room); looks only when a test asks."""
    return config(mount / "disk", backend, capacity=pages * page_bytes, follow_interval_s=3600.0, min_free_bytes=0,
                  enospc_retries=0, free_space_recheck_s=3600.0)


def fill_rest(path: Path) -> None:
    """What :func:`fill_up`'s 64 KiB chunks left free, filled by 4 KiB ones (a page file fits in less)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        while True:
            try:
                os.write(fd, bytes(4096))
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
        os.fsync(fd)
    finally:
        os.close(fd)


def fill(mount: Path) -> None:
    """The file system under ``mount`` filled for real: a page write there answers ENOSPC."""
    fill_up(mount / "filler", 0)
    fill_rest(mount / "filler-rest")


@asynccontextmanager
async def writer(cfg: DiskConfig, layout: KVLayout, pool: PagePool, tag: int) -> AsyncIterator[
        tuple[DiskTier, LockChecks, Path]]:
    """A, started (closed at exit), the lock checks it applies counted, and the fan-out directory
    of ``tag``'s keys."""
    async with started(DiskTier(cfg, layout, pool)) as a:
        yield a, LockChecks(a), a.files.layout_dir / f"{tag:02x}"


@asynccontextmanager
async def second_writer(a: DiskTier, cfg: DiskConfig, layout: KVLayout, pool: PagePool) -> AsyncIterator[DiskTier]:
    """A's lock file unlinked, B started on the directory: B writes (A loses the lock at its next
    lock check). B is closed at exit (again, where the test closed it: ``aclose`` is idempotent)."""
    os.unlink(a.files.layout_dir / ".lock")
    async with started(DiskTier(cfg, layout, pool)) as b:
        assert b.read_only is None
        yield b


@asynccontextmanager
async def write_held_over_loss(mount: Path, a: DiskTier, checks: LockChecks, key: PageKey) -> AsyncIterator[
        asyncio.Future[bool]]:
    """``mount`` frozen, A's write of ``key`` (its :func:`_bytes_of` bytes) in flight, held in the
    kernel; then A's next lock check applied: A lost the lock (B holds it), the write still held.
    Yields the write's future; the body runs frozen. Thawed at exit, without an await (the write's
    end has not run on the loop when the ``async with`` is left), or by a watchdog after THAW_S."""
    watchdog = threading.Timer(THAW_S, thaw, args=(mount,))
    freeze(mount)
    watchdog.start()
    try:
        store = asyncio.ensure_future(a.write_from(key, memoryview(_bytes_of(key, a.layout.page_bytes))))
        await until_thread(lambda: a.statistics().writes_in_flight > 0, "the write in flight")
        await checks.next()  # A loses the lock, its write still held in the kernel
        assert a.read_only is ReadOnly.LOCKED
        yield store
    finally:
        thaw(mount)
        watchdog.cancel()


@dataclass(frozen=True)
class Followed:
    """What a look at A's directory needs, taken while A follows (after its lock loss)."""

    state: FollowState
    prepared: Prepared
    shown: Path

    def look(self) -> Look:
        """A look now, on the test's thread (it only reads): the caller applies it or closes it."""
        return look(self.state, self.prepared.dir_fd, list(self.prepared.fanout), self.shown)


def followed(a: DiskTier) -> Followed:
    """A's follow state and directory, now (A follows: both are set)."""
    state, prepared = a._follow_state, a._dir
    assert state is not None and prepared is not None
    return Followed(state, prepared, a.files.layout_dir)


async def apply_look(a: DiskTier, found: Look) -> None:
    """``found`` applied on A's loop, its descriptors closed after (those A did not take)."""
    try:
        await a._apply_look(found)
    finally:
        found.close()


def wait_published(path: Path) -> None:
    """Until the thawed write's file is at ``path``, without yielding to the loop (the write's
    completion is not read meanwhile: its end runs after the test's next step). Bounded: 10 s."""
    deadline = time.monotonic() + 10.0
    while not path.exists():
        assert time.monotonic() < deadline, "the write was not published in 10 s"


async def take_over_under_write(a: DiskTier, b: DiskTier, key: PageKey, listed: bool = False) -> Followed:
    """Inside :func:`write_held_over_loss`: B closes, A's look (it only reads: the file system is
    frozen) takes the directory over while A's write of ``key`` is still held. ``listed``: the look
    must have found ``key``'s file (B's page). Returns what the look was taken from."""
    await asyncio.wait_for(b.aclose(), 10.0)  # B lets the directory go
    following = followed(a)
    began = time.monotonic()
    found = following.look()
    # The look only reads: it never waits for the thaw (the watchdog's, THAW_S). A take-over that
    # unlinked a `.deletes.new` that was not there waited for it, 30 s a test.
    assert time.monotonic() - began < THAW_S / 3, "the take-over look waited for the frozen file system"
    assert found.lock_fd is not None
    if listed:
        assert key in found.added
    await apply_look(a, found)
    assert a.read_only is None and a.statistics().took_over == 1
    assert key in a._writing, "the write ended before the thaw"
    return following


async def delete_away_and_reopen(a: DiskTier, checks: LockChecks, victim: PageKey, other: PageKey, fan: Path,
                                 away: Path) -> None:
    """A stores ``victim``; its fan-out directory ``fan`` is moved to ``away`` (A's lock check retires it);
    A's caller deletes ``victim`` (remembered: its file is away); A stores ``other`` (same fan-out:
    the name opened again) and the listing of that reopened directory ends."""
    size = a.layout.page_bytes
    assert await a.write_from(victim, memoryview(_bytes_of(victim, size)))  # the page deleted below
    os.rename(fan, away)
    await checks.next()  # retired
    await a.delete(victim)  # remembered: its file is away
    assert victim in a._deleted_away
    assert await a.write_from(other, memoryview(_bytes_of(other, size)))  # the name opened again
    # Its listing of the reopened directory ends first: applied after a second writer's store
    # (after a freeze), it unlinked that page as deleted, blocked on the frozen fs until the thaw.
    await _settled(a)


async def assert_deleted_page_gone(a: DiskTier, key: PageKey, fan: Path, how: str) -> None:
    """The page A's caller deleted (``how`` it came back under ``key``'s name in ``fan``) is
    neither served, indexed, nor on disk once A's background tasks ended."""
    await _settled(a)
    served = await _served(a, key, a.layout.page_bytes)
    await _settled(a)
    assert not served, f"the page the caller deleted ({how}) was served"
    assert not a.contains(key), "the page the caller deleted was indexed"
    assert not (fan / key.hex()).exists(), "the page the caller deleted stayed on disk"


@dataclass(frozen=True)
class FoundUnderWrite:
    """:func:`found_under_write`'s scene, as it yields it."""

    a: DiskTier
    fan: Path
    """The victim's fan-out directory (under its name: the other writer's page in it)."""
    away: Path
    """The victim's first fan-out directory, moved away: the page A's caller deleted in it."""
    store: asyncio.Future[bool]
    """A's write of the victim: it fails ENOSPC once its end runs."""
    following: Followed
    """What the take-over look was taken from."""


@asynccontextmanager
async def found_under_write(mount: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, tag: int,
                            before_fill: Callable[[Path], None]) -> AsyncIterator[FoundUnderWrite]:
    """Review 200's scene: A's caller deletes ``key_of(0, tag)`` with its fan-out directory moved
    to ``mount / "away"`` (:func:`delete_away_and_reopen`); B stores the key again after the delete;
    ``before_fill(fan)``; the file system is filled; A's write of the key is held by a freeze across
    the lock loss, B's close and the take-over look, which found B's page under the write. Yields
    once thawed, before the write's end runs on the loop (no await in between): the body's first
    await lets it end (ENOSPC). A is closed at exit."""
    size = layout.page_bytes
    victim, other = key_of(0, tag), key_of(1, tag)
    cfg = full_fs_config(mount, backend, size, 64)
    async with writer(cfg, layout, pool, tag) as (a, checks, fan):
        away = mount / "away"
        await delete_away_and_reopen(a, checks, victim, other, fan, away)
        async with second_writer(a, cfg, layout, pool) as b:
            assert await b.write_from(victim, memoryview(_bytes_of(victim, size)))  # stored after the delete
            before_fill(fan)
            fill(mount)
            async with write_held_over_loss(mount, a, checks, victim) as store:
                following = await take_over_under_write(a, b, victim)
                assert victim in a._found_under_write, "the take-over did not find the other writer's page"
            # Inside B's block: leaving it awaits B's (idempotent) aclose, which must not come
            # between the thaw and the body's first step.
            yield FoundUnderWrite(a, fan, away, store, following)
