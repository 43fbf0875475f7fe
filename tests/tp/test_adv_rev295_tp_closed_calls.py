"""Review 295, the TP side: a closed ``TPCache`` refuses ``keys``, ``estimate`` and ``note_prefill``
as it refuses ``match``/``offload``/``prefetch`` (``RuntimeError("the cache is closed")``), and a
``TPLoadStream`` refuses ``claim`` once ``finish()`` or ``aclose()`` was called, as a second
``finish()`` does; nothing changes (statistics, the prefill meter, the match, the stream).

Before the fix the closed cache computed keys, built an estimate and folded a prefill report into
a meter whose rates the close had saved; the ended stream answered a claim as if open and folded
the previous claim into the prefill meter.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from tp_helpers import CONFIG, full_kv, rank_kv, threads_off_loop

from aiokv import CacheConfig, KVLayout, Match
from aiokv.tp import RankWorkerThread, TPCache, TPLoadStream

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
PAGES = 4
N = PAGES * T
SLOTS = 96
TP = 2
CLOSED = "^the cache is closed$"
_namespaces = itertools.count()


def _config() -> CacheConfig:
    return CacheConfig(cpu_bytes=32 * LAYOUT.page_bytes, disk=None, namespace=f"tp-rev295c-{next(_namespaces)}",
                       pool_chunk_bytes=8 * LAYOUT.page_bytes)


def _cache_state(cache: TPCache, match: Match) -> tuple[Any, ...]:
    return cache.stats(), dict(vars(cache.manager.costs.prefill)), match.released


def _stream_state(cache: TPCache, stream: TPLoadStream) -> tuple[Any, ...]:
    return (stream._claimed, stream.front, repr(stream), dict(vars(cache.manager.costs.prefill)),
            cache.stats(), cache.group.statistics())


@pytest.mark.asyncio
async def test_a_closed_tp_cache_refuses_keys_estimate_and_note_prefill() -> None:
    kv = [rank_kv(full_kv(LAYOUT, 2957, SLOTS), LAYOUT, rank, TP) for rank in range(TP)]
    tokens = list(range(N))
    cache = TPCache(_config(), LAYOUT, tp_size=TP, num_slots=SLOTS, tp_config=CONFIG)
    async with cache:
        workers = [RankWorkerThread(cache.address, rank, TP, LAYOUT, kv[rank], CONFIG) for rank in range(TP)]
        async with threads_off_loop(*workers):
            await cache.wait_ranks()
            assert (await cache.offload(tokens, torch.arange(N))).stored == PAGES
            match = await cache.match(tokens)
            assert len(cache.keys(tokens)) == PAGES and cache.estimate(match).disk_seconds == 0.0  # served
            cache.note_prefill(8 * T, 0.01)
    before = _cache_state(cache, match)
    with pytest.raises(RuntimeError, match=CLOSED):
        cache.keys(tokens)
    with pytest.raises(RuntimeError, match=CLOSED):
        cache.estimate(match)
    with pytest.raises(RuntimeError, match=CLOSED):
        cache.note_prefill(8 * T, 0.01, prefix=T)
    assert _cache_state(cache, match) == before
    with pytest.raises(RuntimeError, match=CLOSED):  # the same words as the calls that always refused
        await cache.match(tokens)
    match.release()


@pytest.mark.asyncio
@pytest.mark.parametrize("layered", [False, True])
@pytest.mark.parametrize("end", ["finish", "aclose"])
async def test_a_claim_on_an_ended_tp_stream_raises_and_changes_nothing(layered: bool, end: str) -> None:
    full = full_kv(LAYOUT, 2958, SLOTS)
    kv = [rank_kv(full, LAYOUT, rank, TP) for rank in range(TP)]
    tokens = list(range(N))
    async with TPCache(_config(), LAYOUT, tp_size=TP, num_slots=SLOTS, tp_config=CONFIG) as cache:
        workers = [RankWorkerThread(cache.address, rank, TP, LAYOUT, kv[rank], CONFIG) for rank in range(TP)]
        async with threads_off_loop(*workers):
            await cache.wait_ranks()
            assert (await cache.offload(tokens, torch.arange(N))).stored == PAGES
            stream = cache.start_load(await cache.match(tokens), torch.arange(2 * N, 3 * N), layered=layered)
            assert stream.claim(T) == T
            if end == "finish":
                result = await stream.finish()
                assert (result.claimed, result.loaded_from) == (T, T), result
                words = r"^LoadStream\.claim\(\) after finish\(\): the stream is finished$"
            else:
                await stream.aclose()
                words = r"^LoadStream\.claim\(\) after aclose\(\): the stream was closed$"
            before = _stream_state(cache, stream)
            for claim in (T, 2 * T, N):
                with pytest.raises(RuntimeError, match=words):
                    stream.claim(claim)
            assert _stream_state(cache, stream) == before
            assert cache.stats().pool_referenced == 0
