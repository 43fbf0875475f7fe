"""Adversarial (helper-307): rank processes SIGKILLed in the middle of loads (plain, streamed and
layer by layer) while the disk tier's file system is frozen (``fsfreeze``: the write-behind's writes
stuck in the kernel), then the manager closed with its writes still stuck and a rank dead, and a new
`TPCache` with new rank processes started on the same socket and disk directories.

The soak of ``test_tp_adversarial_soak.py`` kills ranks over a healthy directory, and the frozen
file system of ``tests/cache/test_adv_rev263_fs_phases.py`` holds a single-process cache; here both
at once. Oracle (adv_helpers): each token's KV on each rank is a hash of its salt and whole prefix,
so a page committed from a dead rank's half copy, served under the other salt or written torn when
the frozen writes went on shows on the rank that gets it. Checked: no wrong byte during the traffic,
nor in what the restarted manager serves from disk; the close with writes stuck and a rank dead
ends within its bound; no call hangs. Root only (a loop-mounted ext4); a watchdog thaws if the test
hangs. ``AIOKV_H307_TP_SEED`` picks the traffic and kills (seeds 1-4 and 307 held).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from adv_helpers import START_S, AdvRanks, Soak
from loop_probes import until_thread
from tp_helpers import CONFIG

from aiokv import CacheConfig, KVLayout
from aiokv.storage import DiskConfig
from aiokv.tp import TPCache

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from fs_helpers import freeze, loop_ext4, thaw

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
NUM_SLOTS = 640
CLIENTS = 8
KILLS = 2
SEED = int(os.environ.get("AIOKV_H307_TP_SEED", "307"))
CLOSE_S = 4.0
"""The manager's close_timeout: the close with writes stuck in the kernel gives up on them after it."""
THAW_S = 240.0
"""The watchdog's thaw: a test stuck with the file system frozen would hang the machine's other users."""
RANK_CONFIG = dataclasses.replace(CONFIG, inline_copy_bytes=0)

pytestmark = pytest.mark.skipif(shutil.which("fsfreeze") is None, reason="fsfreeze is not installed")


def _config(disk: Path) -> CacheConfig:
    # A pool of 40 pages against ~100 distinct pages: eviction to disk and promotions from it.
    return CacheConfig(cpu_bytes=40 * LAYOUT.page_bytes, namespace="tp-h307", pool_chunk_bytes=8 * LAYOUT.page_bytes,
                       launch_pages=1, launch_turn_s=0, offload_wait=0.5, close_timeout=CLOSE_S,
                       disk=DiskConfig(directory=disk, capacity_bytes=400 * (LAYOUT.page_bytes + 4096),
                                      min_free_bytes=0))


def _cache(tmp_path: Path, disk: Path) -> TPCache:
    return TPCache(_config(disk), LAYOUT, tp_size=2, num_slots=NUM_SLOTS,
                   tp_config=dataclasses.replace(CONFIG, max_jobs=6), directory=tmp_path / "sock")


async def _attached(cache: TPCache, ranks_left: list[AdvRanks]) -> AdvRanks:
    # Copies of up to 20 ms on the ranks' copy threads: kills land while copies run.
    ranks = AdvRanks(cache.address, LAYOUT, 2, NUM_SLOTS, RANK_CONFIG, slow_s=0.02)
    ranks_left.append(ranks)
    ranks.start_all()
    async with asyncio.timeout(START_S):
        await cache.wait_ranks()
    return ranks


async def _freeze_while_killing(run: Soak, mount: Path) -> None:
    """Freeze once some offloads went to the write-behind, thaw once the killer made its kills."""
    await until_thread(lambda: run.tally.offloads >= 6 or run.stop.is_set(), "six offloads", START_S)
    await asyncio.to_thread(freeze, mount)
    try:
        await until_thread(lambda: run.tally.kills >= KILLS or run.stop.is_set(), "the kills", START_S)
    finally:
        await asyncio.to_thread(thaw, mount)


@pytest.mark.slow(seconds=60)
@pytest.mark.asyncio
async def test_rank_kills_while_the_disk_is_frozen_never_serve_a_wrong_byte(tmp_path: Path,
                                                                           ranks_left: list[AdvRanks]) -> None:
    with loop_ext4(tmp_path, 48, reserved_percent=0) as mount:
        watchdog = threading.Timer(THAW_S, thaw, [mount])
        watchdog.start()
        try:
            disk = mount / "disk"
            cache = _cache(tmp_path, disk)
            async with cache:
                ranks = await _attached(cache, ranks_left)
                run = Soak(cache, ranks, SEED)
                freezer = asyncio.create_task(_freeze_while_killing(run, mount))
                try:
                    await run.run(CLIENTS, KILLS)
                finally:
                    run.stop.set()
                    await freezer
                await run.verify_docs()
                assert not run.tally.wrong, "\n".join(run.tally.wrong[:20])
                assert run.tally.kills >= KILLS and run.tally.stored > 10, run.tally
                async with asyncio.timeout(60):
                    await cache.flush()
                flushed = cache.stats().disk
                assert flushed is not None and flushed.pages > 20, flushed
                # Frozen again with every document's pages offloaded anew under the other salt's
                # traffic (write-behind stuck), rank 0 killed, then the close: it ends in its bound.
                await asyncio.to_thread(freeze, mount)
                again = Soak(cache, ranks, SEED + 1)
                await again.run(4, 1)
                assert not again.tally.wrong, "\n".join(again.tally.wrong[:20])
                stuck = cache.stats().disk
                assert stuck is not None and stuck.writes_in_flight > 0, stuck  # held by the freeze
                ranks.kill(0)
                started = time.monotonic()
                async with asyncio.timeout(CLOSE_S * 4 + 30):
                    await cache.aclose()
                closed_in = time.monotonic() - started
                assert cache.stats().errors["close_timeout"] == 1, cache.stats().errors
            thaw(mount)
            await ranks.kill_all()
            # A new manager and new ranks on the same directories: what is on disk is the oracle's.
            restarted = _cache(tmp_path, disk)
            async with restarted:
                ranks = await _attached(restarted, ranks_left)
                # Both traffics' documents: the second's writes were those stuck at the close.
                for seed in (SEED, SEED + 1):
                    served = Soak(restarted, ranks, seed)
                    await served.verify_docs()
                    assert not served.tally.wrong, "\n".join(served.tally.wrong[:20])
                    assert served.tally.loaded_tokens > 0, served.tally  # the disk tier served them
                await ranks.stop_all()
            assert closed_in < CLOSE_S * 4 + 30
        finally:
            thaw(mount)
            watchdog.cancel()
