"""Adversarial (helper-307): a disk page the tier takes out of its index after the cache checked it
was there and before the tier's read of it begins.

A promotion looks the page up (``disk.contains``), takes the tier's read marks, then starts the read
as a task of its own (``ensure_future(disk.read(...))``, or ``read_many`` for a read group): the
read's first step runs only after the callbacks already queued on the loop, and one of those may be
a write-behind whose budget evicts that very page. The read then finds its key out of the index and
misses before it opens anything. Before the fix the tier counted that miss nowhere the cache looks
(``ReadMarks.reads_evicted`` moves only for a file found gone under a read), so the cache counted a
fault, ``disk_read_failed`` (and the shortened load ``load_shortened``), where only the budget had
spoken: the rev202 shared-prefix fuzz met it once in 60 seeds on a loaded machine (seed 3086:
``disk_read_failed 1 with no disk fault injected``). Here the page is taken out of the index in that
window for certain (``DiskTier.delete``, the tier's own removal, run as the read task's first
step); the call must serve the pages before it exactly, count no fault, and leak nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, errors_of, on_disk_only
from test_adv_crash_restart import prefix_oracle

from aiokv import DiskBackend, KVCache

T = LAYOUT.page_tokens
PAGES = 6
VICTIM = 2
N = PAGES * T
BOUND_S = 30.0
CALLS = ["load", "stream", "prefetch"]
BACKENDS = [DiskBackend.URING_FIXED, DiskBackend.THREADS]


def _evict_as_the_read_starts(monkeypatch: pytest.MonkeyPatch, cache: KVCache, victim: bytes) -> list[bytes]:
    """Wrap the tier's reads: the first one whose keys include ``victim`` first takes it out of the
    index (as an eviction queued before the read task's first step would). Returns the keys taken."""
    disk = cache.disk
    assert disk is not None
    read, read_many, taken = disk.read, disk.read_many, []

    async def first(keys: Sequence[bytes]) -> None:
        if victim in keys and not taken:
            taken.append(victim)
            await disk.delete(victim)
            assert not disk.contains(victim)

    async def read_one(key: bytes, handle: Any) -> bool:
        await first([key])
        return await read(key, handle)

    async def read_group(keys: Sequence[bytes], handles: Sequence[Any]) -> list[bool]:
        await first(keys)
        return await read_many(keys, handles)

    monkeypatch.setattr(disk, "read", read_one)
    monkeypatch.setattr(disk, "read_many", read_group)
    return taken


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
@pytest.mark.parametrize("call", CALLS)
async def test_a_page_evicted_before_its_read_starts_is_a_miss_not_a_fault(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str, backend: DiskBackend) -> None:
    tokens = list(range(5000, 5000 + N))
    kv = torch.zeros(LAYOUT.num_layers, 3 * N, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    kv[:, :N] = prefix_oracle(tokens)
    async with KVCache(config(tmp_path / "disk", pool_pages=32, disk_pages=4 * PAGES, backend=backend,
                              launch_pages=1, launch_turn_s=0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        keys = await on_disk_only(cache, tokens, torch.arange(N))
        match = await cache.match(tokens)
        assert match.disk_pages == PAGES
        taken = _evict_as_the_read_starts(monkeypatch, cache, keys[VICTIM])
        target = torch.arange(N, 2 * N)
        async with asyncio.timeout(BOUND_S):
            if call == "load":
                loaded = (await cache.load(match, target)).tokens
                assert loaded == VICTIM * T, loaded
                assert torch.equal(kv[:, target[:loaded]], prefix_oracle(tokens)[:, :loaded])
            elif call == "stream":
                async with await cache.start_load(match, target) as stream:
                    low = (await stream.finish()).loaded_from
                assert low == (VICTIM + 1) * T, low  # read from the back: stopped at the victim
                assert torch.equal(kv[:, target[low:]], prefix_oracle(tokens)[:, low:])
            else:
                match.release()
                assert (await cache.prefetch(tokens)).promoted == VICTIM
        assert taken == [keys[VICTIM]], "the victim's read never started"
        assert errors_of(cache) == {}, errors_of(cache)  # the budget spoke: no fault
        await assert_quiescent(cache)
