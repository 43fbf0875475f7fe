"""A Match used after it was loaded or released, or handed to another cache, is a caller mistake:
``load``/``start_load``/``estimate`` raise ``ValueError`` (``StaleHandleError`` for a used match, still
a ``RuntimeError`` as well) and nothing changes: the KV buffer, the pool's references, the hit and
miss counts, the other cache's match (#11: ``load`` raised a bare ``RuntimeError`` and ``estimate``
answered for a released or foreign match)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, make_kv, prompt

from aiokv import KVCache, StaleHandleError
from aiokv.costs import LoadEstimate

T = LAYOUT.page_tokens
PAGES = 4


def _state(cache: KVCache, kv: torch.Tensor) -> tuple[object, ...]:
    stats = cache.stats()
    return (kv.clone(), stats.pool_referenced, stats.pool_reserved, stats.pool_ready, stats.lookups,
            dict(stats.hit_tokens), dict(stats.loaded_tokens), dict(stats.errors))


def _same(before: tuple[object, ...], after: tuple[object, ...]) -> None:
    assert isinstance(before[0], torch.Tensor) and isinstance(after[0], torch.Tensor)
    assert torch.equal(before[0], after[0]), "the KV buffer changed"
    assert before[1:] == after[1:]


def test_stale_handle_error_is_a_value_error_and_still_a_runtime_error() -> None:
    assert issubclass(StaleHandleError, ValueError)
    assert issubclass(StaleHandleError, RuntimeError)


@pytest.mark.asyncio
@pytest.mark.parametrize("used", ["released", "loaded"])
async def test_load_and_estimate_of_a_used_match_raise_value_error_and_change_nothing(
        tmp_path: Path, used: str) -> None:
    kv = make_kv(0)
    async with KVCache(config(tmp_path / "disk"), LAYOUT, kv) as cache:
        tokens = prompt(0, PAGES * T)
        await cache.offload(tokens, torch.arange(PAGES * T))
        await cache.flush()
        match = await cache.match(tokens)
        assert match.pages == PAGES
        if used == "released":
            match.release()
        else:
            await cache.load(match, torch.arange(100, 100 + PAGES * T))
        assert match.released
        before = _state(cache, kv)
        calls: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            ("load", lambda: cache.load(match, torch.arange(100, 100 + PAGES * T))),
            ("start_load", lambda: cache.start_load(match, torch.arange(100, 100 + PAGES * T))),
        ]
        for name, call in calls:
            with pytest.raises(ValueError, match="already loaded or released") as raised:
                await call()
            assert isinstance(raised.value, StaleHandleError), name
            _same(before, _state(cache, kv))
        with pytest.raises(ValueError, match="already loaded or released"):
            cache.estimate(match)
        _same(before, _state(cache, kv))
        # A fresh match of the same prompt is estimated and loaded as ever.
        again = await cache.match(tokens)
        assert isinstance(cache.estimate(again), LoadEstimate)  # answers for a live match
        result = await cache.load(again, torch.arange(200, 200 + PAGES * T))
        assert result.tokens == PAGES * T
        assert torch.equal(kv[:, 200 : 200 + PAGES * T], kv[:, : PAGES * T])
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_estimate_refuses_another_caches_match_and_changes_nothing(tmp_path: Path) -> None:
    kv_a, kv_b = make_kv(0), make_kv(1)
    async with KVCache(config(tmp_path / "a"), LAYOUT, kv_a) as a, KVCache(config(tmp_path / "b"), LAYOUT, kv_b) as b:
        tokens = prompt(0, PAGES * T)
        await a.offload(tokens, torch.arange(PAGES * T))
        match = await a.match(tokens)
        assert match.pool_pages == PAGES
        before_a, before_b = _state(a, kv_a), _state(b, kv_b)
        with pytest.raises(ValueError, match="another KVCache"):
            b.estimate(match)
        with pytest.raises(TypeError, match="must be a Match"):
            b.estimate("match")  # type: ignore[arg-type]
        _same(before_a, _state(a, kv_a))
        _same(before_b, _state(b, kv_b))
        assert not match.released  # still its cache's, and loads there
        assert isinstance(a.estimate(match), LoadEstimate)
        result = await a.load(match, torch.arange(100, 100 + PAGES * T))
        assert result.tokens == PAGES * T
        assert torch.equal(kv_a[:, 100 : 100 + PAGES * T], kv_a[:, : PAGES * T])
        await assert_quiescent(a)
        await assert_quiescent(b)
