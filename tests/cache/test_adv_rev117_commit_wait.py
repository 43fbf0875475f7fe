"""Review 117: adversarial checks of ``CacheConfig.commit_wait`` (f37ede4, 90afd66, 4feb8de).

A prompt's pages are on disk only; an offload of the same prompt reserves them in the pool and its
copy is held on the copy thread (as a SIGSTOPped TP rank holds it). Checked, with the fault real:

- a load of a match taken before the writer reserved waits ``commit_wait`` in all, not once per
  page (its promotions wait side by side), ends short, and the prompt loads bit-exact once the
  writer is let go, nothing left referenced;
- a load or a match cancelled while it waits for the held writer raises ``CancelledError`` and
  leaves no reference or reservation behind (the writer's pages commit later, whole);
- such a load stops once and counts ``commit_wait_expired`` once, as a match that stops does (it
  counted once per page it found being written, 3 here, until the batch's waits shared one count).

CPU only: the copy thread is held (on CUDA the mover runs on the loop).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, config, make_kv, prompt
from test_adv_rev115_match_expired_disk import PAGES, POOL, _finish, _held_offload, _on_disk_only

from aiokv import KVCache

T = LAYOUT.page_tokens
WAIT_S = 0.5
"""commit_wait here; PAGES waits one after another would take PAGES times as long."""
BOUND_S = 10.0

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="holds the CPU copy thread")


async def _load_behind_held_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int,
                                   check: object) -> None:
    """A load of a match taken before the writer reserved, with the writer held; ``check(cache,
    load)`` runs against it; then the writer is let go and the prompt loads whole."""
    tokens = prompt(seed, PAGES * T)
    kv = make_kv(seed + 1)
    async with KVCache(config(tmp_path, pool_pages=POOL, commit_wait=WAIT_S), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await _on_disk_only(cache, kv, tokens)
        match = await cache.match(tokens)
        assert match.disk_pages == PAGES
        hold, offload = await _held_offload(cache, monkeypatch, tokens)
        try:
            load = asyncio.create_task(cache.load(match, torch.arange(120, 120 + PAGES * T)))
            await check(cache, load)  # type: ignore[operator]
        finally:
            await _finish(cache, kv, tokens, hold, offload)


@pytest.mark.asyncio
async def test_a_load_behind_a_held_writer_waits_commit_wait_in_all(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    async def check(cache: KVCache, load: asyncio.Task[object]) -> None:
        started = time.monotonic()
        async with asyncio.timeout(BOUND_S):
            result = await load
        elapsed = time.monotonic() - started
        assert WAIT_S * 0.8 < elapsed < WAIT_S * (PAGES - 0.5), elapsed  # once, not once per page
        assert result.tokens == 0  # type: ignore[attr-defined]
        assert cache.stats().errors["load_shortened"] == 1

    await _load_behind_held_writer(tmp_path, monkeypatch, 1171, check)


@pytest.mark.asyncio
async def test_a_load_stopped_once_by_a_held_writer_counts_one_expiry(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    async def check(cache: KVCache, load: asyncio.Task[object]) -> None:
        async with asyncio.timeout(BOUND_S):
            await load
        assert cache.stats().errors["commit_wait_expired"] == 1  # 3 (PAGES) now

    await _load_behind_held_writer(tmp_path, monkeypatch, 1173, check)


@pytest.mark.asyncio
async def test_a_load_cancelled_while_it_waits_for_a_held_writer_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def check(cache: KVCache, load: asyncio.Task[object]) -> None:
        for _ in range(5):  # into the promotions' waits (each a loop turn away)
            await asyncio.sleep(0)
        await asyncio.sleep(WAIT_S / 3)
        assert not load.done()
        load.cancel()
        with pytest.raises(asyncio.CancelledError):
            await load
        assert cache.stats().errors.get("commit_wait_expired", 0) == 0

    await _load_behind_held_writer(tmp_path, monkeypatch, 1175, check)


@pytest.mark.asyncio
async def test_a_match_cancelled_while_it_waits_for_a_held_writer_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = prompt(1177, PAGES * T)
    kv = make_kv(1178)
    async with KVCache(config(tmp_path, pool_pages=POOL, commit_wait=WAIT_S), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await _on_disk_only(cache, kv, tokens)
        hold, offload = await _held_offload(cache, monkeypatch, tokens)
        try:
            match = asyncio.create_task(cache.match(tokens))
            await asyncio.sleep(WAIT_S / 3)
            assert not match.done()
            match.cancel()
            with pytest.raises(asyncio.CancelledError):
                await match
            assert cache.stats().errors.get("commit_wait_expired", 0) == 0
        finally:
            await _finish(cache, kv, tokens, hold, offload)
