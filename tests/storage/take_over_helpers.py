"""Helpers of the take-over tests: a writer and a follower over one directory (the follower takes it
over once the writer lets go), and the writer's pending-delete record (``.deletes``,
:mod:`storage.deletelog`) read, damaged or planted for real."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
from disk_helpers import config
from follow_helpers import Looks, started
from fs_helpers import remount
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served

from aiokv.keys import PageKey
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskConfig, DiskTier, ReadOnly
from aiokv.storage.deletelog import DELETES_NAME, load_deletes

PLANTED = b"not a pending-delete record, planted"
"""A planted record (not one this code wrote: it fails its check)."""


def take_over_config(directory: Path, backend: DiskBackend) -> DiskConfig:
    """Looks only when a test asks (:meth:`Looks.next`); no free-space floor."""
    return config(directory, backend, follow_interval_s=3600.0, min_free_bytes=0)


async def writer_and_follower(stack: contextlib.AsyncExitStack, cfg: DiskConfig, layout: KVLayout, pool: PagePool,
                              keys: Sequence[PageKey]) -> tuple[DiskTier, DiskTier, Looks]:
    """A writer over ``cfg``'s directory that stored ``keys`` (their :func:`_bytes_of`) and settled,
    then a second tier over it (a follower while the writer holds the lock) with its looks counted;
    both closed by ``stack``."""
    writer = await stack.enter_async_context(started(DiskTier(cfg, layout, pool)))
    for key in keys:
        assert await writer.write_from(key, memoryview(_bytes_of(key, layout.page_bytes)))
    await _settled(writer)
    follower = await stack.enter_async_context(started(DiskTier(cfg, layout, pool)))
    return writer, follower, Looks(follower)


async def follower_indexed(stack: contextlib.AsyncExitStack, cfg: DiskConfig, layout: KVLayout, pool: PagePool,
                           keys: Sequence[PageKey]) -> tuple[DiskTier, DiskTier, Looks]:
    """:func:`writer_and_follower`, checked: the second tier follows and serves ``keys[0]``."""
    writer, follower, looks = await writer_and_follower(stack, cfg, layout, pool, keys)
    assert follower.read_only is ReadOnly.LOCKED
    assert await _served(follower, keys[0], layout.page_bytes), "the follower did not index the page"
    return writer, follower, looks


async def took_over(looks: Looks) -> None:
    """The next look, which must take the directory over (its writer let go)."""
    await looks.next()
    assert looks.tier.read_only is None, "the follower did not take the directory over"


def plant_damaged_record(writer: DiskTier) -> Path:
    """:data:`PLANTED` written as ``writer``'s record; returns the record's path."""
    record = writer.files.layout_dir / DELETES_NAME
    record.write_bytes(PLANTED)
    return record


async def planted_take_over(writer: DiskTier, looks: Looks) -> Path:
    """``writer``'s record planted damaged and the writer closed: the next look takes the directory
    over. Returns the record's path."""
    record = plant_damaged_record(writer)
    await writer.aclose()
    await took_over(looks)
    return record


async def read_only_take_over(mount: Path, writer: DiskTier, looks: Looks) -> Path:
    """``writer``'s record planted damaged, the writer closed and ``mount`` remounted read-only: the
    next look takes the directory over read-only. Returns the record's path."""
    record = plant_damaged_record(writer)
    await writer.aclose()
    remount(mount, "ro")
    await looks.next()
    assert looks.tier.read_only is ReadOnly.FILE_SYSTEM, "no read-only take-over: no test"
    return record


def writable_again(mount: Path) -> None:
    """``mount`` read-write again (a test's clean-up: also when it is already)."""
    with contextlib.suppress(AssertionError):
        remount(mount, "rw")


def record_deletes(layout_dir: Path) -> dict[PageKey, int]:
    """The record of ``layout_dir`` read now; raises ``OSError`` as :func:`load_deletes`."""
    fd = os.open(layout_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return load_deletes(fd)
    finally:
        os.close(fd)


def record_errno(layout_dir: Path, naming: PageKey | None = None) -> int:
    """What reading the record answers now: 0 read (and it names ``naming``, when given; -1 when it
    does not), else the errno (-1 for none)."""
    try:
        named = record_deletes(layout_dir)
    except OSError as exc:
        return exc.errno or -1
    return 0 if naming is None or naming in named else -1


def flip_last_byte(record: Path) -> None:
    """The record's last byte (its checksum's) flipped on disk: it fails its check (EBADMSG)."""
    fd = os.open(record, os.O_RDWR)
    try:
        at = os.fstat(fd).st_size - 1
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0xFF]), at)
        os.fsync(fd)
    finally:
        os.close(fd)


def exists(path: Path) -> bool:
    return os.path.exists(path)


def chattr(flag: str, path: Path) -> None:
    """``chattr flag path`` (``+i``: immutable, an unlink answers EPERM for root too); skips the test
    where that is not possible."""
    done = subprocess.run(["chattr", flag, str(path)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"chattr {flag} not possible here: {done.stderr.strip()}")


async def delete_left_on_disk(writer: DiskTier, key: PageKey, page: Path) -> None:
    """``writer`` deletes ``key`` while its file ``page`` is immutable: the unlink answers EPERM and
    the file stays, named in the record; settled."""
    chattr("+i", page)
    await writer.delete(key)
    await _settled(writer)


async def delete_recorded(writer: DiskTier, key: PageKey, page: Path) -> None:
    """:func:`delete_left_on_disk`, checked: the file stays and the record reads, naming ``key``."""
    await delete_left_on_disk(writer, key, page)
    assert exists(page) and record_errno(writer.files.layout_dir, key) == 0, "the unlink did not fail: no test"


def mutable_again(page: Path | None) -> None:
    """A test's clean-up: ``page`` (when made immutable and still there) mutable again."""
    if page is not None and exists(page):
        chattr("-i", page)
