"""Adversarial (helper-202): a disk page evicted for room between ``match`` and its read.

A match counts the disk's prefix without holding it; before the load reads a page, other
offloads fill the disk tier's budget and the tier evicts it (a real eviction: a small
``capacity_bytes``, real page files, the write-behind of another prompt). The load (a stream)
then finds the page absent. That is a plain miss for capacity, not a fault: it was
counted ``disk_read_failed`` (and the shortened load ``load_shortened``), so a metric user saw
faults where only the budget had spoken. Now nothing is counted in ``errors``; the tier counts the
eviction (``disk.evictions``) and the absent read (``disk.misses``), and the call stops there as
before, serving the oracle's bytes for what it did load.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, errors_of
from test_adv_rev195_cancel_sweep import GARBAGE, POISON, oracle, prompt

from aiokv import KVCache

T = LAYOUT.page_tokens
PAGES = 6
KEPT = 3
N = PAGES * T + 2
SLOTS = 8 * N

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU KV buffer: poison checks read it directly")


def _kv() -> torch.Tensor:
    return torch.full((LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim), POISON, dtype=LAYOUT.dtype)


def _region(i: int, n: int = N) -> torch.Tensor:
    return torch.arange(i * N, i * N + n)


async def _offload(cache: KVCache, kv: torch.Tensor, tokens: list[int], region: int = 7) -> None:
    slots = _region(region, len(tokens))
    kv[:, slots] = oracle(tokens, None)
    result = await cache.offload(tokens, slots)
    assert result.stored == len(tokens) // T, result
    kv[:, slots] = GARBAGE


@pytest.mark.asyncio
@pytest.mark.parametrize("call", ["load", "stream"])
async def test_a_disk_page_evicted_for_room_after_the_match_is_a_miss_not_a_fault(tmp_path: Path, call: str) -> None:
    """The prompt's 6 pages on disk only (a budget of 6 pages), matched; then 3 pages of another
    prompt are written, and the tier evicts the 3 least recently used of the prompt's (the back
    half for a load, which loads from the front; the front half for a stream, which loads from
    the back). The call loads the other 3, bit-exact, and no fault is counted."""
    kv = _kv()
    tokens = prompt(41)[:N]
    other = prompt(42)[: KEPT * T]
    async with KVCache(config(tmp_path / "disk", pool_pages=16, disk_pages=PAGES), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        await _offload(cache, kv, tokens)
        await cache.flush()
        keys = cache.keys(tokens)
        for key in keys:
            assert cache.pool.table.discard(key)
        assert all(disk.contains(k) for k in keys)
        match = await cache.match(tokens)
        assert (match.pool_pages, match.disk_pages) == (0, PAGES), match
        # Keep the half the call loads first most recently used: the eviction takes the rest.
        kept, lost = (keys[:KEPT], keys[KEPT:]) if call != "stream" else (keys[KEPT:], keys[:KEPT])
        assert disk.touch(kept) == KEPT
        before = disk.statistics()
        await _offload(cache, kv, other, region=5)
        await cache.flush()
        after = disk.statistics()
        assert not any(disk.contains(k) for k in lost), "the budget did not evict the prompt's pages"
        assert all(disk.contains(k) for k in kept)
        assert after.evictions - before.evictions >= KEPT, after
        target = _region(2)
        if call == "load":
            result = await cache.load(match, target[: match.tokens])
            assert (result.tokens, result.disk_pages) == (KEPT * T, KEPT), result
            assert torch.equal(kv[:, target[: result.tokens]], oracle(tokens, None)[:, : result.tokens])
            assert bool((kv[:, target[result.tokens :]] == POISON).all())
        else:
            stream = await cache.start_load(match, target[: match.tokens])
            streamed = await stream.finish()
            assert (streamed.loaded_from, streamed.disk_pages) == (KEPT * T, KEPT), streamed
            truth = oracle(tokens, None)
            assert torch.equal(kv[:, target[KEPT * T : match.tokens]], truth[:, KEPT * T : match.tokens])
            assert bool((kv[:, target[: KEPT * T]] == POISON).all())
        assert errors_of(cache) == {}, errors_of(cache)  # no disk_read_failed, no load_shortened
        assert disk.statistics().misses > before.misses  # the tier's own count of an absent page
        await assert_quiescent(cache)
