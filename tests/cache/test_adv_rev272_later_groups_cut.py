"""Helper-272: a load's read groups all start at once; a failed read in one group ends the load's
prefix there, yet the later groups went on reading (d058b19 stopped reads past a failed page only
within its own group). Their pages are never served: the reads were wasted I/O, holding pool pages
and I/O slots. Now a group whose read failed cuts the later ones (``aiokv.loadpath.GroupStop``): a
read of theirs not started yet never starts, one under way finishes and its pages go back.

Real EIO on the io_uring ring (``_eio``); groups of 2 pages, 4 groups; ``queue_depth`` 2, so the
later groups' pages wait for an I/O slot behind the first group's. The second group's reads are
held in front of the backend until the load returned (nothing sleeps): before the fix, once they
ended, the third and fourth groups' pages were read.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, make_kv, prompt
from loop_probes import until
from test_failed_copy_stops_work import _eio

from aiokv import KVCache
from aiokv.keys import PageKey
from aiokv.loadpath import NoPage

T = LAYOUT.page_tokens
GROUP = 2
"""Pages in one read group (``read_group_bytes``)."""
PAGES = 4 * GROUP
N = PAGES * T
POISON = 100.0


def _config(tmp_path: Path) -> Any:
    cfg = config(tmp_path, pool_pages=16, read_group_bytes=GROUP * LAYOUT.page_bytes)
    assert cfg.disk is not None
    return dataclasses.replace(cfg, disk=dataclasses.replace(cfg.disk, queue_depth=GROUP))


async def _on_disk(cfg: Any, tokens: list[int], source: torch.Tensor) -> None:
    """Offload ``tokens`` (their K/V in ``source``'s first slots) into the disk tier of ``cfg``, flushed."""
    async with KVCache(cfg, LAYOUT, source) as writer:
        await writer.pool.wait_ready()
        assert (await writer.offload(tokens, torch.arange(len(tokens)))).stored == len(tokens) // T
        await writer.flush()


@pytest.mark.asyncio
@pytest.mark.parametrize("failed", [0, 1])
async def test_a_failed_read_in_the_first_group_starts_no_read_in_the_later_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failed: int,
) -> None:
    """Page ``failed`` (of the first group) fails with EIO on every read: the load returns pages
    ``[0, failed)`` bit-exact, the second group's reads (under way) finish, the third and fourth
    groups' pages are never read (before: all of them were), and every pool page comes back."""
    tokens = prompt(272, N)
    source = make_kv(272)
    await _on_disk(_config(tmp_path), tokens, source)

    kv = torch.full_like(source, POISON)
    cache = KVCache(_config(tmp_path), LAYOUT, kv)
    await cache.start()
    try:
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        keys = cache._manager.keys(tokens)
        names = [bytes(key).hex() for key in keys]
        started: list[int] = []  # pages whose load the tier handed to the backend, in order
        held: list[tuple[Any, ...]] = []
        real = disk.backend.start_load

        def start_load(*args: Any) -> None:
            page = names.index(args[1])
            started.append(page)
            if GROUP <= page < 2 * GROUP:
                held.append(args)  # the second group's reads: under way until the load returned
            else:
                real(*args)

        monkeypatch.setattr(disk.backend, "start_load", start_load)
        _eio(cache, keys[failed], every=True)
        match = await cache.match(tokens)
        assert match.disk_pages == PAGES
        reads = disk.statistics().reads
        result = await cache.load(match, torch.arange(N))
        assert result.tokens == failed * T
        for args in held:
            real(*args)
        await assert_quiescent(cache)  # every read the load left behind ended, every page came back
        assert max(started) < 2 * GROUP, f"pages read past the failed group's cut: {started}"
        assert disk.statistics().reads - reads == len(started)
        assert torch.equal(kv[:, : failed * T], source[:, : failed * T])
        assert bool((kv[:, failed * T : N] == POISON).all())  # nothing past the prefix was written
        errors = cache.stats().errors
        assert errors.get("disk_read_failed") == 1, errors  # the failed page only: cut pages are no fault
    finally:
        await cache.aclose()


LOADER: contextvars.ContextVar[bool] = contextvars.ContextVar("LOADER", default=False)
"""Set in the load's task (its read groups' tasks and their waits copy it): its reads are the load's."""


@pytest.mark.asyncio
async def test_a_later_groups_wait_for_another_calls_page_is_cut(tmp_path: Path) -> None:
    """Page 1 (first group) fails with EIO; page 4 (third group) is being brought in by another
    promotion whose read is held, then fails too (EIO). The load returns page 0; its third group's
    wait for page 4 must be cut (before: once the other read failed, the group read page 4 itself,
    for a load that had returned), and every pool page comes back."""
    pages = 3 * GROUP
    n = pages * T
    tokens = prompt(2720, n)
    source = make_kv(2720)
    await _on_disk(_config(tmp_path), tokens, source)

    kv = torch.full_like(source, POISON)
    cache = KVCache(_config(tmp_path), LAYOUT, kv)
    await cache.start()
    try:
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        keys = cache._manager.keys(tokens)
        held = keys[2 * GROUP]
        gate = asyncio.Event()
        loads_reads: list[int] = []  # the load's reads of pages past the first group, as decided
        real_one = disk.read

        def read(key: PageKey, handle: Any) -> Coroutine[Any, Any, bool]:
            if LOADER.get():
                loads_reads.append(keys.index(key))

            async def gated() -> bool:
                if not LOADER.get() and key == held:
                    await gate.wait()
                ok: bool = await real_one(key, handle)
                return ok

            return gated()

        disk.read = read  # type: ignore[method-assign]
        _eio(cache, keys[1], every=True)
        _eio(cache, held, every=True)
        match = await cache.match(tokens)
        assert match.disk_pages == pages
        other = asyncio.ensure_future(cache._manager.promote(held))
        await until(lambda: cache.stats().pool_reserved == 1)  # its read waits for the gate
        token = LOADER.set(True)
        try:
            load = asyncio.ensure_future(cache.load(match, torch.arange(n)))
        finally:
            LOADER.reset(token)
        result = await load
        assert result.tokens == T
        gate.set()
        assert await other is NoPage.MISS
        await assert_quiescent(cache)  # every read the load left behind ended, every page came back
        assert not loads_reads, f"the load read pages {loads_reads} on their own after its first group failed"
        assert torch.equal(kv[:, :T], source[:, :T])
        assert bool((kv[:, T:n] == POISON).all())
        errors = cache.stats().errors
        assert errors.get("disk_read_failed") == 2, errors  # page 1 (the load's), page 4 (the other call's)
    finally:
        await cache.aclose()


@pytest.mark.asyncio
async def test_a_waits_failed_read_cuts_the_later_waits_at_once(tmp_path: Path) -> None:
    """One read group of 5 pages; pages 1 and 3 are reserved by someone else (the load's group waits
    for them). Page 1 is given up: the group's wait reads it itself, which fails (EIO); page 3 is
    given up in that very step. The wait for page 3 must be cut then, not read page 3 (before: the
    group learned of page 1's miss only once it got to page 1, after its batch (held here until
    the wait for page 3 ended), and the wait for page 3 read its page meanwhile, past the load's
    failed read)."""
    pages = 5
    n = pages * T
    tokens = prompt(2721, n)
    source = make_kv(2721)
    await _on_disk(config(tmp_path, pool_pages=16), tokens, source)

    kv = torch.full_like(source, POISON)
    cache = KVCache(config(tmp_path, pool_pages=16), LAYOUT, kv)
    await cache.start()
    try:
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        manager = cache._manager
        keys = manager.keys(tokens)
        table = cache.pool.table
        first, second = (r.handle for r in cache.pool.reserve([keys[1], keys[3]]))
        assert first is not None and second is not None
        batches: list[list[int]] = []
        singles: list[int] = []  # the load's reads of one page (its waits', once a page was given up)
        waited: list[int] = []  # the load's waits for pages 1 and 3 that ended (cut, or returned)
        batch_gate = asyncio.Event()
        real_many, real_one, real_landed = disk.read_many, disk.read, manager._landed_or_gone
        real_already_in = manager._already_in

        def read_many(pages: Any, handles: Any) -> Coroutine[Any, Any, list[bool]]:
            if LOADER.get():
                batches.append([keys.index(k) for k in pages])

            async def gated() -> list[bool]:
                # The group learns of page 1 only after its batch: held until page 3's wait ended.
                await batch_gate.wait()
                oks: list[bool] = await real_many(pages, handles)
                return oks

            return gated()

        async def already_in(key: PageKey, *args: Any, **kwargs: Any) -> Any:
            try:
                return await real_already_in(key, *args, **kwargs)
            finally:
                waited.append(keys.index(key))

        def read(key: PageKey, handle: Any) -> Coroutine[Any, Any, bool]:
            if LOADER.get():
                singles.append(keys.index(key))
            return real_one(key, handle)

        def landed_or_gone(handle: Any, ok: bool, gone: bool) -> Any:
            if LOADER.get() and handle.key == keys[1] and not ok:
                table.abort(second)  # given up as the load learns its read of page 1 failed
            return real_landed(handle, ok, gone)

        disk.read_many = read_many  # type: ignore[method-assign]
        disk.read = read  # type: ignore[method-assign]
        manager._landed_or_gone = landed_or_gone  # type: ignore[method-assign]
        manager._already_in = already_in  # type: ignore[method-assign]
        _eio(cache, keys[1], every=True)
        match = await cache.match(tokens)
        assert match.pool_pages == 0 and match.disk_pages == pages
        token = LOADER.set(True)
        try:
            load = asyncio.ensure_future(cache.load(match, torch.arange(n)))
        finally:
            LOADER.reset(token)
        await until(lambda: bool(batches))  # the group reserved: it waits for pages 1 and 3
        assert batches == [[0, 2, 4]]
        table.abort(first)
        await until(lambda: 3 in waited)  # cut (the fix), or it read page 3 (before)
        batch_gate.set()
        result = await load
        assert result.tokens == T
        await assert_quiescent(cache)
        assert singles == [1], f"the load read pages {singles} on their own (page 1's read failed)"
        assert torch.equal(kv[:, :T], source[:, :T])
        assert bool((kv[:, T:n] == POISON).all())
    finally:
        await cache.aclose()


@pytest.mark.asyncio
async def test_a_cancelled_groups_late_miss_leaves_the_cache_quiescent(tmp_path: Path) -> None:
    """A read group cancelled while it waits for pages 1 and 3 (reserved elsewhere) adopts both
    waits. Page 3 then lands (its wait's reference is dropped), page 1 is given up and the wait's
    own read of it fails (EIO), noted after the group ended (it cuts nothing of the group's any
    more): every reference and reservation comes back, no exception is left in the loop. (Passes
    without the group's ``landing.clear()`` too: a second release of page 3 is skipped.)"""
    pages = 4
    n = pages * T
    tokens = prompt(2722, n)
    await _on_disk(config(tmp_path, pool_pages=16), tokens, make_kv(2722))

    cache = KVCache(config(tmp_path, pool_pages=16), LAYOUT, make_kv(0))
    await cache.start()
    try:
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        manager = cache._manager
        keys = manager.keys(tokens)
        table = cache.pool.table
        first, second = (r.handle for r in cache.pool.reserve([keys[1], keys[3]]))
        assert first is not None and second is not None
        gate = asyncio.Event()
        real_many = disk.read_many

        def read_many(pages: Any, handles: Any) -> Coroutine[Any, Any, list[bool]]:
            async def gated() -> list[bool]:
                await gate.wait()
                oks: list[bool] = await real_many(pages, handles)
                return oks

            return gated()

        disk.read_many = read_many  # type: ignore[method-assign]
        _eio(cache, keys[1], every=True)
        (group,) = manager._promote_groups(keys, windowed=True)
        await until(lambda: cache.stats().pool_reserved == 4)  # pages 0 and 2 reserved: the batch waits
        group.cancel()
        with pytest.raises(asyncio.CancelledError):
            await group
        table.commit(second)  # page 3 lands: its wait's reference is dropped
        table.abort(first)  # page 1 given up: its wait reads it itself, which fails
        gate.set()
        await assert_quiescent(cache)
    finally:
        await cache.aclose()
