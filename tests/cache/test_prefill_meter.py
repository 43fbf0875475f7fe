"""The prefill meter prices attention (#10): ``seconds = fixed + a·t + b·t·(p + t/2)`` for ``t``
tokens computed on top of a ``p``-token prefix, fitted online from the engine's calls.

References are computed here: a weighted least-squares fit with numpy over the observations
weighted as the meter's moving average weighs them, the truth the samples were generated from,
and the linear :class:`RateMeter` the prefill was priced with before (the 32K case must fail on it).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, make_kv, prompt

from aiokv import KVCache
from aiokv.costs import FIXED_MAX_S, PREFILL_WEIGHT, CostModel, PrefillMeter, RateMeter, SavedFit
from aiokv.rates_file import RATES_VERSION, RatesFileError, decode_rates, encode_rates

FIXED, A, B = 0.002, 3e-5, 1.5e-9
"""The H200's 8B-shape prefill, about: 2 ms per call, 30 µs per token, 1.5 ns per token² of prefix."""
LAYOUT_HEX, DEVICE = "cd" * 16, "cuda:NVIDIA H200"
PAGE_TOKENS, PAGE_BYTES = 256, 32 << 20


def truth(t: float, p: float, fixed: float = FIXED, a: float = A, b: float = B) -> float:
    return fixed + a * t + b * t * (p + t / 2)


def h200_calls(seed: int, n: int = 60) -> list[tuple[int, int]]:
    """(tokens, prefix) of calls like the H200 run's: chunks of 256..4096 tokens, most over a short
    prefix (requests of a few K tokens, claims near the front), every fifth over one up to 28K."""
    rng = random.Random(seed)
    calls = []
    for i in range(n):
        t = rng.choice([256, 512, 1024, 2048, 4096])
        p = rng.randrange(0, 28 * 1024 - t, 256) if i % 5 == 0 else rng.randrange(0, 2048, 256)
        calls.append((t, p))
    return calls


def weighted_fit(rows: list[tuple[float, float, float]], weight: float) -> tuple[float, float, float]:
    """Unconstrained least squares of seconds over (1, t, q), weighted as the meter's moving average."""
    n = len(rows)
    w = np.array([(1 - weight) ** (n - 1)] + [weight * (1 - weight) ** (n - 1 - i) for i in range(1, n)])
    x = np.array([[1.0, t, t * (p + t / 2)] for t, _, p in rows])
    y = np.array([s for _, s, _ in rows])
    sw = np.sqrt(w)
    coef, *_ = np.linalg.lstsq(x * sw[:, None], y * sw, rcond=None)
    return float(coef[0]), float(coef[1]), float(coef[2])


def test_the_fit_recovers_fixed_a_and_b_from_noiseless_calls_at_mixed_prefixes() -> None:
    meter = PrefillMeter()
    for t, p in h200_calls(1):
        meter.update(t, truth(t, p), p)
    curve = meter.curve()
    assert curve is not None
    assert curve == pytest.approx((FIXED, A, B), rel=1e-6)
    assert meter.coefficients() == curve
    assert meter.seconds(1000, 5000) == pytest.approx(truth(1000, 5000), rel=1e-9)
    # Tokens [s, e) in any chunking: the same per-token work, one fixed part per call.
    chunks = [(0, 300), (300, 2048), (2048, 2049), (2049, 9000)]
    summed = sum(meter.seconds(e - s, s) or 0.0 for s, e in chunks)
    assert meter.compute_seconds(0, 9000, calls=len(chunks)) == pytest.approx(summed, rel=1e-12)
    assert meter.compute_seconds(0, 9000, calls=0) == pytest.approx(A * 9000 + B * 9000**2 / 2, rel=1e-6)
    assert meter.compute_seconds(500, 500) == 0.0


def test_the_fit_is_the_weighted_least_squares_of_noisy_calls_and_near_the_truth() -> None:
    rng = random.Random(5)
    meter = PrefillMeter()
    rows: list[tuple[float, float, float]] = []
    for t, p in h200_calls(2, 200):
        seconds = truth(t, p) * rng.uniform(0.98, 1.02)
        meter.update(t, seconds, p)
        rows.append((t, seconds, p))
    reference = weighted_fit(rows, PREFILL_WEIGHT)
    assert 0 <= reference[0] <= FIXED_MAX_S and reference[2] > 0  # no bound binds: the plain fit
    curve = meter.curve()
    assert curve is not None and curve == pytest.approx(reference, rel=1e-6, abs=1e-9)
    assert curve[1] == pytest.approx(A, rel=0.1) and curve[2] == pytest.approx(B, rel=0.15)


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_a_32k_recompute_is_priced_within_5_percent_where_the_linear_meter_was_off_by_a_quarter(noise: float) -> None:
    # On the H200 the linear meter priced a 32K recompute at 1.198 s; it took 2.011 s.
    rng = random.Random(11)
    model, linear = CostModel(), RateMeter()
    for t, p in h200_calls(3):
        seconds = truth(t, p) * (1 + rng.uniform(-noise, noise))
        model.prefill.update(t, seconds, p)
        linear.update(t, seconds)
    pages = 32 * 1024 // PAGE_TOKENS
    true_s = truth(pages * PAGE_TOKENS, 0) - FIXED  # the engine's own pass: its fixed cost is paid anyway
    estimate = model.estimate(pages, 0, PAGE_TOKENS, PAGE_BYTES)
    assert estimate.recompute_seconds is not None
    assert estimate.recompute_seconds == pytest.approx(true_s, rel=0.05)
    # What the cost model priced it at before: the linear line's marginal rate.
    assert linear.marginal is not None
    old = pages * PAGE_TOKENS / linear.marginal
    assert abs(old - true_s) > 0.25 * true_s


def test_one_size_at_one_prefix_falls_back_to_the_rate_and_one_size_at_many_prefixes_tells_b() -> None:
    same = PrefillMeter()
    for seconds in (0.10, 0.11, 0.09, 0.10):
        same.update(2048, seconds, 4096)  # singular: nothing tells a fixed part, nor b
    assert same.curve() is None and same.line() is None
    assert same.rate is not None and same.coefficients() == (0.0, 1 / same.rate, 0.0)
    claims = PrefillMeter()  # the demo's claims: chunks of 2048 at growing prefixes
    for p in range(0, 30_000, 2048):
        claims.update(2048, truth(2048, p), p)
    curve = claims.curve()
    # The fixed part and a cannot be told apart at one size: the fixed part is priced per token.
    assert curve is not None and curve[0] == 0.0
    assert curve[1] == pytest.approx(A + FIXED / 2048, rel=1e-6) and curve[2] == pytest.approx(B, rel=1e-6)
    assert claims.seconds(2048, 40_000) == pytest.approx(truth(2048, 40_000), rel=1e-9)


def test_linear_calls_and_a_negative_b_price_as_the_linear_meter_does() -> None:
    for b in (0.0, -2e-10):  # b < 0 (a faster long prefix: noise) is clipped to the line
        meter, line = PrefillMeter(), RateMeter(weight=PREFILL_WEIGHT)
        for t, p in h200_calls(4, 30):
            seconds = truth(t, p, b=b)
            meter.update(t, seconds, p)
            line.update(t, seconds)
        assert meter.curve() is None
        fitted = line.line()
        assert fitted is not None and meter.line() == fitted
        assert meter.coefficients() == (fitted[0], 1 / fitted[1], 0.0)
        assert meter.seconds(1000, 20_000) == pytest.approx(line.seconds(1000), rel=1e-12)
    prior = CostModel(prefill_tokens_per_s=1000.0)  # a configured rate is the linear prior
    assert prior.prefill.coefficients() == (0.0, 1e-3, 0.0)
    assert prior.estimate(4, 0, PAGE_TOKENS, PAGE_BYTES).recompute_seconds == pytest.approx(4 * PAGE_TOKENS / 1000)


def test_a_fixed_part_below_zero_is_clipped_and_the_fit_stays_in_its_bounds() -> None:
    meter = PrefillMeter()
    for t, p in h200_calls(6, 40):
        meter.update(t, truth(t, p, fixed=-0.004), p)  # the calls' line passes below the origin
    curve = meter.curve()
    assert curve is not None and curve[0] == 0.0 and curve[1] >= 0 and curve[2] > 0
    slow = PrefillMeter()
    for t, p in h200_calls(7, 40):
        slow.update(t, truth(t, p, fixed=50.0), p)  # beyond FIXED_MAX_S
    slow_curve = slow.curve()
    assert slow_curve is None or slow_curve[0] == FIXED_MAX_S
    predicted = slow.seconds(1000, 1000)
    assert predicted is not None and math.isfinite(predicted) and predicted > 0


def test_the_spread_is_the_moving_gap_between_calls_and_their_predictions_at_their_prefixes() -> None:
    rng = random.Random(9)
    meter, replay = PrefillMeter(), PrefillMeter()
    spread = None
    for t, p in h200_calls(8, 40):
        seconds = truth(t, p) * rng.uniform(0.97, 1.03)
        predicted = replay.seconds(t, p)
        if predicted is not None:
            gap = abs(seconds - predicted)
            spread = gap if spread is None else (1 - PREFILL_WEIGHT) * spread + PREFILL_WEIGHT * gap
        replay.update(t, seconds, p)
        meter.update(t, seconds, p)
    assert spread is not None and meter.spread == pytest.approx(spread, rel=1e-12)


def test_calls_that_tell_nothing_change_nothing() -> None:
    meter = PrefillMeter()
    for t, p in h200_calls(10, 10):
        meter.update(t, truth(t, p), p)
    before = (meter.rate, meter.samples, meter.saved_fit(), meter.curve())
    for bad in ((0, 1.0, 0), (64, math.nan, 0), (64, 1.0, -1), (64, 1.0, math.nan), (64, 1.0, 1e16),
                (1e16, 1.0, 0), (64, 1e5, 0)):
        meter.update(*bad)
    assert (meter.rate, meter.samples, meter.saved_fit(), meter.curve()) == before


def _model(seed: int) -> CostModel:
    model = CostModel()
    for t, p in h200_calls(seed, 30):
        model.prefill.update(t, truth(t, p), p)
        model.disk.update(t * 1e5, 0.02 + t * 1e5 / 1.5e9)
    return model


def test_the_rates_file_keeps_the_curve() -> None:
    model = _model(12)
    data = encode_rates(model, LAYOUT_HEX, DEVICE)
    assert json.loads(data)["version"] == RATES_VERSION
    restarted = CostModel()
    restarted.restore(decode_rates(data, LAYOUT_HEX, DEVICE))
    assert restarted.prefill.curve() == model.prefill.curve() is not None
    assert restarted.prefill.saved_fit() == model.prefill.saved_fit()
    assert restarted.estimate(100, 28, PAGE_TOKENS, PAGE_BYTES) == model.estimate(100, 28, PAGE_TOKENS, PAGE_BYTES)
    # The fit goes on across the restart as it would have without one.
    for meter in (model.prefill, restarted.prefill):
        meter.update(1024, truth(1024, 9000), 9000)
    assert restarted.prefill.curve() == model.prefill.curve()
    # Line moments without the curve's (a linear meter's) are not taken: they describe other calls.
    fit = model.prefill.saved_fit()
    assert fit is not None and fit.moments is not None
    bare = PrefillMeter()
    bare.restore(1000.0, 5, SavedFit(fit.moments, fit.fitted, fit.spread))
    assert bare.saved_fit() == SavedFit(None, 0, fit.spread, None) and bare.line() is None


def _prefill_entry(**fields: object) -> bytes:
    model = _model(13)
    doc = json.loads(encode_rates(model, LAYOUT_HEX, DEVICE))
    doc["rates"]["prefill"].update(fields)
    return json.dumps(doc).encode()


def test_a_corrupt_or_impossible_curve_is_refused() -> None:
    doc = json.loads(encode_rates(_model(13), LAYOUT_HEX, DEVICE))
    good = doc["rates"]["prefill"]["curve"]
    mq, mqq, mtq, mqy = good
    mtt = doc["rates"]["prefill"]["moments"][2]
    assert decode_rates(_prefill_entry(), LAYOUT_HEX, DEVICE).fits["prefill"].curve == tuple(good)
    corrupt = [
        _prefill_entry(curve=good[:3]),
        _prefill_entry(curve=[*good[:3], "1"]),
        _prefill_entry(curve=[*good[:3], True]),
        _prefill_entry(curve={"q": 1}),
        _prefill_entry(curve=[*good[:3], 0.0]).replace(b"0.0]", b"NaN]"),
        _prefill_entry(curve=[*good[:3], 0.0]).replace(b"0.0]", b"Infinity]"),
        _prefill_entry(curve=[*good[:3], 10**400]),
        _prefill_entry(curve=[-mq, mqq, mtq, mqy]),
        _prefill_entry(curve=[mq, mq * mq * 0.5, mtq, mqy]),  # E[q²] < E[q]²
        _prefill_entry(curve=[mq, mqq, math.sqrt(mtt * mqq) * 1.01, mqy]),  # E[tq]² > E[t²]E[q²]
        _prefill_entry(curve=[mtt / 2 * 0.9, mqq, mtq, mqy]),  # E[q] < E[t²]/2: no prefix is negative
        _prefill_entry(curve=[1e31, 1e62, 1e47, 1e34]),  # beyond what the bounds allow
        _prefill_entry(curve=[mq, mqq, mtq, 0.0]),
    ]
    no_moments = json.loads(_prefill_entry())
    del no_moments["rates"]["prefill"]["moments"], no_moments["rates"]["prefill"]["fitted"]
    corrupt.append(json.dumps(no_moments).encode())  # a curve without its line's moments
    on_disk = json.loads(_prefill_entry())
    on_disk["rates"]["disk"]["curve"] = good
    corrupt.append(json.dumps(on_disk).encode())  # a curve is the prefill meter's only
    for data in corrupt:
        with pytest.raises(RatesFileError) as info:
            decode_rates(data, LAYOUT_HEX, DEVICE)
        assert info.value.reason == "corrupt", data
    older = _prefill_entry().replace(f'"version": {RATES_VERSION}'.encode(), b'"version": 2')
    with pytest.raises(RatesFileError) as version:
        decode_rates(older, LAYOUT_HEX, DEVICE)
    assert version.value.reason == "version"


def test_a_crafted_curve_that_passes_its_checks_prices_finitely() -> None:
    # Moments some calls could have produced, in any proportions the checks let through: whatever
    # the fit makes of them, estimates stay finite and non-negative, never raise.
    rng = random.Random(17)
    for _ in range(300):
        mt = 10 ** rng.uniform(0, 6)
        mtt = mt * mt * (1 + 10 ** rng.uniform(-6, 2))
        my = 10 ** rng.uniform(-6, 3)
        mty = mt * my * 10 ** rng.uniform(-1, 1)
        mq = mtt / 2 * (1 + 10 ** rng.uniform(-3, 4))
        mqq = mq * mq * (1 + 10 ** rng.uniform(-6, 2))
        mtq = math.sqrt(mtt * mqq) * rng.uniform(0.01, 1.0)
        mqy = mq * my * 10 ** rng.uniform(-1, 1)
        meter = PrefillMeter()
        meter.restore(1000.0, 5, SavedFit((mt, my, mtt, mty), 5, None, (mq, mqq, mtq, mqy)))
        coefficients = meter.coefficients()
        assert coefficients is not None and all(math.isfinite(c) and c >= 0 for c in coefficients)
        priced = meter.compute_seconds(0, 32768, calls=4)
        assert priced is not None and math.isfinite(priced) and priced >= 0


@pytest.mark.parametrize(
    ("prefix", "error"),
    [(-1, ValueError), ((1 << 53) + 1, ValueError), (1.5, TypeError), (True, TypeError), ("8", TypeError),
     (None, TypeError)],
)
@pytest.mark.asyncio
async def test_a_bad_prefix_raises_and_folds_nothing(prefix: object, error: type[Exception]) -> None:
    async with KVCache(config(None, pool_pages=8), LAYOUT, make_kv(0)) as cache:
        cache.note_prefill(64, 0.01, prefix=128)
        meter = cache._manager.costs.prefill
        before = (meter.rate, meter.samples, meter.saved_fit())
        with pytest.raises(error):
            cache.note_prefill(64, 0.01, prefix=prefix)  # type: ignore[arg-type]
        assert (meter.rate, meter.samples, meter.saved_fit()) == before


@pytest.mark.asyncio
async def test_note_prefill_and_the_stream_claims_report_their_prefix(tmp_path: Path) -> None:
    t = LAYOUT.page_tokens
    tokens = prompt(21, 8 * t)
    async with KVCache(config(None, pool_pages=16), LAYOUT, make_kv(21)) as cache:
        await cache.pool.wait_ready()
        assert (await cache.offload(tokens, torch.arange(len(tokens)))).stored == 8
        costs = cache._manager.costs
        for n, p in ((t, 0), (3 * t, 2 * t), (2 * t, 5 * t), (4 * t, 0), (t, 7 * t)):
            cache.note_prefill(n, truth(n, p, a=1e-3, b=1e-4), prefix=p)
        reported = costs.prefill.curve()
        assert reported is not None and reported == pytest.approx((FIXED, 1e-3, 1e-4), rel=1e-6)
        match = await cache.match(tokens)
        # The stream's estimate prices pages [1, 8) on top of the page the engine holds.
        async with await cache.start_load(match, torch.arange(100, 100 + 7 * t), from_token=t) as stream:
            assert stream.estimate.recompute_seconds == pytest.approx(
                costs.prefill.compute_seconds(t, 8 * t, calls=0), rel=1e-12)
            before = costs.prefill.saved_fit()
            assert before is not None and before.curve is not None
            # Before the loader's first turn: the front is the match's end, each claim is granted.
            assert stream.claim(3 * t) == 3 * t  # computes [t, 3t) on top of t tokens
            assert stream.claim(4 * t) == 4 * t  # reports [t, 3t): q = 2t·(t + t)
            assert stream.claim(6 * t) == 6 * t  # reports [3t, 4t): q = t·(3t + t/2)
            after = costs.prefill.saved_fit()
            assert after is not None and after.curve is not None
            w = PREFILL_WEIGHT
            expected = before.curve[0]
            for q in (2 * t * (t + t), t * (3 * t + t / 2)):
                expected = (1 - w) * expected + w * q
            assert after.curve[0] == pytest.approx(expected, rel=1e-12)
            await stream.finish()
        await assert_quiescent(cache)
