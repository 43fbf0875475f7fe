"""Adversarial (helper-263): a loop-wide cancel repeated turn after turn (an application's SIGTERM
handler run by every signal of a burst) while a stream is closed with its copies still queued.

A stream's close waits until no copy touches the engine's slots (``StreamCopies.quiesce``), in a
task of its own so that the cancels it waits through land there. A loop-wide cancel that came after
that task was created but before its first step ended it without running: nothing was withdrawn nor
waited for, ``quiesce`` raised, and ``_abandon`` raised past the release of the stream's pages. So
``aclose()`` raised ``CancelledError`` with its copies still queued on the copy thread, which then
wrote the slots the engine had reused (the cancellation contract), and the stream's pool references
were never given back (pages pinned until the cache's close).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, CopyThreadGate, assert_quiescent, config, prompt
from test_adv_rev263_loop_cancel import POISON

from aiokv import KVCache

T = LAYOUT.page_tokens
PAGES = 8
N = PAGES * T
BOUND_S = 20.0
BURST = 12

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU KV buffer: poison checks read it directly")


def _cut_all_but(spared: set[asyncio.Task[object] | None]) -> None:
    for task in asyncio.all_tasks():
        if task not in spared and not task.done():
            task.cancel()


@pytest.mark.asyncio
@pytest.mark.parametrize("turns", range(1, 8))
@pytest.mark.parametrize("end", ["aclose", "finish"])
async def test_a_cancel_burst_never_ends_a_streams_close_before_its_copies(
    tmp_path: Path, turns: int, end: str
) -> None:
    kv = torch.full((LAYOUT.num_layers, 4 * N, LAYOUT.rows, LAYOUT.head_dim), POISON, dtype=LAYOUT.dtype)
    cache = KVCache(config(None, pool_pages=2 * PAGES, launch_pages=1), LAYOUT, kv)
    await cache.start()
    await cache.pool.wait_ready()
    try:
        tokens = prompt(263, N)
        source = torch.arange(0, N)
        kv[:, source] = torch.randn(LAYOUT.num_layers, N, LAYOUT.rows, LAYOUT.head_dim).to(LAYOUT.dtype)
        assert (await cache.offload(tokens, source)).stored == PAGES
        target = torch.arange(N, 2 * N)
        match = await cache.match(tokens)
        gate = CopyThreadGate(cache)  # the stream's copies queue behind it
        try:
            stream = await cache.start_load(match, target)
            await stream.launched()

            async def ending() -> None:
                if end == "aclose":
                    await stream.aclose()
                else:
                    await stream.finish()

            task = asyncio.ensure_future(ending())
            cutter = asyncio.current_task()
            for _ in range(turns):  # (at least one: the call began, as an engine's own call has)
                await asyncio.sleep(0)
            # The burst: every task but this one and the gate's blocker cut, turn after turn.
            for _ in range(BURST):
                _cut_all_but({cutter})
                await asyncio.sleep(0)
            async with asyncio.timeout(BOUND_S):
                outcome = await asyncio.gather(task, return_exceptions=True)
            # Cut, or over before the burst reached it (its queued copies withdrawn, not waited for).
            assert outcome[0] is None or isinstance(outcome[0], asyncio.CancelledError), outcome
            kv[:, target] = POISON  # the engine reuses the slots once the call is over
        finally:
            await gate.open()
        async with asyncio.timeout(BOUND_S):
            await cache._bridge.run_cpu(lambda: None)  # behind whatever was queued on the copy thread
            await cache.flush()
        changed = (kv[:, target] != POISON).any(dim=(0, 2, 3)).nonzero().flatten().tolist()
        assert not changed, f"slots {changed} written after the stream's {end}() ended"
        async with asyncio.timeout(BOUND_S):
            await assert_quiescent(cache)
    finally:
        async with asyncio.timeout(BOUND_S):
            await cache.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("turns", range(0, 6))
@pytest.mark.parametrize("call", ["load", "offload"])
async def test_a_cancel_burst_never_ends_a_load_or_offload_before_its_copies(
    tmp_path: Path, turns: int, call: str
) -> None:
    """The same burst over a plain load (its copies queued behind a held copy thread) and an offload
    (its gathers likewise): once the call ended, its slots are the engine's. A late load copy would
    write the poisoned target; a late gather would store the garbage written into the source, which
    a load of the prompt afterwards shows."""
    kv = torch.full((LAYOUT.num_layers, 4 * N, LAYOUT.rows, LAYOUT.head_dim), POISON, dtype=LAYOUT.dtype)
    cache = KVCache(config(None, pool_pages=2 * PAGES, launch_pages=1), LAYOUT, kv)
    await cache.start()
    await cache.pool.wait_ready()
    try:
        tokens = prompt(264, N)
        source = torch.arange(0, N)
        truth = torch.randn(LAYOUT.num_layers, N, LAYOUT.rows, LAYOUT.head_dim).to(LAYOUT.dtype)
        kv[:, source] = truth
        target = torch.arange(N, 2 * N)
        if call == "load":
            assert (await cache.offload(tokens, source)).stored == PAGES
            match = await cache.match(tokens)
        gate = CopyThreadGate(cache)
        try:
            if call == "load":
                task = asyncio.ensure_future(cache.load(match, target))
            else:
                task = asyncio.ensure_future(cache.offload(tokens, source))
            cutter = asyncio.current_task()
            await asyncio.sleep(0)  # the call began
            for _ in range(turns):
                await asyncio.sleep(0)
            for _ in range(BURST):
                _cut_all_but({cutter})
                await asyncio.sleep(0)
            async with asyncio.timeout(BOUND_S):
                outcome = (await asyncio.gather(task, return_exceptions=True))[0]
            assert not isinstance(outcome, BaseException) or isinstance(outcome, asyncio.CancelledError), outcome
            # The engine reuses the slots once the call is over.
            kv[:, target] = POISON
            kv[:, source] = POISON
        finally:
            await gate.open()
        async with asyncio.timeout(BOUND_S):
            await cache._bridge.run_cpu(lambda: None)  # behind whatever was queued on the copy thread
            await cache.flush()
        changed = (kv[:, target] != POISON).any(dim=(0, 2, 3)).nonzero().flatten().tolist()
        assert not changed, f"slots {changed} written after the {call} ended ({outcome!r})"
        async with asyncio.timeout(BOUND_S):
            await assert_quiescent(cache)
            again = await cache.match(tokens)
            check = torch.arange(2 * N, 2 * N + again.tokens)
            got = await cache.load(again, check)
        assert torch.equal(kv[:, check[: got.tokens]], truth[:, : got.tokens]), "a page stored the engine's reuse"
        if call == "load" or not isinstance(outcome, BaseException):
            assert got.tokens == N, got
    finally:
        async with asyncio.timeout(BOUND_S):
            await cache.aclose()
