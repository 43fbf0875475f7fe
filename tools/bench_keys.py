"""Page keys for a long prompt against the floor: one xxh3-128 over the whole token array.

    python tools/bench_keys.py                 # 128K tokens, 256-token pages
    python tools/bench_keys.py --tokens 131072 --page-tokens 256 --json out.json

Both are timed in this run over the same array (medians of ``--repeat`` runs); the ratio is what
counts (target <= 3x). Key computation is one streaming xxh3 state updated once per page.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import xxhash

from aiokv.keys import namespace_seed, page_keys
from aiokv.layout import KVLayout


def median_us(fn: Callable[[], object], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128 * 1024)
    parser.add_argument("--page-tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()

    layout = KVLayout.mha(32, 8, 128, torch.bfloat16, page_tokens=args.page_tokens)
    seed = namespace_seed(layout, "bench", "tenant")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 128_000, args.tokens, dtype=np.int64)
    as_u64 = ids.astype("<u8")
    as_tensor = torch.from_numpy(ids.copy())
    as_list = ids.tolist()

    floor = median_us(lambda: xxhash.xxh3_128_digest(as_u64), args.repeat)
    rows = {
        "numpy int64": median_us(lambda: page_keys(ids, args.page_tokens, seed), args.repeat),
        "torch int64 (CPU)": median_us(lambda: page_keys(as_tensor, args.page_tokens, seed), args.repeat),
        "list[int]": median_us(lambda: page_keys(as_list, args.page_tokens, seed), max(5, args.repeat // 20)),
    }
    floor_list = median_us(lambda: xxhash.xxh3_128_digest(np.asarray(as_list, dtype="<u8")), max(5, args.repeat // 20))
    pages = args.tokens // args.page_tokens
    print(f"{args.tokens} tokens, {args.page_tokens}-token pages ({pages} keys)")
    print(f"floor: one xxh3-128 over the uint64 array: {floor:.1f} us")
    print(f"{'input':<20} {'keys us':>10} {'vs floor':>9}")
    result: dict[str, object] = {"tokens": args.tokens, "page_tokens": args.page_tokens, "floor_us": floor}
    for name, us in rows.items():
        base = floor_list if name == "list[int]" else floor
        print(f"{name:<20} {us:>10.1f} {us / base:>8.2f}x")
        result[name] = {"us": us, "ratio": us / base}
    print(f"(list[int] is compared with list -> array conversion + one xxh3: {floor_list:.1f} us)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
