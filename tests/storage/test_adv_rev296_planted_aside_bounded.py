"""Review 296: a non-empty directory planted at the pending-delete record's names (``.deletes``,
``.deletes.new``) is renamed aside to a ``.deletes.planted-*`` name (review 289), and nothing ever
removed those names: whoever could write into the cache directory made the tier gather them for
ever. Now at each directory set aside the older names beyond ``PLANTED_KEPT`` are removed where
that is safe: a non-directory unlinked (the name: a symlink's target, a hard link's file stay), a
directory emptied one level down and removed. One with a non-empty directory within, or a mount
point (a bind mount of a directory outside), is left as it is and counted.

Also: a start or a take-over that met a directory planted at ``.deletes.new`` (with no save of the
record to clear it) failed to unlink it, counted and logged at every start; now it is cleared
there, once. Every backend; real planted entries, real restarts, a real bind mount."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import time
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from fs_helpers import bind_mount
from planted_helpers import bytes_of, served, snapshot, started
from take_over_helpers import take_over_config, took_over, writer_and_follower

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly
from aiokv.storage.config import ErrorKind
from aiokv.storage.deletelog import DELETES_NAME, DELETES_TEMP, PLANTED_KEPT, PLANTED_PREFIX

TAG = 0x96
ROUNDS = PLANTED_KEPT + 3


def _outside(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "target").write_bytes(b"not ours")
    (outside / "sub" / "deep").write_bytes(b"not ours either")
    return outside


def _plant_dir(where: Path, outside: Path) -> None:
    """A directory at ``where`` holding what a removal must never follow: links to outside (a
    directory, a file), a hard link to a file outside, a FIFO, an empty directory, a file."""
    where.mkdir(mode=0o700)
    (where / "inside").write_bytes(b"x")
    (where / "out").symlink_to(outside)
    (where / "target").symlink_to(outside / "target")
    os.link(outside / "target", where / "hard")
    os.mkfifo(where / "fifo", 0o600)
    (where / "empty").mkdir()


def _aside(layout_dir: Path) -> list[Path]:
    return sorted(p for p in layout_dir.iterdir() if p.name.startswith(PLANTED_PREFIX))


def _unsafe(tier: DiskTier) -> int:
    return tier.statistics().errors.get(ErrorKind.UNSAFE, 0)


async def _saved(tier: DiskTier) -> None:
    if tier._deletes_saving is not None:  # the start's save of the record (in the background)
        await asyncio.wait({tier._deletes_saving})


@pytest.mark.asyncio
async def test_directories_set_aside_stay_bounded_and_nothing_outside_is_touched(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    outside = _outside(tmp_path)
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(cfg, layout, pool) as tier:
        layout_dir = tier.files.layout_dir
    before = snapshot(outside)
    for round_ in range(ROUNDS):
        # At the record (its save sets it aside) or at its temporary name (the start does).
        _plant_dir(layout_dir / (DELETES_NAME if round_ % 2 == 0 else DELETES_TEMP), outside)
        async with started(cfg, layout, pool) as tier:
            await _saved(tier)
            key = key_of(round_, TAG)
            assert await tier.write_from(key, memoryview(bytes_of(key, size)))
            assert await served(tier, key, size)
            assert _unsafe(tier) == 1, (round_, tier.statistics())  # the directory set aside, once
        aside = _aside(layout_dir)
        assert len(aside) == min(round_ + 1, PLANTED_KEPT), (round_, aside)
        assert snapshot(outside) == before, f"something outside the cache directory changed (round {round_})"
        for name in (DELETES_NAME, DELETES_TEMP):
            with contextlib.suppress(FileNotFoundError):
                assert stat.S_ISREG((layout_dir / name).lstat().st_mode), f"{name} still planted"
    for kept in aside:  # the newest set aside as they were
        assert (kept / "inside").read_bytes() == b"x"
        assert os.readlink(kept / "out") == str(outside)
        assert (kept / "hard").read_bytes() == b"not ours"
    async with started(cfg, layout, pool) as tier:
        key = key_of(ROUNDS - 1, TAG)
        assert await served(tier, key, size), "the page stored after the last plant was lost"
        assert _unsafe(tier) == 0
    assert len(_aside(layout_dir)) == PLANTED_KEPT
    assert snapshot(outside) == before
    assert_clean(pool)


@pytest.mark.asyncio
async def test_what_cannot_be_removed_safely_is_left_and_counted(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """Old names set aside of every kind: a symlink to outside and a FIFO (unlinked), a directory
    with a non-empty directory within, one with a bind mount within, and one that is a bind mount
    of a directory outside (left, counted once)."""
    outside = _outside(tmp_path)
    mounted = tmp_path / "mounted"  # a directory outside, bind-mounted into planted entries
    mounted.mkdir()
    (mounted / "precious").write_bytes(b"outside the cache")
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(cfg, layout, pool) as tier:
        layout_dir = tier.files.layout_dir
    recent = time.time_ns() - 10**9  # older than the next directory set aside, newer than those below
    for i in range(PLANTED_KEPT - 1):  # kept: the newest with the one set aside next
        _plant_dir(layout_dir / f"{PLANTED_PREFIX}{recent + i}", outside)
    (layout_dir / f"{PLANTED_PREFIX}1").symlink_to(outside / "target")
    os.mkfifo(layout_dir / f"{PLANTED_PREFIX}2", 0o600)
    nested = layout_dir / f"{PLANTED_PREFIX}3"
    _plant_dir(nested, outside)
    (nested / "nest").mkdir()
    (nested / "nest" / "deeper").write_bytes(b"deep")
    holder = layout_dir / f"{PLANTED_PREFIX}4"
    _plant_dir(holder, outside)
    (holder / "mnt").mkdir()
    mount_point = layout_dir / f"{PLANTED_PREFIX}5"
    mount_point.mkdir()
    _plant_dir(layout_dir / f"{PLANTED_PREFIX}x", outside)  # not a name of ours: the oldest
    _plant_dir(layout_dir / DELETES_NAME, outside)
    with bind_mount(mounted, holder / "mnt"), bind_mount(mounted, mount_point):
        before, before_mounted = snapshot(outside), snapshot(mounted)
        async with started(cfg, layout, pool) as tier:
            await _saved(tier)
            # The directory set aside (EISDIR) and one fault for the three left (not one each);
            # the record unreadable (a directory: OTHER). Nothing else failed (a mount point's
            # rmdir, EBUSY: it is known for one before anything is tried).
            errors = {kind: n for kind, n in tier.statistics().errors.items() if n}
            assert errors == {ErrorKind.UNSAFE: 2, ErrorKind.OTHER: 1}, errors
        assert snapshot(outside) == before, "something outside the cache directory changed"
        assert snapshot(mounted) == before_mounted, "something in a directory mounted into the cache changed"
        names = {p.name for p in _aside(layout_dir)}
        assert not {f"{PLANTED_PREFIX}{n}" for n in ("1", "2", "x")} & names, names
        assert {nested.name, holder.name, mount_point.name} <= names, names
        assert len(names) == PLANTED_KEPT + 3, names
        assert (nested / "nest" / "deeper").read_bytes() == b"deep"  # left: nothing within touched
        assert (holder / "mnt" / "precious").read_bytes() == b"outside the cache"
        assert (mount_point / "precious").read_bytes() == b"outside the cache"
    assert (mounted / "precious").read_bytes() == b"outside the cache"
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_directory_planted_at_the_temporary_name_is_cleared_once_not_at_every_start(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        caplog: pytest.LogCaptureFixture) -> None:
    """No record to save (none pending): before, each start failed to unlink the directory
    (EISDIR), counted it and logged it, and it stayed."""
    outside = _outside(tmp_path)
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(cfg, layout, pool) as tier:
        layout_dir = tier.files.layout_dir
    for planted in ("empty", "full"):
        temp = layout_dir / DELETES_TEMP
        if planted == "empty":
            temp.mkdir()
        else:
            _plant_dir(temp, outside)
        before = snapshot(outside)
        counts = []
        for _ in range(3):
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="aiokv"):
                async with started(cfg, layout, pool) as tier:
                    await _saved(tier)
                    counts.append(_unsafe(tier))
            lines = [r for r in caplog.records if DELETES_TEMP in r.getMessage()]
            assert len(lines) <= 1, [r.getMessage() for r in lines]
            assert not temp.exists(), f"the directory planted at {DELETES_TEMP} ({planted}) stayed"
        assert counts == [1, 0, 0], (planted, counts)
        assert snapshot(outside) == before
    assert len(_aside(layout_dir)) == 1  # the full one, as it was
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_take_over_clears_a_directory_planted_at_the_temporary_name(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    outside = _outside(tmp_path)
    keys = [key_of(100 + i, TAG) for i in range(2)]
    cfg = take_over_config(tmp_path / "disk", backend)
    async with contextlib.AsyncExitStack() as stack:
        writer, follower, looks = await writer_and_follower(stack, cfg, layout, pool, keys[:1])
        assert follower.read_only is ReadOnly.LOCKED
        layout_dir = writer.files.layout_dir
        _plant_dir(layout_dir / DELETES_TEMP, outside)
        before = snapshot(outside)
        await writer.aclose()
        unsafe = _unsafe(follower)
        await took_over(looks)
        assert _unsafe(follower) == unsafe + 1, follower.statistics()
        assert not (layout_dir / DELETES_TEMP).exists(), "the take-over left the planted directory"
        (aside,) = _aside(layout_dir)
        assert (aside / "inside").read_bytes() == b"x"
        assert await follower.write_from(keys[1], memoryview(bytes_of(keys[1], size)))
    async with started(cfg, layout, pool) as restarted:
        assert await served(restarted, keys[1], size)
        assert _unsafe(restarted) == 0
    assert snapshot(outside) == before
    assert_clean(pool)
