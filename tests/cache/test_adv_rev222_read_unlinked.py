"""Adversarial (helper-222): a disk page's file unlinked from outside while its read is held.

Commit 29c75c1 (review 214) made a failed read whose page left the tier's index a plain miss
(``NoPage.GONE``) when the tier had evicted pages (``evictions``) and counted no fault over the
read. A file unlinked behind the tier's back (another process, an operator, a bad clean-up) while
its page was still indexed met the same ENOENT, dropped the page and counted nothing: beside any
eviction of other pages it read as an eviction, and the fault was hidden (no
``disk_read_failed``, nothing anywhere). Now the mark is the tier's count of reads that met their
own page evicted under them (``ReadMarks.reads_evicted``): the unlinked page is
``disk_read_failed``; a page the tier itself evicted under the read is still a miss, on the threads
and io_uring backends.

Everything real: a small disk budget, real page files, ``os.unlink`` of the page files' own
paths, another prompt's write-behind evicting other pages, the read's load held in front of the
backend (:class:`LoadGate`) until both happened.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, errors_of, held_read_call, prompt
from loop_probes import until_thread

from aiokv import DiskBackend, KVCache
from aiokv.storage import DiskTier

T = LAYOUT.page_tokens
PAGES = 2
BOUND_S = 10.0
SLOTS = 16 * PAGES * T
TARGET = torch.arange(4 * PAGES * T, 5 * PAGES * T)
BACKENDS = [DiskBackend.THREADS, DiskBackend.URING]
CALLS = ["load", "prefetch", "stream"]

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU KV buffer: checks read it directly")


def _kv() -> torch.Tensor:
    gen = torch.Generator().manual_seed(2221)
    return torch.randn(LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim, generator=gen).to(LAYOUT.dtype)


async def _store(cache: KVCache, tokens: list[int], at: int, drop: bool) -> None:
    """``tokens`` offloaded from slot ``at`` and flushed to disk (``drop``: out of the pool)."""
    slots = torch.arange(at, at + len(tokens))
    assert (await cache.offload(tokens, slots)).stored == len(tokens) // T
    await cache.flush()
    disk = cache.disk
    assert disk is not None
    for key in cache.keys(tokens):
        assert disk.contains(key)
        if drop:
            assert cache.pool.table.discard(key)


def _served(call: str, result: Any) -> int:
    if call == "prefetch":
        assert result.pool_pages == 0, result
        return int(result.promoted)
    return int(result.tokens if call == "load" else result.loaded_tokens)


async def _evict_others(cache: KVCache, disk: DiskTier, other: list[int], spared: list[bytes]) -> None:
    """``other`` written into the full tier: it evicts pages (not ``spared``, which reads hold)."""
    before = disk.read_marks().evictions
    await _store(cache, other, 8 * PAGES * T, drop=False)
    assert disk.read_marks().evictions - before >= PAGES


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
@pytest.mark.parametrize("call", CALLS)
async def test_a_file_unlinked_under_a_held_read_is_a_failed_read_even_beside_evictions(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str, backend: DiskBackend) -> None:
    tokens, filler, other = prompt(2222, PAGES * T), prompt(2223, PAGES * T), prompt(2224, PAGES * T)
    kv = _kv()
    cfg = config(tmp_path / "disk", pool_pages=16, disk_pages=2 * PAGES, backend=backend)
    async with KVCache(cfg, LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        await _store(cache, filler, 0, drop=True)  # the least recently used: the eviction's victims
        await _store(cache, tokens, 2 * PAGES * T, drop=True)
        keys = cache.keys(tokens)
        untouched = kv[:, TARGET].clone()
        gate, task, _ = await held_read_call(cache, monkeypatch, call, tokens, TARGET, PAGES)
        try:
            before = disk.read_marks()
            for key in keys:
                os.unlink(disk.files.path(key))  # behind the tier's back: still indexed
            await _evict_others(cache, disk, other, keys)
            assert all(disk.contains(k) for k in keys)
        finally:
            gate.open()
        async with asyncio.timeout(BOUND_S):
            result = await task
        after = disk.read_marks()
        assert _served(call, result) == 0, result  # a miss: nothing served
        assert torch.equal(kv[:, TARGET], untouched)  # never wrong bytes
        # Before: GONE, nothing counted anywhere (errors_of {}).
        errors = errors_of(cache)
        assert errors.get("disk_read_failed", 0) >= 1, errors
        assert after.reads_evicted == before.reads_evicted, (before, after)  # no read met an eviction
        assert not disk.contains(keys[-1])  # read, found gone: never readable again
        await assert_quiescent(cache)


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
@pytest.mark.parametrize("call", CALLS)
async def test_a_page_the_tier_evicts_under_a_held_read_is_gone_on_every_backend(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str, backend: DiskBackend) -> None:
    """The other side (review 214's case, here on the threads and io_uring backends): the tier's
    own eviction takes the read pages and unlinks their files: a miss, no fault."""
    tokens, other = prompt(2225, PAGES * T), prompt(2226, PAGES * T)
    kv = _kv()
    cfg = config(tmp_path / "disk", pool_pages=16, disk_pages=PAGES, backend=backend)
    async with KVCache(cfg, LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        await _store(cache, tokens, 0, drop=True)
        keys = cache.keys(tokens)
        untouched = kv[:, TARGET].clone()
        gate, task, reads = await held_read_call(cache, monkeypatch, call, tokens, TARGET, PAGES)
        try:
            before = disk.read_marks()
            await _evict_others(cache, disk, other, [])
            assert not any(disk.contains(k) for k in keys), "the budget did not evict the read pages"
            paths = [disk.files.path(k) for k in keys]
            await until_thread(lambda: not any(os.path.exists(p) for p in paths), "the evicted files' unlinks")
        finally:
            gate.open()
        async with asyncio.timeout(BOUND_S):
            result = await task
        after = disk.read_marks()
        assert _served(call, result) == 0, result
        assert torch.equal(kv[:, TARGET], untouched)
        assert reads <= after.reads_evicted - before.reads_evicted <= PAGES, (before, after)
        assert after.faults == before.faults, (before, after)
        assert errors_of(cache) == {}, errors_of(cache)
        await assert_quiescent(cache)
