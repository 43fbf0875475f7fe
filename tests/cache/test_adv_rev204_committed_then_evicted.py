"""Adversarial (review 204): a load's promotion waited for a page another call was writing; that
call committed it and, before the waiter looked, the pool evicted it for room.

The prompt is on disk only and matched there. An offload of the same prompt (another engine's)
reserves its pages, its copy held; the load's promotions find them being written and wait. The
offload's copy then delivers; the disk holds the pages already, so they are committed with no
reference (evictable at once), and before the waiter's task resumes another offload needs room
and the pool evicts one of them (every other pool page is held by a match). The load took the
page for a miss: it stopped short (1 of 2 pages, counted only ``load_shortened``) although the page
was still on disk, as the prompt's match said: the shape of the shared-prefix fuzz's unexplained
"load one page short, no fault counted" with a disk budget that never evicts (review 202). It
must read the page from disk again, as it does for a page whose writer gave it up.

The interleaving is forced: the page table's ``commit`` is wrapped so that the other offload
starts right after the writer's commits; it reserves in its first step, before the waiter's task
resumes (two loop hops behind the commit).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, CopyThreadGate, assert_quiescent, config, errors_of
from loop_probes import until, waiting_in
from test_adv_rev195_cancel_sweep import GARBAGE, POISON, oracle, prompt

from aiokv import KVCache

T = LAYOUT.page_tokens
PAGES = 2
POOL = 8
PINNED = POOL - PAGES
BOUND_S = 10.0

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="holds the CPU copy thread")


@pytest.mark.asyncio
async def test_a_load_waiting_for_a_page_evicted_right_after_its_commit_reads_it_from_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = PAGES * T
    kv = torch.full((LAYOUT.num_layers, 8 * n + (PINNED + 1) * T, LAYOUT.rows, LAYOUT.head_dim), POISON,
                    dtype=LAYOUT.dtype)
    tokens = prompt(61)[:n]
    pinned_tokens = prompt(62)[: PINNED * T]
    later_tokens = prompt(63)[:T]
    truth = oracle(tokens, None)
    region = [torch.arange(i * n, (i + 1) * n) for i in range(8)]
    async with KVCache(config(tmp_path / "disk", pool_pages=POOL, commit_wait=5.0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        assert cache.pool.table.capacity == POOL
        kv[:, region[0]] = truth
        assert (await cache.offload(tokens, region[0])).stored == PAGES
        kv[:, region[0]] = GARBAGE
        pinned_slots = torch.arange(8 * n, 8 * n + PINNED * T)
        kv[:, pinned_slots] = oracle(pinned_tokens, None)
        await cache.offload(pinned_tokens, pinned_slots)
        await cache.flush()
        table = cache.pool.table
        for key in cache.keys(tokens):
            assert table.discard(key)
        match = await cache.match(tokens)
        assert (match.pool_pages, match.disk_pages) == (0, PAGES), match
        # Every other pool page held: a reservation can evict only the prompt's pages.
        pins = await cache.match(pinned_tokens)
        assert pins.pool_pages == PINNED, pins
        writer_slots, target = region[1], region[2]
        kv[:, writer_slots] = truth
        later_slots = torch.arange(8 * n + PINNED * T, 8 * n + (PINNED + 1) * T)
        kv[:, later_slots] = oracle(later_tokens, None)
        real_commit = table.commit
        later: list[asyncio.Future[Any]] = []

        def commit(handle: Any, *, keep: bool = False) -> Any:
            kept = real_commit(handle, keep=keep)
            if not later and handle.key == cache.keys(tokens)[-1]:
                # The writer's last commit: the other offload reserves before the waiter looks.
                later.append(asyncio.ensure_future(cache._manager.offload(later_tokens, later_slots)))
            return kept

        gate = CopyThreadGate(cache)
        try:
            writer = asyncio.ensure_future(cache.offload(tokens, writer_slots))
            await until(lambda: cache.stats().pool_reserved == PAGES)
            loading = asyncio.ensure_future(cache.load(match, target[: match.tokens]))
            await until(lambda: any(waiting_in(t, "wait_committed") for t in asyncio.all_tasks()))
            monkeypatch.setattr(table, "commit", commit)
        finally:
            await gate.open()
        async with asyncio.timeout(BOUND_S):
            written = await writer
            kv[:, writer_slots] = GARBAGE
            await until(lambda: bool(later))
            monkeypatch.setattr(table, "commit", real_commit)
            loaded = await loading
            other = await later[0]
        pins.release()
        assert written.stored == PAGES, written
        assert other.stored == 1, other  # it evicted one of the prompt's pages
        assert torch.equal(kv[:, target[: loaded.tokens]], truth[:, : loaded.tokens])
        assert bool((kv[:, target[loaded.tokens :]] == POISON).all())
        assert loaded.tokens == PAGES * T, (loaded, errors_of(cache))
        assert errors_of(cache) == {}, errors_of(cache)
        await assert_quiescent(cache)
