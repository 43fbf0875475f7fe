"""A write in flight as its fan-out directory is moved out of the cache and retired.

f084194 retires a fan-out directory moved away under the writing tier at the writer's next check.
A write handed to the backend before that check names its file through the old descriptor: it
completed into the moved directory, outside the cache, and its key was indexed though nothing was
under the name (until its first read missed). Now such a write is not indexed (the caller gets
False, nothing counted) and its file is unlinked from the retired directory. Real renames, every
backend, the new-file, recycled-file and spare-file paths; the backend's completion is held until
the check retired the directory, as a slow device would hold it.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_helpers import assert_clean, key_of
from follow_helpers import follow_config, started
from test_fanout_removed import TAG, _fanout, _read, _write
from test_fanout_restored import OTHER, _names, _no_faults, _settled
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.pagefile import file_bytes


def _hold_completions(io: Any, name: str, held: list[Callable[[], None]], arrived: asyncio.Event) -> None:
    """``io.<name>`` (``start_publish``/``start_recycle``) with its completion held in ``held``."""
    real = getattr(io, name)

    def start(*args: Any) -> None:
        *rest, done = args

        def later(*result: Any) -> None:
            held.append(functools.partial(done, *result))
            arrived.set()

        real(*rest, later)

    setattr(io, name, start)


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["new", "recycled", "spare"])
async def test_a_write_in_flight_as_its_fan_out_directory_is_moved_away_is_not_indexed(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, path: str) -> None:
    """A write whose file the backend published through the descriptor of ``3a`` when ``3a`` was
    moved out of the cache and retired (its completion held until then): not indexed (before: the
    key indexed, no file under the name), its file unlinked from the moved directory (before: left
    there, outside the cache); written again, the key is stored under the name."""
    disk_dir = tmp_path / "disk"
    fb = file_bytes(layout)
    cfg = follow_config(disk_dir, backend, capacity=(2 if path == "recycled" else 64) * fb)
    tier = DiskTier(cfg, layout, pool, spare_files=4 if path == "spare" else 0)
    async with started(tier):
        checks = LockChecks(tier)
        if path == "recycled":
            for i in range(2):
                assert (await _write(tier, pool, i, tag=OTHER))[0]
        if path == "spare":
            assert (await _write(tier, pool, 0, tag=OTHER))[0]  # starts the stock
            if tier._refill is not None:
                await asyncio.wait({tier._refill})
            assert tier.spare_statistics().stock > 0
        held: list[Callable[[], None]] = []
        arrived = asyncio.Event()
        start = "start_publish" if path == "new" else "start_recycle"
        _hold_completions(tier.backend, start, held, arrived)
        write = asyncio.create_task(_write(tier, pool, 0))
        async with asyncio.timeout(30):
            await arrived.wait()
        fan, away = _fanout(tier), tmp_path / "elsewhere"
        assert bytes.hex(key_of(0, TAG)) in _names(fan)  # published through the descriptor
        os.rename(fan, away)
        await checks.next()
        for done in held:
            done()
        ok, _data = await write
        await _settled(tier)
        assert not ok
        assert not tier.contains(key_of(0, TAG)), "indexed, with no file under the name"
        assert bytes.hex(key_of(0, TAG)) not in _names(away), "left in the directory moved out of the cache"
        delattr(tier.backend, start)  # the backend's own again
        ok, data = await _write(tier, pool, 0)
        assert ok
        got = await _read(tier, pool, 0)
        assert got is not None and torch.equal(got, data)
        _no_faults(tier)
    assert_clean(pool)
