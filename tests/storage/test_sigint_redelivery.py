"""A completion delivered twice (at least once: whoever cannot tell whether its ``done`` ran delivers
it again after a KeyboardInterrupt) runs once, even when the job moved on to another hand-off of the
same kind meanwhile.

A recycle whose victim's file is gone is not taken: its ``done`` goes on at once to a new file's
publish (a second write hand-off). A real SIGINT raised as that ``done`` returns makes the backend
deliver it again in the next turn (an EINTR, or the same outcome). Before, the job then waited for
"a write" again (``Job.step`` named the kind of hand-off, not the hand-off), so the stale completion
ran as the publish's: the job ended as a bug (counted ``disk_other``, the caller told False) while
the publish was still in flight with the job's I/O slot and page, and the file it published stayed
on disk unindexed."""

from __future__ import annotations

import asyncio
import os
import types
from pathlib import Path

from disk_helpers import config, fill, key_of
from interrupt_helpers import SignalAfterCall, open_fds, private_loop, run

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, backends
from aiokv.storage.config import ErrorKind
from aiokv.storage.pagefile import file_bytes

STORED = 4


def _nested(code: types.CodeType, name: str) -> types.CodeType:
    return next(c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == name)


async def _write(tier: DiskTier, pool: PagePool, i: int) -> bool:
    held = fill(pool, key_of(i), i)
    try:
        return await tier.write(key_of(i), held)
    finally:
        pool.table.release(held)


async def _settled(tier: DiskTier) -> None:
    while tier._active or tier._jobs:
        if tier._active:
            tier._idle = asyncio.get_running_loop().create_future()
            await tier._idle
        if tier._jobs:
            await asyncio.wait(set(tier._jobs))


def test_a_recycle_not_taken_delivered_twice_runs_once(tmp_path: Path, backend: DiskBackend, layout: KVLayout,
                                                       pool: PagePool) -> None:
    before = open_fds()
    with private_loop() as loop:
        tier = DiskTier(config(tmp_path / "disk", backend, capacity=STORED * file_bytes(layout)), layout, pool)
        run(loop, tier.start())
        for i in range(STORED):
            assert run(loop, _write(tier, pool, i))
        if backend is DiskBackend.THREADS:
            point = SignalAfterCall(backends._recycled.__code__, "done")  # the worker's outcome delivered
        else:
            # Opens through the ring: the victim's ENOENT comes to ``opened``, which calls ``done``.
            io = tier.backend
            assert isinstance(io, backends.UringPageIO)
            io._cached.available = False
            point = SignalAfterCall(_nested(backends.UringPageIO.start_recycle.__code__, "opened"), "done")
        os.unlink(tier.files.path(key_of(0)))  # the next write's victim (least recently used) is gone
        task = loop.create_task(_write(tier, pool, 100))
        with point:
            try:
                loop.run_until_complete(task)
            except KeyboardInterrupt:
                pass
        assert point.fired is not None, "the recycle's done was never called"
        assert run(loop, task), "the write was published, but its caller was told it was not"
        run(loop, _settled(tier))
        assert tier.contains(key_of(100)) and os.path.exists(tier.files.path(key_of(100)))
        errors = tier.statistics().errors
        assert errors.get(ErrorKind.OTHER, 0) == 0, f"a stale completion ran as a bug: {errors}"
        slots = tier._io_slots
        assert slots.in_use == 0 and not slots.waiting
        index = tier._index
        assert index.used == len(index) * index.file_bytes
        on_disk = sum(len(files) for _, _, files in os.walk(tier.files.layout_dir)) - 1  # less the lock
        assert on_disk == len(index), "a published file is not indexed"
        run(loop, tier.aclose())
    assert open_fds() <= before

