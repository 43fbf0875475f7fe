"""Review 141: the reference ``test_tp_stream_cancelled_layer`` once found after ``finish()`` was the
disk tier's write-behind, not the stream's.

On a loaded host (16 test processes on 16 cores) that test saw ``referenced=1`` right after
``stream.finish()``. Every other holder was ruled out by forcing interleavings (random yields and
delays at the library's sleeps and the FakeRanks' reports: never a reference with no disk tier):
the offload commits its pages with ``keep=True`` for the write-behind, which gives the reference
back only once the page's disk write ended, and a write still in flight at ``finish()`` is that
page. Locally the test always passed because its pages sat in the shared default disk directory
from an earlier run, so nothing was written behind.

Here the disk's writes are held: after ``finish()`` both pages are referenced by the held writes
and nothing else; once the writes end (``flush()``) no reference is left.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from stream_ranks import stream_ranks
from test_group import FAST, LAYOUT, T

from aiokv import CacheConfig
from aiokv.keys import PageKey
from aiokv.pagetable import PageHandle
from aiokv.tp import Direction, TPCache


@pytest.mark.asyncio
async def test_the_write_behind_holds_the_pages_after_finish_until_its_writes_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = CacheConfig(cpu_bytes=16 * LAYOUT.for_tp(2).page_bytes, namespace="rev141-ref",
                         disk_dir=tmp_path / "disk")
    async with TPCache(config, LAYOUT, tp_size=2, num_slots=64, tp_config=FAST, directory=tmp_path / "s") as cache:
        disk = cache.disk
        assert disk is not None
        # The disk's writes wait here: the interleaving of the loaded host, where they had not
        # ended by the time the stream finished, made certain.
        real_write = disk._write_owned
        writes_go = asyncio.Event()
        held: list[PageKey] = []

        async def held_write(key: PageKey, ref: PageHandle) -> bool:
            held.append(key)
            await writes_go.wait()
            return await real_write(key, ref)

        monkeypatch.setattr(disk, "_write_owned", held_write)
        served = await stream_ranks(cache.group, monkeypatch)
        jobs, ranks, loads = served.jobs, served.ranks, served.loads
        try:
            await cache.wait_ranks()
            tokens = list(range(2 * T))
            assert (await cache.offload(tokens, torch.arange(2 * T))).stored == 2
            table = cache.manager.pool.table
            assert table.statistics().referenced == 2  # queued for disk: the write-behind's references

            stream = cache.start_load(await cache.match(tokens), torch.arange(16, 16 + 2 * T), layered=True)
            await stream.launched()
            (job,) = [j for j in jobs if j.spec.direction is Direction.LOAD]
            for q in loads:
                assert (await asyncio.wait_for(q.get(), 10)).job_id == job.id
            with pytest.raises(TimeoutError):  # the consumer's bounded wait cancels the shared future
                await asyncio.wait_for(job.layer_futures[0], 0.01)
            for r in ranks:
                r.report(job.id)
            assert (await asyncio.wait_for(job, 10)).ok
            assert await stream.wait_layer(0) is False
            result = await stream.finish()
            assert result.tokens == 2 * T and result.loaded_from == 0

            # What the failed assertion saw (there one write had ended): the stream gave its
            # references back, the writes still hold theirs.
            assert sorted(held) == sorted(cache.keys(tokens))
            stats = table.statistics()
            assert (stats.ready, stats.referenced, stats.reserved) == (2, 2, 0), stats

            writes_go.set()
            await asyncio.wait_for(cache.flush(), 10)
            assert table.statistics().referenced == 0  # the writes ended: every reference given back
            assert disk.statistics().pages == 2
            table.check_invariants()
        finally:
            writes_go.set()
            await served.close()
