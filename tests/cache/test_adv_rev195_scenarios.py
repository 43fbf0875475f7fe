"""Adversarial (helper-195): interleavings of one prefix's callers, driven deterministically.

The copy thread is held (:class:`cache_helpers.CopyThreadGate`) so that copies wait where the test
wants them: an offload of a prefix while a load of the same pages runs (from the pool, and from
disk through promotions), the same prefix offloaded by two callers, one cancelled, a stream's
pages under eviction pressure, and isolation of namespaces, salts and layouts over one disk
directory. Oracle: a token's KV is a hash of its salt and whole prefix (``test_adv_rev195_cancel_sweep.oracle``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, CopyThreadGate, assert_quiescent, config, errors_of
from test_adv_rev195_cancel_sweep import GARBAGE, POISON, oracle, prompt

from aiokv import KVCache

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

