"""Faults while a read-only tier follows a directory another cache holds, each injected for real:
a fan-out directory answering EIO (FUSE), removed, replaced by a symlink or a file; planted FIFOs,
hard links, files of another owner, temporary files and lock files; the follower's own ``aclose``
while a look runs. Each degrades to "nothing new indexed from there this time", counted, never a
crash, never a hang, never a write outside the cache. (EACCES: ``test_follow_eacces.py``.)

The writer here is a tier of this process (another open file description of ``.lock``: the kernel
treats it as another holder); ``key_of(i, tag)`` lives in fan-out directory ``<tag:02x>``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_helpers import assert_clean, fill, key_of, payload, reserve, spin, thread_starts_on_the_loop
from follow_helpers import Looks, follow_config, follow_threads, open_fds, started
from fs_helpers import eio_directory

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskConfig, DiskTier, ErrorKind, ReadOnly
from aiokv.storage import follow as follow_module

Stored = dict[tuple[int, int], torch.Tensor]


async def _write(tier: DiskTier, pool: PagePool, stored: Stored, tag: int, *numbers: int) -> None:
    for i in numbers:
        h = fill(pool, key_of(i, tag), 100 * tag + i)
        stored[tag, i] = payload(pool, h)
        assert await tier.write(key_of(i, tag), h)
        pool.table.release(h)
        pool.table.evict(pool.num_pages)


async def _read(tier: DiskTier, pool: PagePool, i: int, tag: int) -> torch.Tensor | None:
    into = reserve(pool, key_of(200 + i, 99))
    try:
        ok = await asyncio.wait_for(tier.read(key_of(i, tag), into), 10)
        return payload(pool, into).clone() if ok else None
    finally:
        pool.table.abort(into)


async def _served(tier: DiskTier, pool: PagePool, stored: Stored, tag: int, *numbers: int) -> None:
    for i in numbers:
        got = await _read(tier, pool, i, tag)
        assert got is not None and torch.equal(got, stored[tag, i]), (tag, i)


def _errors(tier: DiskTier) -> dict[ErrorKind, int]:
    return tier.statistics().errors


@pytest.mark.root
@pytest.mark.asyncio
async def test_eio_listing_a_fanout_directory_indexes_nothing_from_it_until_it_heals(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    stored: Stored = {}
    async with started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as writer:
        await _write(writer, pool, stored, 1, 0, 1)
        await _write(writer, pool, stored, 2, 0, 1)
        follower = DiskTier(follow_config(disk_dir, backend), layout, pool)
        try:
            with eio_directory(writer.files.layout_dir / "02"):  # the writer keeps the directory underneath
                await follower.start()
                looks = Looks(follower)
                stats = follower.statistics()
                assert (stats.read_only, stats.pages, stats.errors[ErrorKind.EIO]) == (ReadOnly.LOCKED, 2, 1)
                await _write(writer, pool, stored, 1, 2, 3)
                await _write(writer, pool, stored, 2, 2, 3)
                for _ in range(2):  # each look lists it again (EIO, counted), and indexes the rest
                    eio = _errors(follower)[ErrorKind.EIO]
                    await looks.next()
                    assert _errors(follower)[ErrorKind.EIO] == eio + 1
                    assert follower.statistics().pages == 4
                    assert follower._dir is not None and follower._dir.fanout[2] < 0  # not kept open
                await _served(follower, pool, stored, 1, 0, 1, 2, 3)
                assert await _read(follower, pool, 0, 2) is None  # not indexed: a miss, nothing read
            # Unmounted: the next look lists the directory underneath, all of it.
            await looks.next()
            assert follower.statistics().pages == 8
            await _served(follower, pool, stored, 2, 0, 1, 2, 3)
            assert _errors(follower)[ErrorKind.OTHER] == 0 and follower.statistics().corrupt == 0
        finally:
            await follower.aclose()
    assert_clean(pool)


@pytest.mark.asyncio
async def test_removed_fanout_directory_drops_its_pages_and_the_take_over_makes_it_again(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    stored: Stored = {}
    writer = DiskTier(follow_config(disk_dir, backend), layout, pool)
    await writer.start()
    try:
        await _write(writer, pool, stored, 4, 0, 1, 2)
        await _write(writer, pool, stored, 5, 0, 1)
        async with started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as follower:
            looks = Looks(follower)
            assert follower.statistics().pages == 5
            await asyncio.to_thread(shutil.rmtree, follower.files.layout_dir / "04")  # ENOENT from now on
            await _write(writer, pool, stored, 5, 2)
            await looks.next()
            stats = follower.statistics()
            assert (stats.pages, stats.followed_out, stats.followed_in) == (3, 3, 1), stats
            assert stats.errors[ErrorKind.OTHER] == 1  # the removed directory (ENOENT), once
            for i in range(3):
                assert await _read(follower, pool, i, 4) is None
            await _served(follower, pool, stored, 5, 0, 1, 2)
            await looks.next()
            assert _errors(follower)[ErrorKind.OTHER] == 1  # not counted again
            await writer.aclose()
            await looks.next()
            assert follower.read_only is None and follower.statistics().took_over == 1
            await _write(follower, pool, stored, 4, 7)  # into a new fan-out directory 04
            assert (follower.files.layout_dir / "04" / key_of(7, 4).hex()).is_file()
            await _served(follower, pool, stored, 4, 7)
            await _served(follower, pool, stored, 5, 0, 1, 2)
    finally:
        await writer.aclose()
    assert_clean(pool)


@pytest.mark.asyncio
async def test_removed_layout_directory_drops_every_page_and_never_takes_over(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    stored: Stored = {}
    async with started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as writer:
        await _write(writer, pool, stored, 1, 0, 1)
        await _write(writer, pool, stored, 3, 0)
        before = open_fds()
        async with started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as follower:
            looks = Looks(follower)
            assert follower.statistics().pages == 3
            await asyncio.to_thread(shutil.rmtree, disk_dir)
            await writer.aclose()  # the lock is free, but its file is gone with the directory
            for _ in range(2):
                await looks.next()
                stats = follower.statistics()
                assert (stats.pages, stats.read_only, stats.took_over) == (0, ReadOnly.LOCKED, 0), stats
            for tag, i in ((1, 0), (1, 1), (3, 0)):
                assert await _read(follower, pool, i, tag) is None
            assert not await asyncio.to_thread(os.path.lexists, disk_dir)  # nothing made again
    assert open_fds() <= before
    assert await asyncio.to_thread(follow_threads) == []
    assert_clean(pool)


@pytest.mark.parametrize("planted", ["symlink", "file"])
@pytest.mark.asyncio
async def test_fanout_directory_replaced_is_retired_and_nothing_is_written_outside(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, planted: str) -> None:
    disk_dir, outside = tmp_path / "disk", tmp_path / "outside"
    outside.mkdir(mode=0o700)
    stored: Stored = {}
    writer = DiskTier(follow_config(disk_dir, backend), layout, pool)
    await writer.start()
    try:
        await _write(writer, pool, stored, 6, 0, 1)
        await _write(writer, pool, stored, 8, 0)
        async with started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as follower:
            looks = Looks(follower)
            fan = follower.files.layout_dir / "06"
            os.rename(fan, outside / "06")  # the real page files, moved out of the cache
            if planted == "symlink":
                os.symlink(outside / "06", fan)
            else:
                fan.write_bytes(b"not a directory")
            await looks.next()
            stats = follower.statistics()
            assert (stats.pages, stats.followed_out, stats.errors[ErrorKind.UNSAFE]) == (1, 2, 1), stats
            for i in (0, 1):  # not indexed any more: misses; the moved files are never read
                assert await _read(follower, pool, i, 6) is None
            await _served(follower, pool, stored, 8, 0)
            await writer.aclose()
            # The lock is free, but a start would refuse this directory: so does the take-over.
            await looks.next()
            assert follower.read_only is ReadOnly.LOCKED and follower.statistics().took_over == 0
            assert _errors(follower)[ErrorKind.UNSAFE] == 2
            # The operator removes what was planted: the next look takes over and makes 06 anew.
            fan.unlink()
            await looks.next()
            assert follower.read_only is None and follower.statistics().took_over == 1
            moved = sorted(os.listdir(outside / "06"))
            await _write(follower, pool, stored, 6, 5)
            assert sorted(os.listdir(outside / "06")) == moved  # nothing written outside the cache
            assert (fan / key_of(5, 6).hex()).is_file() and not fan.is_symlink()
            await _served(follower, pool, stored, 6, 5)
            assert await _read(follower, pool, 0, 6) is None
    finally:
        await writer.aclose()
    assert_clean(pool)


@pytest.mark.asyncio
async def test_planted_files_are_skipped_once_and_a_hard_link_is_refused_on_read(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    stored: Stored = {}
    writer = DiskTier(follow_config(disk_dir, backend), layout, pool)
    await writer.start()
    try:
        await _write(writer, pool, stored, 9, 0, 1, 2)
        async with started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as follower:
            looks = Looks(follower)
            fan = follower.files.layout_dir / "09"
            os.mkfifo(fan / key_of(10, 9).hex(), 0o600)
            foreign = fan / key_of(11, 9).hex()
            shutil.copyfile(fan / key_of(0, 9).hex(), foreign)
            os.chown(foreign, 12345, 12345)
            os.link(fan / key_of(1, 9).hex(), fan / key_of(12, 9).hex())  # page 1's file under page 12's name
            temp = fan / f".tmp-{key_of(13, 9).hex()}-0123456789abcdef0"  # a write in flight, for all we know
            temp.write_bytes(b"torn")
            await _write(writer, pool, stored, 9, 3)
            await looks.next()
            stats = follower.statistics()
            assert (stats.pages, stats.followed_in, stats.errors[ErrorKind.UNSAFE]) == (5, 2, 2), stats
            assert not follower.contains(key_of(10, 9)) and not follower.contains(key_of(11, 9))
            assert follower.contains(key_of(12, 9)) and not follower.contains(key_of(13, 9))
            for i in (10, 11, 13):
                assert await _read(follower, pool, i, 9) is None  # no hang on the FIFO: never opened
            assert await _read(follower, pool, 12, 9) is None  # its header names page 1: refused, kept
            # The looks tell why: the file has not changed since it was indexed. Its identity was
            # recorded within a second of its change time (a change and its undoing within one tick
            # of a coarse clock would not show): recorded again, indexed again, counted neither way;
            # its second refusal is counted corrupt.
            await looks.until(lambda: follower.contains(key_of(12, 9)))
            assert (follower.statistics().corrupt, follower.statistics().follow_raced) == (0, 0)
            assert await _read(follower, pool, 12, 9) is None
            await looks.until(lambda: follower.statistics().corrupt == 1)
            stats = follower.statistics()
            assert (stats.corrupt, stats.follow_raced) == (1, 0) and (fan / key_of(12, 9).hex()).exists()
            await _served(follower, pool, stored, 9, 0, 1, 2, 3)
            await looks.next()  # nothing changed: nothing counted again
            assert _errors(follower)[ErrorKind.UNSAFE] == 2 and not follower.contains(key_of(12, 9))
            assert follower.statistics().corrupt == 1
            assert temp.exists()  # the writer's, maybe: left alone while it holds the directory
            await writer.aclose()
            await looks.next()
            stats = follower.statistics()
            assert (stats.read_only, stats.took_over, stats.temp_files_removed) == (None, 1, 1), stats
            assert not temp.exists()
            if follower._jobs:  # the unlinks it started
                await asyncio.wait(set(follower._jobs))
            assert not (fan / key_of(12, 9).hex()).exists()  # the file it refused, unlinked once it writes
            assert (fan / key_of(10, 9).hex()).exists() and foreign.exists()  # not ours to remove
            assert _errors(follower)[ErrorKind.UNSAFE] == 2
            await _served(follower, pool, stored, 9, 0, 1, 2, 3)
    finally:
        await writer.aclose()
    assert_clean(pool)


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
@pytest.mark.asyncio
async def test_planted_lock_file_is_never_followed_or_taken(
        tmp_path: Path, layout: KVLayout, pool: PagePool, planted: str) -> None:
    backend = DiskBackend.THREADS  # the lock is taken on a thread whatever the backend
    disk_dir, outside = tmp_path / "disk", tmp_path / "outside"
    outside.write_bytes(b"")
    async with (started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as writer,
                started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as follower):
        looks = Looks(follower)
        lock = follower.files.layout_dir / ".lock"
        lock.unlink()
        if planted == "symlink":
            os.symlink(outside, lock)
        else:
            os.mkfifo(lock, 0o600)
        await writer.aclose()
        for n in (1, 2):
            await looks.next()
            stats = follower.statistics()
            assert (stats.read_only, stats.took_over, stats.errors[ErrorKind.UNSAFE]) == (
                ReadOnly.LOCKED, 0, n), stats
        assert outside.read_bytes() == b""
    assert_clean(pool)


@pytest.mark.parametrize("taking_over", [False, True], ids=["following", "taking-over"])
@pytest.mark.asyncio
async def test_aclose_while_a_look_runs_leaves_no_thread_or_descriptor(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, monkeypatch: pytest.MonkeyPatch,
        taking_over: bool) -> None:
    stored: Stored = {}
    loop_starts = thread_starts_on_the_loop(monkeypatch)
    writer = DiskTier(follow_config(disk_dir, backend), layout, pool)
    await writer.start()
    try:
        await _write(writer, pool, stored, 1, 0)
        before = open_fds()
        follower = DiskTier(follow_config(disk_dir, backend), layout, pool)
        await follower.start()
        looks = Looks(follower)
        await looks.next()  # one look as usual (the thread started off the loop)
        real_list = follow_module.list_fanout
        entered, release, listed = asyncio.Event(), threading.Event(), [0]
        loop = asyncio.get_running_loop()

        def gated(*args: Any) -> Any:
            listed[0] += 1
            loop.call_soon_threadsafe(entered.set)
            assert release.wait(30), "the test never released the look"
            return real_list(*args)

        monkeypatch.setattr(follow_module, "list_fanout", gated)
        if taking_over:
            await writer.aclose()  # the look takes the lock, then lists every fan-out directory
        else:
            await _write(writer, pool, stored, 1, 1)  # fan-out directory 01 changed: listed again
        follower._look_soon()
        await asyncio.wait_for(entered.wait(), 30)
        closing = asyncio.ensure_future(follower.aclose())
        await spin(20)
        assert not closing.done()  # it waits for the look's thread
        release.set()
        await asyncio.wait_for(closing, 30)
        assert listed[0] == 1  # the look stopped after the directory it was at
        assert await asyncio.to_thread(follow_threads) == []
        assert not [s for s in loop_starts if s.startswith("aiokv-disk-follow")], loop_starts
        await writer.aclose()
        assert open_fds() <= before
        # The follower let the lock go with its close: the next start writes.
        async with started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as after:
            assert after.read_only is None
    finally:
        release.set()
        await writer.aclose()
    assert_clean(pool)


@pytest.mark.asyncio
async def test_of_two_followers_one_takes_over_and_the_other_follows_it(
        disk_dir: Path, layout: KVLayout, pool: PagePool) -> None:
    backend = DiskBackend.URING
    stored: Stored = {}
    writer = DiskTier(follow_config(disk_dir, backend), layout, pool)
    await writer.start()
    try:
        await _write(writer, pool, stored, 1, 0)
        async with (started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as first,
                    started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as second):
            looks = {first: Looks(first), second: Looks(second)}
            await writer.aclose()
            await asyncio.gather(looks[first].next(), looks[second].next())  # both try the lock at once
            winners = [tier for tier in (first, second) if tier.read_only is None]
            assert len(winners) == 1, [t.statistics() for t in (first, second)]
            (new_writer,) = winners
            (other,) = [tier for tier in (first, second) if tier is not new_writer]
            assert other.read_only is ReadOnly.LOCKED
            await _write(new_writer, pool, stored, 2, 0, 1)
            await looks[other].next()
            assert other.read_only is ReadOnly.LOCKED and other.statistics().took_over == 0
            await _served(other, pool, stored, 2, 0, 1)
            await _served(other, pool, stored, 1, 0)
    finally:
        await writer.aclose()
    assert_clean(pool)


def test_follow_interval_is_validated(tmp_path: Path) -> None:
    for bad, error in (("2", TypeError), (True, TypeError), (None, TypeError), (-1, ValueError),
                       (float("nan"), ValueError), (float("inf"), ValueError), (86401, ValueError)):
        with pytest.raises(error, match=r"DiskConfig\.follow_interval_s must be"):
            DiskConfig(directory=tmp_path, follow_interval_s=bad)  # type: ignore[arg-type]
    for good in (0, 0.25, 2, 86400):
        assert DiskConfig(directory=tmp_path, follow_interval_s=good).follow_interval_s == good
    assert DiskConfig(directory=tmp_path).follow_interval_s == 2.0
