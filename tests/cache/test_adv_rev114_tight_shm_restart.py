"""Review 114: SIGKILLed writers restarted in a /dev/shm too small for two pools.

In a private /dev/shm (an 11 MiB tmpfs in a mount namespace of its own: the space is really short)
a live sibling process holds a pool of its own with a known pattern, and three times a writer
process offloads prompts (each token's KV a hash of its whole prefix: tests/cache's prefix oracle)
through a 5 MiB pool with write-behind to disk and is SIGKILLed at a random moment. Each restart
(a 5 MiB pool) fits only once the dead writer's segment is reclaimed: it must start (reclaiming
the dead one first, in its creating thread: the loop keeps ticking), never touch the live
sibling's segment, and serve only bit-exact KV for every prompt.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from private_shm import SCENARIO, needs_namespace, run_in_private_shm

MIB = 1 << 20


@needs_namespace
def test_killed_writers_restart_in_a_tight_shm_and_serve_only_right_kv(tmp_path: Path) -> None:
    report = run_in_private_shm(__file__, 11, str(tmp_path / "disk"), timeout=240)
    assert report["wrong"] == 0, report
    assert report["loaded"] > 0, report  # the restarts served pages from disk
    assert report["sibling_intact"], report
    assert all(r["reclaimed_first"] for r in report["rounds"]), report
    assert report["max_gap"] < 0.5, report  # the loop ran through every restart


# -- the scenario, run in the private namespace -------------------------------------------------------


def _scenario(disk: str) -> dict[str, Any]:
    import asyncio
    import multiprocessing
    import random
    import signal
    import time

    import torch
    from cache_helpers import LAYOUT
    from test_adv_crash_restart import prefix_oracle, prompts_of

    from aiokv import CacheConfig, KVCache
    from aiokv.shm import SHM_DIR, SharedSegment
    from aiokv.storage import DiskConfig

    budget = 5 * MIB // LAYOUT.page_bytes * LAYOUT.page_bytes
    slots = 64 * LAYOUT.page_tokens
    ctx = multiprocessing.get_context("fork")

    def config() -> CacheConfig:
        return CacheConfig(cpu_bytes=budget, namespace="test-model", pool_chunk_bytes=budget // 4,
                           launch_pages=1, launch_turn_s=0,
                           disk=DiskConfig(directory=Path(disk), capacity_bytes=200 * (LAYOUT.page_bytes + 4096),
                                           min_free_bytes=0))

    def sibling(conn: Any) -> None:
        segment = SharedSegment.create(2 * MIB)
        assert segment.prepare_chunk(0, 0, segment.size, False).error is None  # its tmpfs pages taken
        segment.buffer[:] = bytes(range(256)) * (segment.size // 256)
        conn.send(segment.name)
        conn.poll(200)  # until the test is over
        segment.close()

    def writer(seed: int, conn: Any) -> None:
        async def main() -> None:
            kv = torch.zeros(LAYOUT.num_layers, slots, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
            async with KVCache(config(), LAYOUT, kv) as cache:
                conn.send(cache.pool.name)
                for index, tokens in enumerate(prompts_of(seed, 40)):
                    at = torch.arange(len(tokens))
                    kv[:, at] = prefix_oracle(tokens)
                    await cache.offload(tokens, at)
                    conn.send(index)
                await cache.flush()
                conn.send("done")
                await asyncio.sleep(3600)

        asyncio.run(main())

    async def restart(seed: int, dead_pool: str) -> tuple[int, int, float, bool]:
        """The restart over the dead writer's leftovers: (prompts wrong, tokens loaded, the loop's
        longest gap, whether the dead pool was gone once the start returned)."""
        gaps = [0.0]
        ticking = True

        async def ticker() -> None:
            last = time.monotonic()
            while ticking:
                await asyncio.sleep(0.005)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        kv = torch.zeros(LAYOUT.num_layers, slots, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
        bad = got = 0
        async with KVCache(config(), LAYOUT, kv) as cache:
            first = not await asyncio.to_thread(os.path.exists, SHM_DIR + dead_pool)
            for tokens in prompts_of(seed, 40):
                match = await cache.match(tokens)
                kv.zero_()
                result = await cache.load(match, torch.arange(match.tokens))
                if not torch.equal(kv[:, : result.tokens], prefix_oracle(tokens[: result.tokens])):
                    bad += 1
                got += result.tokens
        ticking = False
        await tick
        return bad, got, max(gaps), first

    mine, theirs = ctx.Pipe()
    sib = ctx.Process(target=sibling, args=(theirs,), daemon=True)
    sib.start()
    assert mine.poll(60), "the sibling never started"
    sibling_name = mine.recv()
    rng = random.Random(114)
    rounds: list[dict[str, Any]] = []
    wrong = loaded = 0
    max_gap = 0.0
    for round_ in range(3):
        seed = 60 + round_ % 2
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=writer, args=(seed, child), daemon=True)
        proc.start()
        assert parent.poll(60), "the writer never started"
        dead_pool = parent.recv()
        stop = rng.randrange(3, 30)
        seen = 0
        while seen < stop and parent.poll(30) and parent.recv() != "done":
            seen += 1
        time.sleep(rng.random() * 0.02)  # inside the next offload or its write-behind
        os.kill(proc.pid or 0, signal.SIGKILL)
        proc.join(30)

        bad, got, gap, first = asyncio.run(restart(seed, dead_pool))
        wrong, loaded, max_gap = wrong + bad, loaded + got, max(max_gap, gap)
        rounds.append({"offloads_seen": seen, "wrong": bad, "loaded": got, "reclaimed_first": first})
    intact = os.path.exists(SHM_DIR + sibling_name)
    if intact:
        with open(SHM_DIR + sibling_name, "rb") as f:
            data = f.read()
        intact = data == bytes(range(256)) * (len(data) // 256)
    mine.send("stop")
    sib.join(30)
    return {"wrong": wrong, "loaded": loaded, "max_gap": max_gap, "sibling_intact": intact, "rounds": rounds}


if __name__ == "__main__" and sys.argv[1:2] == [SCENARIO]:
    print(json.dumps(_scenario(sys.argv[2])))
