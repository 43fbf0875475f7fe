"""Adversarial: two engine processes on one disk directory. The first (the writer: it holds the
directory's lock) offloads without pause through a disk budget of 40 pages, so it evicts and
recycles page files all the time; the second cache starts read-only on the same directory and
loads, streams and prefetches from its start-up snapshot of the index while files under those
names are recycled for other keys. Every byte it serves must be the prefix oracle's.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config
from child_procs import end_child, fork_context
from test_adv_crash_restart import SLOTS, prefix_oracle, prompts_of

from aiokv import KVCache

T = LAYOUT.page_tokens
SEEDS = 60


def _config(directory: Path) -> Any:
    return config(directory, pool_pages=8, disk_pages=40, launch_pages=1, launch_turn_s=0)


def busy_writer(directory: str, conn: Any) -> None:
    """Offload prompt sets seed 0, 1, ... forever, reporting each finished set; from the second
    set on, each starts when the reader says so (a set per reader round: writing beside the
    reader's loads, never hundreds of sets ahead of them)."""

    async def main() -> None:
        kv = torch.zeros(LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
        async with KVCache(_config(Path(directory)), LAYOUT, kv) as cache:
            seed = 0
            while True:
                for tokens in prompts_of(SEEDS + seed % 4, 20):
                    slots = torch.arange(len(tokens))
                    kv[:, slots] = prefix_oracle(tokens)
                    await cache.offload(tokens, slots)
                await cache.flush()
                conn.send(seed)
                seed += 1
                await asyncio.to_thread(conn.recv)  # the reader's next round began

    asyncio.run(main())


@pytest.mark.slow
@pytest.mark.asyncio
async def test_read_only_peer_never_serves_a_recycled_file(tmp_path: Path) -> None:
    ctx = fork_context()
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=busy_writer, args=(str(tmp_path), child), daemon=True)
    proc.start()
    child.close()
    kv = torch.zeros(LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    served = refused = rounds = 0
    try:
        assert await asyncio.to_thread(parent.poll, 60), "the writer never got going"
        assert parent.recv() == 0
        async with KVCache(_config(tmp_path), LAYOUT, kv) as reader:
            assert reader.disk is not None and reader.disk.read_only is not None  # the writer holds the lock
            deadline = time.monotonic() + 8
            while time.monotonic() < deadline:
                # The writer writes (and recycles) a set while this round loads: unpaced, it ran
                # so far ahead on a loaded host that every file of the reader's start-up snapshot
                # was recycled before its first read, and nothing was served at all (0, 405).
                parent.send("go")
                for i, tokens in enumerate(prompts_of(SEEDS + rounds % 4, 20)):
                    kv.zero_()
                    way = (i + rounds) % 3
                    if way == 2:
                        await asyncio.wait_for(reader.prefetch(tokens), 20)
                    match = await asyncio.wait_for(reader.match(tokens), 20)
                    if way == 1:
                        stream = await reader.start_load(match, torch.arange(match.tokens))
                        result = await asyncio.wait_for(stream.finish(), 20)
                        low, high = result.loaded_from, result.tokens
                    else:
                        loaded = await asyncio.wait_for(reader.load(match, torch.arange(match.tokens)), 20)
                        low, high = 0, loaded.tokens
                        refused += int(loaded.shortened)
                    assert torch.equal(kv[:, low:high], prefix_oracle(tokens)[:, low:high]), (
                        f"round {rounds}, prompt {i}: a read-only peer served wrong KV")
                    served += high - low
                rounds += 1
                while parent.poll():  # the sets the writer finished
                    parent.recv()
            await assert_quiescent(reader)
            assert reader.disk.statistics().pages > 0
        assert proc.is_alive(), "the writer died"
    finally:
        end_child(proc)
        parent.close()
    assert served > 0 and rounds > 1, (served, rounds)
