"""Review 300: a directory planted in the record's way and set aside (``.deletes.planted-<ns>``) was
named by the wall clock; where names set aside already carry a later time (the clock stepped back
since, or a name planted from the future), the one just set aside was the oldest and the trim
removed it at once (its content with it), contradicting "the newest 4 kept". Now a name set
aside is always the newest: one past the newest there when the clock is behind it. Every backend;
real planted directories, real restarts (the start that holds the lock clears ``.deletes.new``)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config
from planted_helpers import started

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend
from aiokv.storage.config import ErrorKind
from aiokv.storage.deletelog import DELETES_TEMP, PLANTED_KEPT, PLANTED_PREFIX, _aside_stamp

FUTURE_NS = time.time_ns() + 100 * 365 * 86_400 * 10**9  # a century ahead


def _aside(layout_dir: Path) -> dict[str, str]:
    """Each name set aside and what its ``mark`` file says ('' where it has none)."""
    out = {}
    for path in layout_dir.iterdir():
        if path.name.startswith(PLANTED_PREFIX):
            mark = path / "mark"
            out[path.name] = mark.read_text() if mark.is_file() else ""
    return out


def _plant(where: Path, mark: str) -> None:
    where.mkdir()
    (where / "mark").write_text(mark)


@pytest.mark.asyncio
async def test_a_directory_set_aside_behind_names_from_the_future_is_kept(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(cfg, layout, pool) as tier:
        layout_dir = tier.files.layout_dir
    future = [f"{PLANTED_PREFIX}{FUTURE_NS + i}" for i in range(PLANTED_KEPT)]
    for i, name in enumerate(future):
        _plant(layout_dir / name, f"future {i}")
    for round_ in range(2):
        mark = f"set aside {round_}"
        _plant(layout_dir / DELETES_TEMP, mark)
        async with started(cfg, layout, pool) as tier:
            saving = tier._deletes_saving
            if saving is not None:
                await asyncio.wait({saving})
                assert saving.exception() is None, repr(saving.exception())
            errors = {kind: n for kind, n in tier.statistics().errors.items() if n}
            assert errors.get(ErrorKind.UNSAFE) == 1, errors  # the directory set aside, nothing left uncleared
        assert not (layout_dir / DELETES_TEMP).exists()
        aside = _aside(layout_dir)
        assert len(aside) == PLANTED_KEPT, aside
        marks = set(aside.values())
        # The one just set aside, and the one before it, kept: the future's oldest ones went first.
        assert {f"set aside {r}" for r in range(round_ + 1)} <= marks, aside
        assert marks == {f"set aside {r}" for r in range(round_ + 1)} | {
            f"future {i}" for i in range(round_ + 1, PLANTED_KEPT)}, aside
        newest = max(aside, key=lambda n: int(n[len(PLANTED_PREFIX):]))
        assert aside[newest] == mark, aside  # named the newest (one past the future's)
    assert_clean(pool)


def test_a_name_set_aside_keeps_the_wall_clock_when_nothing_is_ahead(tmp_path: Path) -> None:
    """Nothing set aside from the future: the name carries the clock's time (as before)."""
    (tmp_path / f"{PLANTED_PREFIX}5").mkdir()
    (tmp_path / f"{PLANTED_PREFIX}odd").mkdir()
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        before = time.time_ns()
        stamp = _aside_stamp(fd)
        assert before <= stamp <= time.time_ns()
        (tmp_path / f"{PLANTED_PREFIX}{FUTURE_NS}").mkdir()
        assert _aside_stamp(fd) == FUTURE_NS + 1
    finally:
        os.close(fd)
