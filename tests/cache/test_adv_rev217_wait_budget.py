"""Adversarial (helper-217): ``commit_wait`` bounds the time a call waits, not its wall time.

Reviews 214 and 217 gave a load, a prefetch and a stream one ``commit_wait`` for all their waits
on pages other calls are writing. As a deadline set at the call's first wait it also cut a wait
that began after the deadline: a stream lives as long as the engine's prefill (seconds for a long
prompt), so one that waited briefly for a page another request was reading (a shared system
prompt), then met another such page a bound later, stopped there at once: ``commit_wait_expired``
and a shorter stream although every writer was quick. The bound is now the time spent waiting
(while any wait of the call runs), ``commit_wait`` in all.

Page 1's and page 0's writers are page-table reservations (as a TP rank's copy holds one), each
given up soon after the stream waits for it (the stream then reads the page itself); the stream's
read of page 1 is held in front of the tier's backend (``LoadGate``) until the call's first wait
is more than ``commit_wait`` old, so its wait for page 0 begins after that.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, errors_of, make_kv, on_disk_only, prompt, reserve_each
from load_gate import LoadGate
from loop_probes import until, until_thread, waiting_in

from aiokv import KVCache
from aiokv.pagetable import PageHandle

T = LAYOUT.page_tokens
PAGES = 2
WAIT_S = 0.5
"""commit_wait."""
BOUND_S = 10.0


def _waiting() -> bool:
    return any(waiting_in(t, "wait_committed") for t in asyncio.all_tasks())


@pytest.mark.asyncio
async def test_a_stream_waits_past_its_first_waits_deadline_when_it_waited_little(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = prompt(2176, PAGES * T)
    kv = make_kv(2177)
    cfg = config(tmp_path / "disk", pool_pages=16, commit_wait=WAIT_S)
    assert cfg.disk is not None
    cfg = dataclasses.replace(cfg, disk=dataclasses.replace(cfg.disk, queue_depth=1))  # one read ahead
    async with KVCache(cfg, LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        table = cache.pool.table
        keys = await on_disk_only(cache, tokens, torch.arange(PAGES * T))
        match = await cache.match(tokens)
        assert (match.pool_pages, match.disk_pages) == (0, PAGES), match
        writers: list[PageHandle] = reserve_each(cache, keys)
        loop = asyncio.get_running_loop()
        target = torch.arange(100, 100 + PAGES * T)
        gate = LoadGate(disk, monkeypatch, limit=1)

        async def stream() -> Any:
            s = await cache.start_load(match, target)
            return await s.finish()

        task = asyncio.create_task(stream())
        try:
            await until(_waiting)  # page 1 (a stream reads back to front)
            first_wait = loop.time()
            table.abort(writers[1])  # given up: the stream reads page 1 itself (held)
            await until_thread(lambda: bool(gate.held), "page 1's read")
            # The bound is what this is about: the first wait's deadline passes meanwhile.
            await asyncio.sleep(max(0.0, first_wait + WAIT_S - loop.time()) + 0.1)
            gate.open()
            # Page 0: the stream waits for its writer (before: expired at once, the stream over).
            await until_thread(lambda: task.done() or _waiting(), "page 0's wait")
            table.abort(writers[0])
            async with asyncio.timeout(BOUND_S):
                result = await task
        finally:
            gate.open()
            for handle in writers:
                if not handle.released:
                    table.abort(handle)
            if not task.done():
                task.cancel()
        assert result.loaded_tokens == PAGES * T, (result, errors_of(cache))
        assert errors_of(cache) == {}, errors_of(cache)
        assert torch.equal(kv[:, target], kv[:, : PAGES * T])
        await assert_quiescent(cache)
