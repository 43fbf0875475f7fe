"""Stress a TP load for wrong KV: ``tests/tp/test_tp_gpu.py``'s mha-tp4 flow, loads repeated.

Four writer rank processes offload 8 pages; four reader rank processes (zeroed buffers) then load
them again and again into random target slots, and every rank's buffer is compared with what the
pages hold after each load reported OK. Prints each rank-load that is not bit-exact (which slots,
which layers, whether they are still zero) and a count at the end.

Run several at once beside GPU load to reproduce the one failure seen on an H100 host (rank 1 not
bit-exact after an OK report, 16 pytest workers sharing the GPU):
``python tools/stress_tp_load.py --seconds 60 --seed N`` (``--device cpu`` checks the script);
``--fresh`` starts new readers for every load, so each is a first load beside the readers' warm-up.
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
from tp_helpers import CONFIG, RankProcesses, expected_page, full_kv, key, new_pool, rank_kv, reserve  # noqa: E402

from aiokv.layout import KVLayout  # noqa: E402
from aiokv.tp import Direction, RankGroup, TPConfig  # noqa: E402


async def stress(seconds: float, seed: int, device: str, fresh: bool = False) -> int:
    """Loads for ``seconds``; returns the number of rank-loads that were not bit-exact. ``fresh``: new
    reader processes for every load, each load straight after they attached."""
    layout, tp = KVLayout.mha(4, 8, 128, torch.float16, page_tokens=16), 4
    tokens, num_slots, num_pages = layout.page_tokens, 256, 12
    config = TPConfig(reconnect_initial_s=CONFIG.reconnect_initial_s, register_chunk_bytes=2 * layout.page_bytes,
                      handshake_timeout_s=60.0)
    full = full_kv(layout, seed=9, slots=num_slots)
    generator = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(2))[: 8 * tokens]
    pool = await new_pool(layout.for_tp(tp), num_pages)
    bad = rounds = fresh_rounds = 0
    first = False
    try:
        with tempfile.TemporaryDirectory() as scratch:
            async with RankGroup(layout, tp, pool.name, pool.num_pages, config, Path(scratch) / "m") as group:
                writers = RankProcesses(group.address, layout, tp, 9, True, num_slots, device, config)
                writers.start_all()
                await group.wait_attached()
                handles = reserve(pool, [key(i) for i in range(8)])
                pages = [h.page for h in handles]
                for i in range(0, 8, 2):
                    spec = group.spec(Direction.OFFLOAD, pages[i : i + 2], slots[i * tokens : (i + 2) * tokens])
                    offloaded = await group.submit_nowait(spec)
                    assert offloaded.ok, offloaded
                for handle in handles:
                    pool.table.commit(handle)
                for i, page in enumerate(pages):
                    want_page = expected_page(full, slots[i * tokens : (i + 1) * tokens].tolist(), pool.layout)
                    assert torch.equal(pool.pages[page], want_page), f"page {i} offloaded wrong"
                await writers.stop_all()
                wants = [rank_kv(full, layout, rank, tp)[:, slots[1:]] for rank in range(tp)]
                end = time.monotonic() + seconds
                readers = None
                while time.monotonic() < end:
                    if readers is None:
                        readers = RankProcesses(group.address, layout, tp, 9, False, num_slots, device, config)
                        readers.start_all()
                        await group.wait_attached()
                        first = True  # straight after attach: the readers' warm-up may still run
                    if first:  # the test's own target: every page, the first token skipped
                        target = torch.arange(num_slots - 1, num_slots - 8 * tokens, -1)
                    else:
                        target = torch.randperm(num_slots, generator=generator)[: 8 * tokens - 1]
                    refs = [pool.table.acquire(key(i)) for i in range(8)]
                    outcome = await group.submit_nowait(group.spec(Direction.LOAD, pages, target, skip_first=1))
                    for ref in refs:
                        assert ref is not None
                        pool.table.release(ref)
                    assert outcome.ok, outcome
                    rounds += 1
                    for rank in range(tp):
                        got = (await readers.dump(rank))[:, target]
                        if torch.equal(got, wants[rank]):
                            continue
                        bad += 1
                        wrong = (got != wants[rank]).flatten(2).any(-1)  # [layers, target slots]
                        where = wrong.any(0).nonzero().flatten().tolist()
                        zero = bool((got[wrong] == 0).all())
                        print(f"seed {seed} load {rounds} (fresh readers: {first}) rank {rank}: {len(where)} of "
                              f"{len(target)} slots wrong, layers {wrong.any(1).nonzero().flatten().tolist()}, "
                              f"first {where[:12]}, pages {sorted({(p + 1) // tokens for p in where})}, "
                              f"all still zero: {zero}; stats {await readers.ask(rank, 'stats')}", flush=True)
                    first = False
                    if fresh:  # new readers for every load: each load is a first one
                        await readers.stop_all()
                        readers = None
                        fresh_rounds += 1
                if readers is not None:
                    await readers.stop_all()
    finally:
        await pool.aclose()
    print(f"seed {seed}: {rounds} loads ({fresh_rounds} by fresh readers), {bad} rank-loads not bit-exact", flush=True)
    return bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--fresh", action="store_true", help="new reader processes for every load")
    args = parser.parse_args()
    sys.exit(1 if asyncio.run(stress(args.seconds, args.seed, args.device, args.fresh)) else 0)


if __name__ == "__main__":
    main()
