"""KVCache end to end on the CPU: pool and disk hits, restart, isolation, caller errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, make_kv, prompt

from aiokv import CacheConfig, KVCache, KVLayout, StaleHandleError, Tier

T = LAYOUT.page_tokens


@pytest.mark.asyncio
async def test_offload_then_match_and_load_into_a_fresh_buffer(tmp_path: Path) -> None:
    kv = make_kv(1)
    tokens = prompt(1, 10 * T + 3)  # a partial last page is never stored
    slots = torch.randperm(kv.shape[1])[: len(tokens)]
    async with KVCache(config(tmp_path), LAYOUT, kv) as cache:
        result = await cache.offload(tokens, slots)
        assert (result.stored, result.skipped, result.dropped) == (10, 0, 0)
        again = await cache.offload(tokens, slots)
        assert (again.stored, again.skipped) == (0, 10)

        kv.zero_()  # the engine's buffer is gone: everything must come back from the pool
        match = await cache.match(tokens)
        assert (match.tokens, match.pool_pages, match.disk_pages) == (10 * T, 10, 0)
        target = torch.randperm(kv.shape[1])[: match.tokens]
        loaded = await cache.load(match, target)
        assert loaded.tokens == 10 * T and not loaded.shortened
        reference = make_kv(1)
        assert torch.equal(kv[:, target], reference[:, slots[: 10 * T]])
        assert match.released
        stats = cache.stats()
        assert stats.hit_tokens[Tier.POOL] == 10 * T and stats.loaded_tokens[Tier.POOL] == 10 * T
        assert stats.bytes_moved["gpu_to_pool"] == 10 * LAYOUT.payload_bytes
        await assert_quiescent(cache)


@pytest.mark.asyncio
@pytest.mark.parametrize("from_token", [0, 1, T, T + 3, 4 * T - 1, 4 * T])
async def test_load_from_the_middle_of_a_page(tmp_path: Path, from_token: int) -> None:
    kv = make_kv(2)
    tokens = prompt(2, 4 * T)
    slots = torch.arange(len(tokens))
    async with KVCache(config(None), LAYOUT, kv) as cache:
        await cache.offload(tokens, slots)
        original = kv.clone()
        kv[:, 100:].zero_()
        match = await cache.match(tokens)
        target = torch.arange(100, 100 + match.tokens - from_token)
        loaded = await cache.load(match, target, from_token=from_token)
        assert (loaded.tokens, loaded.from_token) == (4 * T, from_token)
        assert torch.equal(kv[:, target], original[:, from_token : 4 * T])
        assert torch.all(kv[:, 100 + len(target) :] == 0)  # nothing beyond the requested slots
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_pages_come_back_from_disk_after_the_pool_evicts_them(tmp_path: Path) -> None:
    kv = make_kv(3)
    original = kv.clone()
    first = prompt(3, 6 * T)
    async with KVCache(config(tmp_path, pool_pages=8), LAYOUT, kv) as cache:
        await cache.offload(first, torch.arange(6 * T))
        await cache.flush()
        for i in range(3):  # push the first prompt out of the 8-page pool
            await cache.offload(prompt(100 + i, 4 * T), torch.arange(6 * T, 10 * T))
            await cache.flush()
        match = await cache.match(first)
        assert match.tokens == 6 * T and match.disk_pages > 0
        kv.zero_()
        target = torch.arange(50, 50 + 6 * T)
        loaded = await cache.load(match, target)
        assert loaded.tokens == 6 * T and loaded.disk_pages == match.disk_pages
        assert torch.equal(kv[:, target], original[:, : 6 * T])
        assert cache.stats().pages_promoted >= match.disk_pages
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_prefetch_promotes_disk_pages_into_the_pool(tmp_path: Path) -> None:
    kv = make_kv(4)
    first = prompt(4, 5 * T)
    async with KVCache(config(tmp_path, pool_pages=6), LAYOUT, kv) as cache:
        await cache.offload(first, torch.arange(5 * T))
        await cache.flush()
        await cache.offload(prompt(5, 6 * T), torch.arange(5 * T, 11 * T))
        await cache.flush()
        before = await cache.match(first)
        assert before.pool_pages < 5
        before.release()
        result = await cache.prefetch(first)
        assert result.pool_pages + result.promoted == 5
        after = await cache.match(first)
        assert (after.pool_pages, after.disk_pages) == (5, 0)
        after.release()
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_restart_with_the_same_disk_directory(tmp_path: Path) -> None:
    kv = make_kv(5)
    tokens = prompt(6, 7 * T)
    async with KVCache(config(tmp_path), LAYOUT, kv) as cache:
        await cache.offload(tokens, torch.arange(7 * T))
    fresh = torch.zeros_like(kv)
    async with KVCache(config(tmp_path), LAYOUT, fresh) as cache:
        match = await cache.match(tokens)
        assert (match.pool_pages, match.disk_pages) == (0, 7)
        loaded = await cache.load(match, torch.arange(7 * T))
        assert loaded.tokens == 7 * T
        assert torch.equal(fresh[:, : 7 * T], kv[:, : 7 * T])
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_tenants_are_isolated_by_salt(tmp_path: Path) -> None:
    kv = make_kv(6)
    tokens = prompt(7, 3 * T)
    async with KVCache(config(tmp_path), LAYOUT, kv) as cache:
        await cache.offload(tokens, torch.arange(3 * T), salt="alice")
        async with await cache.match(tokens, salt="bob") as other:
            assert other.tokens == 0
        async with await cache.match(tokens) as unsalted:
            assert unsalted.tokens == 0
        async with await cache.match(tokens, salt="alice") as own:
            assert own.tokens == 3 * T
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_a_different_layout_never_matches(tmp_path: Path) -> None:
    tokens = prompt(8, 3 * T)
    async with KVCache(config(tmp_path), LAYOUT, make_kv(7)) as cache:
        await cache.offload(tokens, torch.arange(3 * T))
    other = KVLayout.mha(2, 2, 8, torch.bfloat16, page_tokens=T)
    async with KVCache(config(tmp_path, layout=other), other, make_kv(7, other)) as cache:
        async with await cache.match(tokens) as match:
            assert match.tokens == 0
        assert cache.stats().miss_tokens == 3 * T


@pytest.mark.asyncio
async def test_buffer_forms_per_layer_and_split_kv(tmp_path: Path) -> None:
    stacked = make_kv(8)
    per_layer = [stacked[i].clone() for i in range(LAYOUT.num_layers)]
    h = LAYOUT.num_kv_heads
    split = ([t[:, :h].clone() for t in per_layer], [t[:, h:].clone() for t in per_layer])
    tokens = prompt(9, 3 * T)
    async with KVCache(config(tmp_path), LAYOUT, per_layer) as cache:
        await cache.offload(tokens, torch.arange(3 * T))
    async with KVCache(config(tmp_path), LAYOUT, split) as cache:
        for t in split[0] + split[1]:
            t.zero_()
        match = await cache.match(tokens)
        await cache.load(match, torch.arange(10, 10 + 3 * T))
        for layer in range(LAYOUT.num_layers):
            assert torch.equal(split[0][layer][10 : 10 + 3 * T], stacked[layer, : 3 * T, :h])
            assert torch.equal(split[1][layer][10 : 10 + 3 * T], stacked[layer, : 3 * T, h:])


@pytest.mark.asyncio
async def test_caller_errors_raise_before_anything_changes(tmp_path: Path) -> None:
    kv = make_kv(9)
    tokens = prompt(10, 2 * T)
    async with KVCache(config(tmp_path), LAYOUT, kv) as cache:
        before = cache.stats()
        bad_offloads: list[tuple[object, object, type[Exception]]] = [
            (tokens, torch.arange(2 * T, dtype=torch.float32), TypeError),
            (tokens, torch.arange(2 * T - 1), ValueError),
            (tokens, torch.arange(2 * T).view(2, T), ValueError),
            (tokens, torch.full((2 * T,), 3), ValueError),  # duplicates
            (tokens, torch.arange(2 * T) + kv.shape[1], ValueError),  # out of range
            (tokens, torch.arange(2 * T) - 1, ValueError),  # negative
            (tokens, list(range(2 * T)), TypeError),
            ([1.5] * (2 * T), torch.arange(2 * T), TypeError),
            ([-1] * (2 * T), torch.arange(2 * T), ValueError),
        ]
        for bad_tokens, bad_slots, error in bad_offloads:
            with pytest.raises(error):
                await cache.offload(bad_tokens, bad_slots)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            await cache.offload(tokens, torch.arange(2 * T), salt=3)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            await cache.match("not tokens")  # type: ignore[arg-type]
        assert cache.stats().pool_ready == before.pool_ready == 0
        await cache.offload(tokens, torch.arange(2 * T))
        match = await cache.match(tokens)
        with pytest.raises(ValueError, match="entries"):
            await cache.load(match, torch.arange(T))  # wrong length
        with pytest.raises(ValueError, match="from_token"):
            await cache.load(match, torch.arange(2 * T), from_token=2 * T + 1)
        with pytest.raises(TypeError):
            await cache.load("match", torch.arange(2 * T))  # type: ignore[arg-type]
        assert not match.released  # nothing changed: the match still holds its pages
        await cache.load(match, torch.arange(2 * T))
        with pytest.raises(StaleHandleError):
            await cache.load(match, torch.arange(2 * T))
        await assert_quiescent(cache)
    with pytest.raises(RuntimeError, match="closed"):
        await cache.match(tokens)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="cpu_bytes"):
        CacheConfig(cpu_bytes=0)
    with pytest.raises(TypeError, match="disk_backend"):
        CacheConfig(disk_backend="threads")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tp_rank"):
        CacheConfig(tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="smaller than one page"):
        KVCache(CacheConfig(cpu_bytes=100, disk_dir=None), LAYOUT, make_kv())


@pytest.mark.asyncio
async def test_default_config_works_with_only_a_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = CacheConfig()
    assert config.disk_dir == tmp_path / "aiokv"
    assert 0 < config.cpu_bytes <= 64 << 30
    small = CacheConfig(cpu_bytes=8 * LAYOUT.page_bytes)  # keep the test's pool small
    async with KVCache(small, LAYOUT, make_kv()) as cache:
        result = await cache.offload(prompt(11, 2 * T), torch.arange(2 * T))
        assert result.stored == 2
    # A cache home that cannot hold a directory (even for root): no disk tier, not an error.
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "sub"))
    assert CacheConfig().disk_dir is None


@pytest.mark.asyncio
async def test_aclose_is_idempotent_and_waits_for_write_behind(tmp_path: Path) -> None:
    kv = make_kv(12)
    cache = KVCache(config(tmp_path), LAYOUT, kv)
    await cache.start()
    await cache.offload(prompt(12, 8 * T), torch.arange(8 * T))
    await cache.aclose()
    await cache.aclose()
    async with KVCache(config(tmp_path), LAYOUT, kv) as reopened, await reopened.match(prompt(12, 8 * T)) as match:
        assert match.disk_pages == 8


@pytest.mark.asyncio
async def test_prefetch_protects_pages_already_in_the_pool(tmp_path: Path) -> None:
    # Regression: prefetch counted pool pages but left them at the cold end of the LRU.
    kv = make_kv(13)
    wanted = prompt(13, 2 * T)
    async with KVCache(config(None, pool_pages=4), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(wanted, torch.arange(2 * T))
        await cache.offload(prompt(14, 2 * T), torch.arange(2 * T, 4 * T))  # pool full, `wanted` oldest
        result = await cache.prefetch(wanted)
        assert (result.pool_pages, result.promoted) == (2, 0)
        await cache.offload(prompt(15, 2 * T), torch.arange(4 * T, 6 * T))  # evicts the two coldest
        async with await cache.match(wanted) as match:
            assert match.pool_pages == 2


@pytest.mark.asyncio
async def test_long_transfers_are_launched_in_groups(tmp_path: Path) -> None:
    kv = make_kv(16)
    original = kv.clone()
    tokens = prompt(16, 11 * T)
    async with KVCache(config(None, pool_pages=16, launch_pages=3, launch_turn_s=0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        assert (await cache.offload(tokens, torch.arange(11 * T))).stored == 11
        kv.zero_()
        match = await cache.match(tokens)
        loaded = await cache.load(match, torch.arange(40, 40 + 11 * T - 5), from_token=5)
        assert loaded.tokens == 11 * T
        assert torch.equal(kv[:, 40 : 40 + 11 * T - 5], original[:, 5 : 11 * T])
        await assert_quiescent(cache)


def test_duplicate_detection_both_ways() -> None:
    from aiokv.kernels.checks import has_duplicates as _has_duplicates

    distinct = torch.randperm(1000)[:300]
    assert not _has_duplicates(distinct, 1000)  # bitmap
    assert not _has_duplicates(distinct, 10**6)  # sort
    repeated = torch.cat([distinct, distinct[7:8]])
    assert _has_duplicates(repeated, 1000)
    assert _has_duplicates(repeated, 10**6)
