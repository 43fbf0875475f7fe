"""EACCES while following, for real: the follower runs in a process without ``CAP_DAC_OVERRIDE``
(permission bits bind it as any user), over a directory whose fan-out and layout directories the
test makes 0000 while the writer (this process, root with its capabilities) goes on storing
pages there. The follower's looks meet EACCES examining new files, opening the lock file and
checking the fan-out names: counted, nothing new indexed from there, no crash; once the modes are
back, the next look indexes the pages and they read back bit for bit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, fill, key_of
from follow_helpers import child, follow_config, receive, started, unprivileged_follower_child

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly

TAG = 3  # fan-out directory 03


async def _write(tier: DiskTier, pool: PagePool, *numbers: int) -> None:
    for i in numbers:
        h = fill(pool, key_of(i, TAG), i)
        assert await tier.write(key_of(i, TAG), h)
        pool.table.release(h)
        pool.table.evict(pool.num_pages)


@pytest.mark.root
@pytest.mark.asyncio
async def test_eacces_during_looks_indexes_nothing_new_until_the_modes_are_back(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: directories of another mode than the follower may pass")
    async with started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as writer:
        await _write(writer, pool, 0, 1, 2)
        layout_dir = writer.files.layout_dir
        fan = layout_dir / f"{TAG:02x}"
        with child(unprivileged_follower_child, str(disk_dir), backend.value) as (conn, _proc):
            assert await receive(conn) == ("ready", 3, ReadOnly.LOCKED)
            try:
                os.chmod(fan, 0)
                await _write(writer, pool, 3, 4)  # root: permission bits do not bind the writer
                conn.send(("look", [(3, TAG), (4, TAG), (0, TAG)]))
                pages, errors, contains = await receive(conn)
                assert (pages, contains) == (3, [False, False, True])
                assert errors["eperm"] >= 1 and errors["other"] == 0, errors  # EACCES counts as EPERM
                os.chmod(layout_dir, 0)  # the lock file and the fan-out names cannot be reached either
                await _write(writer, pool, 5)
                conn.send(("look", [(5, TAG)]))
                pages, later, contains = await receive(conn)
                # .deletes cannot be read either (EACCES): its deletes unknown, the follower serves
                # none of its pages until it reads again (review 231).
                assert (pages, contains) == (0, [False])
                assert later["eperm"] > errors["eperm"] and later["other"] == 0, later
            finally:
                os.chmod(layout_dir, 0o700)
                os.chmod(fan, 0o700)
            conn.send(("look", [(i, TAG) for i in range(6)]))
            pages, _errors, contains = await receive(conn)
            assert (pages, contains) == (6, [True] * 6)
            conn.send(("read", [(i, TAG, i) for i in range(6)]))
            assert await receive(conn) == [True] * 6
            conn.send("close")
            assert await receive(conn) == "closed"
    assert_clean(pool)
