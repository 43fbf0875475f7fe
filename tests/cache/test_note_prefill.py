"""``note_prefill`` checks its report at the public edge, and no report can poison the cost model
(an adversarial run: ``note_prefill(1e300, 1e-300)`` was taken, then every estimate, every later
report and every ``start_load`` raised ``OverflowError``, the failing ``start_load`` leaking its
match's references)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, make_kv, prompt

from aiokv import KVCache
from aiokv.costs import RateMeter

T = LAYOUT.page_tokens


@pytest.mark.parametrize(
    ("tokens", "seconds", "error"),
    [
        (1e300, 1e-300, TypeError),
        (True, 1.0, TypeError),
        (64, "1", TypeError),
        (64, None, TypeError),
        (0, 1.0, ValueError),
        (-5, 1.0, ValueError),
        (10**400, 1.0, ValueError),
        (64, 0.0, ValueError),
        (64, -1.0, ValueError),
        (64, math.inf, ValueError),
        (64, math.nan, ValueError),
        (10**15, 1e-9, ValueError),  # 1e24 tokens/s
        (1, 1e6, ValueError),  # 1e-6 tokens/s
    ],
)
@pytest.mark.asyncio
async def test_a_bad_report_raises_and_changes_nothing(tokens: object, seconds: object, error: type[Exception]) -> None:
    async with KVCache(config(None, pool_pages=8), LAYOUT, make_kv(0)) as cache:
        cache.note_prefill(64, 0.01)
        meter = cache._manager.costs.prefill
        before = (meter.rate, meter.samples, meter.saved_fit())
        with pytest.raises(error):
            cache.note_prefill(tokens, seconds)  # type: ignore[arg-type]
        assert (meter.rate, meter.samples, meter.saved_fit()) == before


def test_a_meter_ignores_calls_whose_moments_could_overflow() -> None:
    meter = RateMeter()
    for amount, seconds in ((64, 0.01), (128, 0.02), (256, 0.03)):
        meter.update(amount, seconds)
    before = (meter.rate, meter.samples, meter.saved_fit())
    for amount, seconds in ((1e300, 1e-300), (1e-300, 1e300), (1e16, 1.0), (64, 1e-12), (64, 1e5)):
        meter.update(amount, seconds)
    assert (meter.rate, meter.samples, meter.saved_fit()) == before
    predicted = meter.seconds(1000)
    assert predicted is not None and math.isfinite(predicted)


@pytest.mark.asyncio
async def test_estimates_and_streams_work_after_extreme_but_valid_reports(tmp_path: Path) -> None:
    tokens = prompt(3, 8 * T)
    async with KVCache(config(None, pool_pages=16), LAYOUT, make_kv(3)) as cache:
        await cache.pool.wait_ready()  # every pool chunk mapped: under load an early offload fits only the first
        assert (await cache.offload(tokens, torch.arange(len(tokens)))).stored == len(tokens) // T
        cache.note_prefill(1 << 53, (1 << 53) / 1e9)  # the fastest rate a report may give
        cache.note_prefill(1, 1.0)  # the slowest
        match = await cache.match(tokens)
        estimate = cache.estimate(match)
        assert estimate.recompute_seconds is not None and math.isfinite(estimate.recompute_seconds)
        async with await cache.start_load(match, torch.arange(100, 100 + len(tokens))) as stream:
            await stream.finish()
        await assert_quiescent(cache)


def test_calls_of_spread_sizes_with_equal_times_draw_no_line() -> None:
    # Regression (review): times rounded to the ms left a slope of rounding noise, a fixed part
    # equal to the mean time and a ZeroDivisionError on every later note_prefill/estimate/start_load.
    from aiokv.costs import SavedFit

    meter = RateMeter()
    for amount in (256, 4096, 4096, 256, 512, 1024, 300, 5000):
        meter.update(amount, 0.001)
        predicted = meter.seconds(1000)
        assert predicted is not None and math.isfinite(predicted)
    assert meter.line() is None
    # The same moments restored from a rates file (a crafted one passes its checks) are no line either.
    restored = RateMeter()
    restored.restore(1000.0, 3, SavedFit((1.0, 1.0, 1e30, 2.0), 3, None))
    assert restored.line() is None and restored.seconds(10) is not None


@pytest.mark.asyncio
async def test_rounded_prefill_times_leave_estimates_and_streams_working() -> None:
    tokens = prompt(4, 8 * T)
    async with KVCache(config(None, pool_pages=16), LAYOUT, make_kv(4)) as cache:
        await cache.pool.wait_ready()  # every pool chunk mapped: under load an early offload fits only the first
        assert (await cache.offload(tokens, torch.arange(len(tokens)))).stored == len(tokens) // T
        for n in (256, 4096, 4096, 256, 512):
            cache.note_prefill(n, 0.001)
        match = await cache.match(tokens)
        assert math.isfinite(cache.estimate(match).recompute_seconds or 0.0)
        async with await cache.start_load(match, torch.arange(100, 100 + match.tokens)) as stream:
            await stream.finish()
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_a_start_load_whose_estimate_raises_takes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # The stream took the match's pages before the estimate: an estimate that raised leaked them.
    tokens = prompt(5, 8 * T)
    async with KVCache(config(None, pool_pages=16), LAYOUT, make_kv(5)) as cache:
        await cache.pool.wait_ready()  # every pool chunk mapped: under load an early offload fits only the first
        assert (await cache.offload(tokens, torch.arange(len(tokens)))).stored == len(tokens) // T
        match = await cache.match(tokens)

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("injected estimate fault")

        monkeypatch.setattr(cache._manager.costs, "estimate", broken)
        with pytest.raises(RuntimeError, match="injected estimate fault"):
            await cache.start_load(match, torch.arange(100, 100 + match.tokens))
        match.release()
        assert cache.stats().pool_referenced == 0
        await assert_quiescent(cache)
