"""Review 299: the names set aside (``.deletes.planted-*``) are sorted by the time in their name,
and a name this code did not make counts as the oldest. The time was read with ``str.isdigit`` and
``int``: a planted name whose suffix is a Unicode digit that is no decimal digit (``²``, ``①``)
passes ``isdigit`` and makes ``int`` raise ``ValueError`` — not an ``OSError``, so the start (a
directory planted at ``.deletes.new``) failed with it, and a save of the record (one planted at
``.deletes``) ended in the background with it, the record unsaved, at every plant. Now such a
name is one this code did not make: the oldest, removed first like any other. Every backend;
real planted names, real restarts."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from planted_helpers import bytes_of, served, snapshot, started

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend
from aiokv.storage.config import ErrorKind
from aiokv.storage.deletelog import DELETES_NAME, DELETES_TEMP, PLANTED_KEPT, PLANTED_PREFIX

TAG = 0x99
ODD = ("²", "①", "1²", "\u0663\u00b2", "\udcff1")  # digits to isdigit(), not to int(); a name not UTF-8


def _aside(layout_dir: Path) -> set[str]:
    return {p.name for p in layout_dir.iterdir() if p.name.startswith(PLANTED_PREFIX)}


def _plant(where: Path, outside: Path) -> None:
    where.mkdir()
    (where / "inside").write_bytes(b"x")
    (where / "out").symlink_to(outside)


@pytest.mark.asyncio
@pytest.mark.parametrize("at", [DELETES_TEMP, DELETES_NAME])
async def test_a_name_set_aside_with_a_digit_int_refuses_is_the_oldest_not_a_crash(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, at: str) -> None:
    size = layout.page_bytes
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "target").write_bytes(b"not ours")
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(cfg, layout, pool) as tier:
        layout_dir = tier.files.layout_dir
    for suffix in ODD:  # each kind: a directory, a symlink to outside
        _plant(layout_dir / f"{PLANTED_PREFIX}{suffix}", outside)
        os.symlink(outside, layout_dir / f"{PLANTED_PREFIX}{suffix}-link")
    before = snapshot(outside)
    for round_ in range(PLANTED_KEPT):
        _plant(layout_dir / at, outside)
        async with started(cfg, layout, pool) as tier:
            saving = tier._deletes_saving
            if saving is not None:
                await asyncio.wait({saving})
                assert saving.exception() is None, repr(saving.exception())
            key = key_of(round_, TAG)
            assert await tier.write_from(key, memoryview(bytes_of(key, size)))
            assert await served(tier, key, size)
            errors = {kind: n for kind, n in tier.statistics().errors.items() if n}
            # The directory set aside (EISDIR: UNSAFE) and, at .deletes, the record unreadable.
            assert errors.get(ErrorKind.UNSAFE) == 1, errors
            assert not (layout_dir / at).is_dir(), f"{at} still planted"
        names = _aside(layout_dir)
        assert len(names) == PLANTED_KEPT, names
        # The odd names are the oldest: those the directories set aside since displaced, first.
        ours = {n for n in names if n[len(PLANTED_PREFIX):].isascii()}
        assert len(ours) == round_ + 1, names
        assert snapshot(outside) == before
    assert (outside / "target").read_bytes() == b"not ours"
    assert_clean(pool)
