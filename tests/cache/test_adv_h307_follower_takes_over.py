"""Adversarial (helper-307): a cache that follows a disk directory another process writes loads
from it all the time, the writer is SIGKILLed in the middle of its write-behind, pool evictions
and promotions, and the follower takes the directory over and writes and evicts in it itself.

``test_adv_shared_dir.py`` checks a read-only peer beside a live writer, ``test_adv_crash_restart.py``
a restart after the writer's kill, ``tests/storage/test_adv_rev152_follow.py`` the take-over at the
tier's level; here the whole cache, through the public calls, across the kill. Oracle: each token's
KV is a function of its whole prefix (``prefix_oracle``), so a page torn by the kill, one served
under a name the writer recycled, or one the new writer indexed wrongly shows. Checked: every
token any load reports loaded is the oracle's, before, across and after the take-over; the follower
takes over within a bound and its own offloads (through its own evictions) load back exactly; a
cache restarted on the directory serves only the oracle's KV.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config
from child_procs import end_child, fork_context
from loop_probes import until_thread
from test_adv_crash_restart import SLOTS, prefix_oracle, prompts_of, writer_child

from aiokv import DiskBackend, KVCache
from aiokv.storage import ReadOnly

T = LAYOUT.page_tokens
SEED = int(os.environ.get("AIOKV_H307_SEED", "307"))
TAKE_OVER_S = 30.0
BOUND_S = 30.0


def _config(directory: Path, backend: DiskBackend) -> Any:
    # The writer's own config (test_adv_crash_restart._config), looking every 50 ms while following.
    cfg = config(directory, pool_pages=8, disk_pages=40, backend=backend, launch_pages=1, launch_turn_s=0)
    assert cfg.disk is not None
    return dataclasses.replace(cfg, disk=dataclasses.replace(cfg.disk, follow_interval_s=0.05))


async def _load_checked(cache: KVCache, kv: torch.Tensor, tokens: list[int]) -> int:
    """Load the cached prefix of ``tokens`` into fresh slots; the tokens reported loaded must be
    the oracle's (an AssertionError names the prompt otherwise); returns how many."""
    match = await cache.match(tokens)
    slots = torch.arange(SLOTS - match.tokens, SLOTS)
    kv[:, slots] = 0
    async with asyncio.timeout(BOUND_S):
        result = await cache.load(match, slots)
    want = prefix_oracle(tokens[: result.tokens])
    assert torch.equal(kv[:, slots[: result.tokens]], want), f"wrong KV for prompt {tokens[:3]}.. ({result})"
    return result.tokens


@pytest.mark.slow(seconds=15)
@pytest.mark.asyncio
@pytest.mark.parametrize("backend", [DiskBackend.URING_FIXED, DiskBackend.THREADS], ids=lambda b: b.value)
async def test_a_follower_loading_across_the_writers_kill_takes_over_and_serves_only_the_oracle(
        tmp_path: Path, backend: DiskBackend) -> None:
    rng = random.Random(SEED)
    prompts = prompts_of(SEED, 200)
    ctx = fork_context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=writer_child, args=(str(tmp_path), backend.value, SEED, child), daemon=True)
    proc.start()
    child.close()
    try:
        assert await asyncio.to_thread(parent.poll, 60), "the writer never started"
        assert parent.recv() == "starting"
        assert await asyncio.to_thread(parent.poll, 60), "the writer never got ready"
        assert parent.recv() == "ready"
        kv = torch.zeros(LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
        async with KVCache(_config(tmp_path, backend), LAYOUT, kv) as cache:
            disk = cache.disk
            assert disk is not None and disk.statistics().read_only is ReadOnly.LOCKED
            seen = 0
            stop = rng.randrange(15, 40)
            loaded = 0
            while seen < stop:  # loads of what the writer offloaded so far, while it goes on
                if await asyncio.to_thread(parent.poll, 10):
                    message = parent.recv()
                    assert not isinstance(message, tuple), f"the writer loaded wrong KV: {message}"
                    if message == "done":
                        break
                    seen += 1
                loaded += await _load_checked(cache, kv, prompts[rng.randrange(seen + 1)])
            # SIGKILLed in the middle of its next offload while a load of this cache runs.
            loading = asyncio.ensure_future(_load_checked(cache, kv, prompts[rng.randrange(seen + 1)]))
            end_child(proc, 30)
            loaded += await loading
            await until_thread(lambda: disk.statistics().took_over == 1, "the take-over", TAKE_OVER_S)
            assert disk.statistics().read_only is None
            for tokens in prompts[:seen]:  # what the dead writer left: right KV or a miss
                loaded += await _load_checked(cache, kv, tokens)
            assert loaded > 0, "the follower served nothing from the writer's directory"
            # Now the writer: its own prompts through its 8-page pool, evicting on disk.
            mine = prompts_of(SEED + 1, 40)
            for tokens in mine:
                slots = torch.arange(len(tokens))
                kv[:, slots] = prefix_oracle(tokens)
                await cache.offload(tokens, slots)
            await cache.flush()
            stats = disk.statistics()
            assert stats.writes > 0 and stats.pages <= 40, stats
            assert sum([await _load_checked(cache, kv, tokens) for tokens in mine[-5:]]) > 0
            await assert_quiescent(cache)
        # A restart on the directory: everything it serves, of either writer, is the oracle's.
        async with KVCache(_config(tmp_path, backend), LAYOUT, kv) as cache:
            again = 0
            for tokens in prompts[: seen + 1] + prompts_of(SEED + 1, 40):
                again += await _load_checked(cache, kv, tokens)
            assert again > 0
            await assert_quiescent(cache)
    finally:
        end_child(proc, 30)
        parent.close()
