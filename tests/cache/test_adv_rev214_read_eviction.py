"""Adversarial (helper-214): a disk page evicted for room after its read started.

Review 202 made a page the tier no longer held when its read was *started* a plain miss
(``NoPage.GONE``). The window after that stayed: the read is launched (the page indexed, the read
counted as its reader, waiting for an I/O slot or its open), then other writes fill the tier's
budget and the eviction takes the page (a reader does not keep a file from eviction, only from
being recycled) and unlinks its file; the read then opens nothing (ENOENT, no fault counted by the
tier) and returns False. The cache counted that ``disk_read_failed`` (and the load
``load_shortened``): a fault where only the budget had spoken (the TODO(storage) in
``test_adv_rev202_shared_prefix_fuzz``, 2 runs in 800 there). Now it is a miss: the tier counts the
eviction (``evictions``) and the absent read (``misses``), ``errors`` stays empty.

Everything real: a small disk budget, real page files, the write-behind of another prompt evicting,
the read's open held by a gate in front of the tier's backend (as a busy device holds it) and let
go once the evicted files are gone. A page that still fails for a fault (its file corrupted under
the held read) is still counted.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, errors_of, held_read_call, prompt
from load_gate import flip_payload
from loop_probes import until_thread

from aiokv import KVCache

T = LAYOUT.page_tokens
PAGES = 2
BOUND_S = 10.0
SLOTS = 16 * PAGES * T
TARGET = torch.arange(4 * PAGES * T, 5 * PAGES * T)

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU KV buffer: checks read it directly")


def _kv() -> torch.Tensor:
    gen = torch.Generator().manual_seed(2141)
    return torch.randn(LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim, generator=gen).to(LAYOUT.dtype)


async def _on_disk_only(cache: KVCache, tokens: list[int]) -> None:
    assert (await cache.offload(tokens, torch.arange(len(tokens)))).stored == len(tokens) // T
    await cache.flush()
    disk = cache.disk
    assert disk is not None
    for key in cache.keys(tokens):
        assert disk.contains(key)
        assert cache.pool.table.discard(key)


async def _evict(cache: KVCache, tokens: list[int], other: list[int]) -> None:
    """Another prompt written to the full tier: it evicts ``tokens``' pages, their files go."""
    disk = cache.disk
    assert disk is not None
    before = disk.statistics().evictions
    slots = torch.arange(8 * PAGES * T, 8 * PAGES * T + len(other))
    assert (await cache.offload(other, slots)).stored == len(other) // T
    await cache.flush()
    keys = cache.keys(tokens)
    assert not any(disk.contains(k) for k in keys), "the budget did not evict the prompt's pages"
    assert disk.statistics().evictions - before >= PAGES
    paths = [disk.files.path(k) for k in keys]
    await until_thread(lambda: not any(os.path.exists(p) for p in paths), "the evicted files' unlinks")


@pytest.mark.asyncio
@pytest.mark.parametrize("call", ["load", "prefetch", "stream"])
async def test_a_page_evicted_while_its_read_is_held_is_a_miss_not_a_fault(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str) -> None:
    tokens = prompt(2142, PAGES * T)
    other = prompt(2143, PAGES * T)
    async with KVCache(config(tmp_path / "disk", pool_pages=16, disk_pages=PAGES), LAYOUT, _kv()) as cache:
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        await _on_disk_only(cache, tokens)
        gate, task, reads = await held_read_call(cache, monkeypatch, call, tokens, TARGET, PAGES)
        before = disk.statistics()
        await _evict(cache, tokens, other)
        gate.open()
        async with asyncio.timeout(BOUND_S):
            result = await task
        after = disk.statistics()
        assert after.misses - before.misses >= reads, after  # the tier's own count of the absent pages
        # Before: disk_read_failed (and load_shortened for a load).
        assert errors_of(cache) == {}, (errors_of(cache), result)
        if call == "prefetch":
            assert (result.pool_pages, result.promoted) == (0, 0), result
        elif call == "load":
            assert result.tokens == 0, result
        else:
            assert result.loaded_tokens == 0, result
        assert not any(cache.pool.table.state_of(k).name != "FREE" for k in cache.keys(tokens))
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_a_page_corrupted_under_a_held_read_is_still_a_fault(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The other side: the file is there when the held read opens it, but damaged (no eviction):
    the tier refuses it (``corrupt``) and the cache counts ``disk_read_failed`` as before."""
    tokens = prompt(2144, PAGES * T)
    async with KVCache(config(tmp_path / "disk", pool_pages=16, disk_pages=4 * PAGES), LAYOUT, _kv()) as cache:
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        await _on_disk_only(cache, tokens)
        gate, task, _ = await held_read_call(cache, monkeypatch, "load", tokens, TARGET, PAGES)
        flip_payload(disk.files.path(cache.keys(tokens)[0]))
        gate.open()
        async with asyncio.timeout(BOUND_S):
            result = await task
        assert result.tokens == 0, result
        assert disk.statistics().corrupt == 1
        errors = errors_of(cache)
        assert errors.get("disk_read_failed", 0) >= 1 and errors.get("load_shortened") == 1, errors
        await assert_quiescent(cache)
