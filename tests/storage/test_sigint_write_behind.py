"""A KeyboardInterrupt (a real SIGINT) in a write-behind worker's write loses no worker: the pages
queued after it are still written, and ``flush`` and ``aclose`` end.

The workers are tasks that await the tier's write of each queued page; a signal raised in that
write's code (the page-job code, or the worker's own) ends the task with the KeyboardInterrupt,
which stops the loop, as asyncio does. Before, the worker was gone for good: once every worker had
met one, pages queued stayed queued, and ``flush`` and the draining ``aclose`` hung."""

from __future__ import annotations

from pathlib import Path

import pytest
from disk_helpers import config, fill, key_of
from interrupt_helpers import PAGE_JOB_FILES, SignalPoints, open_fds, private_loop, run, settled_fds

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, writebehind

POINTS = [
    ("write-queued-entry", ("call", "DiskTier._write_queued", None)),
    ("join-write-entry", ("call", "WritePath._join_write", None)),
    # The worker's release of the queue's reference (in _worker itself before the fix).
    ("worker-release-entry", ("call", "TierEdge._release", "WriteBehind._finish|WriteBehind._worker")),
]


@pytest.mark.parametrize("where", [p[1] for p in POINTS], ids=[p[0] for p in POINTS])
def test_an_interrupt_in_a_write_behind_worker_loses_no_worker(tmp_path: Path, backend: DiskBackend,
                                                              layout: KVLayout, pool: PagePool,
                                                              where: tuple[str, str, str | None]) -> None:
    before = settled_fds(pool)
    with private_loop() as loop:
        tier = DiskTier(config(tmp_path / "disk", backend, write_behind_workers=1), layout, pool)
        run(loop, tier.start())
        for i in range(3):
            assert tier.write_behind_nowait(key_of(i), fill(pool, key_of(i), i))  # the queue owns the reference
        points = SignalPoints(PAGE_JOB_FILES | {writebehind.__file__}, 0, where)
        with points:
            try:
                loop.run_until_complete(tier.flush())
            except KeyboardInterrupt:
                pass
        assert points.fired is not None, "the point was never reached"
        for i in range(3, 6):  # queued after the interrupt: the worker must still be there
            assert tier.write_behind_nowait(key_of(i), fill(pool, key_of(i), i))
        run(loop, tier.flush())  # bounded: a hang fails here
        assert all(tier.contains(key_of(i)) for i in range(3, 6))
        run(loop, tier.aclose())
        stats = pool.table.statistics()
        assert not stats.reserved and not stats.referenced, f"pool references left: {stats}"
    assert open_fds() <= before
