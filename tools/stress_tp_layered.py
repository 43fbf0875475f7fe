"""Stress a TP layered load for wrong KV: ``tests/tp/test_tp_gpu.py``'s layered mha-tp2 flow, repeated.

A ``TPCache`` and two rank processes (rank 0 a ``RankWorkerThread``, rank 1 an asyncio
``RankWorker``, as in the test); each round offloads 8 new pages from slots 0..127 and streams them
back layer by layer into a random permutation of slots 128..255 (the first token skipped). Each rank
snapshots layer ``l`` right after ``wait_layer(load, l)`` (its engine's stream ordered after the
layer's event), and its whole buffer is dumped once the stream finished. Every layer of every rank
is compared with the KV the tokens were offloaded from; a wrong row is traced to the (layer, slot)
of the rank's original buffer that holds its bytes (a late read shows the slot's old bytes, a
misplaced write another layer's or token's). After every load each rank also reads its mover's
per-layer address tables back and compares them with freshly built ones (``tp_helpers.wrong_tables``:
a table overwritten after it was built would misplace rows exactly so).

Why: the one failure of the GPU suite in the forty-first session (H100, 16 pytest workers sharing
the GPU): rank 1's layer 1 held layer 2's rows of the same tokens after an OK wait, on the ranks'
first load. ``--fresh`` starts a new cache and ranks for every round, so each load is a first one
beside the ranks' warm-up. ``python tools/stress_tp_layered.py --seconds 120 --seed N [--fresh]``,
several at once beside GPU load; ``--device cpu`` checks the script.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "tp"), str(ROOT / "tests")]

import torch  # noqa: E402
from tp_helpers import CONFIG, RankProcesses, full_kv, origins, rank_kv  # noqa: E402

from aiokv import CacheConfig  # noqa: E402
from aiokv.layout import KVLayout  # noqa: E402
from aiokv.tp import TPCache, TPConfig  # noqa: E402

LAYOUT = KVLayout.mha(4, 8, 128, torch.bfloat16, page_tokens=16)
TP, SLOTS, PAGES, SEED = 2, 256, 12, 9


async def one_round(cache: TPCache, ranks: RankProcesses, rnd: int, seed: int, fresh: bool) -> int:
    """One offload and layered load; returns the number of (rank, layer) checks that failed."""
    tokens_per_page = LAYOUT.page_tokens
    n = 8 * tokens_per_page
    tokens = [(seed * 1_000_003 + rnd) * n + t for t in range(n)]
    offloaded = await cache.offload(tokens, torch.arange(n))
    assert offloaded.stored == 8, offloaded
    target = torch.randperm(SLOTS - n, generator=torch.Generator().manual_seed(seed * 7919 + rnd))[: n - 1] + n
    stream = cache.start_load(await cache.match(tokens), target, from_token=1, layered=True)
    await stream.launched()
    load = stream.layered_load()
    for rank in range(TP):
        ranks.send(rank, ("layers", load, target))
    result = await stream.finish()
    assert result.loaded_from == 1, result
    full = full_kv(LAYOUT, seed=SEED, slots=SLOTS)
    bad = 0
    for rank in range(TP):
        original = rank_kv(full, LAYOUT, rank, TP)
        want = original[:, 1:n]
        snapshots = await ranks.reply(rank)
        final = (await ranks.dump(rank))[:, target]
        for layer, (ok, raw) in enumerate(snapshots):
            got = ranks.tensor(raw)
            if ok and torch.equal(got, want[layer]) and torch.equal(final[layer], want[layer]):
                continue
            bad += 1
            rows = (got != want[layer]).flatten(1).any(1).nonzero().flatten()
            later = (final[layer] != want[layer]).flatten(1).any(1).nonzero().flatten()
            picked = torch.cat([rows[:4], rows[-2:]]) if len(rows) > 6 else rows
            traced = [(int(r) + 1, int(target[r]), *o) for r, o in zip(picked, origins(original, got[picked]),
                                                                         strict=True)]
            print(f"seed {seed} round {rnd} (fresh: {fresh}) rank {rank} layer {layer}: wait ok={ok}; "
                  f"snapshot {len(rows)} of {n - 1} rows wrong, after finish {len(later)} wrong; "
                  f"(token, slot, held layer, held slot) {traced}; stats {await ranks.ask(rank, 'stats')}",
                  flush=True)
        tables = await ranks.ask(rank, "tables")
        if tables:
            bad += 1
            print(f"seed {seed} round {rnd} rank {rank}: copy plans' address tables changed: {tables}", flush=True)
    return bad


async def stress(seconds: float, seed: int, device: str, fresh: bool) -> int:
    config = TPConfig(reconnect_initial_s=CONFIG.reconnect_initial_s, handshake_timeout_s=60.0)
    end = time.monotonic() + seconds
    bad = rounds = 0
    with tempfile.TemporaryDirectory() as scratch:
        while time.monotonic() < end:
            cache_config = CacheConfig(cpu_bytes=PAGES * LAYOUT.page_bytes, disk=None, namespace=f"stress-{seed}")
            directory = Path(scratch) / f"m{rounds}"
            async with TPCache(cache_config, LAYOUT, tp_size=TP, num_slots=SLOTS, tp_config=config,
                               directory=directory) as cache:
                ranks = RankProcesses(Path(cache.address), LAYOUT, TP, SEED, True, SLOTS, device, config)
                ranks.start_all()
                try:
                    async with asyncio.timeout(180):
                        await cache.wait_ranks()
                    while time.monotonic() < end:
                        bad += await one_round(cache, ranks, rounds, seed, fresh)
                        rounds += 1
                        if fresh:
                            break
                    await ranks.stop_all()
                finally:
                    await ranks.kill_all()
    print(f"seed {seed}: {rounds} layered loads ({'fresh ranks each' if fresh else 'the same ranks'}), "
          f"{bad} (rank, layer) checks failed", flush=True)
    return bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--fresh", action="store_true", help="a new cache and ranks for every load")
    args = parser.parse_args()
    sys.exit(1 if asyncio.run(stress(args.seconds, args.seed, args.device, args.fresh)) else 0)


if __name__ == "__main__":
    main()
