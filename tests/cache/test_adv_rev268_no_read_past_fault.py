"""Review 263 of 08eb01a (no work past a load's own fault), targeted (helper-268): two ways a read
group of a load still read a page past the load's own failed read. The seeded fuzz
(test_adv_rev159_fault_stop.py, seed 10) saw them about 7 runs in 20 ("caller 0 (load) read pages [4]
past page 2, whose read failed").

- A page another call was bringing in when the group reserved (PENDING) is waited for by a task of
  its own, which reads the page itself (``again``) when that call gives it up. Past the load's
  failed page the group stopped waiting for it but left that task running: once the other call's
  read failed, it read the page again, for a load that had already returned.
- That task's own read failing (the page another call gave up, read again) was no failed read for
  the group: the later pages that had found no pool room were then read one by one into the room
  the failed page's abort freed.

Real EIO on the io_uring ring; the other call's read is held before it starts (a gate), nothing sleeps.
"""

from __future__ import annotations

import asyncio
import contextvars
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, make_kv, prompt
from loop_probes import until
from test_failed_copy_stops_work import _eio

from aiokv import KVCache
from aiokv.keys import PageKey

T = LAYOUT.page_tokens
PAGES = 5
N = PAGES * T

LOADER: contextvars.ContextVar[bool] = contextvars.ContextVar("LOADER", default=False)
"""Set in the load's task (its read groups' tasks copy it): the reads it starts are the load's."""


async def _written(tmp_path: Path, tokens: list[int]) -> None:
    async with KVCache(config(tmp_path, pool_pages=16), LAYOUT, make_kv(2 * N)) as writer:
        await writer.pool.wait_ready()
        assert (await writer.offload(tokens, torch.arange(N))).stored == PAGES
        await writer.flush()


def _probe(cache: KVCache, keys: list[PageKey], held: PageKey, gate: asyncio.Event) -> list[str]:
    """Reads the load starts past a page whose read by it failed (any read of it: its batch's, one
    of its own); the other call's read of ``held`` waits for ``gate`` before it starts."""
    disk = cache.disk
    assert disk is not None
    real_many, real_one = disk.read_many, disk.read
    failed: list[int] = []  # the load's pages whose read failed
    wrong: list[str] = []
    started: list[PageKey] = []

    def reading(pages: list[PageKey]) -> None:
        if not LOADER.get():
            return
        started.extend(pages)
        past = [keys.index(k) for k in pages if failed and keys.index(k) > min(failed)]
        if past:
            wrong.append(f"the load read pages {past} past page {min(failed)}, whose read failed")

    def ended(pages: list[PageKey], oks: list[bool]) -> None:
        if LOADER.get():
            failed.extend(keys.index(k) for k, ok in zip(pages, oks, strict=True) if not ok)

    async def read_many(pages: Any, handles: Any) -> list[bool]:
        reading(list(pages))
        oks: list[bool] = await real_many(pages, handles)
        ended(list(pages), oks)
        return oks

    async def read(key: PageKey, handle: Any) -> bool:
        if not LOADER.get() and key == held:
            await gate.wait()
        reading([key])
        ok: bool = await real_one(key, handle)
        ended([key], [ok])
        return ok

    disk.read_many = read_many  # type: ignore[method-assign]
    disk.read = read  # type: ignore[method-assign]
    return wrong


@pytest.mark.asyncio
@pytest.mark.parametrize(("pool_pages", "failed", "held"), [(8, 2, 4), (4, 1, 1)],
                         ids=["batch-failed-then-other-gives-up", "other-gives-up-then-no-room-pages"])
async def test_a_load_reads_no_page_past_its_own_failed_read(
    tmp_path: Path, pool_pages: int, failed: int, held: int,
) -> None:
    """``batch-failed-then-other-gives-up``: pages 0-3 read in one batch, page 2's read fails (EIO),
    page 4 is being brought in by another promotion (held); the load returns 2 pages; then that
    promotion's read fails (EIO): the load's group must not read page 4 itself (before: it did).

    ``other-gives-up-then-no-room-pages``: a pool of 4 pages; page 1 is another promotion's (held),
    pages 0, 2, 3 take the rest, page 4 finds no room. The other read of page 1 fails, the load
    reads it again (it was given up), which fails too (a bad sector): the load ends at page 1 and
    must not read page 4 into the room page 1's abort freed (before: it did)."""
    tokens = prompt(268, N)
    await _written(tmp_path, tokens)
    cache = KVCache(config(tmp_path, pool_pages=pool_pages), LAYOUT, make_kv(2 * N))
    await cache.start()
    try:
        await cache.pool.wait_ready()
        keys = cache._manager.keys(tokens)
        gate = asyncio.Event()
        wrong = _probe(cache, keys, keys[held], gate)
        _eio(cache, keys[failed], every=True)
        if held != failed:
            _eio(cache, keys[held], every=True)
        match = await cache.match(tokens)
        assert match.tokens == N and match.disk_pages == PAGES
        other = asyncio.ensure_future(cache._manager.promote(keys[held]))
        await until(lambda: cache.stats().pool_reserved == 1)  # its read waits for the gate
        token = LOADER.set(True)
        try:
            load = asyncio.ensure_future(cache.load(match, torch.arange(N, 2 * N)))
        finally:
            LOADER.reset(token)
        if held > failed:
            result = await load  # its group does not wait for page 4, past the failed page
            gate.set()
        else:
            await until(lambda: cache.stats().pool_reserved == 4)  # the batch of pages 0, 2, 3 is read
            gate.set()
            result = await load
        assert result.tokens == failed * T
        await other
        await cache.flush()  # every read the load left behind ended
        assert not wrong, wrong
        await assert_quiescent(cache)
    finally:
        await cache.aclose()
