"""Review 289: a directory planted at the pending-delete record's name (``.deletes``, or its
temporary name ``.deletes.new``) never healed. The record could not be trusted, so a start served
no page it found on disk (unlinked them), and its save could not replace the record: a rename or
an unlink meets EISDIR on a directory. So every later start lost every page stored since. Now the
save moves the directory out of the way — removed when empty (``rmdir`` removes nothing else),
else renamed aside to a ``.deletes.planted-*`` name in the layout directory, its content as it was
— and counts it; the next start serves the pages stored after the plant.

Other planted entries (a FIFO, a symlink to a file outside) never blocked the save (a rename
replaces the name, never what it leads to): checked here too, with nothing followed and nothing
outside the cache directory touched. Every backend; real planted entries between real restarts."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from planted_helpers import bytes_of, served, snapshot, started
from take_over_helpers import take_over_config, took_over, writer_and_follower

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly
from aiokv.storage.config import ErrorKind
from aiokv.storage.deletelog import DELETES_NAME, DELETES_TEMP, PLANTED_PREFIX, encode

TAG = 0x89
KEYS = [key_of(i, TAG) for i in range(4)]
PLANTED = ["deletes-empty-dir", "deletes-dir", "temp-empty-dir", "temp-dir", "deletes-fifo", "deletes-symlink"]


def _plant(layout_dir: Path, outside: Path, planted: str) -> None:
    record, temp = layout_dir / DELETES_NAME, layout_dir / DELETES_TEMP
    if planted.startswith("temp-"):
        record.write_bytes(b"AIOKVDL1" + os.urandom(64))  # damaged: the start replaces it
    where = temp if planted.startswith("temp-") else record
    if planted.endswith("empty-dir"):
        where.mkdir(mode=0o700)
    elif planted.endswith("-dir"):  # not empty: a file, and a link leading outside (never followed)
        where.mkdir(mode=0o700)
        (where / "inside").write_bytes(b"x")
        (where / "out").symlink_to(outside)
    elif planted == "deletes-fifo":
        os.mkfifo(record, 0o600)
    elif planted == "deletes-symlink":  # to a valid record outside, naming a page stored
        (outside / "record").write_bytes(encode({KEYS[2]: 1 << 62}))
        record.symlink_to(outside / "record")
    else:
        raise AssertionError(planted)


def _unsafe(tier: DiskTier) -> int:
    return tier.statistics().errors.get(ErrorKind.UNSAFE, 0)


@pytest.mark.asyncio
@pytest.mark.parametrize("planted", PLANTED)
async def test_a_record_planted_over_heals_at_the_next_save_and_nothing_is_followed(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, planted: str) -> None:
    size = layout.page_bytes
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "target").write_bytes(b"not ours")
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(cfg, layout, pool) as tier:
        for key in KEYS[:2]:
            assert await tier.write_from(key, memoryview(bytes_of(key, size)))
        layout_dir = tier.files.layout_dir
    _plant(layout_dir, outside, planted)
    before = snapshot(outside)
    async with started(cfg, layout, pool) as tier:
        if tier._deletes_saving is not None:  # the start's save of the record (in the background)
            await asyncio.wait({tier._deletes_saving})
        for key in KEYS[:2]:  # the record cannot be trusted: its deletes are unknown
            assert not await served(tier, key, size), f"a page the planted record ({planted}) may name was served"
        assert await tier.write_from(KEYS[2], memoryview(bytes_of(KEYS[2], size)))
        assert await served(tier, KEYS[2], size)
        if planted.endswith("-dir"):
            assert _unsafe(tier) >= 1, tier.statistics()  # the directory moved is counted
    assert snapshot(outside) == before, "something outside the cache directory changed"
    for name in (DELETES_NAME, DELETES_TEMP):  # the record replaced: ours, or none (no delete pending)
        with contextlib.suppress(FileNotFoundError):
            st = (layout_dir / name).lstat()
            assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid(), f"{name} is still planted ({planted})"
    aside = sorted(p for p in layout_dir.iterdir() if p.name.startswith(PLANTED_PREFIX))
    if planted in ("deletes-dir", "temp-dir"):  # renamed aside with its content as it was
        assert len(aside) == 1, aside
        assert (aside[0] / "inside").read_bytes() == b"x"
        assert os.readlink(aside[0] / "out") == str(outside)
    else:  # an empty directory removed; a FIFO or a symlink replaced by the rename, as always
        assert aside == []
    async with started(cfg, layout, pool) as tier:
        # Review 289: the directory stayed in the record's way, and this start served none of
        # the pages stored since the plant.
        assert await served(tier, KEYS[2], size), f"the page stored after the plant ({planted}) was lost"
        for key in KEYS[:2]:
            assert not await served(tier, key, size)
    assert snapshot(outside) == before, "something outside the cache directory changed"
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_take_over_moves_a_directory_planted_at_the_record_and_its_pages_survive_a_restart(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """The take-over's replacement of a record it cannot read (review 225) met the same EISDIR: the
    directory stayed, and every later start served none of the new writer's pages."""
    size = layout.page_bytes
    outside = tmp_path / "outside"
    outside.mkdir()
    cfg = take_over_config(tmp_path / "disk", backend)
    async with contextlib.AsyncExitStack() as stack:
        writer, follower, looks = await writer_and_follower(stack, cfg, layout, pool, KEYS[:2])
        assert follower.read_only is ReadOnly.LOCKED
        layout_dir = writer.files.layout_dir
        _plant(layout_dir, outside, "deletes-dir")
        before = snapshot(outside)
        await writer.aclose()
        unsafe = _unsafe(follower)
        await took_over(looks)
        assert not any(follower.contains(key) for key in KEYS[:2])  # its deletes were unknown
        assert _unsafe(follower) > unsafe, follower.statistics()  # the directory moved is counted
        aside = [p for p in layout_dir.iterdir() if p.name.startswith(PLANTED_PREFIX)]
        assert len(aside) == 1 and (aside[0] / "inside").read_bytes() == b"x", aside
        assert await follower.write_from(KEYS[2], memoryview(bytes_of(KEYS[2], size)))
        assert await served(follower, KEYS[2], size)
    async with started(cfg, layout, pool) as restarted:
        assert await served(restarted, KEYS[2], size), "a page stored after the take-over was lost at the restart"
        assert not any([await served(restarted, key, size) for key in KEYS[:2]])
    assert snapshot(outside) == before, "something outside the cache directory changed"
    assert_clean(pool)
