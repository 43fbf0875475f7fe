"""Compute-or-load split against a disk slower than the engine: the fronts meet without waiting on
reads in flight, nothing lands in the caller's slots afterwards, and a hopeless tier is not read.

Disk reads are held on a gate (the kernel's read is only started once the gate opens), so the tests
are driven by events: the engine overtakes every read in flight, deterministically.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, make_kv, prompt

from aiokv import KVCache
from aiokv.stream import LoadStream, StreamResult

T = LAYOUT.page_tokens
MARK = 7.0  # what the simulated engine writes into the tokens it computes
BOUND_S = 10.0  # a finish() that waits for a held read never returns: fail instead of hanging


async def _fill_disk(path: Path, tokens: list[int]) -> torch.Tensor:
    """Store ``tokens``' pages on disk (then the cache closes: the pool is gone); the source KV."""
    kv = make_kv(90)
    async with KVCache(config(path, pool_pages=32), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(len(tokens)))
        await cache.flush()
    return kv


def _gate_reads(monkeypatch: pytest.MonkeyPatch, cache: KVCache, gate: asyncio.Event, started: list[int]) -> None:
    """Hold every disk read of ``cache`` until ``gate`` opens; count the reads asked for."""
    disk = cache.disk
    assert disk is not None
    real: Callable[..., Awaitable[bool]] = disk.read

    async def held(*args: Any) -> bool:
        started[0] += 1
        await gate.wait()
        return await real(*args)

    monkeypatch.setattr(disk, "read", held)


async def _engine(stream: LoadStream, kv: torch.Tensor, slots: torch.Tensor) -> tuple[int, StreamResult]:
    """Claim a page at a time, "computing" each (writing MARK) with a loop turn between claims."""
    pos = stream.from_token
    while (end := stream.claim(pos + T)) > pos:
        kv[:, slots[pos - stream.from_token : end - stream.from_token].to(DEVICE)] = MARK
        pos = end
        await asyncio.sleep(0)
    async with asyncio.timeout(BOUND_S):
        return pos, await stream.finish()


@pytest.mark.asyncio
async def test_the_fronts_meet_without_waiting_for_reads_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression: the loader awaited the read of the page below its front even after the engine
    # had claimed that page, so finish() waited for disk reads whose bytes nobody used (a 32 MiB
    # page read on the H200 took tens of ms, sixteen in flight ~300 ms: longer than recomputing).
    n = 10 * T
    tokens = prompt(91, n)
    await _fill_disk(tmp_path, tokens)
    kv = make_kv(92)
    async with KVCache(config(tmp_path, pool_pages=32), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        gate, started = asyncio.Event(), [0]
        _gate_reads(monkeypatch, cache, gate, started)
        match = await cache.match(tokens)
        assert match.disk_pages == 10
        target = torch.arange(40, 40 + n)
        stream = await cache.start_load(match, target)
        try:
            computed, result = await _engine(stream, kv, target)
        finally:
            held = not gate.is_set()
            gate.set()  # never leave reads held when the test fails
        # The engine computed everything; no read was waited for; the reads are still held.
        assert computed == result.claimed == result.loaded_from == n
        assert result.disk_pages == 0 and started[0] >= 1 and held
        snapshot = kv[:, target.to(DEVICE)].clone()
        assert bool((snapshot == MARK).all())
        await cache.flush()  # the adopted reads land in the pool, never in the caller's slots
        assert torch.equal(kv[:, target.to(DEVICE)], snapshot), "a read overtaken by the engine reached the slots"
        await assert_quiescent(cache)
        assert cache.stats().pages_promoted >= 1  # what was read stays in the pool for the next hit


@pytest.mark.asyncio
async def test_cancelled_finish_at_the_meeting_point_leaves_no_copy_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The loader launched the back pages' copies; the engine met it; finish() is cancelled while
    # those copies and a read below the front are still pending: when CancelledError arrives, no
    # copy into the slots is pending and every page is released once the read lands.
    n = 8 * T
    tokens = prompt(93, n)
    source = await _fill_disk(tmp_path, tokens)
    kv = make_kv(94)
    original = kv.clone()
    async with KVCache(config(tmp_path, pool_pages=32), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        gate, started = asyncio.Event(), [0]
        _gate_reads(monkeypatch, cache, gate, started)
        target = torch.arange(20, 20 + n)
        if DEVICE.type == "cuda":
            # The copies (ordered after this stream) stay pending on the GPU until the cancel: tiny
            # pages otherwise land before finish() first waits, and it returns at once (the H200
            # once: DID NOT RAISE CancelledError).
            await cache.wait_warm()
            torch.cuda._sleep(400_000_000)  # type: ignore[no-untyped-call]  # ~0.2 s
        stream = await cache.start_load(await cache.match(tokens), target)
        gate.set()  # the back pages land and are launched
        async with asyncio.timeout(BOUND_S):
            # Woken as the loader launches the last page (it polled stream.front every 0.2 ms).
            front = await stream.wait_front(n - T)
        gate.clear()  # later reads are held: the loader waits below its front
        assert front == stream.front and front < n
        assert stream.claim(n) == front  # the engine claims up to the front (the fronts meet)
        task = asyncio.create_task(stream.finish())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        snapshot = kv[:, target.to(DEVICE)].clone()
        gate.set()
        await cache.flush()
        assert torch.equal(kv[:, target.to(DEVICE)], snapshot), "a copy wrote the slots after CancelledError"
        await assert_quiescent(cache)
        # Each page of the slots holds either its loaded bytes or what was there before: no wrong byte.
        for page in range(n // T):
            got = kv[:, target[page * T : (page + 1) * T].to(DEVICE)]
            before = original[:, target[page * T : (page + 1) * T].to(DEVICE)]
            assert torch.equal(got, source[:, page * T : (page + 1) * T]) or torch.equal(got, before), page


@pytest.mark.asyncio
async def test_a_hopeless_tier_is_not_read_once_the_engine_computes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # By the measured rates the disk delivers a page far slower than the engine computes the whole
    # prefix: the cost model says recompute, and the stream starts no read after the engine's first
    # claim (only its read-ahead before it), whatever the engine does.
    n = 12 * T
    tokens = prompt(95, n)
    await _fill_disk(tmp_path, tokens)
    kv = make_kv(96)
    async with KVCache(config(tmp_path, pool_pages=32), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        costs = cache.manager.costs
        costs.disk.update(LAYOUT.page_bytes, 10.0)  # a page per 10 s
        cache.note_prefill(1000 * T, 1.0)  # a page per ms
        gate, started = asyncio.Event(), [0]
        _gate_reads(monkeypatch, cache, gate, started)
        match = await cache.match(tokens)
        estimate = cache.estimate(match)
        assert estimate.worth_loading is False
        assert estimate.split_token == n  # the best split computes everything
        target = torch.arange(0, n)
        stream = await cache.start_load(match, target)
        try:
            before = started[0]
            assert stream.claim(T) == T
            for _ in range(5):
                await asyncio.sleep(0)  # the loader's turns: it would start reads here
            after_claim = started[0]
            computed, result = await _engine(stream, kv, target)
        finally:
            gate.set()
        assert computed == n and result.loaded_from == n and result.disk_pages == 0
        assert started[0] == after_claim == before == 0  # nothing read: the engine computes it all
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_reads_ahead_are_bounded_in_bytes_and_go_from_the_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Sixteen 32 MiB reads in flight landed together after ~300 ms on the H200 (they share the
    # device), as long as the whole 8K prefill: the stream keeps stream_readahead_bytes in flight.
    n = 10 * T
    tokens = prompt(97, n)
    source = await _fill_disk(tmp_path, tokens)
    kv = make_kv(98)
    async with KVCache(config(tmp_path, pool_pages=32, stream_readahead_bytes=3 * LAYOUT.page_bytes),
                       LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        real: Callable[..., Awaitable[bool]] = disk.read
        keys = cache.keys(tokens)
        order: list[int] = []
        in_flight, most = [0], [0]

        async def counted(key: Any, handle: Any) -> bool:
            order.append(keys.index(key))
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            try:
                return await real(key, handle)
            finally:
                in_flight[0] -= 1

        monkeypatch.setattr(disk, "read", counted)
        target = torch.arange(30, 30 + n)
        async with await cache.start_load(await cache.match(tokens), target) as stream:
            result = await stream.finish()  # an idle engine: everything is loaded
        assert (result.loaded_from, result.disk_pages) == (0, 10)
        assert most[0] == 3  # never more than the read-ahead, and it is used
        assert order == sorted(order, reverse=True)  # from the back
        assert torch.equal(kv[:, target.to(DEVICE)], source[:, :n])
        await assert_quiescent(cache)
