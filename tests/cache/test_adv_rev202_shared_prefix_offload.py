"""Adversarial (helper-202): two offloads of one prefix, the first one's write given up.

Two requests share a system prompt: both offload its pages, the second while the first's copy
still runs. The second finds those pages being written (PENDING). It used to report them skipped
at once; when the first was then cancelled (or its copy failed) neither call stored them: the
prefix was lost although the second call returned. Now the second waits (``commit_wait`` at
most, in all) for the first's outcome and writes a page the first gave up itself, from its own
slots, before it returns.

The copy thread is held (:class:`cache_helpers.CopyThreadGate`) so that the first's copy waits
where the test wants it. Oracle: a token's KV is a hash of its whole prefix
(``test_adv_rev195_cancel_sweep.oracle``); a source's slots are overwritten with GARBAGE as soon
as its call ended, so a late read of them would store garbage, which a later load would show.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, CopyThreadGate, assert_quiescent, config, errors_of
from loop_probes import until, waiting_in
from test_adv_rev195_cancel_sweep import GARBAGE, POISON, oracle, prompt

from aiokv import KVCache
from aiokv.kernels.hostcopy import HostGather

T = LAYOUT.page_tokens
PAGES = 6
SHARED = 3
"""Pages of the shared prefix (the first request's whole prompt)."""
N = PAGES * T + 2
SLOTS = 8 * N
BOUND_S = 10.0

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="holds the CPU copy thread")


class InjectedCopyFault(RuntimeError):
    """The first offload's copy failed on the copy thread (the test's fault)."""


def _kv() -> torch.Tensor:
    return torch.full((LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim), POISON, dtype=LAYOUT.dtype)


def _region(i: int, n: int = N) -> torch.Tensor:
    return torch.arange(i * N, i * N + n)


async def _served(cache: KVCache, kv: torch.Tensor, tokens: list[int], region: int = 6) -> tuple[int, int]:
    """A match and load of ``tokens``: the oracle's bytes for what it loaded, POISON past it.
    Returns (tokens loaded, pool pages of the match)."""
    slots = _region(region)
    kv[:, slots] = POISON
    match = await cache.match(tokens)
    pool_pages = match.pool_pages
    result = await cache.load(match, slots[: match.tokens])
    assert torch.equal(kv[:, slots[: result.tokens]], oracle(tokens, None)[:, : result.tokens])
    assert bool((kv[:, slots[result.tokens :]] == POISON).all())
    return result.tokens, pool_pages


def _fail_copies_from(monkeypatch: pytest.MonkeyPatch, region: torch.Tensor) -> list[int]:
    """Offload copies on the copy thread out of the slots ``region`` fail before they write;
    others run. Returns the count of failed copies (one element)."""
    real = HostGather.offload
    low, high = int(region[0]), int(region[-1])
    fired = [0]

    def offload(this: HostGather, slots: torch.Tensor, page_ids: list[int]) -> None:
        if low <= int(slots.min()) and int(slots.max()) <= high:
            fired[0] += 1
            raise InjectedCopyFault("offload copy failed")
        real(this, slots, page_ids)

    monkeypatch.setattr(HostGather, "offload", offload)
    return fired


@pytest.mark.asyncio
@pytest.mark.parametrize("first_ends", ["cancelled", "copy_failed"])
async def test_the_second_offload_stores_the_shared_pages_the_first_gave_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first_ends: str
) -> None:
    """The first request offloads the shared prefix (3 pages), the second its whole prompt (6)
    while the first's copy is held; the first is cancelled (or its copy fails). The second's
    result says every page is stored or skipped, so a later match must find all 6 in the pool,
    and the disk must hold them after the write-behind. Before: the 3 shared pages were lost
    (the match found 0 pages) although the second returned skipped=3."""
    kv = _kv()
    tokens = prompt(21)[:N]
    truth = oracle(tokens, None)
    async with KVCache(config(tmp_path / "disk", pool_pages=16, commit_wait=5.0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        first_slots, second_slots = _region(1, SHARED * T), _region(2)
        fired = _fail_copies_from(monkeypatch, first_slots) if first_ends == "copy_failed" else [0]
        kv[:, first_slots] = truth[:, : SHARED * T]
        kv[:, second_slots] = truth
        gate = CopyThreadGate(cache)
        try:
            first = asyncio.ensure_future(cache.offload(tokens[: SHARED * T], first_slots))
            await until(lambda: cache.stats().pool_reserved == SHARED)
            second = asyncio.ensure_future(cache.offload(tokens, second_slots))
            await until(lambda: cache.stats().pool_reserved == PAGES)  # its own 3 reserved too
            for _ in range(10):
                await asyncio.sleep(0)
            if first_ends == "cancelled":
                first.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await first
                kv[:, first_slots] = GARBAGE
        finally:
            await gate.open()
        async with asyncio.timeout(BOUND_S):
            result = await second
            if first_ends == "copy_failed":
                first_result = await first
                assert first_result.dropped == SHARED and fired[0] >= 1, first_result
                kv[:, first_slots] = GARBAGE
        kv[:, second_slots] = GARBAGE
        assert result.stored + result.skipped == PAGES and result.dropped == 0, result
        assert result.stored == PAGES, result  # the shared pages too: nobody else stored them
        loaded, pool_pages = await _served(cache, kv, tokens)
        assert (loaded, pool_pages) == (PAGES * T, PAGES), (loaded, pool_pages, errors_of(cache))
        allowed = {"copy_failed"} if first_ends == "copy_failed" else set()
        assert set(errors_of(cache)) <= allowed, errors_of(cache)
        await assert_quiescent(cache)
        assert cache.disk is not None and all(cache.disk.contains(k) for k in cache.keys(tokens))


@pytest.mark.asyncio
async def test_the_second_offload_returns_once_the_first_stored_the_shared_pages(tmp_path: Path) -> None:
    """Both offload the shared prefix and the first's copy delivers: the second returns only
    after the first's commit (so that its success means the pages are there), counting them
    skipped, and copies nothing itself."""
    kv = _kv()
    tokens = prompt(22)[: SHARED * T + 2]
    truth = oracle(tokens, None)
    async with KVCache(config(None, pool_pages=16, commit_wait=5.0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        first_slots, second_slots = _region(1, len(tokens)), _region(2, len(tokens))
        kv[:, first_slots] = truth
        kv[:, second_slots] = truth
        gate = CopyThreadGate(cache)
        try:
            first = asyncio.ensure_future(cache.offload(tokens, first_slots))
            await until(lambda: cache.stats().pool_reserved == SHARED)
            second = asyncio.ensure_future(cache.offload(tokens, second_slots))
            await until(lambda: waiting_in(second, "wait_committed"))
            assert not second.done()
        finally:
            await gate.open()
        async with asyncio.timeout(BOUND_S):
            result, first_result = await second, await first
        assert first_result.stored == SHARED, first_result
        assert (result.stored, result.skipped, result.dropped) == (0, SHARED, 0), result
        assert cache.stats().bytes_moved["gpu_to_pool"] == SHARED * LAYOUT.payload_bytes
        kv[:, first_slots] = GARBAGE
        kv[:, second_slots] = GARBAGE
        assert await _served(cache, kv, tokens) == (SHARED * T, SHARED)
        assert errors_of(cache) == {}, errors_of(cache)
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_a_second_offload_cancelled_while_it_waits_leaves_the_first_alone(tmp_path: Path) -> None:
    """Both offload the shared prefix; the second is cancelled while it waits for the first's
    commit: it raises at once (nothing of its own in flight), and the first stores its pages as
    if alone."""
    kv = _kv()
    tokens = prompt(23)[: SHARED * T + 2]
    truth = oracle(tokens, None)
    async with KVCache(config(tmp_path / "disk", pool_pages=16, commit_wait=5.0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        first_slots, second_slots = _region(1, len(tokens)), _region(2, len(tokens))
        kv[:, first_slots] = truth
        kv[:, second_slots] = truth
        gate = CopyThreadGate(cache)
        try:
            first = asyncio.ensure_future(cache.offload(tokens, first_slots))
            await until(lambda: cache.stats().pool_reserved == SHARED)
            second = asyncio.ensure_future(cache.offload(tokens, second_slots))
            await until(lambda: waiting_in(second, "wait_committed"))
            second.cancel()
            with pytest.raises(asyncio.CancelledError):
                await second
            kv[:, second_slots] = GARBAGE
            assert cache.stats().pool_reserved == SHARED  # the first's, untouched
        finally:
            await gate.open()
        async with asyncio.timeout(BOUND_S):
            first_result = await first
        kv[:, first_slots] = GARBAGE
        assert first_result.stored == SHARED, first_result
        assert await _served(cache, kv, tokens) == (SHARED * T, SHARED)
        assert errors_of(cache) == {}, errors_of(cache)
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_a_second_offload_waits_for_a_stopped_writer_only_commit_wait(tmp_path: Path) -> None:
    """The first's copy stays held (a stopped writer): the second, of the same pages, returns
    after ``commit_wait`` (a bound, counted ``commit_wait_expired`` once for all its pages),
    reporting them skipped as before; once the first delivers, they are served."""
    kv = _kv()
    tokens = prompt(25)[: SHARED * T + 2]
    truth = oracle(tokens, None)
    wait = 0.3
    async with KVCache(config(None, pool_pages=16, commit_wait=wait), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        first_slots, second_slots = _region(1, len(tokens)), _region(2, len(tokens))
        kv[:, first_slots] = truth
        kv[:, second_slots] = truth
        gate = CopyThreadGate(cache)
        try:
            first = asyncio.ensure_future(cache.offload(tokens, first_slots))
            await until(lambda: cache.stats().pool_reserved == SHARED)
            loop = asyncio.get_running_loop()
            began = loop.time()
            second = asyncio.ensure_future(cache.offload(tokens, second_slots))
            done, _ = await asyncio.wait({second}, timeout=wait + BOUND_S)
            assert second in done
            assert loop.time() - began >= wait * 0.9
            result = second.result()
            assert not first.done()
        finally:
            await gate.open()
        assert (result.stored, result.skipped, result.dropped) == (0, SHARED, 0), result
        assert errors_of(cache) == {"commit_wait_expired": 1}, errors_of(cache)
        async with asyncio.timeout(BOUND_S):
            await first
        kv[:, first_slots] = GARBAGE
        kv[:, second_slots] = GARBAGE
        assert await _served(cache, kv, tokens) == (SHARED * T, SHARED)
        await assert_quiescent(cache)
