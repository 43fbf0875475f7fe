"""Layer-wise loads overlapping the tail prefill, against their floor, in one run (GPU).

An 8B-shaped KV cache (32 layers, 8 KV heads, head_dim 128, bf16, 256-token pages) holds a prefix
of ``--tokens`` tokens in the pool. The "tail prefill" is a stand-in for the engine's prefill of
the uncached last page: per layer, attention scores of 256 queries against that layer's prefix KV
(it reads the loaded bytes, so it must wait for them) plus a matmul sized by ``--layer-ms``. Rows:

- ``memcpy``: a pinned host-to-device copy of the same bytes;  ``tail``: the tail alone, KV in place;
- ``load`` / ``layer-wise load``: the load alone through ``start_load`` (whole pages / layer by
  layer), as a rate against memcpy (1.0 = the memcpy's rate), with the host time until
  ``launched()`` of the layer-wise one;
- ``load then tail``: ``load`` then the tail (the simple path);
- ``layer-wise + tail``: ``start_load(layered=True)``, ``launched()``, then layer l waits on its
  readiness on the GPU (``wait_layer``) just before its attention.

Floor = max(memcpy, tail) + tail / layers. Every path (``--path``: staging, direct) runs in the
same process against the same baselines, repetitions interleaved; each row checks the tail's
output bit-exact against the first path's sequential run. Medians of ``--reps``.

    python tools/bench_overlap.py --tokens 8192 16384 32768 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from aiokv import CacheConfig, KVCache, KVLayout, TransferPath
from aiokv.cuda import raw_memcpy_available


class Tail:
    """The stand-in tail prefill: per layer, scores of 256 queries over the layer's prefix keys."""

    def __init__(self, layout: KVLayout, kv: torch.Tensor, prefix: torch.Tensor, layer_ms: float) -> None:
        gen = torch.Generator(device=kv.device).manual_seed(7)
        self.layout, self.kv, self.prefix = layout, kv, prefix
        heads, dim = layout.num_kv_heads, layout.head_dim
        self.q = torch.randn(heads, 256, dim, generator=gen, device=kv.device).to(layout.dtype)
        side = 4096
        self.a = torch.randn(256, side, generator=gen, device=kv.device).to(layout.dtype)
        self.b = torch.randn(side, side, generator=gen, device=kv.device).to(layout.dtype)
        self.reps = 1
        self.out: list[torch.Tensor] = []
        self._calibrate(layer_ms)

    def _calibrate(self, layer_ms: float) -> None:
        for _ in range(3):
            self.layer(0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            self.layer(0)
        torch.cuda.synchronize()
        per = (time.perf_counter() - start) / 10 * 1e3
        self.reps = max(1, round(layer_ms / per))
        self.out.clear()

    def layer(self, layer: int) -> None:
        keys = self.kv[layer, self.prefix, : self.layout.num_kv_heads]  # [N, H, D] of this layer
        scores = torch.einsum("hqd,nhd->hqn", self.q, keys)
        x = self.a
        for _ in range(self.reps):
            x = (x @ self.b).tanh_()
        self.out.append(scores.float().sum(-1) + x.float().mean())


async def _timed_load(cache: KVCache, ids: list[int], target: torch.Tensor, layered: bool) -> tuple[float, float]:
    """One load alone through LoadStream (no tail): (host ms until launched(), total ms)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    stream = await cache.start_load(await cache.match(ids), target, layered=layered)
    await stream.launched()
    launched = time.perf_counter()
    await stream.finish()
    torch.cuda.synchronize()
    return (launched - start) * 1e3, (time.perf_counter() - start) * 1e3


async def measure(args: argparse.Namespace, tokens: int, paths: list[TransferPath]) -> dict[str, Any]:
    """Every path against the same memcpy and tail baselines, repetitions interleaved."""
    layout = KVLayout.mha(32, 8, 128, torch.bfloat16, page_tokens=256)
    pages = tokens // layout.page_tokens
    device = torch.device("cuda")
    kv = torch.randn(layout.num_layers, 2 * tokens, layout.rows, layout.head_dim, device=device).to(layout.dtype)
    source, target = torch.arange(tokens), torch.arange(tokens, 2 * tokens)
    base: dict[str, list[float]] = {"memcpy": [], "tail": []}
    kinds = ("load", "layers", "layers_launch", "sequential", "layerwise")
    rows: dict[str, dict[str, list[float]]] = {p.value: {k: [] for k in kinds} for p in paths}
    exact = {p.value: True for p in paths}
    ids = list(range(tokens))
    async with contextlib.AsyncExitStack() as stack:
        caches: dict[TransferPath, KVCache] = {}
        for path in paths:
            config = CacheConfig(cpu_bytes=(pages + 2) * layout.page_bytes, disk_dir=None, transfer_path=path,
                                 namespace=f"bench-overlap-{path.value}")
            cache = await stack.enter_async_context(KVCache(config, layout, kv))
            await cache.pool.wait_ready()
            await cache.offload(ids, source)
            caches[path] = cache
        nbytes = pages * layout.payload_bytes
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        tail = Tail(layout, kv, target.to(device), args.layer_ms)
        reference: list[torch.Tensor] | None = None
        for _ in range(args.reps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            base["memcpy"].append((time.perf_counter() - start) * 1e3)

            start = time.perf_counter()
            tail.out.clear()
            for layer in range(layout.num_layers):
                tail.layer(layer)
            torch.cuda.synchronize()
            base["tail"].append((time.perf_counter() - start) * 1e3)

            for path, cache in caches.items():
                row = rows[path.value]
                row["load"].append((await _timed_load(cache, ids, target, layered=False))[1])
                launch, total = await _timed_load(cache, ids, target, layered=True)
                row["layers_launch"].append(launch)
                row["layers"].append(total)

                kv[:, target.to(device)] = 0
                torch.cuda.synchronize()
                start = time.perf_counter()
                await cache.load(await cache.match(ids), target)
                tail.out.clear()
                for layer in range(layout.num_layers):
                    tail.layer(layer)
                torch.cuda.synchronize()
                row["sequential"].append((time.perf_counter() - start) * 1e3)
                if reference is None:
                    reference = [o.clone() for o in tail.out]
                exact[path.value] &= all(torch.equal(a, b) for a, b in zip(tail.out, reference, strict=True))

                kv[:, target.to(device)] = 0
                torch.cuda.synchronize()
                start = time.perf_counter()
                stream = await cache.start_load(await cache.match(ids), target, layered=True)
                await stream.launched()
                tail.out.clear()
                for layer in range(layout.num_layers):
                    await stream.wait_layer(layer)  # on the loop: order_layer could block it
                    tail.layer(layer)
                result = await stream.finish()
                torch.cuda.synchronize()
                row["layerwise"].append((time.perf_counter() - start) * 1e3)
                same = all(torch.equal(a, b) for a, b in zip(tail.out, reference, strict=True))
                exact[path.value] &= result.loaded_from == 0 and same
    med = {k: statistics.median(v) for k, v in base.items()}
    floor = max(med["memcpy"], med["tail"]) + med["tail"] / layout.num_layers
    out: dict[str, Any] = {"tokens": tokens, "ms": med, "floor_ms": floor, "raw_memcpy": raw_memcpy_available(),
                           "paths": {}}
    for name, row in rows.items():
        ms = {k: statistics.median(v) for k, v in row.items()}
        out["paths"][name] = {
            "ms": ms,
            "load_vs_memcpy": med["memcpy"] / ms["load"],
            "layers_vs_memcpy": med["memcpy"] / ms["layers"],
            "sequential_vs_floor": ms["sequential"] / floor,
            "layerwise_vs_floor": ms["layerwise"] / floor,
            "bit_exact": exact[name],
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--path", choices=["direct", "staging"], nargs="+", default=["direct", "staging"])
    p.add_argument("--layer-ms", type=float, default=0.7, help="stand-in tail prefill time per layer")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    out = []
    paths = [TransferPath(name) for name in args.path]
    for tokens in args.tokens:
        row = asyncio.run(measure(args, tokens, paths))
        out.append(row)
        ms = row["ms"]
        print(f"{tokens:>6} tokens: memcpy {ms['memcpy']:.1f} ms, tail {ms['tail']:.1f} ms -> floor "
              f"{row['floor_ms']:.1f} ms (layer slabs through cudart: {row['raw_memcpy']})")
        for name, p in row["paths"].items():
            pm = p["ms"]
            print(f"    {name:>8}: load {pm['load']:.1f} ({p['load_vs_memcpy']:.2f}x memcpy rate), "
                  f"layer-wise load {pm['layers']:.1f} ({p['layers_vs_memcpy']:.2f}x, launch {pm['layers_launch']:.1f} "
                  f"host ms); load then tail {pm['sequential']:.1f} ({p['sequential_vs_floor']:.2f}x floor), "
                  f"layer-wise + tail {pm['layerwise']:.1f} ({p['layerwise_vs_floor']:.2f}x floor); "
                  f"bit-exact {p['bit_exact']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
