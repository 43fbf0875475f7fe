"""The Prometheus export carries every page counter of ``KVCache.stats()``.

Regression: ``CacheStatistics.pages_withdrawn`` (pages the close kept a load or offload from
copying) was not exported. A real cache withdraws pages of an offload in flight when its close
begins, and the scrape (parsed as Prometheus would) must show them.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, config, make_kv, prompt

from aiokv import KVCache
from aiokv.results import CacheStatistics
from aiokv.transfers import Copy

T = LAYOUT.page_tokens
PAGE_COUNTERS = [f.name for f in dataclasses.fields(CacheStatistics) if f.name.startswith("pages_")]


def _scrape(registry: object) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(registry).decode()  # type: ignore[arg-type]
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


@pytest.mark.skipif(DEVICE.type != "cpu", reason="offloads are paced on CUDA; the close is timed on a CPU launch")
@pytest.mark.asyncio
async def test_every_page_counter_is_exported_withdrawn_included() -> None:
    from prometheus_client import CollectorRegistry

    from aiokv.metrics import register

    assert "pages_withdrawn" in PAGE_COUNTERS
    n = 8
    tokens = prompt(81, n * T)
    cache = KVCache(config(None, pool_pages=16, launch_pages=1, launch_turn_s=0), LAYOUT, make_kv(81))
    await cache.start()
    registry = CollectorRegistry()
    register(cache, registry, name="closing")
    await cache.pool.wait_ready()
    transfers = cache._transfers
    assert transfers is not None
    closing: list[asyncio.Future[None]] = []
    original = transfers.offload

    def offload(slots: torch.Tensor, page_ids: list[int]) -> Copy:
        if not closing:  # the close begins right after the first group's launch
            closing.append(asyncio.ensure_future(cache.aclose()))
        return original(slots, page_ids)

    transfers.offload = offload  # type: ignore[method-assign]
    try:
        result = await cache.offload(tokens, torch.arange(n * T))
    finally:
        if closing:
            await closing[0]
        await cache.aclose()
    stats = cache.stats()
    assert stats.pages_withdrawn > 0 and result.dropped == stats.pages_withdrawn  # the close withdrew pages
    me = {"cache": "closing", "namespace": "test-model", "tp_rank": "0"}
    values = _scrape(registry)
    for counter in PAGE_COUNTERS:
        outcome = counter.removeprefix("pages_")
        key = ("aiokv_pages_total", frozenset({**me, "outcome": outcome}.items()))
        assert key in values, f"stats().{counter} is not exported"
        assert values[key] == getattr(stats, counter), counter
