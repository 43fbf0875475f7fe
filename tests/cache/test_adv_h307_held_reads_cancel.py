"""Adversarial (helper-307): a prefetch, a compute-or-load stream and a layered stream cancelled
while their page reads are held in the kernel, then every pool page the pool will give taken and
overwritten at once, and the engine's slots reused at once.

``test_adv_rev111_held_groups.py`` does this for a plain ``load``; the prefetch and the streams
take pool pages for their reads through other paths (a promotion with no slots; a stream reading
from the back, its reads racing the engine's claims). The page files live on an ext4 whose block
device stops answering on command (``gate_helpers``), read with O_DIRECT so every read reaches it.
Checked: the cancel returns at once (not when the reads end); no page the pool gave away after the
cancel changes when the held reads end (a read landing in a page freed too early would); no slot
the cancelled stream was given changes after the cancel returned; afterwards the whole prompt
loads exactly and nothing stays referenced or reserved. Root only.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
import torch
from cache_helpers import assert_quiescent
from group_helpers import (
    LAYOUT,
    T,
    group_config,
    pages_unchanged,
    put_on_disk,
    random_kv,
    random_tokens,
    take_free_pages,
)
from loop_probes import until_thread

from aiokv import CacheConfig, DiskBackend, KVCache

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from gate_helpers import GateControl, gated_ext4

PAGES = 12
N = PAGES * T
POOL_PAGES = 2 * PAGES + 8
BACKENDS = [DiskBackend.URING_FIXED, DiskBackend.THREADS]
WAYS = ["prefetch", "stream", "layered"]
BOUND_S = 30.0
FILL = 0x6B


def _config(root: Path, backend: DiskBackend) -> CacheConfig:
    return group_config(root, PAGES, POOL_PAGES, backend, close_timeout=1.0, launch_pages=1, launch_turn_s=0,
                        disk={"direct_io": True, "min_free_bytes": 1 << 20, "queue_depth": 4})


async def _held(gate: GateControl, cache: KVCache) -> None:
    """Until a read waits at the gate and the tier has a page read of the call in flight."""
    await asyncio.to_thread(gate.wait_held)
    disk = cache.disk
    assert disk is not None
    await until_thread(lambda: disk.statistics().reads_in_flight > 0, "a page read in flight")


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
async def test_a_call_cancelled_with_its_reads_held_frees_no_page_and_writes_no_slot_late(
        tmp_path: Path, backend: DiskBackend, way: str) -> None:
    with gated_ext4(tmp_path, 64) as (mount, gate):
        source, tokens = random_kv(71, 3 * N), random_tokens(71, N)
        await put_on_disk(_config(mount / "kv", backend), tokens, source)
        kv = random_kv(72, 3 * N)
        async with KVCache(_config(mount / "kv", backend), LAYOUT, kv) as cache:
            await cache.pool.wait_ready()
            slots = torch.arange(N, 2 * N)
            taken = []
            try:
                match = await cache.match(tokens)
                assert match.disk_pages == PAGES
                gate.hold()
                if way == "prefetch":
                    match.release()
                    task: asyncio.Task[object] = asyncio.create_task(cache.prefetch(tokens))
                else:
                    async def streamed() -> object:
                        async with await cache.start_load(match, slots, layered=way == "layered") as stream:
                            stream.claim(T)  # the engine computes the first page meanwhile
                            return await stream.finish()

                    task = asyncio.create_task(streamed())
                await _held(gate, cache)
                began = time.monotonic()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    async with asyncio.timeout(BOUND_S):
                        await task
                assert time.monotonic() - began < 1.0, f"a cancelled {way} waited for reads held in the kernel"
                # The engine reuses the slots at once, and the pool gives every page it can.
                kv[:, N : 2 * N] = 0
                after_cancel = kv.clone()
                taken = take_free_pages(cache, POOL_PAGES, 0x07, FILL)
                assert len(taken) < POOL_PAGES  # the pages under the held reads stayed reserved
            finally:
                gate.release()
            async with asyncio.timeout(BOUND_S):
                await cache.flush()
                disk = cache.disk
                assert disk is not None
                await until_thread(lambda: disk.statistics().reads_in_flight == 0, "the held reads' end")
            pages_unchanged(cache, taken, FILL)
            assert torch.equal(kv, after_cancel), f"the cancelled {way} wrote into the slots after it returned"
            await assert_quiescent(cache)
            match = await cache.match(tokens)
            assert match.tokens == N
            result = await cache.load(match, torch.arange(2 * N, 3 * N))
            assert result.tokens == N
            assert torch.equal(kv[:, 2 * N : 3 * N], source[:, :N])
            await assert_quiescent(cache)
            assert not any(cache.stats().errors.values()), cache.stats().errors
