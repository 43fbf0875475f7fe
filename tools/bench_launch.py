"""Launch groups sized by the loop's time (``CacheConfig.launch_turn_s``) against groups of
``launch_pages`` pages alone (``launch_turn_s=0``, the behaviour before): pool hits and offloads of
small pages, both caches in one process, alternated call by call, as ratios.

Per page size (``--page-kib``): ``--pages`` pages offloaded into a cache of each variant, then
``--repeats`` rounds of (offload, pool hit) into each, alternated. Printed: medians of the offload
and hit times, launch groups per call, the loop's longest step while the calls ran (what a loop
lag is made of; the default asyncio loop) and a 1 ms periodic callback's lateness p99 / max,
and budget ÷ pages ratios. ``--spinners N`` runs the timed calls beside N threads of pure Python
(an engine thread that holds the GIL: each hand-over to aiokv's threads may wait a switch
interval, so fewer groups are fewer waits). On a CUDA device (``--device cuda``) the engine's KV buffer lives there.

    python tools/bench_launch.py
    python tools/bench_launch.py --page-kib 64 2048 --pages 39 --repeats 8
    python tools/bench_launch.py --spinners 1
    python tools/bench_launch.py --device cuda --page-kib 2048 32768 --pages 64

``--group-costs 1 2 4 8 16`` instead times the loop's host time per launch group at each fixed
group size (``launch_pages`` = that size, ``launch_turn_s=0``), loads and offloads apart, as the
sizer records it (validation, the launch call, bookkeeping): a group's fixed cost and its cost per
page, what ``LaunchSizer`` bases the group size on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cache import LoopLag  # the tools' own 1 ms lateness probe
from bench_gil import spinning  # threads of pure Python beside the calls (an engine's busy thread)

from aiokv import CacheConfig, KVCache, KVLayout, launches
from aiokv.transfers import Copy

VARIANTS = ("pages", "budget")
"""``pages``: ``launch_turn_s=0`` (groups of ``launch_pages``); ``budget``: the default turn budget."""


def _layout(page_kib: int) -> KVLayout:
    # 2 layers x K/V x 8 rows x 64 fp16 = 4 KiB per token; page_tokens sets the page size.
    return KVLayout.mha(2, 8, 64, torch.float16, page_tokens=max(1, page_kib // 4))


class Steps:
    """The loop's callback durations (task steps included) while active (the asyncio loop)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._run = asyncio.events.Handle._run
        self._windows: list[bool] = []  # per window entered: whether it was left

    def __enter__(self) -> Steps:
        run, samples, windows = self._run, self.samples, self._windows
        windows.append(False)
        window = len(windows) - 1

        def timed(handle: asyncio.events.Handle) -> None:
            start = time.perf_counter()
            run(handle)
            # Not the step that left the window: it went on with the benchmark's own work (into the
            # next window of this variant, when it runs twice in a row).
            if not windows[window]:
                samples.append(time.perf_counter() - start)

        asyncio.events.Handle._run = timed  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        self._windows[-1] = True
        asyncio.events.Handle._run = self._run  # type: ignore[method-assign]


def _count_groups(cache: KVCache) -> dict[str, int]:
    """Calls of the cache's ``transfers.load``/``.offload`` from now on (one per launch group)."""
    transfers = cache._transfers
    assert transfers is not None
    counts = {"load": 0, "offload": 0}
    for name in counts:
        original: Callable[..., Copy] = getattr(transfers, name)

        def counted(*args: Any, _name: str = name, _original: Callable[..., Copy] = original, **kw: Any) -> Copy:
            counts[_name] += 1
            return _original(*args, **kw)

        setattr(transfers, name, counted)
    return counts


def _setup(args: argparse.Namespace, page_kib: int
           ) -> tuple[KVLayout, torch.device, int, torch.Generator, torch.Tensor]:
    """The layout, device, tokens of ``args.pages`` pages, a seeded generator and a KV buffer of
    twice those tokens (the first half offloaded, loaded back into the second)."""
    layout = _layout(page_kib)
    device = torch.device(args.device)
    n = args.pages * layout.page_tokens
    gen = torch.Generator().manual_seed(page_kib)
    kv = torch.randn(layout.num_layers, 2 * n, layout.rows, layout.head_dim, generator=gen).to(layout.dtype).to(device)
    return layout, device, n, gen, kv


async def _page_size(args: argparse.Namespace, page_kib: int) -> dict[str, Any]:
    layout, device, n, gen, kv = _setup(args, page_kib)
    prompts = [torch.randint(0, 50_000, (n,), generator=gen).tolist() for _ in range(args.repeats + 1)]
    caches: dict[str, KVCache] = {}
    counts: dict[str, dict[str, int]] = {}
    times: dict[str, dict[str, list[float]]] = {v: {"offload": [], "hit": []} for v in VARIANTS}
    groups: dict[str, dict[str, list[int]]] = {v: {"offload": [], "hit": []} for v in VARIANTS}
    steps = {v: Steps() for v in VARIANTS}
    lags = {v: LoopLag() for v in VARIANTS}
    try:
        for variant in VARIANTS:
            extra = {"launch_turn_s": 0.0} if variant == "pages" else {}
            config = CacheConfig(cpu_bytes=(2 * args.pages + 8) * layout.page_bytes, disk=None,
                                 namespace=f"bench-launch-{variant}", **extra)  # type: ignore[arg-type]
            cache = caches[variant] = KVCache(config, layout, kv)
            await cache.start()
            await cache.pool.wait_ready()
            await cache.wait_warm()
            counts[variant] = _count_groups(cache)
        slots = torch.arange(n, 2 * n)
        for round_ in range(args.repeats + 1):  # round 0 warms (the sizers learn, first launches)
            tokens = prompts[round_]
            order = VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                cache, count = caches[variant], counts[variant]
                timed = round_ > 0
                null = contextlib.nullcontext()
                with (steps[variant] if timed else null, lags[variant] if timed else null,
                      spinning(args.spinners if timed else 0)):
                    before = dict(count)
                    start = time.perf_counter()
                    stored = await cache.offload(tokens, torch.arange(n))
                    offload_s = time.perf_counter() - start
                    match = await cache.match(tokens)
                    start = time.perf_counter()
                    loaded = await cache.load(match, slots)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    hit_s = time.perf_counter() - start
                if stored.stored != args.pages or loaded.tokens != n:
                    raise RuntimeError(f"{variant}: stored {stored.stored} of {args.pages}, "
                                       f"loaded {loaded.tokens} of {n}")
                if not torch.equal(kv[:, n:], kv[:, :n]):
                    raise RuntimeError(f"{variant}: the loaded KV differs from what was offloaded")
                if timed:
                    times[variant]["offload"].append(offload_s)
                    times[variant]["hit"].append(hit_s)
                    groups[variant]["offload"].append(count["offload"] - before["offload"])
                    groups[variant]["hit"].append(count["load"] - before["load"])
                for key in cache.keys(tokens):
                    cache.pool.table.discard(key)  # room for the next round's pages
    finally:
        for cache in caches.values():
            await cache.aclose()
    out: dict[str, Any] = {"page_kib": page_kib, "page_bytes": layout.page_bytes, "page_count": args.pages}
    for variant in VARIANTS:
        samples = sorted(steps[variant].samples)
        out[variant] = {
            "offload_ms": statistics.median(times[variant]["offload"]) * 1e3,
            "hit_ms": statistics.median(times[variant]["hit"]) * 1e3,
            "offload_groups": statistics.median(groups[variant]["offload"]),
            "hit_groups": statistics.median(groups[variant]["hit"]),
            "step_p99_ms": samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1e3 if samples else 0.0,
            "step_max_ms": samples[-1] * 1e3 if samples else 0.0,
            "lag": lags[variant].summary(),
        }
    out["hit_ratio"] = out["budget"]["hit_ms"] / out["pages"]["hit_ms"]
    out["offload_ratio"] = out["budget"]["offload_ms"] / out["pages"]["offload_ms"]
    return out


async def _group_costs(args: argparse.Namespace, page_kib: int) -> dict[str, Any]:
    """Median loop seconds per launch group at each fixed group size, loads and offloads apart."""
    layout, _, n, gen, kv = _setup(args, page_kib)
    slots = torch.arange(n, 2 * n)
    samples: dict[int, dict[str, list[float]]] = {}
    original = launches.LaunchSizer.record
    kind: list[str] = ["offload"]

    def recorded(sizer: launches.LaunchSizer, pages: int, seconds: float) -> None:
        samples[size][kind[0]].append(seconds)
        original(sizer, pages, seconds)

    launches.LaunchSizer.record = recorded  # type: ignore[method-assign]
    try:
        for size in args.group_costs:
            samples[size] = {"offload": [], "load": []}
            config = CacheConfig(cpu_bytes=(args.pages + 8) * layout.page_bytes, disk=None, launch_pages=size,
                                 launch_turn_s=0.0, launch_bytes=max(size, 1) * layout.page_bytes,
                                 namespace=f"bench-launch-costs-{size}")
            async with KVCache(config, layout, kv) as cache:
                await cache.pool.wait_ready()
                await cache.wait_warm()
                for round_ in range(args.repeats + 1):
                    tokens = torch.randint(0, 50_000, (n,), generator=gen).tolist()
                    if round_ == 0:  # first launches compile and fault pages in: not timed
                        launches.LaunchSizer.record = original  # type: ignore[method-assign]
                    kind[0] = "offload"
                    stored = await cache.offload(tokens, torch.arange(n))
                    kind[0] = "load"
                    loaded = await cache.load(await cache.match(tokens), slots)
                    launches.LaunchSizer.record = recorded  # type: ignore[method-assign]
                    if stored.stored != args.pages or loaded.tokens != n or not torch.equal(kv[:, n:], kv[:, :n]):
                        raise RuntimeError(f"groups of {size}: stored {stored.stored}, loaded {loaded.tokens} "
                                           "or the loaded KV differs")
                    for key in cache.keys(tokens):
                        cache.pool.table.discard(key)
    finally:
        launches.LaunchSizer.record = original  # type: ignore[method-assign]
    out: dict[str, Any] = {"page_kib": page_kib, "sizes": {}}
    for size, by_kind in samples.items():
        out["sizes"][size] = {k: statistics.median(v) * 1e6 for k, v in by_kind.items() if v}
    return out



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--page-kib", type=int, nargs="+", default=[64, 2048])
    parser.add_argument("--pages", type=int, default=39)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--spinners", type=int, default=0,
                        help="threads running pure Python beside the timed calls (they hold the GIL)")
    parser.add_argument("--group-costs", type=int, nargs="+", default=None, metavar="PAGES",
                        help="time the loop's host time per group at these fixed group sizes instead")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.pages <= 0 or args.repeats <= 0:
        parser.error("--pages and --repeats must be positive")
    if args.group_costs is not None:
        if any(size <= 0 for size in args.group_costs):
            parser.error("--group-costs sizes must be positive")
        costs = [asyncio.run(_group_costs(args, kib)) for kib in args.page_kib]
        print(f"loop host time per launch group (us, median of the groups of {args.repeats} rounds); "
              f"{args.pages} pages, device {args.device}")
        print(f"{'page':>8} {'group':>6} {'load':>9} {'per page':>9} {'offload':>9} {'per page':>9}")
        for c in costs:
            for size, t in c["sizes"].items():
                load, off = t.get("load", float("nan")), t.get("offload", float("nan"))
                print(f"{c['page_kib']:>5}KiB {size:>6} {load:>9.1f} {load / size:>9.1f} "
                      f"{off:>9.1f} {off / size:>9.1f}")
        if args.json is not None:
            args.json.write_text(json.dumps(costs, indent=2))
        return
    results = [asyncio.run(_page_size(args, kib)) for kib in args.page_kib]
    print(f"launch groups: turn budget (default) vs launch_pages alone; {args.pages} pages, device {args.device}, "
          f"medians of {args.repeats} alternated rounds, {args.spinners} GIL-holding threads beside")
    print(f"{'page':>8} {'variant':>7} {'offload':>9} {'groups':>6} {'hit':>9} {'groups':>6} "
          f"{'step p99':>9} {'step max':>9} {'lag p99':>8} {'lag max':>8}")
    for r in results:
        for variant in VARIANTS:
            v = r[variant]
            print(f"{r['page_kib']:>5}KiB {variant:>7} {v['offload_ms']:>7.2f}ms {v['offload_groups']:>6.0f} "
                  f"{v['hit_ms']:>7.2f}ms {v['hit_groups']:>6.0f} "
                  f"{v['step_p99_ms']:>7.3f}ms {v['step_max_ms']:>7.3f}ms "
                  f"{v['lag']['p99_ms']:>6.2f}ms {v['lag']['max_ms']:>6.2f}ms")
        print(f"{'':>8} budget ÷ pages: offload {r['offload_ratio']:.2f}x, hit {r['hit_ratio']:.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
