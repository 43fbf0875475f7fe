"""Adversarial (helper-195): interleavings of one prefix's callers, driven deterministically.

The copy thread is held (:class:`cache_helpers.CopyThreadGate`) so that copies wait where the test
wants them: an offload of a prefix while a load of the same pages runs (from the pool, and from
disk through promotions), the same prefix offloaded by two callers, one cancelled, a stream's
pages under eviction pressure, and isolation of namespaces, salts and layouts over one disk
directory. Oracle: a token's KV is a hash of its salt and whole prefix (``test_adv_rev195_cancel_sweep.oracle``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, CopyThreadGate, assert_quiescent, config, errors_of
from loop_probes import until_spin
from test_adv_rev195_cancel_sweep import GARBAGE, POISON, oracle, prompt

from aiokv import KVCache, KVLayout

T = LAYOUT.page_tokens
PAGES = 6
N = PAGES * T + 2
SLOTS = 8 * N
BOUND_S = 10.0

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="holds the CPU copy thread")


def _kv() -> torch.Tensor:
    return torch.full((LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim), POISON, dtype=LAYOUT.dtype)


def _region(i: int, n: int = N) -> torch.Tensor:
    return torch.arange(i * N, i * N + n)


async def _offload(cache: KVCache, kv: torch.Tensor, tokens: list[int], salt: str | bytes | None,
                   region: int = 7) -> None:
    slots = _region(region, len(tokens))
    kv[:, slots] = oracle(tokens, salt) if not isinstance(salt, bytes) else oracle(tokens, "bytes:" + salt.hex())
    await cache.offload(tokens, slots, salt=salt)
    kv[:, slots] = GARBAGE


def _truth(tokens: list[int], salt: str | bytes | None) -> torch.Tensor:
    return oracle(tokens, salt) if not isinstance(salt, bytes) else oracle(tokens, "bytes:" + salt.hex())


async def _served(cache: KVCache, kv: torch.Tensor, tokens: list[int], salt: str | bytes | None,
                  region: int = 6) -> int:
    """A match and load of ``tokens`` alone: the oracle's bytes for what it loaded; its tokens."""
    slots = _region(region)
    kv[:, slots] = POISON
    match = await cache.match(tokens, salt)
    result = await cache.load(match, slots[: match.tokens])
    assert torch.equal(kv[:, slots[: result.tokens]], _truth(tokens, salt)[:, : result.tokens])
    assert bool((kv[:, slots[result.tokens :]] == POISON).all())
    return result.tokens


async def _on_disk_only(cache: KVCache, kv: torch.Tensor, tokens: list[int], salt: str | None) -> None:
    await _offload(cache, kv, tokens, salt)
    await cache.flush()
    for key in cache.keys(tokens, salt):
        assert cache.pool.table.discard(key)
    assert cache.disk is not None and all(cache.disk.contains(k) for k in cache.keys(tokens, salt))


@pytest.mark.asyncio
@pytest.mark.parametrize("call", ["load", "stream"])
async def test_a_load_waiting_on_a_cancelled_offloads_page_reads_it_from_disk(tmp_path: Path, call: str) -> None:
    """A load's promotion (a stream's) finds the page being written by an offload,
    waits for its commit, and the offload is cancelled (its page aborted): the page is still on
    disk, so the load reads it from there. Before, the promotion took the abort for a miss: the
    load stopped there (0 of 6 pages), counted ``load_shortened`` for no fault."""
    kv = _kv()
    tokens = prompt(11)[:N]
    async with KVCache(config(tmp_path / "disk", pool_pages=16, commit_wait=5.0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await _on_disk_only(cache, kv, tokens, None)
        match = await cache.match(tokens)
        assert match.pool_pages == 0 and match.disk_pages == PAGES, match
        target = _region(2)
        gate = CopyThreadGate(cache)
        try:
            # Another engine stores the same prefix again; its copy waits behind the gate.
            source = _region(1)
            kv[:, source] = _truth(tokens, None)
            offload = asyncio.ensure_future(cache.offload(tokens, source))
            for _ in range(5):
                await asyncio.sleep(0)
            assert cache.stats().pool_reserved == PAGES
            if call == "load":
                done = asyncio.ensure_future(cache.load(match, target[: match.tokens]))
            else:
                stream = await cache.start_load(match, target[: match.tokens])
                done = asyncio.ensure_future(stream.finish())
            for _ in range(5):
                await asyncio.sleep(0)
            assert not done.done()  # waiting for the offload's commits
            offload.cancel()  # its copy never ran: withdrawn, its pages aborted
            with pytest.raises(asyncio.CancelledError):
                await offload
            kv[:, source] = GARBAGE
        finally:
            await gate.open()
        async with asyncio.timeout(BOUND_S):
            result = await done
        loaded = result.tokens if call == "load" else result.tokens - result.loaded_from
        assert loaded == PAGES * T, (result, errors_of(cache))
        assert torch.equal(kv[:, target[:loaded]], _truth(tokens, None)[:, :loaded])
        assert errors_of(cache) == {}, errors_of(cache)
        await assert_quiescent(cache)
        assert await _served(cache, kv, tokens, None) == PAGES * T

@pytest.mark.asyncio
@pytest.mark.parametrize("layered", [False, True])
async def test_a_streams_pages_survive_a_flood_of_offloads_while_its_copies_wait(
    tmp_path: Path, layered: bool
) -> None:
    """A stream's copies wait on the copy thread while other prompts' offloads want the whole pool:
    the pages the stream launched (and those it holds, not launched yet) are never evicted under
    it; it delivers the oracle's bytes; the flood stores what fits and counts the rest."""
    kv = _kv()
    tokens = prompt(12)[:N]
    others = [prompt(100 + i)[:N] for i in range(3)]
    async with KVCache(config(tmp_path / "disk", pool_pages=PAGES + 2, offload_wait=0.05), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await _offload(cache, kv, tokens, "s")
        await cache.flush()
        for key in cache.keys(tokens, "s")[PAGES // 2 :]:
            assert cache.pool.table.discard(key)  # the back half from disk, the front half in the pool
        match = await cache.match(tokens, "s")
        assert (match.pool_pages, match.disk_pages) == (PAGES // 2, PAGES - PAGES // 2), match
        target = _region(2)
        gate = CopyThreadGate(cache)
        try:
            stream = await cache.start_load(match, target[: match.tokens], layered=layered)
            async with asyncio.timeout(BOUND_S):
                while stream.front > 0 and not stream._loader.done():
                    await stream.wait_front(0)
            # Their copies queue behind the stream's (one copy thread): they reserve what they can
            # now, evicting whatever is evictable, and wait for room for the rest.
            flood = [asyncio.ensure_future(_offload(cache, kv, other, None, region=3 + i))
                     for i, other in enumerate(others)]
            for _ in range(20):
                await asyncio.sleep(0)
            assert cache.stats().pool_reserved > 0
        finally:
            await gate.open()
        async with asyncio.timeout(BOUND_S):
            result = await stream.finish()
            await asyncio.gather(*flood)
        assert result.loaded_from == 0, (result, errors_of(cache))
        assert torch.equal(kv[:, target[: match.tokens]], _truth(tokens, "s")[:, : match.tokens])
        kv[:, target] = POISON
        await assert_quiescent(cache)
        assert bool((kv[:, target] == POISON).all())
        assert await _served(cache, kv, tokens, "s") == PAGES * T
        for other in others:
            await _served(cache, kv, other, None)  # whatever was stored is the oracle's


@pytest.mark.asyncio
async def test_namespaces_salts_and_layouts_never_share_pages_over_one_disk(tmp_path: Path) -> None:
    """One prompt stored under three namespaces' worth of tenants (no salt, a str salt, the same
    bytes as a bytes salt) by a cache that then closes: a cache of the same namespace and layout
    serves each tenant its own bytes (from disk); another namespace, or another layout over the
    same directory, serves none of them."""
    kv = _kv()
    tokens = prompt(13)[:N]
    salts: list[str | bytes | None] = [None, "t", b"t"]
    root = tmp_path / "disk"
    async with KVCache(config(root), LAYOUT, kv) as cache:
        for salt in salts:
            await _offload(cache, kv, tokens, salt)
        await cache.flush()
        assert cache.stats().pages_stored == 3 * PAGES  # three tenants: no page shared
    async with KVCache(config(root), LAYOUT, kv) as cache:
        for salt in salts:
            assert await _served(cache, kv, tokens, salt) == PAGES * T
        await assert_quiescent(cache)
    other_ns = dataclasses.replace(config(root), namespace="another-model")
    async with KVCache(other_ns, LAYOUT, kv) as cache:
        for salt in salts:
            match = await cache.match(tokens, salt)
            assert match.tokens == 0, (salt, match)
            match.release()
    wider = KVLayout.mha(2, 2, 8, torch.bfloat16, page_tokens=T)  # same shape and bytes, another dtype
    wide_kv = torch.zeros((wider.num_layers, SLOTS, wider.rows, wider.head_dim), dtype=wider.dtype)
    async with KVCache(config(root, layout=wider), wider, wide_kv) as cache:
        for salt in salts:
            match = await cache.match(tokens, salt)
            assert match.tokens == 0, (salt, match)
            match.release()


@pytest.mark.asyncio
async def test_an_offload_cancelled_after_a_round_counts_the_pages_it_stored(tmp_path: Path) -> None:
    """An offload larger than the pool goes in rounds; cancelled after its first round committed
    (while it waits for room, or in the next round), the pages that round stored are in the pool
    and served: ``pages_stored`` counts them. Before, the counters were folded only after the last
    round: the stored pages went uncounted (``gpu_to_pool`` bytes counted, pages not)."""
    kv = _kv()
    tokens = prompt(14)[:N]
    pool_pages = PAGES - 2
    async with KVCache(config(tmp_path / "disk", pool_pages=pool_pages, offload_wait=5.0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        source = _region(1)
        kv[:, source] = _truth(tokens, None)
        offload = asyncio.ensure_future(cache.offload(tokens, source))
        await until_spin(lambda: cache.pool.table.statistics().commits >= pool_pages, "the first round's commits",
                         BOUND_S)
        # The commits ran in the offload's own step, which went on to its wait for room (or to the
        # next round's first turn) without a pause: it is suspended there now.
        assert not offload.done()
        offload.cancel()
        with pytest.raises(asyncio.CancelledError):
            await offload
        kv[:, source] = GARBAGE
        await assert_quiescent(cache)
        stats = cache.stats()
        assert stats.pages_stored == pool_pages, stats
        assert stats.bytes_moved["gpu_to_pool"] == pool_pages * LAYOUT.payload_bytes, stats
        assert await _served(cache, kv, tokens, None) >= pool_pages * T
