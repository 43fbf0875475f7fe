"""Work a load or stream does past its own fault: none that could still be served.

A stream loads its match from the back; its loaded suffix ends above the first page whose copy or
read failed. A load's prefix ends below the first such page. Three kinds of work past that point
were done for nothing (results stayed right):

- a stream whose copy failed went on launching copies of lower pages and reading them from disk
  (every one of them below the failure, so never part of the suffix);
- a load's read group whose read of a page failed (EIO, a flipped byte the checksum rejects) still
  read the group's later pages that had found no room at its start: the failed page's abort freed
  one, and they were read into the pool one by one (a prefetch does so only while the failed page
  stays on disk: a load reads it again and finds the rest in the pool);
- a stream's read ahead that failed and was then given up by the stream's ``_make_room`` (its read
  met the pool full) was read again later: one fault counted twice (``disk_read_failed``).

Each test counts the work (copies launched, disk reads, faults counted) and fails before the fix.
Real page files, real faults (EIO on the io_uring ring, a flipped payload byte), a small pool, a
CPU KV buffer (the poison checks read it directly); the copy thread held on a gate where the order
of events matters.
"""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, CopyThreadGate, assert_quiescent, config, errors_of, make_kv, prompt
from test_window_faults import BASE, PAGES, POISON, _page_is, _poisoned, _target

from aiokv import KVCache
from aiokv.keys import PageKey
from aiokv.loadpath import NoPage, Promotion
from aiokv.storage.backends import IOOp
from aiokv.transfers import failed_copy

T = LAYOUT.page_tokens
BOUND_S = 30.0

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU KV buffer: poison checks read it directly")


async def _write(root: Path, source: torch.Tensor, tokens: list[int], at: int = 0) -> None:
    """Store ``tokens``' pages (their KV at slots ``at..`` of ``source``) on disk."""
    async with KVCache(config(root, pool_pages=64, disk_pages=96), LAYOUT, source) as writer:
        await writer.pool.wait_ready()
        await writer.offload(tokens, torch.arange(at, at + len(tokens)))
        await writer.flush()


async def _cache(root: Path, kv: torch.Tensor, pool_pages: int, **extra: object) -> KVCache:
    extra.setdefault("launch_pages", 1)  # one copy a page: a copy fault names its page
    extra.setdefault("launch_turn_s", 0)
    cache = KVCache(config(root, pool_pages=pool_pages, disk_pages=96, **extra), LAYOUT, kv)
    await cache.start()
    await cache.pool.wait_ready()
    return cache


def _reads(cache: KVCache) -> int:
    """Page reads the disk tier started (each one I/O job on the ring)."""
    assert cache.disk is not None
    return cache.disk.statistics().reads


def _count_launches(monkeypatch: pytest.MonkeyPatch, cache: KVCache, failing_page: int) -> list[int]:
    """Every load copy launched, by its first page (of ``_target()``); the copy of ``failing_page``
    fails at launch (as a CUDA launch fault settles: its future failed at once)."""
    transfers = cache._transfers
    assert transfers is not None
    launched: list[int] = []
    for name in ("load", "load_layers"):
        real = getattr(transfers, name)

        def launch(page_ids: list[int], slots: torch.Tensor, skip: int, after: Any = None, real: Any = real) -> Any:
            page = (int(slots[0]) - BASE) // T
            launched.append(page)
            if page == failing_page:
                return failed_copy(RuntimeError("copy launch fault (injected)"))
            return real(page_ids, slots, skip, after)

        monkeypatch.setattr(transfers, name, launch)
    return launched


def _spoil(root: Path, key: PageKey) -> None:
    """Flip a payload byte of ``key``'s page file (its checksum rejects it)."""
    (path,) = [p for p in root.rglob(bytes(key).hex()) if p.is_file()]
    data = bytearray(path.read_bytes())
    data[4096 + 17] ^= 0x5A
    path.write_bytes(bytes(data))


def _eio(cache: KVCache, key: PageKey, every: bool) -> None:
    """EIO on the io_uring ring for the read of ``key`` (``every`` read of it: a bad sector; else once)."""
    disk = cache.disk
    assert disk is not None
    real_slot = disk._read_slot
    armed = [True]

    def read_slot(job: Any, slot: int) -> None:
        if job.key == key and armed:
            if not every:
                armed.clear()
            disk.backend.faults.inject(IOOp.READ, errno.EIO)
        real_slot(job, slot)

    disk._read_slot = read_slot  # type: ignore[method-assign]


def _fault(cache: KVCache, root: Path, key: PageKey, kind: str) -> None:
    if kind == "corrupt":
        _spoil(root, key)
    else:
        _eio(cache, key, every=kind == "eio-always")


# -- 1. a stream stops launching below a failed copy -----------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(("tier", "layered"), [("pool", False), ("disk", False), ("disk", True)],
                         ids=["pool", "disk", "disk-layered"])
async def test_a_streams_failed_copy_stops_its_later_launches_and_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tier: str, layered: bool,
) -> None:
    """The copy of page 6 (the second launched) fails: the suffix is page 7 alone. Before, the
    stream launched the copies of pages 5..0 too (8 launches) and read all 8 pages from disk; now
    it launches nothing after the failure is known (2 launches; pages 5..0 keep their poison), reads
    at most the one page its read ahead had started (3 reads), and gives back the pages it never
    launched as its loader ends."""
    source = make_kv(201)
    tokens = prompt(201, PAGES * T)
    await _write(tmp_path, source, tokens)
    kv = make_kv(202)
    cache = await _cache(tmp_path, kv, 16, stream_readahead_bytes=2 * LAYOUT.page_bytes)
    try:
        if tier == "pool":
            assert (await cache.prefetch(tokens)).promoted == PAGES
        launched = _count_launches(monkeypatch, cache, failing_page=6)
        match = await cache.match(tokens)
        assert match.pool_pages == (PAGES if tier == "pool" else 0), match
        reads = _reads(cache)
        target = _target()
        kv[:, target] = POISON
        async with asyncio.timeout(BOUND_S):
            async with await cache.start_load(match, target, layered=layered) as stream:
                await stream.launched()
                # The pages never launched went back as the loader ended: at most the failed copy's
                # page (kept until finish) and page 7's, if its copy still runs, are referenced.
                assert cache.stats().pool_referenced <= 2, cache.stats()
                result = await stream.finish()
        assert result.loaded_from == 7 * T and result.loaded_tokens == T, (result, errors_of(cache))
        assert launched == [7, 6], launched
        if tier == "disk":
            assert _reads(cache) - reads <= 3, (_reads(cache) - reads, "pages read for a suffix of one")
        assert _page_is(kv, source, 7)
        assert all(_poisoned(kv, p) for p in range(7)), "a page below the failed copy was written"
        errors = errors_of(cache)
        assert errors.get("copy_failed") == 1 and errors.get("load_shortened") == 1, errors
        assert "disk_read_failed" not in errors and "pool_exhausted" not in errors, errors
        await assert_quiescent(cache)
    finally:
        await cache.aclose()


# -- 2. a load's read group reads nothing past a failed page ---------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["eio", "corrupt"])
@pytest.mark.parametrize("page", [0, 1, 2])
async def test_a_failed_read_ends_a_loads_reads_in_its_group(
    tmp_path: Path, kind: str, page: int,
) -> None:
    """8 disk pages, one read group, a 3-page pool: pages 0-2 are reserved and read in one batch,
    3-7 find no room. The read of ``page`` fails: the prefix ends there. Before, the failed page's
    abort freed a page and the group read page 3 into it (4 reads); now nothing past the failure is
    read (3 reads: the batch's, read side by side)."""
    source = make_kv(203)
    tokens = prompt(203, PAGES * T)
    await _write(tmp_path, source, tokens)
    kv = make_kv(204)
    cache = await _cache(tmp_path, kv, 3)
    try:
        match = await cache.match(tokens)
        assert match.disk_pages == PAGES, match
        _fault(cache, tmp_path, cache._manager.keys(tokens)[page], kind)
        reads = _reads(cache)
        target = _target()
        kv[:, target] = POISON
        async with asyncio.timeout(BOUND_S):
            result = await cache.load(match, target)
        assert result.tokens == page * T, (result, errors_of(cache))
        assert _reads(cache) - reads == 3, (_reads(cache) - reads, "pages read past the failed one")
        assert all(_page_is(kv, source, p) for p in range(page))
        assert all(_poisoned(kv, p) for p in range(page, PAGES))
        errors = errors_of(cache)
        assert errors.get("disk_read_failed") == 1 and errors.get("load_shortened") == 1, errors
        assert "pool_exhausted" not in errors, errors
        await assert_quiescent(cache)
    finally:
        await cache.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("page", [0, 1])
async def test_a_prefetch_reads_nothing_past_a_page_the_tier_dropped(tmp_path: Path, page: int) -> None:
    """A prefetch through a 3-page pool; ``page``'s file is corrupt (rejected and dropped by the
    tier): no match can reach the pages past it, so they are not read (3 reads, no wait for room
    and no ``pool_exhausted``; before: page 3 read into the room the abort freed, then a counted
    ``pool_exhausted``)."""
    source = make_kv(205)
    tokens = prompt(205, PAGES * T)
    await _write(tmp_path, source, tokens)
    kv = make_kv(206)
    cache = await _cache(tmp_path, kv, 3)
    try:
        _fault(cache, tmp_path, cache._manager.keys(tokens)[page], "corrupt")
        reads = _reads(cache)
        async with asyncio.timeout(BOUND_S):
            fetched = await cache.prefetch(tokens)
        assert fetched.promoted == page, (fetched, errors_of(cache))
        assert _reads(cache) - reads == 3, (_reads(cache) - reads, "pages read past the dropped one")
        errors = errors_of(cache)
        assert errors.get("disk_read_failed") == 1 and "pool_exhausted" not in errors, errors
        await assert_quiescent(cache)
        match = await cache.match(tokens)
        assert match.tokens == page * T, match
        match.release()
    finally:
        await cache.aclose()


# -- 3. a failed read ahead given up by _make_room is not read (nor counted) again ------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["corrupt", "eio-always"])
async def test_a_failed_read_ahead_given_up_for_room_counts_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str,
) -> None:
    """A stream of 8 disk pages through a 4-page pool, one page of which another match holds; reads
    two ahead, its copies held on the copy thread. Pages 7, 6, 5 are read and copied (queued); page
    4's read finds the pool full. As the loader asks for page 3, the other match lets its page go:
    page 3's read takes it and fails (a flipped byte; EIO on every read, a bad sector). Then page
    4's read is given up for room with page 3's (``_make_room``), and the copies run. Before, the
    stream read page 3 again and counted the fault twice (``disk_read_failed`` 2; EIO: ``disk_eio``
    2); now the suffix ends above page 3 as for a read that failed in place, counted once."""
    source = make_kv(207)
    tokens = prompt(207, PAGES * T)
    other = prompt(208, T)
    await _write(tmp_path, source, tokens)
    await _write(tmp_path, source, other, at=PAGES * T)
    kv = make_kv(209)
    cache = await _cache(tmp_path, kv, 4, stream_readahead_bytes=2 * LAYOUT.page_bytes)
    try:
        assert (await cache.prefetch(other)).promoted == 1
        held = await cache.match(other)
        assert held.pool_pages == 1, held
        keys = cache._manager.keys(tokens)
        _fault(cache, tmp_path, keys[3], kind)
        manager = cache._manager
        real_promote = manager.promote
        outcomes: dict[int, list[object]] = {}
        gate: CopyThreadGate | None = None

        async def promote(key: PageKey, windowed: bool = False) -> Promotion | NoPage:
            page = keys.index(key)
            first = page not in outcomes
            outcomes.setdefault(page, [])
            if page == 3 and first:
                held.release()  # the room page 3's read takes; 4's found none
            got = await real_promote(key, windowed)
            outcomes[page].append(got if isinstance(got, NoPage) else "page")
            if page == 3 and first:
                assert gate is not None
                await gate.open()  # the copies run once page 3's read failed
            return got

        manager.promote = promote  # type: ignore[method-assign]
        match = await cache.match(tokens)
        assert match.disk_pages == PAGES, match
        target = _target()
        kv[:, target] = POISON
        gate = CopyThreadGate(cache)
        try:
            async with asyncio.timeout(BOUND_S):
                async with await cache.start_load(match, target) as stream:
                    result = await stream.finish()
        finally:
            await gate.open()
        assert outcomes[4][0] is NoPage.FULL and outcomes[3][0] is NoPage.MISS, outcomes  # the scenario
        assert len(outcomes[3]) == 1, ("page 3 read again after its read ahead failed", outcomes)
        assert result.loaded_from == 4 * T, (result, errors_of(cache))
        assert all(_page_is(kv, source, p) for p in range(4, PAGES))
        assert all(_poisoned(kv, p) for p in range(4))
        errors = errors_of(cache)
        assert errors.get("disk_read_failed") == 1, errors
        assert errors.get("disk_eio", 0) == (kind == "eio-always"), errors
        assert errors.get("load_shortened") == 1 and "pool_exhausted" not in errors, errors
        await assert_quiescent(cache)
    finally:
        await cache.aclose()
