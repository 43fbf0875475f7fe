"""Layer-wise loads overlapping the tail prefill, against their floor, in one run (GPU).

An 8B-shaped KV cache (32 layers, 8 KV heads, head_dim 128, bf16, 256-token pages) holds a prefix
of ``--tokens`` tokens in the pool. The "tail prefill" is a stand-in for the engine's prefill of
the uncached last page: per layer, attention scores of 256 queries against that layer's prefix KV
(it reads the loaded bytes, so it must wait for them) plus a matmul sized by ``--layer-ms``. Rows:

- ``memcpy``: a pinned host-to-device copy of the same bytes;  ``tail``: the tail alone, KV in place;
- ``sequential``: ``load`` then the tail (today's path);
- ``layerwise``: ``start_load(layered=True)``, ``launched()``, then layer l waits on its readiness
  on the GPU (``order_layer``) just before its attention.

Floor = max(memcpy, tail) + tail / layers. Each row also checks the tail's output bit-exact
against the sequential run. Medians of ``--reps``, paths ``--path`` (direct, staging).

    python tools/bench_overlap.py --tokens 8192 16384 32768 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from aiokv import CacheConfig, KVCache, KVLayout, TransferPath


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


async def measure(args: argparse.Namespace, tokens: int, path: TransferPath) -> dict[str, Any]:
    layout = KVLayout.mha(32, 8, 128, torch.bfloat16, page_tokens=256)
    pages = tokens // layout.page_tokens
    device = torch.device("cuda")
    kv = torch.randn(layout.num_layers, 2 * tokens, layout.rows, layout.head_dim, device=device).to(layout.dtype)
    source, target = torch.arange(tokens), torch.arange(tokens, 2 * tokens)
    config = CacheConfig(cpu_bytes=(pages + 2) * layout.page_bytes, disk_dir=None, transfer_path=path,
                         namespace="bench-overlap")
    rows: dict[str, list[float]] = {k: [] for k in ("memcpy", "tail", "sequential", "layerwise")}
    exact = True
    async with KVCache(config, layout, kv) as cache:
        await cache.pool.wait_ready()
        ids = list(range(tokens))
        await cache.offload(ids, source)
        nbytes = pages * layout.payload_bytes
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        tail = Tail(layout, kv, target.to(device), args.layer_ms)
        for _ in range(args.reps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            rows["memcpy"].append(time.perf_counter() - start)

            start = time.perf_counter()
            tail.out.clear()
            for layer in range(layout.num_layers):
                tail.layer(layer)
            torch.cuda.synchronize()
            rows["tail"].append(time.perf_counter() - start)

            kv[:, target.to(device)] = 0
            torch.cuda.synchronize()
            start = time.perf_counter()
            await cache.load(await cache.match(ids), target)
            tail.out.clear()
            for layer in range(layout.num_layers):
                tail.layer(layer)
            torch.cuda.synchronize()
            rows["sequential"].append(time.perf_counter() - start)
            reference = [o.clone() for o in tail.out]

            kv[:, target.to(device)] = 0
            torch.cuda.synchronize()
            start = time.perf_counter()
            stream = await cache.start_load(await cache.match(ids), target, layered=True)
            await stream.launched()
            tail.out.clear()
            for layer in range(layout.num_layers):
                stream.order_layer(layer)
                tail.layer(layer)
            result = await stream.finish()
            torch.cuda.synchronize()
            rows["layerwise"].append(time.perf_counter() - start)
            same = all(torch.equal(a, b) for a, b in zip(tail.out, reference, strict=True))
            exact &= result.loaded_from == 0 and same
    med = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
    floor = max(med["memcpy"], med["tail"]) + med["tail"] / layout.num_layers
    return {"tokens": tokens, "path": path.value, "ms": med, "floor_ms": floor,
            "layerwise_vs_floor": med["layerwise"] / floor, "sequential_vs_floor": med["sequential"] / floor,
            "bit_exact": exact}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--path", choices=["direct", "staging"], nargs="+", default=["direct", "staging"])
    p.add_argument("--layer-ms", type=float, default=0.7, help="stand-in tail prefill time per layer")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    out = []
    for tokens in args.tokens:
        for name in args.path:
            row = asyncio.run(measure(args, tokens, TransferPath(name)))
            out.append(row)
            ms = row["ms"]
            print(f"{tokens:>6} tokens {name:>8}: memcpy {ms['memcpy']:.1f} tail {ms['tail']:.1f} -> floor "
                  f"{row['floor_ms']:.1f} ms; sequential {ms['sequential']:.1f} ({row['sequential_vs_floor']:.2f}x), "
                  f"layer-wise {ms['layerwise']:.1f} ({row['layerwise_vs_floor']:.2f}x); bit-exact {row['bit_exact']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
