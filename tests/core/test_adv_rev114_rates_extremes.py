"""Review 114: a rates file that ``decode_rates`` accepts must only ever cost speed.

A file of ours (0600, regular) whose line moments lie at the edge of what the checks allowed (a
mean amount of 1e-300 bytes per call) made a meter's marginal rate 2.8e-304 B/s: a page's read
cost overflowed to inf, the split's crossing became NaN and ``CostModel.estimate`` raised
``ValueError: cannot convert float NaN to integer`` (so did ``KVCache.estimate`` and
``start_load`` on every hit); prefill moments of 1e-300 tokens a call made the curve's fit divide
by zero (``ZeroDivisionError``). Calls move at least a byte or a token and take at least
``MIN_CALL_S``: moments below those are now refused as corrupt.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from aiokv.costs import MOMENT_BOUNDS, CostModel
from aiokv.rates_file import RATES_FORMAT, RATES_VERSION, RatesFileError, decode_rates

LAYOUT, KIND = "ab" * 8, "cpu"
MAX_X, MAX_Y = MOMENT_BOUNDS


def _doc(name: str, moments: list[float], curve: list[float] | None = None) -> bytes:
    entry: dict[str, object] = {"rate": 1e9 if name != "prefill" else 1e4, "samples": 100,
                                "moments": moments, "fitted": 100}
    if curve is not None:
        entry["curve"] = curve
    rates: dict[str, object] = {name: entry}
    if name != "prefill":
        rates["prefill"] = {"rate": 1000.0, "samples": 100}
    if name != "pool":
        rates["pool"] = {"rate": 1e10, "samples": 100}
    return json.dumps({"format": RATES_FORMAT, "version": RATES_VERSION, "layout": LAYOUT, "device": KIND,
                       "rates": rates}).encode()


def _estimates_are_sound(costs: CostModel) -> None:
    """Every estimate over a spread of matches is computed, its plan inside the match."""
    for pool_pages, disk_pages in ((1, 0), (8, 0), (0, 1), (0, 8), (4, 4), (300, 700)):
        for prefix in (0, 4096):
            estimate = costs.estimate(pool_pages, disk_pages, 16, 1 << 20, prefix)
            if estimate.split_token is not None:
                assert 0 <= estimate.split_token <= (pool_pages + disk_pages) * 16
                assert estimate.split_seconds is not None and not math.isnan(estimate.split_seconds)


@pytest.mark.parametrize("name", ["pool", "disk"])
def test_moments_of_calls_below_a_byte_are_refused(name: str) -> None:
    # Accepted before: the line through them priced a page at inf and the estimate raised.
    with pytest.raises(RatesFileError) as caught:
        decode_rates(_doc(name, [1e-300, 3600.0, 1e-300, 1e5]), LAYOUT, KIND)
    assert caught.value.reason == "corrupt"


def test_moments_of_calls_shorter_than_a_call_can_be_are_refused() -> None:
    with pytest.raises(RatesFileError) as caught:
        decode_rates(_doc("disk", [1e6, 1e-300, 1e12 * 1.5, 1e-290]), LAYOUT, KIND)
    assert caught.value.reason == "corrupt"


def test_prefill_moments_of_calls_below_a_token_are_refused() -> None:
    # Accepted before: PrefillMeter's curve fit divided by E[t]² = 0 on every estimate.
    tiny = [1e-300, 1e-300, 1e-300, 1e-300]
    with pytest.raises(RatesFileError) as caught:
        decode_rates(_doc("prefill", [1e-300, 1.0, 1e-300, 1e-300], tiny), LAYOUT, KIND)
    assert caught.value.reason == "corrupt"


def _log_uniform(low: float, high: float) -> st.SearchStrategy[float]:
    return st.floats(math.log10(low), math.log10(high)).map(lambda e: min(max(10.0**e, low), high))


@settings(max_examples=400, deadline=None)
@example(name="disk", mx=1e-300, my=3600.0, excess=1.0, floor=1e-300, mxy=1e5, q=(1.0, 1.0, 0.5, 1.0))
@example(name="pool", mx=1e-300, my=3600.0, excess=1.0, floor=1e-300, mxy=1e5, q=(1.0, 1.0, 0.5, 1.0))
@example(name="prefill", mx=1e-300, my=1.0, excess=1.0, floor=1e-300, mxy=1e-300, q=(1e-3, 1.0, 0.5, 1e-300))
@example(name="prefill", mx=1.0, my=1e-9, excess=1e-12, floor=1e-320, mxy=1e-9, q=(1e-3, 1e-12, 1.0, 1e-300))
@given(name=st.sampled_from(["pool", "disk", "prefill"]),
       mx=_log_uniform(1e-320, MAX_X), my=_log_uniform(1e-320, MAX_Y),
       excess=_log_uniform(1e-12, 1e12), floor=_log_uniform(1e-320, 1.0), mxy=_log_uniform(1e-320, MAX_X * MAX_Y),
       q=st.tuples(_log_uniform(1e-3, 1e9), _log_uniform(1e-12, 1e6), st.floats(0.0, 1.0),
                   _log_uniform(1e-320, 1.5 * MAX_X * MAX_X * MAX_Y)))
def test_any_file_decode_accepts_prices_every_match(name: str, mx: float, my: float, excess: float, floor: float,
                                                   mxy: float, q: tuple[float, float, float, float]) -> None:
    mxx = min(max(mx * mx * (1 + excess), floor), MAX_X * MAX_X)  # (floor: mx² may underflow to 0)
    curve = None
    if name == "prefill":  # q = t·(p + t/2) >= t²/2 per call; E[tq]² <= E[t²]E[q²]
        grow, excess_q, corr, mqy = q
        mq = mxx / 2 * (1 + grow)
        mqq = mq * mq * (1 + excess_q)
        curve = [mq, mqq, corr * math.sqrt(mxx * mqq), mqy]
    try:
        saved = decode_rates(_doc(name, [mx, my, mxx, mxy], curve), LAYOUT, KIND)
    except RatesFileError:
        return
    costs = CostModel()
    costs.restore(saved)
    _estimates_are_sound(costs)
