"""Adversarial (helper-307): one disk directory shared at once by processes of different layouts
(another page size and dtype: another layout directory) and by one of the same layout under another
model namespace (the same layout directory: it follows, read-only).

Each writer offloads through an 8-page pool into a 40-page disk budget (evicting and recycling its
files all the time) and loads earlier prompts back while the others do the same beside it. Oracle:
each token's KV is a function of its whole prefix (``prefix_oracle``, in the layout's dtype). Checked:
no process ever loads a wrong byte; each layout's restart serves only its own oracle's KV; the other
namespace never hits the first one's pages (keys differ) and writes nothing there (read-only).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import LAYOUT, config
from child_procs import end_child, fork_context
from test_adv_crash_restart import SLOTS, prefix_oracle, prompts_of

from aiokv import KVCache, KVLayout

OTHER = dataclasses.replace(LAYOUT, page_tokens=2 * LAYOUT.page_tokens, dtype=torch.bfloat16)
LAYOUTS = {"base": LAYOUT, "other": OTHER}
PROMPTS = 40
BOUND_S = 30.0


def _oracle(layout: KVLayout, namespace: str, tokens: list[int]) -> torch.Tensor:
    """The model's KV: another model's KV of the same prompt is the negation (a page served across
    namespaces shows)."""
    kv = prefix_oracle(tokens).to(layout.dtype)
    return kv if namespace == "test-model" else -kv


def _config(directory: Path, layout: KVLayout, namespace: str) -> Any:
    return dataclasses.replace(config(directory, pool_pages=8, disk_pages=40, layout=layout, launch_pages=1,
                                      launch_turn_s=0), namespace=namespace)


async def _load(cache: KVCache, kv: torch.Tensor, layout: KVLayout, namespace: str,
                tokens: list[int]) -> tuple[int, bool]:
    """Load the cached prefix of ``tokens``: (tokens loaded, whether they are the oracle's)."""
    async with asyncio.timeout(BOUND_S):
        match = await cache.match(tokens)
        slots = torch.arange(SLOTS - match.tokens, SLOTS)
        kv[:, slots] = 0
        got = (await cache.load(match, slots)).tokens
    return got, torch.equal(kv[:, slots[:got]], _oracle(layout, namespace, tokens[:got]))


def writer(directory: str, which: str, namespace: str, seed: int, conn: Any) -> None:
    """Offload PROMPTS prompts, loading an earlier one back after each; sends ``("done", loaded,
    wrong, disk writes)`` or ``("failed", text)``."""

    async def main() -> tuple[int, int, int]:
        layout = LAYOUTS[which]
        kv = torch.zeros(layout.num_layers, SLOTS, layout.rows, layout.head_dim, dtype=layout.dtype)
        loaded = wrong = 0
        async with KVCache(_config(Path(directory), layout, namespace), layout, kv) as cache:
            prompts = prompts_of(seed, PROMPTS)
            for index, tokens in enumerate(prompts):
                slots = torch.arange(len(tokens))
                kv[:, slots] = _oracle(layout, namespace, tokens)
                async with asyncio.timeout(BOUND_S):
                    await cache.offload(tokens, slots)
                got, right = await _load(cache, kv, layout, namespace, prompts[(index * 7) % (index + 1)])
                loaded += got
                wrong += not right
            async with asyncio.timeout(BOUND_S):
                await cache.flush()
            disk = cache.stats().disk
            return loaded, wrong, 0 if disk is None else disk.writes

    try:
        conn.send(("done", *asyncio.run(main())))
    except BaseException as exc:  # reported to the test, which fails with it
        conn.send(("failed", repr(exc)))


@pytest.mark.slow(seconds=15)
@pytest.mark.asyncio
async def test_layouts_and_namespaces_sharing_a_directory_serve_only_their_own_kv(tmp_path: Path) -> None:
    ctx = fork_context()
    runs = {"base": ("base", "test-model", 11), "other": ("other", "test-model", 12),
            "namespace": ("base", "another-model", 11)}  # the same prompts as "base", another model
    procs, conns = {}, {}
    for name, (which, namespace, seed) in runs.items():
        parent, child = ctx.Pipe(duplex=False)
        procs[name] = ctx.Process(target=writer, args=(str(tmp_path), which, namespace, seed, child), daemon=True)
        procs[name].start()
        child.close()
        conns[name] = parent
    reports = {}
    try:
        for name, conn in conns.items():
            assert await asyncio.to_thread(conn.poll, 120), f"{name} hung"
            reports[name] = conn.recv()
    finally:
        for proc in procs.values():
            end_child(proc, 30)
        for conn in conns.values():
            conn.close()
    for name, report in reports.items():
        assert report[0] == "done", (name, report)
        assert report[2] == 0, f"{name} loaded wrong KV: {report}"
        assert report[1] > 0, (name, report)
    # "base" and "namespace" share a layout directory: the one holding it writes (both, one after
    # the other, where one closed before the other started).
    assert reports["other"][3] > 0 and max(reports["base"][3], reports["namespace"][3]) > 0, reports
    served = {}
    for name, (which, namespace, seed) in runs.items():
        layout = LAYOUTS[which]
        kv = torch.zeros(layout.num_layers, SLOTS, layout.rows, layout.head_dim, dtype=layout.dtype)
        async with KVCache(_config(tmp_path, layout, namespace), layout, kv) as cache:
            results = [await _load(cache, kv, layout, namespace, tokens) for tokens in prompts_of(seed, PROMPTS)]
        assert all(right for _, right in results), f"{name}: a restart served wrong KV"
        served[name] = sum(got for got, _ in results)
        if reports[name][3] == 0:  # it wrote nothing: the other model's pages are no hit for it
            assert served[name] == 0, (name, served, reports)
    assert served["other"] > 0 and served["base"] + served["namespace"] > 0, (served, reports)
    names = await asyncio.to_thread(lambda: sorted(p.name for p in tmp_path.iterdir() if p.is_dir()))
    assert names == sorted([LAYOUT.fingerprint.hex(), OTHER.fingerprint.hex()])
