"""`DiskTier.statistics()` tells in-flight reads from in-flight writes.

It had one ``in_flight`` count: whether a tier was busy reading (a load waiting on the disk) or
writing (offloads behind a slow disk) could not be told apart. Now ``reads_in_flight`` and
``writes_in_flight`` split it (``in_flight`` stays their sum). Page-file reads and writes are held
in the kernel for real, both at once, by an ext4 on a loop device whose FUSE backing file stops
answering (``gate_helpers``). Root only.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, fill, key_of, payload, ready_pool, reserve, small_layout, write_page
from gate_helpers import gated_ext4

from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage import jobs as jobs_module

READS = 2
WRITES = 3
BOUND_S = 30.0


async def _until(condition: object, what: str) -> None:
    """Until ``condition()`` holds, within a bounded number of loop turns (the starts are synchronous)."""
    assert callable(condition)
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    pytest.fail(f"not within 1000 loop turns: {what}")


@pytest.mark.root
@pytest.mark.asyncio
async def test_reads_and_writes_held_in_the_kernel_are_counted_apart(
        tmp_path: Path, backend: DiskBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobs_module, "START_TURN_S", 60.0)  # every start at once: no turn budget here
    layout = small_layout()
    with ready_pool(layout, 16) as pool, gated_ext4(tmp_path, 64) as (mount, gate):
        tier = DiskTier(config(mount / "disk", backend, min_free_bytes=0, direct_io=True), layout, pool)
        await tier.start()
        try:
            want = []
            for i in range(READS):
                ok, data = await write_page(tier, pool, i)  # on disk before the gate closes
                assert ok
                want.append(data)
            stats = tier.statistics()
            assert (stats.in_flight, stats.reads_in_flight, stats.writes_in_flight) == (0, 0, 0)

            gate.hold()
            targets = [reserve(pool, key_of(i)) for i in range(READS)]
            reads = [asyncio.ensure_future(tier.read(key_of(i), h)) for i, h in enumerate(targets)]
            held = [fill(pool, key_of(100 + i), 100 + i) for i in range(WRITES)]
            writes = [asyncio.ensure_future(tier.write(key_of(100 + i), h)) for i, h in enumerate(held)]
            await _until(lambda: tier.statistics().in_flight == READS + WRITES, "every job holding an I/O slot")
            async with asyncio.timeout(BOUND_S):
                await asyncio.to_thread(gate.wait_held)  # the I/O reached the device: stuck in the kernel
            stats = tier.statistics()
            assert (stats.reads_in_flight, stats.writes_in_flight) == (READS, WRITES), stats
            assert stats.in_flight == READS + WRITES
            assert not any(f.done() for f in reads + writes), "an I/O ended while the device held every request"

            await asyncio.to_thread(gate.release)
            async with asyncio.timeout(BOUND_S):
                assert await asyncio.gather(*reads) == [True] * READS
                assert await asyncio.gather(*writes) == [True] * WRITES
            for i, handle in enumerate(targets):
                assert bytes(payload(pool, handle)) == bytes(want[i])
                pool.table.abort(handle)
            for handle in held:
                pool.table.release(handle)
            stats = tier.statistics()
            assert (stats.in_flight, stats.reads_in_flight, stats.writes_in_flight) == (0, 0, 0)
            assert stats.writes == READS + WRITES
        finally:
            await asyncio.to_thread(gate.release)
            await tier.aclose()
        pool.table.evict(pool.num_pages)
        assert_clean(pool)
