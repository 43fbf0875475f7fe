"""Review 306: names set aside (``.deletes.planted-*``) that a trim cannot remove safely (a
directory with a non-empty directory within, one of over ``ASIDE_EMPTIED_MAX`` entries, a mount
point) were tried again at every trim — every directory set aside, so every plant — and counted
each time: the work of a trim grew with the plants. Now a trim remembers what it left, by
(device, inode, name), for the process: later trims neither try nor count it again. Every
backend; real restarts, real planted directories, a real bind mount; nothing followed, nothing
outside the cache directory changed."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config
from fs_helpers import bind_mount
from planted_helpers import snapshot, started

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.config import ErrorKind
from aiokv.storage.deletelog import ASIDE_EMPTIED_MAX, DELETES_NAME, PLANTED_KEPT, PLANTED_PREFIX

ROUNDS = 3


def _plant_dir(where: Path, outside: Path) -> None:
    """A non-empty directory at ``where`` with links to outside (never to be followed)."""
    where.mkdir(mode=0o700)
    (where / "inside").write_bytes(b"x")
    (where / "out").symlink_to(outside)
    os.link(outside / "target", where / "hard")


async def _saved(tier: DiskTier) -> None:
    if tier._deletes_saving is not None:  # the start's save of the record (in the background)
        await asyncio.wait({tier._deletes_saving})


@pytest.mark.root
@pytest.mark.asyncio
async def test_names_left_by_a_trim_are_not_tried_or_counted_again(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "target").write_bytes(b"not ours")
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    (mounted / "precious").write_bytes(b"outside the cache")
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(cfg, layout, pool) as tier:
        layout_dir = tier.files.layout_dir
    # The old names, none removable safely (the oldest: each trim's candidates).
    nested = layout_dir / f"{PLANTED_PREFIX}1"
    _plant_dir(nested, outside)
    (nested / "nest").mkdir()
    (nested / "nest" / "deeper").write_bytes(b"deep")
    crowded = layout_dir / f"{PLANTED_PREFIX}2"
    crowded.mkdir()
    for j in range(ASIDE_EMPTIED_MAX + 1):
        (crowded / f"e{j}").write_bytes(b"")
    mount_point = layout_dir / f"{PLANTED_PREFIX}3"
    mount_point.mkdir()
    recent = time.time_ns() - 10**9  # older than the directories set aside below
    for i in range(PLANTED_KEPT):
        _plant_dir(layout_dir / f"{PLANTED_PREFIX}{recent + i}", outside)
    unsafe = []
    with bind_mount(mounted, mount_point):
        before, before_mounted = snapshot(outside), snapshot(mounted)
        for round_ in range(ROUNDS):
            _plant_dir(layout_dir / DELETES_NAME, outside)  # the start's save sets it aside
            async with started(cfg, layout, pool) as tier:
                await _saved(tier)
                errors = {kind: n for kind, n in tier.statistics().errors.items() if n}
            assert errors.get(ErrorKind.OTHER) == 1, errors  # the record unreadable (a directory)
            unsafe.append(errors.get(ErrorKind.UNSAFE, 0))
            if round_ == 0:
                # The first trim emptied the nested one down to its non-empty directory. A file
                # put there now would go at a trim that tried it again.
                assert sorted(os.listdir(nested)) == ["nest"]
                (nested / "loose").write_bytes(b"put back")
            names = {p.name for p in layout_dir.iterdir() if p.name.startswith(PLANTED_PREFIX)}
            assert {nested.name, crowded.name, mount_point.name} <= names, names
            assert len(names) == PLANTED_KEPT + 3, names  # the removable old ones trimmed as before
        assert snapshot(outside) == before, "something outside the cache directory changed"
        assert snapshot(mounted) == before_mounted, "something in a directory mounted into the cache changed"
        assert (mount_point / "precious").read_bytes() == b"outside the cache"
    # Each round: the directory set aside (EISDIR); the three left counted once, at the first trim
    # only (before: [2, 2, 2], each trim trying them all again).
    assert unsafe == [2] + [1] * (ROUNDS - 1), unsafe
    assert (nested / "loose").read_bytes() == b"put back"  # not tried again
    assert (nested / "nest" / "deeper").read_bytes() == b"deep"
    assert len(os.listdir(crowded)) == ASIDE_EMPTIED_MAX + 1
    assert (outside / "target").read_bytes() == b"not ours"
    assert_clean(pool)
