"""A consumer that cancels a TP job's layer future must not make the stream's ``wait_layer`` raise
into the engine (the contract: a fault below the caller is a miss, never a crash of the engine's
loop). The future is shared by the job, its copy and the stream, and an ``asyncio.wait_for`` on it
that times out cancels it.

A TP stream's copies carry no CUDA event (each rank orders its own stream), so even with CUDA ranks
``wait_layer`` gathers the layer futures with ``return_exceptions``: the cancelled layer answers
False, the other layers still answer True, ``finish()`` ends normally and no page reference leaks.
The ranks are FakeRanks speaking raw frames and claiming a CUDA device.

The offload queues both pages for the disk tier's write-behind, which holds a reference on each
until its write ends: the test flushes before counting references (review 141: on a loaded host a
write was still in flight at ``finish()``; ``test_adv_rev141_stream_ref_leak.py`` holds the writes).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from stream_ranks import stream_ranks
from test_group import FAST, LAYOUT, T

from aiokv import CacheConfig
from aiokv.tp import Direction, TPCache


@pytest.mark.asyncio
async def test_a_consumer_cancelling_a_layer_future_makes_wait_layer_false_not_raise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A disk tier of its own: under the shared default directory the pages were on disk from an
    # earlier run (no write-behind then), so the write-behind, and the flush below, ran only on a
    # machine's first run.
    config = CacheConfig(cpu_bytes=16 * LAYOUT.for_tp(2).page_bytes, namespace="cancelled-layer",
                         disk_dir=tmp_path / "disk")
    async with TPCache(config, LAYOUT, tp_size=2, num_slots=64, tp_config=FAST, directory=tmp_path / "s") as cache:
        group = cache.group
        served = await stream_ranks(group, monkeypatch)
        jobs, ranks, loads = served.jobs, served.ranks, served.loads
        try:
            await cache.wait_ranks()
            assert group.device_kind == "cuda"
            tokens = list(range(2 * T))
            assert (await cache.offload(tokens, torch.arange(2 * T))).stored == 2

            stream = cache.start_load(await cache.match(tokens), torch.arange(16, 16 + 2 * T), layered=True)
            await stream.launched()
            (job,) = [j for j in jobs if j.spec.direction is Direction.LOAD]
            assert stream.layered_load().jobs == (job.id,)
            specs = [await asyncio.wait_for(q.get(), 10) for q in loads]
            assert {s.job_id for s in specs} == {job.id}

            waiting = asyncio.ensure_future(stream.wait_layer(0))  # the engine, before layer 0
            await asyncio.sleep(0)
            assert not waiting.done()
            with pytest.raises(TimeoutError):  # a consumer's bounded wait on the shared future
                await asyncio.wait_for(job.layer_futures[0], 0.01)
            assert job.layer_futures[0].cancelled()

            assert await asyncio.wait_for(waiting, 10) is False  # raised CancelledError if gathered plainly
            for r in ranks:
                r.report(job.id)  # every rank's whole part landed
            outcome = await asyncio.wait_for(job, 10)
            assert outcome.ok
            for layer in range(1, LAYOUT.num_layers):
                assert await stream.wait_layer(layer) is True
            assert await stream.wait_layer(0) is False  # asked again: still an answer, not an error
            result = await stream.finish()
            assert result.tokens == 2 * T
            # The stream gave its references back in finish(); the write-behind holds one on each
            # page until its disk write ends, which only flush() waits for.
            await cache.flush()
            assert cache.manager.pool.table.statistics().referenced == 0  # every reference given back
        finally:
            await served.close()
