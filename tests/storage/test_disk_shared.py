"""Two engine processes on one disk directory (the default directory is per user, so two instances
share it by default): one cache writes and evicts there, the other serves what is there, read-only;
together they never exceed the budget."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
from child_procs import fork_context
from disk_helpers import assert_clean, config, fill, holder_child, key_of, page_files, payload, reserve, seed_payload

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly
from aiokv.storage.pagefile import HEADER_BYTES

FILES = 6  # the budget, in page files


def _disk_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in page_files(directory))



@pytest.mark.asyncio
async def test_second_process_on_a_directory_is_read_only_and_the_budget_holds(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    # Regression: two processes each kept their own budget for the same files and together used
    # 1.8x of it. Now the first takes the directory's lock; the second serves, refuses writes.
    capacity = FILES * (HEADER_BYTES + layout.page_bytes)
    ctx = fork_context()
    ours, theirs = ctx.Pipe()
    holder = ctx.Process(target=holder_child, args=(str(disk_dir), backend.value, FILES, FILES + 2, theirs),
                         daemon=True)
    holder.start()
    theirs.close()
    try:
        kind, their_mode = await asyncio.to_thread(ours.recv)
        assert (kind, their_mode) == ("ready", None)  # the first one writes
        async with DiskTier(config(disk_dir, backend, capacity), layout, pool) as second:
            stats = second.statistics()
            assert (second.read_only, stats.pages) == (ReadOnly.LOCKED, FILES)
            for i in range(20):
                h = fill(pool, key_of(i), i)
                assert not await second.write(key_of(i), h)
                assert not second.write_behind_nowait(key_of(i), h)
                pool.table.release(h)
            assert second.statistics().writes_refused == 40
            for i in range(2, FILES + 2):  # the holder's pages, verified bit for bit
                into = reserve(pool, key_of(100 + i))
                assert await second.read(key_of(i, 7), into)
                assert torch.equal(payload(pool, into), seed_payload(pool, i, 7))
                pool.table.abort(into)
            ours.send(("write", FILES))  # meanwhile the first one goes on writing
            assert await asyncio.to_thread(ours.recv) == "written"
            assert _disk_bytes(disk_dir) <= capacity
            # Its files were recycled for new pages: what is gone is a plain miss here.
            into = reserve(pool, key_of(99))
            assert not await second.read(key_of(2, 7), into)
            pool.table.abort(into)
            assert second.statistics().corrupt == 0
        ours.send("close")
        await asyncio.to_thread(holder.join, 60)
        assert holder.exitcode == 0
        async with DiskTier(config(disk_dir, backend, capacity), layout, pool) as after:  # the lock is free
            assert after.read_only is None
            for i in range(50, 50 + FILES):
                h = fill(pool, key_of(i), i)
                assert await after.write(key_of(i), h)
                pool.table.release(h)
        assert _disk_bytes(disk_dir) <= capacity
    finally:
        if holder.is_alive():
            holder.kill()
            await asyncio.to_thread(holder.join)
        ours.close()
    assert not [p for p in os.listdir("/dev/shm") if p.startswith(f"aiokv-{holder.pid}-")]
    assert_clean(pool)
