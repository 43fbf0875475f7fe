"""The event loop thread's CPU per GB offloaded and written to disk, against a baseline revision.

An engine whose model thread is host-launch bound shares the GIL with aiokv's loop thread: every ms
of Python the loop runs for offloads (gpu->pool) and the write-behind (pool->disk) can delay the
model. This measures that ms: the loop thread's CPU time (``time.thread_time``, user and system)
over ``--calls`` offloads of ``--pages`` new pages each through ``KVCache`` (a CPU KV buffer: the
copies run on the copy thread, hashing of large pages on the checksum thread), each followed by
``flush`` (the write-behind's hashing, room, slots, io_uring submissions and completions), split
into the offload calls and the write-behind, and the loop callbacks (task steps and handles) run
per page: a count, free of the noise of a shared machine. ``--device cuda`` puts the KV buffer on the GPU: the
offloads' kernel launches and event hand-overs then run as on the H200. Token ids are passed as a
list of ints, as the demo does. Shapes: ``small`` (the demo's small preset: 4 layers, 2 KV heads,
head_dim 64, fp32, 32-token pages of 128 KiB: per-page costs dominate) and ``8b`` (Llama-3.1-8B:
32 layers, 8 KV heads, bf16, 256-token pages of 32 MiB, as on the H200).

``--against REV`` runs the same measurement on git revision REV's package too, each in a fresh
process, alternated ``--rounds`` times, and prints current/REV ratios of the medians.

    python tools/bench_loop_cpu.py --shape small
    python tools/bench_loop_cpu.py --shape small --against HEAD~1 --rounds 4
    python tools/bench_loop_cpu.py --shape 8b --pages 4 --calls 8 --dir /var/tmp
    python tools/bench_loop_cpu.py --shape 8b --device cuda --pages 16 --calls 20 --dir /var/tmp
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from aiokv import CacheConfig, KVCache, KVLayout

SHAPES: dict[str, tuple[int, int, int, torch.dtype, int]] = {
    # layers, KV heads, head_dim, dtype, page tokens
    "small": (4, 2, 64, torch.float32, 32),
    "8b": (32, 8, 128, torch.bfloat16, 256),
}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One process's figures (see the module docstring)."""
    layers, heads, head_dim, dtype, page_tokens = SHAPES[args.shape]
    layout = KVLayout.mha(layers, heads, head_dim, dtype, page_tokens=page_tokens)
    tokens = args.pages * page_tokens
    kv = torch.zeros(layout.num_layers, tokens, layout.rows, layout.head_dim, dtype=layout.dtype, device=args.device)
    slots = torch.arange(tokens)
    root = Path(tempfile.mkdtemp(prefix="aiokv-loopcpu-", dir=args.dir))
    written = (args.calls + args.warm + 1) * args.pages * layout.page_bytes  # room for all: no eviction
    config = CacheConfig(cpu_bytes=4 * args.pages * layout.page_bytes, namespace="loopcpu",
                         disk_dir=root / "disk", disk_bytes=written)
    offload_s = write_s = 0.0
    steps = [0]  # loop callbacks run (task steps, handles): per page, noise-free unlike CPU time
    run = asyncio.events.Handle._run

    def counted(handle: asyncio.events.Handle) -> None:
        steps[0] += 1
        run(handle)

    try:
        async with KVCache(config, layout, kv) as cache:
            await cache.wait_started()
            asyncio.events.Handle._run = counted  # type: ignore[method-assign,assignment]
            for call in range(args.warm + args.calls):
                ids = list(range(call * tokens, (call + 1) * tokens))  # new tokens: every page is new
                t0 = time.thread_time()
                result = await cache.offload(ids, slots)
                t1 = time.thread_time()
                await cache.flush()
                t2 = time.thread_time()
                if result.stored != args.pages:
                    raise RuntimeError(f"offload stored {result.stored} of {args.pages} pages: {result}")
                if call == args.warm - 1:
                    steps[0] = 0
                if call >= args.warm:
                    offload_s += t1 - t0
                    write_s += t2 - t1
            asyncio.events.Handle._run = run  # type: ignore[method-assign]
            taken = steps[0]
            stats = cache.stats()
    finally:
        asyncio.events.Handle._run = run  # type: ignore[method-assign]
        shutil.rmtree(root, ignore_errors=True)
    if any(stats.errors.values()):
        raise RuntimeError(f"faults during the run: {stats.errors}")
    gb = args.calls * args.pages * layout.page_bytes / 1e9
    pages = args.calls * args.pages
    return {
        "shape": args.shape, "device": args.device, "page_bytes": layout.page_bytes, "pages": pages, "gb": gb,
        "loop_s_per_gb": (offload_s + write_s) / gb,
        "offload_loop_s_per_gb": offload_s / gb, "write_loop_s_per_gb": write_s / gb,
        "loop_us_per_page": 1e6 * (offload_s + write_s) / pages,
        "offload_us_per_page": 1e6 * offload_s / pages, "write_us_per_page": 1e6 * write_s / pages,
        "loop_steps_per_page": taken / pages,
    }


FIELDS = ("loop_us_per_page", "offload_us_per_page", "write_us_per_page", "loop_s_per_gb", "loop_steps_per_page")


def against(args: argparse.Namespace) -> dict[str, Any]:
    """This tree and revision ``args.against``, each in a fresh process, alternated ``args.rounds`` times."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_cache import package_tree

    own = [a for a in sys.argv[1:] if a not in ("--against", args.against)]
    scratch = Path(tempfile.mkdtemp(prefix="aiokv-against-"))
    runs: dict[str, list[dict[str, Any]]] = {"current": [], args.against: []}
    try:
        trees = {"current": None, args.against: package_tree(args.against, scratch / "rev")}
        for rnd in range(args.rounds):
            for name in list(trees) if rnd % 2 == 0 else list(trees)[::-1]:
                env = dict(os.environ)
                tree = trees[name]
                if tree is not None:
                    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
                out = scratch / "run.json"
                cmd = [sys.executable, str(Path(__file__).resolve()), *own, "--json", str(out)]
                subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
                runs[name].append(json.loads(out.read_text()))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result: dict[str, Any] = {"against": args.against, "runs": runs}
    for field in FIELDS:
        current = statistics.median(r[field] for r in runs["current"])
        other = statistics.median(r[field] for r in runs[args.against])
        result[field] = {"current": current, "against": other, "ratio": current / other}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--pages", type=int, default=32, help="new pages per offload")
    parser.add_argument("--calls", type=int, default=100, help="timed offload+flush calls")
    parser.add_argument("--warm", type=int, default=5, help="untimed calls first")
    parser.add_argument("--device", default="cpu", help="the KV buffer's device (cuda: copies on the GPU's "
                        "side streams, launched from the loop)")
    parser.add_argument("--dir", help="where the disk tier's directory goes (default: the temp dir)")
    parser.add_argument("--against", metavar="REV")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    if args.pages < 1 or args.calls < 1 or args.warm < 0 or args.rounds < 1:
        parser.error("--pages, --calls and --rounds must be at least 1, --warm at least 0")
    if args.against:
        result = against(args)
        for field in FIELDS:
            r = result[field]
            print(f"{field:22s} current {r['current']:9.3f}  {args.against} {r['against']:9.3f}  "
                  f"ratio {r['ratio']:.3f}")
    else:
        if args.device != "cpu":
            KVCache.preload(args.device)  # imports and CUDA set-up before the loop runs, as an engine does
        result = asyncio.run(measure(args))
        print(f"{args.shape}: page {result['page_bytes'] / 1024:.0f} KiB, {result['pages']} pages "
              f"({result['gb']:.2f} GB): loop CPU {result['loop_s_per_gb']:.3f} s/GB "
              f"(offload {result['offload_loop_s_per_gb']:.3f}, write-behind {result['write_loop_s_per_gb']:.3f}); "
              f"per page {result['loop_us_per_page']:.0f} us (offload {result['offload_us_per_page']:.0f}, "
              f"write-behind {result['write_us_per_page']:.0f}); loop callbacks per page "
              f"{result['loop_steps_per_page']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
