"""Review 295: once ``await stream.finish()`` (or ``aclose()``) of a TP stream returned, layered or
not, the stream holds no pool reference: ``stats().pool_referenced`` read right after it, with no
loop turn between, counts other holders only.

The review saw pages still referenced right after ``finish()`` that were unreferenced a loop turn
or two later. Those were the write-behind's (an offload keeps a page referenced until its disk
write ended, as review 141 found for ``test_tp_stream_cancelled_layer``), not the stream's: with no
disk tier, or the write-behind drained by ``flush()`` before the stream, none is left, in every
order of the ranks' reports and the engine's waits tried (``launched``, every ``wait_layer``,
straight to ``finish``). This pins it, with the write-behind's case beside it (its references end
with ``flush()``). Passed before any change: the stream gives every reference back before
``finish`` returns (each copy's as it ends, the rest in the settling), nothing is left to a later
callback.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from tp_helpers import CONFIG, full_kv, rank_kv, threads_off_loop

from aiokv import CacheConfig, KVLayout
from aiokv.tp import RankWorkerThread, TPCache

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
PAGES = 4
N = PAGES * T
SLOTS = 96
TP = 2
_namespaces = itertools.count()


def _config(disk: Path | None) -> CacheConfig:
    return CacheConfig(cpu_bytes=32 * LAYOUT.page_bytes, disk_dir=disk, namespace=f"tp-rev295f-{next(_namespaces)}",
                       pool_chunk_bytes=8 * LAYOUT.page_bytes)


@pytest.mark.asyncio
@pytest.mark.parametrize("layered", [True, False])
@pytest.mark.parametrize("waits", ["none", "launched", "layers"])
@pytest.mark.parametrize("end", ["finish", "aclose"])
@pytest.mark.parametrize("tier", ["none", "flushed", "writing"])
async def test_finish_returns_with_the_stream_s_references_given_back(
        tmp_path: Path, layered: bool, waits: str, end: str, tier: str) -> None:
    kv = [rank_kv(full_kv(LAYOUT, 2959, SLOTS), LAYOUT, rank, TP) for rank in range(TP)]
    tokens = list(range(N))
    disk = None if tier == "none" else tmp_path / "disk"
    async with TPCache(_config(disk), LAYOUT, tp_size=TP, num_slots=SLOTS, tp_config=CONFIG) as cache:
        workers = [RankWorkerThread(cache.address, rank, TP, LAYOUT, kv[rank], CONFIG) for rank in range(TP)]
        async with threads_off_loop(*workers):
            await cache.wait_ranks()
            assert (await cache.offload(tokens, torch.arange(N))).stored == PAGES
            if tier == "flushed":
                await cache.flush()
            stream = cache.start_load(await cache.match(tokens), torch.arange(2 * N, 3 * N), layered=layered)
            if waits != "none":
                assert await stream.launched() == 0
            if waits == "layers" and layered:
                for layer in range(LAYOUT.num_layers):
                    assert await stream.wait_layer(layer)
            if end == "finish":
                assert (await stream.finish()).loaded_tokens == N
            else:
                await stream.aclose()
            stats = cache.stats()  # no loop turn since the stream ended
            if tier == "writing":
                # Only the write-behind may still hold pages (those whose disk write has not ended).
                assert stats.pool_referenced <= PAGES
                await cache.flush()
                stats = cache.stats()
            assert (stats.pool_referenced, stats.pool_reserved) == (0, 0), stats
