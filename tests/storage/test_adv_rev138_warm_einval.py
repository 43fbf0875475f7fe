"""A warm read that a chain could make opens its name on the loop with ``O_DIRECT`` at once
(``openat2`` ``RESOLVE_CACHED``, 3a13d5f); what that open refuses with EINVAL (a FIFO, a character
device, a directory planted under a page's name) is opened again without ``O_DIRECT`` to look at
it, and refused (counted ``disk_unsafe``). A planted file is one counted miss, nothing more: the
loop's cached opens must stay on for every later read and recycle.

Before the fix ``CachedOpen`` took that EINVAL for "``openat2`` or ``RESOLVE_CACHED`` is missing
here" and turned itself off for good: one planted FIFO sent every later read (and every recycled
write) of the tier through the ring's OPENAT, and the re-open without ``O_DIRECT`` never ran (the
refusal came from the cold chain instead). Found by helper-138 (review of 3a13d5f)."""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Callable

import pytest
import torch
from disk_helpers import assert_clean, key_of, read_page, stored_page

from aiokv.pool import PagePool
from aiokv.storage import DiskTier, ErrorKind
from aiokv.storage.backends import UringPageIO


def _fifo(path: str) -> None:
    os.mkfifo(path, 0o600)


def _char_device(path: str) -> None:
    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers


def _directory(path: str) -> None:
    os.mkdir(path, 0o700)


PLANTS: dict[str, Callable[[str], None]] = {"fifo": _fifo, "char_device": _char_device, "directory": _directory}


@pytest.mark.asyncio
@pytest.mark.parametrize("plant", list(PLANTS))
async def test_a_planted_file_refusing_o_direct_leaves_the_loops_opens_on(
        warm_tier: DiskTier, pool: PagePool, plant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if plant == "char_device" and os.geteuid() != 0:
        pytest.skip("mknod of a character device needs root")
    tier = warm_tier
    io = tier.backend
    assert isinstance(io, UringPageIO)
    await stored_page(tier, pool, 0)
    datas = [await stored_page(tier, pool, i) for i in (1, 2)]
    path = tier.files.path(key_of(0))
    os.unlink(path)
    PLANTS[plant](path)
    os.lstat(path)  # its name in the lookup caches: opened on the loop
    opens: list[tuple[int, int | None]] = []  # (flags, fd or None) of each open on the loop
    real_open = io._cached.open

    def recording(dir_fd: int, name: bytes, flags: int) -> int | None:
        try:
            fd = real_open(dir_fd, name, flags)
        except OSError:
            opens.append((flags, -1))
            raise
        opens.append((flags, fd))
        return fd

    monkeypatch.setattr(io._cached, "open", recording)
    assert await read_page(tier, pool, 0) is None
    stats = tier.statistics()
    assert (stats.misses, stats.errors[ErrorKind.UNSAFE]) == (1, 1)
    # Looked at on the loop: refused with O_DIRECT, opened again without it (then fstat-refused).
    assert [flags & os.O_DIRECT for flags, _ in opens] == [os.O_DIRECT, 0], opens
    assert opens[1][1] is not None and opens[1][1] >= 0
    assert io._cached.available  # before the fix: off for the tier's life
    del opens[:]
    for i, data in zip((1, 2), datas, strict=True):
        os.stat(tier.files.path(key_of(i)))
        got = await read_page(tier, pool, i)
        assert got is not None and torch.equal(got, data)
    # Both opened on the loop (warm), with O_DIRECT: no OPENAT through the ring.
    assert len(opens) == 2 and all(fd is not None and fd >= 0 and flags & os.O_DIRECT for flags, fd in opens), opens
    stats = tier.statistics()
    assert (stats.hits, stats.misses) == (2, 1)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_an_openat2_refusing_resolve_cached_still_turns_the_loops_opens_off(
        warm_tier: DiskTier, pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before Linux 5.12 openat2 answers EINVAL to RESOLVE_CACHED, whatever the flags: the O_DIRECT
    # open's EINVAL is asked again without O_DIRECT, which answers EINVAL too: off, as before.
    tier = warm_tier
    io = tier.backend
    assert isinstance(io, UringPageIO)
    datas = [await stored_page(tier, pool, i) for i in range(2)]
    cached = io._cached
    calls: list[int] = []

    def no_resolve_cached(_nr: int, _dir_fd: int, _name: bytes, _how: object, _size: int) -> None:
        calls.append(cached._how.flags)
        ctypes.set_errno(errno.EINVAL)
        cached._got.append(-1)

    monkeypatch.setattr(cached, "_syscall", no_resolve_cached)
    for i, data in enumerate(datas):
        os.stat(tier.files.path(key_of(i)))
        got = await read_page(tier, pool, i)
        assert got is not None and torch.equal(got, data)
    assert not cached.available
    assert [flags & os.O_DIRECT for flags in calls] == [os.O_DIRECT, 0]  # then never asked again
    stats = tier.statistics()
    assert (stats.hits, stats.misses) == (2, 0)
    assert_clean(pool)
