"""Faults below the caller while a hit larger than the pool passes through it in windows.

A disk hit of 8 pages through a 3-page pool is read in three windows (pages 0-2, 3-5, 6-7 for a
load; 7-5, 4-2, 1-0 for a stream, which loads from the back). A fault in the first, a middle or the
last window shortens the load there (a counted miss): the reported prefix (a stream's suffix) is
bit-exact, nothing past a failed page is reported loaded, slots the load never reached keep their
poison, no reference, reservation or background job is left, and nothing hangs. Faults are real
where the repository has them: EIO on that page's own read on the io_uring ring (``FaultPlan``), a
flipped payload byte in its page file (the checksum rejects it), the file unlinked behind the tier's
back, the tier dropping the page (as its eviction does) between the match and the read (no fault:
a miss the tier counts ``reads_evicted``, since 44dd26d); the copy
into the engine's buffer failing at launch (a failed copy at once, as a CUDA launch fault settles)
or on the copy thread after writing garbage into part of its slots (a layer-wise one after its
first layers landed). Plain loads (also a pool+disk hit), streams whole and layer by layer, and
prefetch. Then: cancellation of the caller and the cache's ``aclose()`` exactly while a windowed
load or stream waits for its own copies, or holds nothing and waits for room (the copy thread held
on a gate: events, not sleeps), a fault in the load that holds the pool while another waits for
room, and a seeded mix of two callers over one hit with faults and cancels.

Two defects these found (fixed with them): a page given back just as a load began to wait for room
was missed (``PageTable.wait_reclaimable`` registered its wait at its task's first step) and the
load slept ``offload_wait``, then stopped there; a stream whose read ahead had met the pool full
stopped there (``pool_exhausted``) although another caller had brought the page in since.
``AIOKV_WINDOW_FAULT_SEEDS=a:b`` runs more seeds of the mix (helper-150 ran 0-400 under both loops).
"""
from __future__ import annotations

import asyncio
import errno
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import (
    DEVICE,
    LAYOUT,
    CopyThreadGate,
    assert_quiescent,
    config,
    errors_of,
    make_kv,
    prompt,
    slow_host_copies,
)

from aiokv import KVCache
from aiokv.kernels.hostcopy import HostScatter
from aiokv.keys import PageKey
from aiokv.loadpath import NoPage
from aiokv.storage.backends import IOOp
from aiokv.stream import LoadStream
from aiokv.transfers import failed_copy

T = LAYOUT.page_tokens
PAGES = 8
POOL = 3
"""A hit of 8 disk pages through a 3-page pool: windows 0-2, 3-5 and 6-7 (a load)."""
BASE = 40
"""The first slot the load writes: ``target = arange(BASE, BASE + PAGES * T)``."""
POISON = 100.0
GARBAGE = -77.0
BOUND_S = 30.0

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU KV buffer: poison checks read it directly")

DISK_FAULTS = ["eio", "corrupt", "unlinked", "evicted"]
COPY_FAULTS = ["launch", "torn"]
FAULT_PAGES = [0, 1, 2, 3, 4, 5, 6, 7]
"""Every page: the first, a middle and the last window, at their edges and inside."""


# -- set-up ---------------------------------------------------------------------------------------


async def _write(root: Path, source: torch.Tensor, tokens: list[int]) -> None:
    """Store ``tokens``' pages (their KV at slots 0.. of ``source``) on disk, through a roomy pool."""
    async with KVCache(config(root, pool_pages=64, disk_pages=96), LAYOUT, source) as writer:
        await writer.pool.wait_ready()
        await writer.offload(tokens, torch.arange(len(tokens)))
        await writer.flush()


async def _small(root: Path, kv: torch.Tensor, pool_pages: int = POOL, **extra: object) -> KVCache:
    extra.setdefault("launch_pages", 1)  # one copy a page (groups never grow): a copy fault names its page
    extra.setdefault("launch_turn_s", 0)
    cache = KVCache(config(root, pool_pages=pool_pages, disk_pages=96, **extra), LAYOUT, kv)
    await cache.start()
    await cache.pool.wait_ready()
    return cache


def _keys(cache: KVCache, tokens: list[int]) -> list[PageKey]:
    return cache._manager.keys(tokens)


def _target() -> torch.Tensor:
    return torch.arange(BASE, BASE + PAGES * T)


def _slots_of(page: int) -> torch.Tensor:
    return torch.arange(BASE + page * T, BASE + (page + 1) * T)


def _page_is(kv: torch.Tensor, source: torch.Tensor, page: int) -> bool:
    return torch.equal(kv[:, _slots_of(page)], source[:, page * T : (page + 1) * T])


def _poisoned(kv: torch.Tensor, page: int) -> bool:
    return bool((kv[:, _slots_of(page)] == POISON).all())


# -- faults ---------------------------------------------------------------------------------------


def _spoil_file(root: Path, key: PageKey, unlink: bool) -> None:
    """Flip a payload byte of ``key``'s page file (past the header: its checksum catches it), or
    unlink the file behind the tier's back (it stays in the index until a read misses it)."""
    (path,) = [p for p in root.rglob(bytes(key).hex()) if p.is_file()]
    if unlink:
        path.unlink()
        return
    data = bytearray(path.read_bytes())
    data[4096 + 17] ^= 0x5A
    path.write_bytes(bytes(data))


async def _disk_fault(cache: KVCache, root: Path, key: PageKey, kind: str) -> None:
    """Make the read of ``key`` fail: EIO on its own read (io_uring, once), a flipped payload byte
    (the checksum rejects the file), its file unlinked behind the tier's back (still indexed), or
    the tier dropping it (as its eviction does) just as the read batch holding it starts."""
    disk = cache.disk
    assert disk is not None
    if kind == "eio":
        real_slot = disk._read_slot
        armed = [True]

        def read_slot(job: Any, slot: int) -> None:
            if job.key == key and armed:
                armed.clear()  # once: a later read of the page passes
                disk.backend.faults.inject(IOOp.READ, errno.EIO)  # this page's read, on the ring now
            real_slot(job, slot)

        disk._read_slot = read_slot  # type: ignore[method-assign]
    elif kind in ("corrupt", "unlinked"):
        _spoil_file(root, key, unlink=kind == "unlinked")
    else:
        real_many, real_one = disk.read_many, disk.read

        async def read_many(keys: Any, handles: Any) -> list[bool]:
            if key in keys:
                disk._drop(key)  # evicted after the match (or prefetch) counted it, before its read
            return await real_many(keys, handles)

        async def read(read_key: PageKey, handle: Any) -> bool:  # a stream reads its pages one by one
            if read_key == key:
                disk._drop(key)
            return await real_one(read_key, handle)

        disk.read_many = read_many  # type: ignore[method-assign]
        disk.read = read  # type: ignore[method-assign]


def _assert_disk_fault_counted(cache: KVCache, kind: str) -> None:
    """A load or stream shortened at one page's failed read is counted by what failed it: a fault
    (EIO, a rejected or unlinked file) as ``disk_read_failed`` and ``load_shortened``; the page the
    tier dropped before its read began (its budget's eviction) as a miss, not a fault: no error,
    the tier's ``reads_evicted`` (44dd26d, helper 307: before, such a read moved no mark and the
    cache took it for a fault, unlike one evicted under the read, review 214)."""
    errors = errors_of(cache)
    assert cache.disk is not None
    if kind == "evicted":
        assert not errors, errors
        assert cache.disk.read_marks().reads_evicted == 1
        return
    assert errors.get("disk_read_failed") == 1 and errors.get("load_shortened") == 1, errors
    assert "pool_exhausted" not in errors and "copy_failed" not in errors, errors
    assert errors.get("disk_eio", 0) == (kind == "eio"), errors
    assert cache.disk.read_marks().reads_evicted == 0


def _copy_fault(monkeypatch: pytest.MonkeyPatch, cache: KVCache, kv: torch.Tensor, page: int, kind: str,
                layer: int = 0) -> list[int]:
    """Make the copy of ``page`` (into ``_slots_of(page)``) fail: at launch (a failed copy at once,
    as a CUDA launch fault settles) or on the copy thread after writing garbage into its slots
    (``layer`` and later of a layer-wise copy; the layers before it land). Returns a list that
    counts the failures."""
    failed: list[int] = []
    first_slot = BASE + page * T
    if kind == "launch":
        transfers = cache._transfers
        assert transfers is not None
        for name in ("load", "load_layers"):
            real = getattr(transfers, name)

            def launch(page_ids: list[int], slots: torch.Tensor, skip: int, after: Any = None,
                       real: Callable[..., Any] = real) -> Any:
                if int(slots[0]) == first_slot:
                    failed.append(page)
                    return failed_copy(RuntimeError("copy launch fault (injected)"))
                return real(page_ids, slots, skip, after)

            monkeypatch.setattr(transfers, name, launch)
        return failed
    real_scatter = HostScatter.load

    def scatter(self: HostScatter, page_ids: list[int], slots: torch.Tensor, skip_first: int = 0,
                layers: range | None = None) -> None:
        if int(slots[0]) == first_slot and (layers is None or layers.start >= layer):
            rows = slice(None) if layers is None else slice(layers.start, layers.stop)
            kv[rows, slots[: len(slots) // 2 + 1]] = GARBAGE  # a torn copy: part of it written
            failed.append(page)
            raise RuntimeError("copy engine fault (injected)")
        real_scatter(self, page_ids, slots, skip_first, layers)

    monkeypatch.setattr(HostScatter, "load", scatter)
    return failed


# -- plain loads ----------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", DISK_FAULTS)
@pytest.mark.parametrize("page", FAULT_PAGES)
async def test_a_disk_fault_in_a_window_shortens_the_load_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, page: int,
) -> None:
    source = make_kv(61)
    tokens = prompt(61, PAGES * T)
    await _write(tmp_path, source, tokens)
    slow_host_copies(monkeypatch, page)
    kv = make_kv(62)
    cache = await _small(tmp_path, kv)
    try:
        match = await cache.match(tokens)
        assert (match.pool_pages, match.disk_pages) == (0, PAGES), match
        await _disk_fault(cache, tmp_path, _keys(cache, tokens)[page], kind)
        target = _target()
        kv[:, target] = POISON
        async with asyncio.timeout(BOUND_S):
            result = await cache.load(match, target)
        assert (result.tokens, result.disk_pages, result.pool_pages) == (page * T, page, 0), \
            (result, errors_of(cache))
        for p in range(PAGES):
            if p < page:
                assert _page_is(kv, source, p), f"page {p} reported loaded holds other bytes"
            else:
                assert _poisoned(kv, p), f"page {p}, at or past the failed page {page}, was written"
        _assert_disk_fault_counted(cache, kind)
        assert sum(cache.stats().loaded_tokens.values()) == page * T, cache.stats().loaded_tokens
        await assert_quiescent(cache)
        # The cache goes on: an EIO passes (the page is read again, the hit loads whole); a rejected
        # or deleted page is gone from the tier (the next match stops there).
        again = await cache.match(tokens)
        expected = PAGES if kind == "eio" else page
        assert again.tokens == expected * T, again
        kv[:, target] = POISON
        async with asyncio.timeout(BOUND_S):
            result = await cache.load(again, target[: again.tokens])
        assert result.tokens == expected * T, (result, errors_of(cache))
        assert all(_page_is(kv, source, p) for p in range(expected))
        await assert_quiescent(cache)
    finally:
        await cache.aclose()


def _window_of(page: int) -> range:
    """The pages of a load's window holding ``page`` (windows of ``POOL`` pages from the front)."""
    start = page // POOL * POOL
    return range(start, min(start + POOL, PAGES))


@pytest.mark.asyncio
@pytest.mark.parametrize(("pooled", "slow"), [(0, False), (0, True), (2, True)], ids=["fast", "slow", "pool+disk"])
@pytest.mark.parametrize("kind", COPY_FAULTS)
@pytest.mark.parametrize("page", FAULT_PAGES)
async def test_a_copy_fault_in_a_window_shortens_the_load_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, page: int, pooled: int, slow: bool,
) -> None:
    """The copy of ``page`` fails: the prefix ends there (``copy_failed``, ``load_shortened``); the
    pages of its window copied after it may have landed (not reported), later windows are never
    read or copied (their slots keep their poison), and the call returns only once no copy runs.
    ``pooled``: the hit's first pages are in the pool (they take the first window's room until
    their copies end: the windows stay 0-2, 3-5, 6-7)."""
    source = make_kv(63)
    tokens = prompt(63, PAGES * T)
    await _write(tmp_path, source, tokens)
    if slow:
        slow_host_copies(monkeypatch, page)
    kv = make_kv(64)
    cache = await _small(tmp_path, kv)
    try:
        if pooled:
            assert (await cache.prefetch(tokens[: pooled * T])).promoted == pooled
        failed = _copy_fault(monkeypatch, cache, kv, page, kind)
        match = await cache.match(tokens)
        assert (match.pool_pages, match.disk_pages) == (pooled, PAGES - pooled), match
        target = _target()
        kv[:, target] = POISON
        reads = cache.stats().pages_promoted
        async with asyncio.timeout(BOUND_S):
            result = await cache.load(match, target)
        assert failed == [page]
        assert (result.tokens, result.pool_pages) == (page * T, min(page, pooled)), (result, errors_of(cache))
        after = kv[:, target].clone()
        window = _window_of(page)
        for p in range(PAGES):
            if p < page:
                assert _page_is(kv, source, p), f"page {p} reported loaded holds other bytes"
            elif p > window[-1]:
                assert _poisoned(kv, p), f"page {p}, in a window after the failed copy's, was written"
            elif p > page:  # launched in the failed copy's window before its failure was known
                assert _page_is(kv, source, p) or _poisoned(kv, p), f"page {p} holds other bytes"
        errors = errors_of(cache)
        assert errors.get("copy_failed") == 1 and errors.get("load_shortened") == 1, errors
        assert "pool_exhausted" not in errors and "disk_read_failed" not in errors, errors
        # Nothing past the failed copy's window was read from disk.
        assert cache.stats().pages_promoted - reads == window[-1] + 1 - pooled, cache.stats()
        assert sum(cache.stats().loaded_tokens.values()) == page * T
        await assert_quiescent(cache)
        assert torch.equal(kv[:, target], after), "a copy wrote the slots after the load returned"
    finally:
        await cache.aclose()


# -- streams (the compute-or-load split), whole and layer by layer ----------------------------------


async def _stream(cache: KVCache, match: Any, target: torch.Tensor, layered: bool) -> tuple[Any, list[bool]]:
    """A stream the engine never claims from (it loads from the back down to a fault, or whole):
    its result and what ``wait_layer`` answered for each layer."""
    async with await cache.start_load(match, target, layered=layered) as stream:
        await stream.launched()
        layers = [await stream.wait_layer(layer) for layer in range(LAYOUT.num_layers)]
        result = await stream.finish()
    return result, layers


@pytest.mark.asyncio
@pytest.mark.parametrize("layered", [False, True], ids=["whole", "layered"])
@pytest.mark.parametrize("kind", DISK_FAULTS)
@pytest.mark.parametrize("page", FAULT_PAGES)
async def test_a_disk_fault_in_a_streams_window_ends_its_suffix_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, page: int, layered: bool,
) -> None:
    """A stream reads from the back (windows 7-5, 4-2, 1-0): a page that cannot be read ends the
    loaded suffix above it; nothing below it is launched (poison kept)."""
    source = make_kv(65)
    tokens = prompt(65, PAGES * T)
    await _write(tmp_path, source, tokens)
    slow_host_copies(monkeypatch, page)
    kv = make_kv(66)
    cache = await _small(tmp_path, kv)
    try:
        match = await cache.match(tokens)
        assert match.disk_pages == PAGES, match
        await _disk_fault(cache, tmp_path, _keys(cache, tokens)[page], kind)
        target = _target()
        kv[:, target] = POISON
        async with asyncio.timeout(BOUND_S):
            result, layers = await _stream(cache, match, target, layered)
        assert (result.loaded_from, result.disk_pages, result.claimed) == ((page + 1) * T, PAGES - 1 - page, 0), \
            (result, errors_of(cache))
        assert all(layers), layers  # every launched copy landed
        for p in range(PAGES):
            if p > page:
                assert _page_is(kv, source, p), f"page {p} reported loaded holds other bytes"
            else:
                assert _poisoned(kv, p), f"page {p}, at or below the failed page {page}, was written"
        _assert_disk_fault_counted(cache, kind)
        assert sum(cache.stats().loaded_tokens.values()) == (PAGES - 1 - page) * T
        await assert_quiescent(cache)
    finally:
        await cache.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize(("layered", "layer"), [(False, 0), (True, 0), (True, 1)],
                         ids=["whole", "layered-at-0", "layered-at-1"])
@pytest.mark.parametrize("kind", COPY_FAULTS)
@pytest.mark.parametrize("page", FAULT_PAGES)
async def test_a_copy_fault_in_a_streams_window_ends_its_suffix_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, page: int, layered: bool, layer: int,
) -> None:
    """The copy of ``page`` fails (a layer-wise one at ``layer``: the layers before it land): the
    loaded suffix is the pages above it; ``wait_layer`` answers False for a layer it lacks; pages
    below it may have been copied (right bytes, not reported); nothing writes after the return."""
    source = make_kv(67)
    tokens = prompt(67, PAGES * T)
    await _write(tmp_path, source, tokens)
    slow_host_copies(monkeypatch, page)
    kv = make_kv(68)
    cache = await _small(tmp_path, kv)
    try:
        failed = _copy_fault(monkeypatch, cache, kv, page, kind, layer)
        match = await cache.match(tokens)
        target = _target()
        kv[:, target] = POISON
        async with asyncio.timeout(BOUND_S):
            result, layers = await _stream(cache, match, target, layered)
        assert failed == [page]
        assert (result.loaded_from, result.disk_pages) == ((page + 1) * T, PAGES - 1 - page), \
            (result, errors_of(cache))
        landed = [kind == "torn" and layered and at < layer for at in range(LAYOUT.num_layers)]
        assert layers == landed, (layers, landed)
        after = kv[:, target].clone()
        for p in range(PAGES):
            if p > page:
                assert _page_is(kv, source, p), f"page {p} reported loaded holds other bytes"
            elif p < page:
                assert _page_is(kv, source, p) or _poisoned(kv, p), f"page {p} holds other bytes"
        errors = errors_of(cache)
        assert errors.get("copy_failed") == 1 and errors.get("load_shortened") == 1, errors
        assert "pool_exhausted" not in errors and "disk_read_failed" not in errors, errors
        assert sum(cache.stats().loaded_tokens.values()) == (PAGES - 1 - page) * T
        await assert_quiescent(cache)
        assert torch.equal(kv[:, target], after), "a copy wrote the slots after the stream finished"
    finally:
        await cache.aclose()


# -- prefetch -------------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("pool_pages", [16, POOL], ids=["roomy", "small"])
@pytest.mark.parametrize("kind", DISK_FAULTS)
@pytest.mark.parametrize("page", [0, 1, 2, 4, 7])
async def test_a_disk_fault_in_a_prefetch_ends_its_count_there(
    tmp_path: Path, kind: str, page: int, pool_pages: int,
) -> None:
    """Prefetch counts the pages it read before the failed one (a small pool: before it was full);
    what it left in the pool is what a match then finds, and a load of that match is bit-exact (a
    fault the prefetch never reached shortens that load instead)."""
    source = make_kv(69)
    tokens = prompt(69, PAGES * T)
    await _write(tmp_path, source, tokens)
    kv = make_kv(70)
    cache = await _small(tmp_path, kv, pool_pages)
    try:
        await _disk_fault(cache, tmp_path, _keys(cache, tokens)[page], kind)
        async with asyncio.timeout(BOUND_S):
            fetched = await cache.prefetch(tokens)
        reached = page < pool_pages  # a small pool stops where it is full (prefetch keeps that limit)
        assert (fetched.pool_pages, fetched.promoted) == (0, min(page, pool_pages)), (fetched, errors_of(cache))
        errors = errors_of(cache)
        evicted = kind == "evicted"  # the budget's miss, not a fault (see _assert_disk_fault_counted)
        assert errors.get("disk_read_failed", 0) == (reached and not evicted), errors
        assert "load_shortened" not in errors and "copy_failed" not in errors, errors
        assert cache.disk is not None and cache.disk.read_marks().reads_evicted == (reached and evicted)
        await assert_quiescent(cache)
        match = await cache.match(tokens)
        assert match.pool_pages >= min(page, pool_pages), match
        # An EIO passes (the page is read again); the other faults took the page off the tier.
        assert match.tokens == (page if reached and kind != "eio" else PAGES) * T, match
        target = _target()
        kv[:, target] = POISON
        async with asyncio.timeout(BOUND_S):
            result = await cache.load(match, target[: match.tokens])
        assert result.tokens == (match.tokens if reached else page * T), (result, errors_of(cache))
        assert all(_page_is(kv, source, p) for p in range(result.tokens // T))
        assert all(_poisoned(kv, p) for p in range(result.tokens // T, PAGES))
        await assert_quiescent(cache)
    finally:
        await cache.aclose()


# -- cancellation and the cache's close between windows -------------------------------------------


def _watch_full(cache: KVCache) -> asyncio.Event:
    """Set once a load's read group met a full pool (its window ends there: it waits for its copies)."""
    manager = cache._manager
    real = manager._promote_group
    full = asyncio.Event()

    async def group(keys: list[PageKey], windowed: bool = False) -> list[Any]:
        got = await real(keys, windowed)
        if NoPage.FULL in got:
            full.set()
        return got

    manager._promote_group = group  # type: ignore[method-assign]
    return full


def _watch_make_room(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Set once a stream's read met a full pool (it gives back its copies' pages, waiting for them)."""
    real = LoadStream._make_room
    entered = asyncio.Event()

    async def make_room(self: LoadStream, page: int) -> bool:
        entered.set()
        return await real(self, page)

    monkeypatch.setattr(LoadStream, "_make_room", make_room)
    return entered


def _watch_room_waits(cache: KVCache) -> asyncio.Queue[asyncio.Task[Any] | None]:
    """The tasks that wait for room holding no pool page (none free), as they begin to wait."""
    manager = cache._manager
    real = manager._wait_for_load_room
    waiting: asyncio.Queue[asyncio.Task[Any] | None] = asyncio.Queue()

    async def wait() -> bool:
        if not manager.pool.table.has_room():
            waiting.put_nowait(asyncio.current_task())
        return await real()

    manager._wait_for_load_room = wait  # type: ignore[method-assign]
    return waiting


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def _run(cache: KVCache, how: str, match: Any, target: torch.Tensor) -> Any:
    """A load (its result), or a stream the engine never claims from (its result, layer answers)."""
    if how == "load":
        return await cache.load(match, target)
    return await _stream(cache, match, target, how == "layered")


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["load", "stream", "layered"])
@pytest.mark.parametrize("stop", ["cancel", "aclose"])
async def test_a_load_stopped_while_it_waits_for_its_windows_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, stop: str,
) -> None:
    """The first window's copies are held on the copy thread, the load (or stream) waits for them
    to give their pages back. Cancelled: CancelledError at once (its queued copies withdrawn),
    nothing writes the slots after it, nothing held, the cache serves the hit whole again. The
    cache closed: the call returns the first window's pages (its copies ran: the close lets copies
    queued before it run) and no more (withdrawn, no fault) once the copy thread is let go, and the
    close ends."""
    source = make_kv(71)
    tokens = prompt(71, PAGES * T)
    await _write(tmp_path, source, tokens)
    kv = make_kv(72)
    cache = await _small(tmp_path, kv, offload_wait=BOUND_S)
    closed = False
    try:
        entered = _watch_full(cache) if how == "load" else _watch_make_room(monkeypatch)
        match = await cache.match(tokens)
        target = _target()
        kv[:, target] = POISON
        gate = CopyThreadGate(cache)
        try:
            task = asyncio.ensure_future(_run(cache, how, match, target))
            async with asyncio.timeout(BOUND_S):
                await entered.wait()
            await _turns(20)  # its window's launches, then the wait: nothing else can move
            assert not task.done()
            if stop == "cancel":
                task.cancel()
                async with asyncio.timeout(BOUND_S):  # before the gate opens: nothing is awaited
                    with pytest.raises(asyncio.CancelledError):
                        await task
                at_cancel = kv[:, target].clone()
            else:
                closed = True
                closing = asyncio.ensure_future(cache.aclose())
                await _turns(20)
        finally:
            await gate.open()
        if stop == "cancel":
            await assert_quiescent(cache)
            assert torch.equal(kv[:, target], at_cancel), "a copy wrote the slots after the CancelledError"
            assert all(_poisoned(kv, p) for p in range(PAGES))  # its copies never ran
            errors = errors_of(cache)
            assert not errors, errors
            again = await cache.match(tokens)
            async with asyncio.timeout(BOUND_S):
                result = await _run(cache, how, again, target)
            loaded = result.tokens if how == "load" else result[0].loaded_tokens
            assert loaded == PAGES * T, (result, errors_of(cache))
            assert torch.equal(kv[:, target], source[:, : PAGES * T])
            await assert_quiescent(cache)
            return
        async with asyncio.timeout(BOUND_S):
            result = await task
            await closing
        if how == "load":
            low, high = 0, result.tokens // T
        else:
            result = result[0]
            low, high = result.loaded_from // T, PAGES
        # The first window's copies ran (the close lets copies queued before it run), nothing after.
        assert high - low == POOL, result
        for p in range(PAGES):
            if low <= p < high:
                assert _page_is(kv, source, p), f"page {p} reported loaded holds other bytes"
        stats = cache.stats()
        errors = {k: v for k, v in stats.errors.items() if v}
        assert not errors, errors  # cut by the close: withdrawn, not a fault
        assert stats.pages_withdrawn == PAGES - (high - low), stats
    finally:
        if not closed:
            await cache.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("holder", ["load", "stream"])
@pytest.mark.parametrize("stop", ["cancel", "aclose", "holder-copy-fault", "holder-disk-fault"])
async def test_a_load_stopped_or_faulted_while_it_waits_for_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, holder: str, stop: str,
) -> None:
    """``holder`` (a load or a stream of 6 disk pages) fills the 3-page pool and waits for its
    copies (held on the copy thread); a load of another 6 disk pages then holds nothing and waits
    for room. Cancelled there: CancelledError at once, its slots untouched, the holder whole. The
    cache closed there: it returns nothing loaded (withdrawn) at once. A fault in the holder's
    copies or reads: the holder is shortened there, the waiting load gets the room and loads whole."""
    source = make_kv(73)
    a, b = prompt(73, 6 * T), prompt(74, 6 * T)
    async with KVCache(config(tmp_path, pool_pages=64, disk_pages=96), LAYOUT, source) as writer:
        await writer.pool.wait_ready()
        await writer.offload(a, torch.arange(6 * T))
        await writer.offload(b, torch.arange(6 * T, 12 * T))  # b's KV at slots 6T..12T of the source
        await writer.flush()
    kv = make_kv(74)
    cache = await _small(tmp_path, kv, offload_wait=BOUND_S)
    closed = False
    # The holder's fault: the copy of its first page launched (a load's 0, a stream's 5), or the read
    # of its second window's first page (a load's 3, a stream's 2).
    fault_page = {"load": (0, 3), "stream": (5, 2)}[holder][stop == "holder-disk-fault"]
    try:
        filled = _watch_full(cache) if holder == "load" else _watch_make_room(monkeypatch)
        waiting = _watch_room_waits(cache)
        if stop == "holder-copy-fault":
            _copy_fault(monkeypatch, cache, kv, fault_page, "torn")
        elif stop == "holder-disk-fault":
            await _disk_fault(cache, tmp_path, _keys(cache, a)[fault_page], "eio")
        ma, mb = await cache.match(a), await cache.match(b)
        assert (ma.disk_pages, mb.disk_pages) == (6, 6)
        ta, tb = _target()[: 6 * T], torch.arange(150, 150 + 6 * T)
        kv[:, ta] = POISON
        kv[:, tb] = POISON
        gate = CopyThreadGate(cache)
        try:
            first = asyncio.ensure_future(_run(cache, holder, ma, ta))
            async with asyncio.timeout(BOUND_S):
                await filled.wait()
            second = asyncio.ensure_future(cache.load(mb, tb))
            async with asyncio.timeout(BOUND_S):
                assert await waiting.get() is second  # it holds nothing and waits for room
            await _turns(10)
            assert not second.done() and not first.done()
            if stop == "cancel":
                second.cancel()
                async with asyncio.timeout(BOUND_S):  # before the gate opens
                    with pytest.raises(asyncio.CancelledError):
                        await second
            elif stop == "aclose":
                closed = True
                closing = asyncio.ensure_future(cache.aclose())
                async with asyncio.timeout(BOUND_S):  # before the gate opens: the close ends its wait
                    cut = await second
                assert cut.tokens == 0, cut
        finally:
            await gate.open()
        async with asyncio.timeout(BOUND_S):
            got = await first
        if holder == "load":
            low, high = 0, got.tokens // T
        else:
            got = got[0]
            low, high = got.loaded_from // T, 6
        for p in range(low, high):
            assert torch.equal(kv[:, ta[p * T : (p + 1) * T]], source[:, p * T : (p + 1) * T]), p
        if stop == "aclose":
            async with asyncio.timeout(BOUND_S):
                await closing
            assert high - low == POOL, got  # its first window, then the close
            assert bool((kv[:, tb] == POISON).all())
            stats = cache.stats()
            assert not {k: v for k, v in stats.errors.items() if v}, stats.errors
            assert stats.pages_withdrawn == (6 - POOL) + 6, stats
            return
        if stop == "cancel":
            assert (low, high) == (0, 6), got
            assert bool((kv[:, tb] == POISON).all()), "the cancelled load wrote its slots"
            assert not errors_of(cache), errors_of(cache)
        else:
            # Shortened at its fault (a load: the pages before it; a stream: those above it).
            assert (low, high) == ((0, fault_page) if holder == "load" else (fault_page + 1, 6)), got
            async with asyncio.timeout(BOUND_S):
                rb = await second
            assert rb.tokens == 6 * T, (rb, errors_of(cache))
            assert torch.equal(kv[:, tb], source[:, 6 * T : 12 * T])
            errors = errors_of(cache)
            assert errors.get("load_shortened") == 1 and "pool_exhausted" not in errors, errors
        await assert_quiescent(cache)
    finally:
        if not closed:
            await cache.aclose()


# -- a seeded mix: two callers over one hit, faults and cancels at random --------------------------


ROUNDS = 4


def _seeds() -> range:
    """``AIOKV_WINDOW_FAULT_SEEDS=a:b`` runs seeds ``[a, b)`` (default: eight)."""
    low, high = (int(x) for x in os.environ.get("AIOKV_WINDOW_FAULT_SEEDS", "0:8").split(":"))
    return range(low, high)


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", _seeds())
async def test_two_callers_over_one_hit_with_faults_and_cancels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int,
) -> None:
    """Two loads or streams of the same 8-page disk hit at once through the 3-page pool (they share
    its pages), with a random disk or copy fault in one page and, sometimes, one caller cancelled
    after a random number of loop turns. Each result is bit-exact where it says it loaded; every
    other page of its slots holds either the right bytes (a copy launched past a failed one) or its
    poison (garbage only in the failed copy's own slots); a cancelled caller's slots never change
    after its CancelledError; both end, and the cache is quiescent after every round."""
    rng = random.Random(seed)
    source = make_kv(75)
    hits = [prompt(750 + r, PAGES * T) for r in range(ROUNDS)]  # one hit a round: a fault's page is gone
    async with KVCache(config(tmp_path, pool_pages=64, disk_pages=96), LAYOUT, source) as writer:
        await writer.pool.wait_ready()
        for tokens in hits:
            await writer.offload(tokens, torch.arange(PAGES * T))
        await writer.flush()
    slow_host_copies(monkeypatch, seed)
    kv = make_kv(76)
    cache = await _small(tmp_path, kv, offload_wait=BOUND_S)
    targets = [torch.arange(BASE + i * PAGES * T, BASE + (i + 1) * PAGES * T) for i in range(2)]
    try:
        for tokens in hits:
            page = rng.randrange(PAGES)
            kind = rng.choice([*DISK_FAULTS, *COPY_FAULTS, "none"])
            if kind in DISK_FAULTS:
                await _disk_fault(cache, tmp_path, _keys(cache, tokens)[page], kind)
            matches = [await cache.match(tokens) for _ in range(2)]
            assert all(m.disk_pages == PAGES for m in matches), matches
            hows = [rng.choice(["load", "stream", "layered"]) for _ in range(2)]
            for target in targets:
                kv[:, target] = POISON
            torn: set[int] = set()  # first slots of copies that may hold garbage
            with monkeypatch.context() as patch:
                if kind in COPY_FAULTS:
                    # Both callers' copies of ``page`` fail (each caller's own slots).
                    for target in targets:
                        _copy_fault(patch, cache, kv, (int(target[page * T]) - BASE) // T, kind)
                        torn.add(int(target[page * T]))
                outcomes = await _two(cache, kv, rng, hows, matches, targets)
            for how, target, outcome in zip(hows, targets, outcomes, strict=True):
                if outcome is None:  # cancelled: checked in _two
                    continue
                low, high = (0, outcome.tokens // T) if how == "load" else (outcome.loaded_from // T, PAGES)
                for p in range(PAGES):
                    got = kv[:, target[p * T : (p + 1) * T]]
                    right = torch.equal(got, source[:, p * T : (p + 1) * T])
                    if low <= p < high:
                        assert right, f"seed {seed}: {how} page {p} reported loaded holds other bytes ({kind}, {page})"
                    elif int(target[p * T]) not in torn:
                        assert right or bool((got == POISON).all()), \
                            f"seed {seed}: {how} page {p} holds other bytes ({kind} at {page})"
            await assert_quiescent(cache)
        assert "pool_exhausted" not in errors_of(cache), errors_of(cache)
    finally:
        await cache.aclose()


async def _two(cache: KVCache, kv: torch.Tensor, rng: random.Random, hows: list[str], matches: list[Any],
               targets: list[torch.Tensor]) -> list[Any]:
    """Run both callers at once, one of them cancelled after random turns now and then; a caller's
    result (a stream's StreamResult), or None when it was cancelled (its slots, as they were at its
    CancelledError, checked unchanged once the cache is quiescent)."""
    frozen: dict[int, torch.Tensor] = {}

    async def run(i: int) -> Any:
        try:
            return await _run(cache, hows[i], matches[i], targets[i])
        except asyncio.CancelledError:
            frozen[i] = kv[:, targets[i]].clone()  # in the step the CancelledError came out
            raise

    tasks = [asyncio.ensure_future(run(i)) for i in range(2)]
    if rng.random() < 0.4:
        await _turns(rng.randrange(0, 60))
        tasks[rng.randrange(2)].cancel()
    outcomes: list[Any] = []
    async with asyncio.timeout(BOUND_S):
        for i, task in enumerate(tasks):
            try:
                got = await asyncio.shield(task)
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise
                outcomes.append(None)
                continue
            outcomes.append(got if hows[i] == "load" else got[0])
    await assert_quiescent(cache)
    for i, before in frozen.items():
        assert torch.equal(kv[:, targets[i]], before), "a copy wrote the slots after the CancelledError"
    return outcomes


# -- a page given back while a load begins to wait for room ---------------------------------------

WAKE_BOUND_S = 5.0
"""How long a load may take to notice room that came free (``offload_wait`` is far longer)."""


@pytest.mark.asyncio
@pytest.mark.parametrize("waiter", ["load", "stream"])
async def test_a_page_given_back_as_a_load_begins_to_wait_for_room_wakes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, waiter: str,
) -> None:
    """A load holding the pool waits for its copies (held on the copy thread); the engine's match
    pins the last page; a second load (or stream) finds no room and holds nothing, so it waits for a
    page to come back. The engine releases its match right after that caller found no room, before
    its wait is in place (the next callback). The wait must still see it: it was registered lazily
    (a task's first step), missed the release, and slept ``offload_wait`` (5 s by default: a load
    and a stream of one hit through a 4-page pool lost it in 8 of 20 rounds and were cut short,
    ``pool_exhausted``, with the pool's pages all evictable)."""
    source = make_kv(77)
    held_tokens, a, b = prompt(77, T), prompt(78, 6 * T), prompt(79, 6 * T)
    async with KVCache(config(tmp_path, pool_pages=64, disk_pages=96), LAYOUT, source) as writer:
        await writer.pool.wait_ready()
        await writer.offload(held_tokens, torch.arange(T))
        await writer.offload(a, torch.arange(T, 7 * T))
        await writer.offload(b, torch.arange(7 * T, 13 * T))
        await writer.flush()
    kv = make_kv(78)
    cache = await _small(tmp_path, kv, offload_wait=BOUND_S)
    try:
        assert (await cache.prefetch(held_tokens)).promoted == 1
        held = await cache.match(held_tokens)
        assert held.pool_pages == 1
        filled = _watch_full(cache)
        table = cache.pool.table
        real_has_room = table.has_room
        armed: list[bool] = []
        released = asyncio.Event()

        def has_room() -> bool:
            room = real_has_room()
            if armed and not room:
                armed.clear()
                # The engine gives its page back in the very next callback: before the wait's task
                # took its first step.
                asyncio.get_running_loop().call_soon(lambda: (held.release(), released.set()))
            return room

        monkeypatch.setattr(table, "has_room", has_room)
        manager = cache._manager
        real_wait = manager._wait_for_load_room
        second_wait: list[asyncio.Task[Any] | None] = []

        async def wait_for_load_room() -> bool:
            if asyncio.current_task() is not first:
                second_wait.append(asyncio.current_task())
                armed.append(True)
            return await real_wait()

        monkeypatch.setattr(manager, "_wait_for_load_room", wait_for_load_room)
        ma, mb = await cache.match(a), await cache.match(b)
        assert (ma.disk_pages, mb.disk_pages) == (6, 6)
        ta, tb = torch.arange(BASE, BASE + 6 * T), torch.arange(150, 150 + 6 * T)
        kv[:, ta] = POISON
        kv[:, tb] = POISON
        gate = CopyThreadGate(cache)
        try:
            first = asyncio.ensure_future(cache.load(ma, ta))
            async with asyncio.timeout(BOUND_S):
                await filled.wait()  # its first window took the two free pages; it waits for its copies
            landed = asyncio.Event()  # a read landed in the pool from now on (the second caller's)
            real_read_into = manager._read_into_pool

            def read_into_pool(handle: Any, ok: bool) -> Any:
                landed.set()
                return real_read_into(handle, ok)

            monkeypatch.setattr(manager, "_read_into_pool", read_into_pool)
            second = asyncio.ensure_future(_run(cache, waiter, mb, tb))
            async with asyncio.timeout(BOUND_S):
                await released.wait()
            assert second_wait, "the second caller did not wait for room"
            # The page came back: the second caller reads into it while the first still waits for
            # its copies (the copy thread is held).
            async with asyncio.timeout(WAKE_BOUND_S):
                await landed.wait()
            assert not first.done()
        finally:
            await gate.open()
        async with asyncio.timeout(BOUND_S):
            ra, rb = await first, await second
        assert ra.tokens == 6 * T, (ra, errors_of(cache))
        loaded_b = rb.tokens if waiter == "load" else rb[0].loaded_tokens
        assert loaded_b == 6 * T, (rb, errors_of(cache))
        assert torch.equal(kv[:, ta], source[:, T : 7 * T])
        assert torch.equal(kv[:, tb], source[:, 7 * T : 13 * T])
        assert not errors_of(cache), errors_of(cache)
        await assert_quiescent(cache)
    finally:
        await cache.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("layered", [False, True], ids=["whole", "layered"])
async def test_a_stream_takes_a_page_brought_in_since_its_read_found_the_pool_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layered: bool,
) -> None:
    """A stream's read of a page found the pool full (the engine's matches pinned it); before the
    loader took that answer, another caller brought the page into the pool (and the pool is full
    again). The loader must take the page from the pool, where it is, not wait for room that nothing
    will free and stop there (``pool_exhausted``, nothing loaded): two streams of one hit through a
    small pool cut the one behind short so, its read ahead having met the pool full before the one
    ahead read the page."""
    source = make_kv(79)
    pins, hit = [prompt(790 + i, T) for i in range(POOL)], prompt(80, T)  # one page each
    async with KVCache(config(tmp_path, pool_pages=64, disk_pages=96), LAYOUT, source) as writer:
        await writer.pool.wait_ready()
        for i, tokens in enumerate([*pins, hit]):
            await writer.offload(tokens, torch.arange(i * T, (i + 1) * T))
        await writer.flush()
    kv = make_kv(80)
    cache = await _small(tmp_path, kv)
    held: list[Any] = []
    try:
        for tokens in pins:
            assert (await cache.prefetch(tokens)).promoted == 1
            held.append(await cache.match(tokens))  # the engine's: every pool page pinned
        match = await cache.match(hit)
        assert (match.pool_pages, match.disk_pages) == (0, 1), match
        manager = cache._manager
        real_promote = manager.promote
        answers: list[Any] = []

        async def promote(key: PageKey, windowed: bool = False) -> Any:
            got = await real_promote(key, windowed)
            if not answers:
                # Meanwhile another caller brings the page in, and the engine pins the pool again.
                held.pop(0).release()
                assert (await cache.prefetch(hit)).promoted == 1
                held.append(await cache.match(hit))
                assert not cache.pool.table.has_room()
            answers.append(got)
            return got

        monkeypatch.setattr(manager, "promote", promote)
        target = torch.arange(BASE, BASE + T)
        kv[:, target] = POISON
        async with asyncio.timeout(BOUND_S):
            result, layers = await _stream(cache, match, target, layered)
        assert answers[0] is NoPage.FULL, answers  # the read met the pool full, as set up
        assert (result.loaded_from, result.disk_pages) == (0, 1), (result, errors_of(cache))
        assert all(layers), layers
        assert torch.equal(kv[:, target], source[:, POOL * T : (POOL + 1) * T])
        assert not errors_of(cache), errors_of(cache)
        for match_held in held:
            match_held.release()
        held.clear()
        await assert_quiescent(cache)
    finally:
        for match_held in held:
            match_held.release()
        await cache.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize(("pool_pages", "pages"), [(4, 8), (3, 8), (2, 5)])
@pytest.mark.parametrize("hows", [("load", "stream"), ("stream", "layered"), ("layered", "layered")],
                         ids=["load+stream", "stream+layered", "layered+layered"])
async def test_two_callers_of_one_hit_through_a_small_pool_both_load_it_whole(
    tmp_path: Path, hows: tuple[str, str], pool_pages: int, pages: int,
) -> None:
    """No fault: two requests of one prompt at once (a shared system prompt) each load the whole
    hit. A load and a stream through a 4-page pool were cut short (``pool_exhausted``) in 8 of 20
    rounds after waiting ``offload_wait`` (a page given back as the wait began was missed); two
    streams now and then (the one behind met the pool full for a page the other had read since)."""
    source = make_kv(81)
    tokens = prompt(81, pages * T)
    await _write(tmp_path, source, tokens)
    kv = make_kv(82)
    cache = await _small(tmp_path, kv, pool_pages, offload_wait=WAKE_BOUND_S)
    targets = [torch.arange(BASE + i * pages * T, BASE + (i + 1) * pages * T) for i in range(2)]
    try:
        for _ in range(12):
            cache.pool.table.evict(cache.pool.num_pages)  # the whole hit on disk only
            matches = [await cache.match(tokens) for _ in hows]
            for target in targets:
                kv[:, target] = POISON
            async with asyncio.timeout(BOUND_S):
                results = await asyncio.gather(*(_run(cache, how, m, t)
                                                 for how, m, t in zip(hows, matches, targets, strict=True)))
            for how, target, result in zip(hows, targets, results, strict=True):
                loaded = result.tokens if how == "load" else result[0].loaded_tokens
                assert loaded == pages * T, (how, result, errors_of(cache))
                assert torch.equal(kv[:, target], source[:, : pages * T])
            assert not errors_of(cache), errors_of(cache)
            await assert_quiescent(cache)
    finally:
        await cache.aclose()
