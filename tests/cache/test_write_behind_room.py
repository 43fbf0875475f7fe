"""Loads waiting for pool room count the pages a write-behind worker took but has not written yet.

Review 166 saw ``test_adv_rev163_room_waits.py::test_loads_wait_for_an_offloads_reservations`` fail
4 runs in 10: the offload's pages were committed into the write-behind, its workers had taken them
off the queue but their writes held no I/O slot yet (a few loop turns: claiming a file), so the
disk said ``write_behind_queued`` 0 and ``in_flight`` 0; two loads waiting for room found nothing
that frees a page and gave up (``pool_exhausted``) although the writes gave those pages back a
moment later. ``write_behind_writing`` counts them now. Here those turns are held open on purpose:
the tier's queued-page write waits on a gate before it starts."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, make_kv, prompt
from test_adv_rev163_room_waits import WAIT_S, _store, _turns

from aiokv import DiskBackend, KVCache

T = LAYOUT.page_tokens

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU KV buffer: results read it directly")


@pytest.mark.asyncio
async def test_loads_wait_for_pages_the_write_behind_took_before_their_writes_start(tmp_path: Path) -> None:
    source = make_kv(411)
    x, y = prompt(411, T), prompt(412, T)
    await _store(tmp_path, x, source)
    await _store(tmp_path, y, source)
    kv = make_kv(413)
    base = config(tmp_path, pool_pages=4, disk_pages=96, offload_wait=WAIT_S)
    assert base.disk is not None
    cfg = dataclasses.replace(base, disk=dataclasses.replace(base.disk, write_behind_workers=4))
    cache = KVCache(cfg, LAYOUT, kv)
    await cache.start()
    gate = asyncio.Event()
    try:
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        queue = disk._queue
        assert queue is not None
        real = queue._write

        async def held(*args: Any) -> Any:
            await gate.wait()  # the turns before the write takes an I/O slot, held open
            return await real(*args)

        queue._write = held  # the workers' write of each page they take
        mx, my = await cache.match(x), await cache.match(y)
        assert (mx.disk_pages, my.disk_pages) == (1, 1)
        assert (await cache.offload(prompt(414, 4 * T), torch.arange(4 * T))).stored == 4
        await _turns(lambda: disk.statistics().write_behind_writing == 4)
        busy = disk.statistics()
        assert (busy.write_behind_queued, busy.in_flight) == (0, 0), busy
        manager = cache._manager
        loads = [asyncio.ensure_future(cache.load(m, torch.arange(b, b + T))) for m, b in ((mx, 100), (my, 150))]
        await _turns(lambda: manager._room_waiters == 2 or all(f.done() for f in loads))
        assert not any(f.done() for f in loads), "they gave up beside the write-behind's pages"
        gate.set()
        async with asyncio.timeout(WAIT_S):
            results = await asyncio.gather(*loads)
        assert [r.tokens for r in results] == [T, T], results
        assert torch.equal(kv[:, 100:100 + T], source[:, 0:T])
        assert torch.equal(kv[:, 150:150 + T], source[:, 0:T])
        assert "pool_exhausted" not in cache.stats().errors
        await cache.flush()
        assert disk.statistics().write_behind_writing == 0
        await assert_quiescent(cache)
    finally:
        gate.set()
        await cache.aclose()


@pytest.mark.asyncio
async def test_write_behind_writing_counts_a_page_until_its_write_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate, real = threading.Event(), os.pwritev

    def pwritev(fd: int, buffers: Any, offset: int) -> int:
        gate.wait(60)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)  # the threads backend's workers write through it
    cache = KVCache(config(tmp_path, pool_pages=8, backend=DiskBackend.THREADS), LAYOUT, make_kv(421))
    await cache.start()
    try:
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        assert (await cache.offload(prompt(421, T), torch.arange(T))).stored == 1
        await _turns(lambda: disk.statistics().writes_in_flight == 1)
        assert disk.statistics().write_behind_writing == 1
        gate.set()
        await cache.flush()
        busy = disk.statistics()
        assert (busy.write_behind_writing, busy.write_behind_queued, busy.writes) == (0, 0, 1), busy
    finally:
        gate.set()
        await cache.aclose()
