"""The cost model's fixed costs per call (#10): learned online, persisted, priced into every plan.

References are brute force, computed here from the observations or the per-page costs: the
closed-form split against the loop it replaced and against a scan of every meeting page, the
meter's line against a weighted least-squares fit, its spread against a replay of its predictions.
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv.costs import FIT_MIN_SAMPLES, FIXED_MAX_S, MARGIN_FRACTION, CostModel, PageCosts, RateMeter
from aiokv.rates_file import RATES_FORMAT, RATES_VERSION, RatesFileError, decode_rates, encode_rates

LAYOUT, DEVICE = "ab" * 16, "cuda:NVIDIA H200"
MIB = 1 << 20


def loop_split(pool_pages: int, disk_pages: int, page_tokens: int, page_bytes: int,
               pool_rate: float | None, disk_rate: float, prefill: float) -> tuple[int, float]:
    """The estimate's loop before #10's fixed costs (2259c32..c268544), verbatim in its arithmetic:
    the split token and its ready time."""
    pages = pool_pages + disk_pages
    copy = None if pool_rate is None else pages * page_bytes / pool_rate
    read = 0.0 if disk_pages == 0 else disk_pages * page_bytes / disk_rate
    copy_known = copy if copy is not None else 0.0
    compute_page = page_tokens / prefill
    per_pool = copy_known / pages
    per_disk = read / disk_pages + per_pool if disk_pages else per_pool
    best_k, best = pages, pages * compute_page
    load = 0.0
    for k in range(pages - 1, -1, -1):
        load += per_disk if k >= pool_pages else per_pool
        ready = max(k * compute_page, load)
        if ready <= best:
            best_k, best = k, ready
    return best_k * page_tokens, best


def brute_compute(c: PageCosts, k: int) -> float:
    """Computing pages [0, k), page by page: page i attends over the i pages (and the prefix) before it."""
    return sum(c.compute + c.attend * (i + 0.5) for i in range(k))


def brute_ready(c: PageCosts, k: int) -> float:
    """The split's ready time at page k, written out page by page (no closed form)."""
    p = c.pool_pages + c.disk_pages
    if k == p:
        return brute_compute(c, p)
    load = c.copy_fixed + (c.read_fixed if c.disk_pages else 0.0)
    for page in range(k, p):
        load += c.copy + (c.read if page >= c.pool_pages else 0.0)
    claims = 1 if c.claim_pages == 0 else (k + c.claim_pages - 1) / c.claim_pages
    computed = 0.0 if k == 0 else c.claim_fixed * claims + brute_compute(c, k)
    return max(computed, load)


rates = st.floats(1e3, 1e12)


@settings(max_examples=400, deadline=None)
@given(pool=st.integers(0, 300), disk=st.integers(0, 300), page_tokens=st.integers(1, 512),
       page_bytes=st.integers(1, 64 * MIB), pool_rate=st.one_of(st.none(), rates), disk_rate=rates,
       prefill=st.floats(1.0, 1e7))
def test_closed_form_split_agrees_with_the_loop_it_replaced(
    pool: int, disk: int, page_tokens: int, page_bytes: int, pool_rate: float | None, disk_rate: float,
    prefill: float,
) -> None:
    if pool + disk == 0 or (pool_rate is None and disk == 0):
        return  # no split is estimated (as before)
    model = CostModel(prefill_tokens_per_s=prefill)
    if pool_rate is not None:
        model.pool.update(pool_rate, 1.0)
    model.disk.update(disk_rate, 1.0)
    est = model.estimate(pool, disk, page_tokens, page_bytes)
    token, ready = loop_split(pool, disk, page_tokens, page_bytes, pool_rate, disk_rate, prefill)
    assert est.split_token is not None and est.split_seconds is not None and est.costs is not None
    # The same least time; the same page unless two pages tie within rounding (then the least).
    assert est.split_seconds == pytest.approx(ready, rel=1e-9, abs=1e-300)
    if est.split_token != token:
        assert est.costs.ready(token // page_tokens) == pytest.approx(ready, rel=1e-9)
    assert est.overhead_seconds == 0.0  # one call size per meter: no fixed cost can be told


costs_strategy = st.builds(
    PageCosts,
    copy=st.floats(0.0, 1.0), read=st.floats(0.0, 1.0), compute=st.floats(1e-6, 1.0),
    copy_fixed=st.floats(0.0, 5.0), read_fixed=st.floats(0.0, 5.0), claim_fixed=st.floats(0.0, 5.0),
    pool_pages=st.integers(0, 200), disk_pages=st.integers(0, 200), page_tokens=st.just(16),
    claim_pages=st.integers(0, 16),
    # Attention's growth per page of prefix: none (the line), tiny (near the linear formula), up
    # to where a page's attention dwarfs its linear cost.
    attend=st.just(0.0) | st.floats(0.0, 1e-12) | st.floats(0.0, 0.05),
)


@settings(max_examples=600, deadline=None)
@given(costs=costs_strategy)
def test_closed_form_split_is_the_least_ready_time_of_every_meeting_page(costs: PageCosts) -> None:
    p = costs.pages
    times = [brute_ready(costs, k) for k in range(p + 1)]
    best = min(times)
    k = costs.best_split()
    assert costs.ready(k) == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert times[k] == pytest.approx(best, rel=1e-9, abs=1e-12)
    # The least such page (the most loaded), up to rounding between tied pages.
    slack = 1e-9 * best + 1e-12
    first = next(i for i, t in enumerate(times) if t <= best + slack)
    # (Both within the same slack of the least time: a page picked by the first test passes the second.)
    assert k <= first or abs(times[first] - times[k]) <= 2 * slack


def weighted_line(xs: list[float], ys: list[float], weight: float) -> tuple[float, float]:
    """Least-squares line over observations weighted as the meter's moving average weighs them."""
    n = len(xs)
    w = np.array([(1 - weight) ** (n - 1)] + [weight * (1 - weight) ** (n - 1 - i) for i in range(1, n)])
    slope, intercept = np.polyfit(np.array(xs), np.array(ys), 1, w=np.sqrt(w))
    return float(intercept), float(slope)


def test_meter_splits_calls_into_a_fixed_cost_and_a_marginal_rate() -> None:
    rng = random.Random(7)
    meter = RateMeter()
    xs: list[float] = []
    ys: list[float] = []
    # A disk read: 40 ms to the first byte, then 2 GB/s; 1 to 31 pages of 32 MiB, 3% noise.
    for _ in range(40):
        x = float(rng.randint(1, 31) * 32 * MIB)
        y = (0.040 + x / 2e9) * rng.uniform(0.97, 1.03)
        meter.update(x, y)
        xs.append(x)
        ys.append(y)
    intercept, slope = weighted_line(xs, ys, 0.3)
    line = meter.line()
    assert line is not None
    assert line[0] == pytest.approx(intercept, rel=1e-6, abs=1e-9)
    assert line[1] == pytest.approx(1 / slope, rel=1e-6)
    assert meter.fixed == pytest.approx(0.040, abs=0.015)  # near the truth despite the noise
    assert meter.seconds(5 * 32 * MIB) == pytest.approx(intercept + slope * 5 * 32 * MIB, rel=1e-6)
    # The average rate is still the moving average of amount/seconds (what version 1 saved).
    rate: float | None = None
    for x, y in zip(xs, ys, strict=True):
        rate = x / y if rate is None else 0.7 * rate + 0.3 * x / y
    assert meter.rate == pytest.approx(rate, rel=1e-12)


def test_meter_spread_is_the_moving_gap_between_calls_and_their_predictions() -> None:
    rng = random.Random(3)
    meter, replay = RateMeter(), RateMeter()
    spread = None
    for _ in range(25):
        x = rng.uniform(1e6, 1e8)
        y = 0.01 + x / 1e9 + rng.uniform(-0.004, 0.004)
        predicted = replay.seconds(x)
        if predicted is not None:
            gap = abs(y - predicted)
            spread = gap if spread is None else 0.7 * spread + 0.3 * gap
        replay.update(x, y)
        meter.update(x, y)
    assert spread is not None and meter.spread == pytest.approx(spread, rel=1e-12)


def test_meter_tells_no_fixed_cost_from_calls_of_one_size_or_too_few() -> None:
    same = RateMeter()
    for y in (0.10, 0.11, 0.09, 0.10):
        same.update(1000.0, y)  # one size: a fixed cost and a slower rate look alike
    assert same.line() is None and same.fixed == 0.0 and same.marginal == same.rate
    few = RateMeter()
    for i in range(1, FIT_MIN_SAMPLES):
        few.update(i * 1000.0, 0.05 + i * 0.01)
    assert few.line() is None
    shrinking = RateMeter()  # more bytes in less time: no line, the average rate stands
    for amount, seconds in ((1000.0, 0.3), (2000.0, 0.2), (4000.0, 0.1), (8000.0, 0.05)):
        shrinking.update(amount, seconds)
    assert shrinking.line() is None and shrinking.rate is not None
    assert shrinking.seconds(1000.0) == pytest.approx(1000.0 / shrinking.rate)
    negative = RateMeter()  # a line below the origin is noise: calls scale with their size
    for amount, seconds in ((1000.0, 0.009), (2000.0, 0.02), (4000.0, 0.041), (8000.0, 0.083)):
        negative.update(amount, seconds)
    line = negative.line()
    assert line is not None and line[0] == 0.0
    for bad in ((0.0, 1.0), (1.0, 0.0), (math.nan, 1.0), (1.0, math.inf), (-5.0, 1.0)):
        before = (negative.rate, negative.samples, negative.line(), negative.spread)
        negative.update(*bad)
        assert (negative.rate, negative.samples, negative.line(), negative.spread) == before


def h200_8k_model(read_latency: float) -> CostModel:
    """The 8B shape's 8K disk hit (call 1 of stop 22): 31 pages of 256 tokens, 32 MiB each, recompute
    ~310 ms, pinned memcpy ~19 ms for the hit; disk reads at 1.5 GB/s after ``read_latency``; a claim
    call costs 3 ms beyond its tokens. Eight calls: a meter with fewer is young and offers a trial
    (:data:`aiokv.costs.TRIAL_SAMPLES`)."""
    page = 32 * MIB
    model = CostModel()
    for pages in (1, 5, 31, 12, 31, 3, 8, 20):
        model.pool.update(pages * page, 0.0005 + pages * page / 52e9)
        model.disk.update(pages * page, read_latency + pages * page / 1.5e9)
        model.prefill.update(pages * 256, 0.003 + pages * 256 / 26_000)
    return model


def test_a_split_whose_gain_is_within_its_overhead_recomputes() -> None:
    page_tokens, page_bytes = 256, 32 * MIB
    for latency in (0.0, 0.05, 0.15, 0.3, 0.6):
        model = h200_8k_model(latency)
        est = model.estimate(26, 5, page_tokens, page_bytes)
        assert est.costs is not None and est.recompute_seconds is not None and est.split_seconds is not None
        assert est.split_token is not None
        c = est.costs
        assert c.read_fixed == pytest.approx(latency, abs=1e-6)  # noise-free calls: the line is exact
        assert c.claim_fixed == pytest.approx(0.003, rel=1e-6)
        times = [brute_ready(c, k) for k in range(c.pages + 1)]
        assert est.split_seconds == pytest.approx(min(times), rel=1e-9)
        margin = MARGIN_FRACTION * est.recompute_seconds + c.copy_spread + c.read_spread + (
            c.claim_spread if 0 < est.split_token // page_tokens < c.pages else 0.0)
        assert est.margin_seconds == pytest.approx(margin)
        # A split proper is priced without the load's spreads (a slower load only moves the meeting).
        claims = 0 < est.split_token // page_tokens < c.pages
        split_margin = MARGIN_FRACTION * est.recompute_seconds + c.claim_spread if claims else margin
        assert est.split_margin == pytest.approx(split_margin)
        assert est.split_pays is (min(times) < est.recompute_seconds - split_margin)
        assert est.worth_loading is (max(est.pool_seconds or 0, est.disk_seconds or 0) < est.recompute_seconds - margin)
    # Where the first read's latency eats the gain, recompute; the rates alone (no fixed cost) say split.
    slow = h200_8k_model(0.6).estimate(26, 5, page_tokens, page_bytes)
    assert slow.split_pays is False and slow.split_token == 31 * page_tokens
    fast = h200_8k_model(0.0).estimate(26, 5, page_tokens, page_bytes)
    assert fast.split_pays is True and fast.split_token is not None and fast.split_token < 31 * page_tokens


def test_suffix_prices_only_the_pages_the_engine_lacks() -> None:
    est = h200_8k_model(0.05).estimate(26, 5, 256, 32 * MIB)
    assert est.costs is not None
    for first in (0, 10, 26, 29, 31):
        part = est.costs.suffix(first)
        assert (part.pool_pages, part.disk_pages) == (max(26 - first, 0), 31 - max(first, 26))
        times = [brute_ready(part, k) for k in range(part.pages + 1)]
        assert part.estimate().split_seconds == pytest.approx(min(times), rel=1e-9)


def test_rates_file_keeps_the_line_and_spread_and_refuses_older_versions() -> None:
    model = h200_8k_model(0.08)
    data = encode_rates(model, LAYOUT, DEVICE)
    doc = json.loads(data)
    assert doc["version"] == RATES_VERSION == 3
    assert set(doc["rates"]["disk"]) == {"rate", "samples", "spread", "moments", "fitted"}
    assert set(doc["rates"]["prefill"]) == {"rate", "samples", "spread", "moments", "fitted", "curve"}
    saved = decode_rates(data, LAYOUT, DEVICE)
    restarted = CostModel()
    restarted.restore(saved)
    for name, meter in model.meters().items():
        again = restarted.meters()[name]
        assert again.rate == meter.rate and again.samples == meter.samples
        assert again.line() == meter.line() and again.spread == meter.spread
    assert restarted.estimate(26, 5, 256, 32 * MIB) == model.estimate(26, 5, 256, 32 * MIB)
    # The line goes on across restarts: a process that saw one call of each size still has one.
    first, second = CostModel(), CostModel()
    first.disk.update(31 * 32 * MIB, 0.08 + 31 * 32 * MIB / 1.5e9)
    first.disk.update(31 * 32 * MIB, 0.08 + 31 * 32 * MIB / 1.5e9)
    second.restore(decode_rates(encode_rates(first, LAYOUT, DEVICE), LAYOUT, DEVICE))
    assert second.disk.line() is None
    second.disk.update(5 * 32 * MIB, 0.08 + 5 * 32 * MIB / 1.5e9)
    line = second.disk.line()
    assert line is not None and line[0] == pytest.approx(0.08, rel=1e-6) and line[1] == pytest.approx(1.5e9)
    # Older files (version 2's prefill line ignored the calls' prefixes) are refused, as other
    # versions are: the file is a hint, the meters start afresh. Rates only is still version 3.
    for version in (1, 2):
        old = json.dumps({"format": RATES_FORMAT, "version": version, "layout": LAYOUT, "device": DEVICE,
                          "rates": {"disk": {"rate": 1.5e9, "samples": 4}}}).encode()
        with pytest.raises(RatesFileError) as info:
            decode_rates(old, LAYOUT, DEVICE)
        assert info.value.reason == "version"
    rates_only = decode_rates(json.dumps({"format": RATES_FORMAT, "version": 3, "layout": LAYOUT, "device": DEVICE,
                                          "rates": {"disk": {"rate": 1.5e9, "samples": 4}}}).encode(), LAYOUT, DEVICE)
    assert rates_only.rates == {"disk": (1.5e9, 4)} and rates_only.fits == {}
    fresh = CostModel()
    fresh.restore(rates_only, keep=lambda name: name == "prefill")
    assert fresh.disk.rate == 1.5e9 and fresh.disk.line() is None and fresh.disk.fixed == 0.0
    # A prefill rate the engine gave itself is kept.
    given_rate = CostModel(prefill_tokens_per_s=1234.0)
    given_rate.restore(saved, keep=lambda name: name == "prefill")
    assert given_rate.prefill.rate == 1234.0 and given_rate.prefill.line() is None


def _entry(**fields: object) -> bytes:
    return json.dumps({"format": RATES_FORMAT, "version": RATES_VERSION, "layout": LAYOUT, "device": DEVICE,
                       "rates": {"disk": {"rate": 1e9, "samples": 3, **fields}}}).encode()


def test_rates_file_lines_are_validated_and_clamped() -> None:
    good = [32 * MIB, 0.05, (32 * MIB) ** 2 * 1.5, 32 * MIB * 0.05 * 1.2]
    ok = decode_rates(_entry(moments=good, fitted=9, spread=0.01), LAYOUT, DEVICE)
    fit = ok.fits["disk"]
    assert ok.clamped == () and fit.moments == tuple(good) and fit.fitted == 9 and fit.spread == 0.01
    clamped = decode_rates(_entry(moments=good, fitted=10**9, spread=FIXED_MAX_S * 3), LAYOUT, DEVICE)
    assert clamped.clamped == ("disk",)
    assert clamped.fits["disk"].spread == FIXED_MAX_S and clamped.fits["disk"].fitted == 1_000_000
    assert decode_rates(_entry(moments=good, fitted=0), LAYOUT, DEVICE).fits["disk"].fitted == 1
    spread_only = decode_rates(_entry(spread=0.01), LAYOUT, DEVICE)
    assert spread_only.clamped == () and spread_only.fits["disk"].moments is None
    corrupt = [
        _entry(moments=good),  # without its count
        _entry(fitted=3),
        _entry(moments=good[:3], fitted=3),
        _entry(moments=[*good[:3], "1"], fitted=3),
        _entry(moments=[good[0], good[1], good[0] ** 2 * 0.5, good[3]], fitted=3),  # E[x²] < E[x]²
        _entry(moments=[-good[0], *good[1:]], fitted=3),
        _entry(moments=[good[0], 1e6, *good[2:]], fitted=3),  # a mean call of 11 days
        _entry(moments=[*good[:3], 0.0], fitted=3),
        _entry(moments=good, fitted=2.5),
        _entry(moments=good, fitted=True),
        _entry(spread=True),
        _entry(spread=-0.0).replace(b"-0.0", b"NaN"),
        _entry(latency=0.1),  # a key no version has
        _entry(moments=good, fitted=3, curve=[1e15, 1e30, 1e30, 1e15]),  # a curve is the prefill meter's
    ]
    for data in corrupt:
        with pytest.raises(RatesFileError) as info:
            decode_rates(data, LAYOUT, DEVICE)
        assert info.value.reason == "corrupt", data
    for version in (0, 2, 4, True, "3"):
        data = _entry().replace(b'"version": 3', b'"version": ' + json.dumps(version).encode())
        with pytest.raises(RatesFileError) as info:
            decode_rates(data, LAYOUT, DEVICE)
        assert info.value.reason == "version", data
