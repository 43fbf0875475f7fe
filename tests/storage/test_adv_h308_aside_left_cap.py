"""The names set aside that a trim left (``deletelog._aside_left``, d06feed) past their cap, and
once gone.

The set is capped (``ASIDE_LEFT_REMEMBERED``). Filled, it was cleared all at once, mid-trim: with
more names left in the directory than the cap, every trim forgot the ones the trim before had
remembered, and tried them all again (a nested directory emptied anew, a file put back into it
removed) and counted them again, at every trim, for ever: what d06feed stopped came back past the
cap. Now a full set takes no more (names past it are tried at each trim, the ones remembered
stay). And a name remembered that the directory no longer lists (an operator removed it) is
forgotten at the next trim of that directory: it kept its room, and a name left later was not
remembered once the cap was reached with such names.

Real tier restarts in one process (each start's save sets a planted ``.deletes`` aside and trims),
real planted directories; the cap made 2 for the test."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config
from planted_helpers import started

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, deletelog
from aiokv.storage.config import ErrorKind
from aiokv.storage.deletelog import DELETES_NAME, PLANTED_KEPT, PLANTED_PREFIX


def _nested(where: Path) -> None:
    """A directory a trim cannot remove: a non-empty directory within (emptied down to it)."""
    where.mkdir()
    (where / "inside").write_bytes(b"x")
    (where / "nest").mkdir()
    (where / "nest" / "deeper").write_bytes(b"deep")


def _removable(where: Path) -> None:
    where.mkdir()
    (where / "inside").write_bytes(b"x")


async def _round(cfg: object, layout: KVLayout, pool: PagePool, layout_dir: Path) -> int:
    """A directory planted at the record's name, a tier started (its save sets it aside and trims
    the names set aside); the UNSAFE faults counted."""
    _removable(layout_dir / DELETES_NAME)
    async with started(cfg, layout, pool) as tier:  # type: ignore[arg-type]
        if tier._deletes_saving is not None:
            await asyncio.wait({tier._deletes_saving})
        return tier.statistics().errors.get(ErrorKind.UNSAFE, 0)


def _put_back(*dirs: Path) -> None:
    for d in dirs:
        assert sorted(p.name for p in d.iterdir()) == ["nest"], d  # emptied down to it by a trim
        (d / "loose").write_bytes(b"put back")


def _still_there(d: Path) -> bool:
    return (d / "loose").exists()


@pytest.mark.asyncio
async def test_left_names_past_the_cap_and_gone_ones(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deletelog, "ASIDE_LEFT_REMEMBERED", 2)
    monkeypatch.setattr(deletelog, "_aside_left", set())
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(cfg, layout, pool) as tier:
        layout_dir = tier.files.layout_dir
    # Three old names no trim can remove; a trim takes the newest first (30, 20, then 10).
    old = {t: layout_dir / f"{PLANTED_PREFIX}{t}" for t in (30, 20, 10)}
    for d in old.values():
        _nested(d)
    recent = time.time_ns() - 10**9
    for i in range(PLANTED_KEPT):
        _removable(layout_dir / f"{PLANTED_PREFIX}{recent + i}")

    assert await _round(cfg, layout, pool, layout_dir) == 2  # the EISDIR, and the three left
    _put_back(*old.values())
    await _round(cfg, layout, pool, layout_dir)
    # 30 and 20 remembered (the cap): not tried again. 10, past the cap, tried again (emptied anew).
    # Before: the set cleared at 10 held only 10, and 30 and 20 were tried again.
    assert _still_there(old[30]) and _still_there(old[20]), "a name remembered within the cap was tried again"
    assert not _still_there(old[10])

    # An operator removes 30; a new name no trim can remove appears among the old ones.
    shutil.rmtree(old[30])
    new = layout_dir / f"{PLANTED_PREFIX}25"
    _nested(new)
    await _round(cfg, layout, pool, layout_dir)  # forgets 30 (not listed), remembers 25 in its room
    assert (deletelog.ASIDE_LEFT_REMEMBERED, len(deletelog._aside_left)) == (2, 2)
    _put_back(new)
    await _round(cfg, layout, pool, layout_dir)
    # Before: 30's key kept its room, 25 was never remembered and was tried at every trim.
    assert _still_there(new), "a name left after a remembered one was removed was tried again"
    assert _still_there(old[20])
    names = {p.name for p in layout_dir.iterdir() if p.name.startswith(PLANTED_PREFIX)}
    assert {old[20].name, old[10].name, new.name} <= names and old[30].name not in names
    assert_clean(pool)


def test_a_tier_of_another_directory_keeps_its_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The forgetting is per directory: a trim of one directory forgets none of another's names
    (the set is the process's, for every tier)."""
    monkeypatch.setattr(deletelog, "_aside_left", set())
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        for t in range(1, PLANTED_KEPT + 2):
            (_nested if t == 1 else _removable)(d / f"{PLANTED_PREFIX}{t}")
    fds = [os.open(d, os.O_RDONLY | os.O_DIRECTORY) for d in (a, b)]
    try:
        for fd in fds:
            moved: deletelog.Planted = []
            deletelog._trim_aside(fd, moved)
            assert [type(e).__name__ for e in moved] == ["UnsafeFileError"]  # the nested one left
        assert len(deletelog._aside_left) == 2
        (a / f"{PLANTED_PREFIX}1" / "loose").write_bytes(b"put back")
        (b / f"{PLANTED_PREFIX}1" / "loose").write_bytes(b"put back")
        for fd in fds:
            moved = []
            deletelog._trim_aside(fd, moved)
            assert moved == []  # neither tried nor counted again
        assert (a / f"{PLANTED_PREFIX}1" / "loose").exists() and (b / f"{PLANTED_PREFIX}1" / "loose").exists()
        assert len(deletelog._aside_left) == 2
    finally:
        for fd in fds:
            os.close(fd)
