"""Faults below the manager: each keeps the engine-facing calls working and is counted."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, make_kv, mover_of, prompt

from aiokv import DiskBackend, KVCache
from aiokv.storage import uring as uring_mod
from aiokv.storage.backends import IOOp

T = LAYOUT.page_tokens


def _flip_payload_byte(root: Path, key: bytes) -> Path:
    layout_dir = next(p for p in root.iterdir() if p.is_dir())
    victim = next(p for p in layout_dir.rglob("*") if p.name == key.hex())
    data = bytearray(victim.read_bytes())
    data[4096 + 10] ^= 0xFF  # first payload bytes, after the 4096-byte header
    victim.write_bytes(bytes(data))
    return victim


async def _evict_pool(cache: KVCache, pages: int) -> None:
    """Fill the pool with other prompts so earlier pages live on disk only."""
    for i in range(pages // 4 + 1):
        await cache.offload(prompt(9000 + i, 4 * T), torch.arange(200, 200 + 4 * T))
        await cache.flush()


@pytest.mark.asyncio
async def test_disk_full_keeps_offload_and_match_working(tmp_path: Path) -> None:
    kv = make_kv(20)
    tokens = prompt(20, 6 * T)
    async with KVCache(config(tmp_path), LAYOUT, kv) as cache:
        assert cache.disk is not None
        cache.disk.backend.faults.inject(IOOp.WRITE, errno.ENOSPC, times=1000)
        result = await cache.offload(tokens, torch.arange(6 * T))
        assert result.stored == 6  # the pool took them; the disk refused them
        await cache.flush()
        stats = cache.stats()
        assert stats.errors["disk_enospc"] >= 1
        assert stats.disk is not None and stats.disk.pages == 0
        async with await cache.match(tokens) as match:
            assert match.pool_pages == 6
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_corrupt_page_shortens_the_load_to_the_valid_prefix(tmp_path: Path) -> None:
    kv = make_kv(21)
    original = kv.clone()
    tokens = prompt(21, 6 * T)
    async with KVCache(config(tmp_path), LAYOUT, kv) as cache:
        await cache.offload(tokens, torch.arange(6 * T))
        keys = cache.keys(tokens)
    # Corrupt page 3's payload on disk, then restart so every page must come from disk.
    victim = _flip_payload_byte(tmp_path, keys[3])
    kv.zero_()
    async with KVCache(config(tmp_path), LAYOUT, kv) as cache:
        match = await cache.match(tokens)
        assert match.disk_pages == 6  # the index cannot know yet
        loaded = await cache.load(match, torch.arange(6 * T))
        assert loaded.shortened and loaded.tokens == 3 * T
        assert torch.equal(kv[:, : 3 * T], original[:, : 3 * T])
        assert torch.all(kv[:, 3 * T : 6 * T] == 0)  # nothing past the valid prefix was written
        stats = cache.stats()
        assert stats.disk is not None and stats.disk.corrupt == 1
        assert stats.errors["load_shortened"] == 1
        async with await cache.match(tokens) as again:
            assert again.tokens == 3 * T  # page 3 is gone from the index: the prefix stops there
        await assert_quiescent(cache)
    assert not _exists(victim)  # the bad file is deleted (by the time the tier has closed)


@pytest.mark.asyncio
async def test_io_error_on_read_is_a_counted_miss(tmp_path: Path) -> None:
    kv = make_kv(22)
    tokens = prompt(22, 4 * T)
    async with KVCache(config(tmp_path, pool_pages=8), LAYOUT, kv) as cache:
        await cache.offload(tokens, torch.arange(4 * T))
        await cache.flush()
        await _evict_pool(cache, 8)
        assert cache.disk is not None
        cache.disk.backend.faults.inject(IOOp.READ, errno.EIO, times=1)
        match = await cache.match(tokens)
        loaded = await cache.load(match, torch.arange(100, 100 + match.tokens))
        assert loaded.shortened
        assert cache.stats().errors["disk_eio"] == 1
        await assert_quiescent(cache)


def _exists(path: Path) -> bool:
    return path.exists()


def _refuse(_entries: int, _params: object) -> int:
    raise OSError(errno.EPERM, "io_uring refused (injected)")


@pytest.mark.asyncio
async def test_io_uring_refused_falls_back_to_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(uring_mod, "io_uring_setup", _refuse)
    kv = make_kv(23)
    original = kv.clone()
    tokens = prompt(23, 4 * T)
    async with KVCache(config(tmp_path), LAYOUT, kv) as cache:
        assert cache.disk is not None
        assert cache.stats().disk is not None
        assert cache.stats().disk.backend is DiskBackend.THREADS  # type: ignore[union-attr]
        await cache.offload(tokens, torch.arange(4 * T))
    kv.zero_()
    async with KVCache(config(tmp_path), LAYOUT, kv) as cache:
        match = await cache.match(tokens)
        loaded = await cache.load(match, torch.arange(4 * T))
        assert loaded.tokens == 4 * T
        assert torch.equal(kv[:, : 4 * T], original[:, : 4 * T])
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_forced_io_uring_refused_disables_the_disk_tier_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(uring_mod, "io_uring_setup", _refuse)
    kv = make_kv(24)
    async with KVCache(config(tmp_path, backend=DiskBackend.URING), LAYOUT, kv) as cache:
        assert cache.disk is None
        assert cache.stats().errors["disk_unavailable"] == 1
        result = await cache.offload(prompt(24, 2 * T), torch.arange(2 * T))
        assert result.stored == 2
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_pool_exhausted_is_counted_not_raised(tmp_path: Path) -> None:
    kv = make_kv(25)
    async with KVCache(config(None, pool_pages=4), LAYOUT, kv) as cache:
        held = []
        await cache.offload(prompt(25, 4 * T), torch.arange(4 * T))
        held.append(await cache.match(prompt(25, 4 * T)))  # every page referenced
        result = await cache.offload(prompt(26, 2 * T), torch.arange(4 * T, 6 * T))
        assert (result.stored, result.dropped) == (0, 2)
        assert cache.stats().errors["pool_exhausted"] == 1
        for match in held:
            match.release()
        result = await cache.offload(prompt(26, 2 * T), torch.arange(4 * T, 6 * T))
        assert result.stored == 2
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_prometheus_exporter_is_scraped(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry

    from aiokv.metrics import register

    kv = make_kv(26)
    async with KVCache(config(tmp_path), LAYOUT, kv) as cache:
        registry = CollectorRegistry()
        register(cache, registry)
        tokens = prompt(26, 3 * T)
        await cache.offload(tokens, torch.arange(3 * T))
        async with await cache.match(tokens):
            pass
        await cache.flush()
        me = {"cache": "test-model", "namespace": "test-model", "tp_rank": "0"}
        values = _scrape(registry)
        assert values["aiokv_hit_tokens_total", frozenset({**me, "tier": "pool"}.items())] == 12
        assert values["aiokv_pages_total", frozenset({**me, "outcome": "stored"}.items())] == 3
        assert values["aiokv_bytes_total", frozenset({**me, "direction": "gpu_to_pool"}.items())] == (
            3 * LAYOUT.payload_bytes
        )
        assert values["aiokv_pool_pages", frozenset({**me, "state": "ready"}.items())] == 3
        assert values["aiokv_disk_pages", frozenset(me.items())] == 3
        assert values["aiokv_lookups_total", frozenset(me.items())] == 1
        # A second cache in the same registry: its own labelled series, no clash (they once were
        # duplicate unlabelled series); the same labels twice are refused.
        async with KVCache(config(None), LAYOUT, make_kv(27)) as other:
            register(other, registry, name="draft-model")
            with pytest.raises(ValueError, match="already registered"):
                register(other, registry, name="draft-model")
            (await other.match(tokens)).release()
            values = _scrape(registry)
            assert values["aiokv_lookups_total", frozenset({**me, "cache": "draft-model"}.items())] == 1
            assert values["aiokv_lookups_total", frozenset(me.items())] == 1


def _scrape(registry: object) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a scrape, by name and label set (parsed as Prometheus would)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(registry).decode()  # type: ignore[arg-type]
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.mark.asyncio
async def test_failed_offload_copy_is_counted_and_its_pages_aborted(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = make_kv(27)
    async with KVCache(config(None), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        mover = mover_of(cache)

        def broken(*_: object, **__: object) -> None:
            raise RuntimeError("copy engine fault (injected)")

        monkeypatch.setattr(mover, "offload", broken)
        result = await cache.offload(prompt(27, 3 * T), torch.arange(3 * T))
        assert (result.stored, result.dropped) == (0, 3)
        assert cache.stats().errors["copy_failed"] >= 1
        async with await cache.match(prompt(27, 3 * T)) as match:
            assert match.tokens == 0  # nothing half-copied was published
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_failed_load_copy_shortens_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = make_kv(28)
    original = kv.clone()
    tokens = prompt(28, 6 * T)
    async with KVCache(config(None, launch_pages=2, launch_turn_s=0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(6 * T))
        mover = mover_of(cache)
        real = mover.load
        calls = {"n": 0}

        def second_group_fails(page_ids: list[int], slots: torch.Tensor, skip: int = 0, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("copy engine fault (injected)")
            # The CUDA event of the copy goes back: without it the load thinks the copy landed.
            return real(page_ids, slots, skip, **kwargs)

        monkeypatch.setattr(mover, "load", second_group_fails)
        kv.zero_()
        match = await cache.match(tokens)
        loaded = await cache.load(match, torch.arange(6 * T))
        assert loaded.shortened and loaded.tokens == 2 * T  # the first group of 2 pages only
        assert torch.equal(kv[:, : 2 * T], original[:, : 2 * T])
        assert cache.stats().errors["copy_failed"] == 1
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_a_read_only_disk_tier_is_not_a_full_write_behind_queue(tmp_path: Path) -> None:
    # Regression: a cache whose disk directory another cache writes (read-only tier) counted every
    # offloaded page as "write_behind_full".
    async with KVCache(config(tmp_path), LAYOUT, make_kv(29)) as writer:
        async with KVCache(config(tmp_path), LAYOUT, make_kv(30)) as reader:
            assert reader.disk is not None and reader.disk.read_only is not None
            result = await reader.offload(prompt(29, 3 * T), torch.arange(3 * T))
            assert result.stored == 3
            assert "write_behind_full" not in reader.stats().errors
            await assert_quiescent(reader)
        assert writer.disk is not None and writer.disk.read_only is None
