"""Adversarial (review 205): 9efa26d's sibling. A load's promotion waited for a page another call
was writing; that call committed it, the pool evicted it (committed with no reference: the disk
held it already), and before the waiter looked another promotion of the same page (another
load's, a stream's) reserved it to read it from disk. 9efa26d reads such a page from disk only
when it is FREE by then: here it is being read by the other call, so the waiter took it for a
miss and the load stopped there (0 of 2 pages, counted only ``load_shortened``) although the page
was on disk and about to be in the pool. It must wait for that read and take the page, as a
promotion that finds the page PENDING does.

Forced as in ``test_adv_rev204_committed_then_evicted``: the writer's copy held on the real copy
thread, the page table's ``commit`` wrapped so that right after the writer's last commit the first
page goes (``discard``: what a reservation's eviction does to an unreferenced page) and another
promotion of it begins; it reserves in its first step, before the waiter's task resumes.
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
from aiokv.loadpath import Promotion

T = LAYOUT.page_tokens
PAGES = 2
POOL = 8
BOUND_S = 10.0

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="holds the CPU copy thread")


@pytest.mark.asyncio
async def test_a_load_waiting_for_a_page_evicted_and_reserved_by_another_read_takes_that_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = PAGES * T
    kv = torch.full((LAYOUT.num_layers, 4 * n, LAYOUT.rows, LAYOUT.head_dim), POISON, dtype=LAYOUT.dtype)
    tokens = prompt(71)[:n]
    truth = oracle(tokens, None)  # each page's bytes tied to its whole prefix
    region = [torch.arange(i * n, (i + 1) * n) for i in range(4)]
    async with KVCache(config(tmp_path / "disk", pool_pages=POOL, commit_wait=5.0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        kv[:, region[0]] = truth
        assert (await cache.offload(tokens, region[0])).stored == PAGES
        kv[:, region[0]] = GARBAGE
        await cache.flush()
        table = cache.pool.table
        keys = cache.keys(tokens)
        for key in keys:
            assert table.discard(key)
        match = await cache.match(tokens)
        assert (match.pool_pages, match.disk_pages) == (0, PAGES), match
        writer_slots, target = region[1], region[2]
        kv[:, writer_slots] = truth
        real_commit = table.commit
        other: list[asyncio.Future[Any]] = []

        def commit(handle: Any, *, keep: bool = False) -> Any:
            kept = real_commit(handle, keep=keep)
            if not other and handle.key == keys[-1]:
                # The writer's last commit: the first page goes, another promotion reserves it.
                assert table.discard(keys[0])
                other.append(asyncio.ensure_future(cache._manager.promote(keys[0])))
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
            await until(lambda: bool(other))
            monkeypatch.setattr(table, "commit", real_commit)
            loaded = await loading
            promoted = await other[0]
        assert isinstance(promoted, Promotion) and promoted.read, promoted  # it read the page from disk
        cache._manager.release([promoted.handle])
        assert written.stored == PAGES, written
        assert torch.equal(kv[:, target[: loaded.tokens]], truth[:, : loaded.tokens])
        assert bool((kv[:, target[loaded.tokens :]] == POISON).all())
        assert loaded.tokens == PAGES * T, (loaded, errors_of(cache))
        assert errors_of(cache) == {}, errors_of(cache)
        await assert_quiescent(cache)
