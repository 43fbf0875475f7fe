"""A disk meter that is no basis for declining a split offers a trial (``LoadEstimate.trial``): a stale
rate, or one with few calls since its start or a jump, so one slow call never locks hits into recompute."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from aiokv.costs import TRIAL_AFTER_S, TRIAL_SAMPLES, CostModel, SavedRates

PAGE_TOKENS, PAGE_BYTES = 256, 32 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def slow_disk_model(clock: Clock) -> CostModel:
    """A disk measured at 10 MB/s (one 32 MiB page: 3.4 s) over enough reads not to be young
    (:data:`TRIAL_SAMPLES`), and a 10K tokens/s prefill (a page: 26 ms): every disk hit is declined,
    a split included (its best is to load nothing)."""
    model = CostModel(prefill_tokens_per_s=10_000.0, clock=clock)
    model.pool.update(50e9, 1.0)
    for _ in range(TRIAL_SAMPLES):
        model.disk.update(10e6, 1.0)
    return model


def test_a_declined_disk_is_offered_a_trial_until_a_read_refreshes_it() -> None:
    clock = Clock()
    model = slow_disk_model(clock)
    est = model.estimate(0, 32, PAGE_TOKENS, PAGE_BYTES)
    assert not est.trial and est.split_pays is False and est.worth_loading is False
    clock.now += TRIAL_AFTER_S - 1
    assert not model.estimate(0, 32, PAGE_TOKENS, PAGE_BYTES).trial
    clock.now += 1
    trial = model.estimate(0, 32, PAGE_TOKENS, PAGE_BYTES)
    assert trial.trial and trial.split_pays is None  # not known: the engine may split to re-measure
    assert trial.worth_loading is False  # a plain load could lose the whole difference: still refused
    assert (trial.split_token, trial.split_seconds) == (est.split_token, est.split_seconds)  # same prices
    # Asking takes nothing: an engine's estimate to decide and a stream's own see the same trial.
    assert model.estimate(0, 32, PAGE_TOKENS, PAGE_BYTES).trial
    model.disk.update(10e6, 1.0)  # the trial's read came back
    again = model.estimate(0, 32, PAGE_TOKENS, PAGE_BYTES)
    assert not again.trial and again.split_pays is False
    clock.now += TRIAL_AFTER_S
    assert model.estimate(0, 32, PAGE_TOKENS, PAGE_BYTES).trial


def test_a_disk_read_restarts_the_period_and_pool_hits_never_trial() -> None:
    clock = Clock()
    model = slow_disk_model(clock)
    model.estimate(0, 32, PAGE_TOKENS, PAGE_BYTES)
    clock.now += TRIAL_AFTER_S + 5
    assert not model.estimate(32, 0, PAGE_TOKENS, PAGE_BYTES).trial  # no disk page: nothing to learn
    model.disk.update(10e6, 1.0)  # a read came back (another request's split, a prefetch)
    assert not model.estimate(0, 32, PAGE_TOKENS, PAGE_BYTES).trial  # seen now: the period starts here
    clock.now += TRIAL_AFTER_S - 1
    assert not model.estimate(0, 32, PAGE_TOKENS, PAGE_BYTES).trial
    clock.now += 1
    assert model.estimate(1, 31, PAGE_TOKENS, PAGE_BYTES).trial


def test_an_unknown_disk_rate_needs_no_trial() -> None:
    clock = Clock()
    model = CostModel(prefill_tokens_per_s=10_000.0, clock=clock)
    model.pool.update(50e9, 1.0)
    clock.now += 10 * TRIAL_AFTER_S
    est = model.estimate(0, 32, PAGE_TOKENS, PAGE_BYTES)
    assert est.split_pays is None  # unknown already: loading is how it is learned
    assert est.trial is False or est.disk_seconds is None


@pytest.mark.parametrize("trial", [False, True])
def test_the_trial_flag_only_changes_split_pays(trial: bool) -> None:
    clock = Clock()
    model = slow_disk_model(clock)
    assert not model.estimate(4, 28, PAGE_TOKENS, PAGE_BYTES).trial  # the disk's sample seen here
    if trial:
        clock.now += TRIAL_AFTER_S
    est = model.estimate(4, 28, PAGE_TOKENS, PAGE_BYTES)
    assert est.trial is trial
    assert est.worth_loading is False
    assert est.split_pays is (None if trial else False)


# -- an unsettled disk meter (few calls since its start or a jump) offers a trial ---------------------

MATCH_PAGES = 31  # the 8B shape's 8K disk hit: 31 pages of 256 tokens, 32 MiB each


def settled_model() -> CostModel:
    """An H200-like model (8B shape): prefill ~26K tokens/s with attention and 3 ms per call, pool
    copies at 52 GB/s, over eight calls of spread sizes; no disk read yet."""
    model = CostModel(clock=lambda: 0.0)  # a clock that never moves: no trial is ever stale
    for pages, prefix in ((1, 0), (5, 8), (31, 0), (12, 40), (31, 2), (3, 100), (8, 16), (20, 4)):
        tokens, before = pages * PAGE_TOKENS, prefix * PAGE_TOKENS
        model.prefill.update(tokens, 0.003 + tokens / 26_000 + 1.5e-9 * tokens * (before + tokens / 2), before)
        model.pool.update(pages * PAGE_BYTES, 0.0005 + pages * PAGE_BYTES / 52e9)
    return model


def warm_read(pages: int) -> float:
    """Seconds of a read of ``pages`` pages on a warm disk: 10 ms to the first byte, then 1.3 GB/s."""
    return 0.01 + pages * PAGE_BYTES / 1.3e9


def slow_read(pages: int) -> float:
    """A disk too slow for any split to pay: 0.3 s to the first byte, then 0.3 GB/s."""
    return 0.3 + pages * PAGE_BYTES / 0.3e9


def serve_hits(model: CostModel, read: Callable[[int], float], hits: int, sizes: tuple[int, ...] = (12,)) -> list[str]:
    """What a claiming engine does with ``hits`` disk hits of the whole match (the demo's
    ``plan_hit``): split when the split pays or a trial is offered, which folds the split's read
    (``sizes`` pages in turn) into the disk meter; else recompute, which reads nothing."""
    plans = []
    for i in range(hits):
        est = model.estimate(0, MATCH_PAGES, PAGE_TOKENS, PAGE_BYTES)
        if est.trial:
            plans.append("trial")
        elif est.split_pays is None or est.split_pays:
            plans.append("split")  # (None: the disk rate is unknown, and reading is how it is learned)
        else:
            plans.append("recompute")
            continue
        pages = sizes[i % len(sizes)]
        model.disk.update(pages * PAGE_BYTES, read(pages))
    return plans


def declines_by_prices(model: CostModel) -> bool:
    """Whether the split's prices alone, trial aside, say recompute."""
    est = dataclasses.replace(model.estimate(0, MATCH_PAGES, PAGE_TOKENS, PAGE_BYTES), trial=False)
    return est.split_pays is False


def test_a_cold_first_split_then_fast_ones_lead_back_to_splitting() -> None:
    # H200, 8K from disk, stop 29: three plain disk-only loads of the whole prefix, then a cold first
    # split whose 12 pages took 0.6 s; the line through them priced a large fixed part, the split was
    # declined, and the two repeats after it recomputed (1.39x the harmonic bound), never measuring
    # the warm disk again.
    model = settled_model()
    for _ in range(3):
        model.disk.update(MATCH_PAGES * PAGE_BYTES, warm_read(MATCH_PAGES))
    model.disk.update(12 * PAGE_BYTES, 0.6)
    assert model.disk.fixed > 0.3 and declines_by_prices(model)  # the cold call alone turns the verdict
    plans = serve_hits(model, warm_read, 12)
    assert plans[0] == "trial"  # not locked into recompute by one call
    assert "recompute" not in plans
    # Back to splitting on the prices alone within a bounded number of loads, and it stays there.
    settled = plans.index("split")
    assert settled <= TRIAL_SAMPLES - 4  # 4 calls were in before the first trial
    assert plans[settled:] == ["split"] * (len(plans) - settled)
    assert model.disk.fixed < 0.05


def test_a_genuinely_slow_disk_keeps_recompute_after_a_bounded_number_of_trials() -> None:
    model = settled_model()
    plans = serve_hits(model, slow_read, 40, sizes=(12, 5, 20))
    # The first read learns the rate; then TRIAL_SAMPLES - 1 trials while the meter is young; then
    # recompute for good (the clock does not move: no stale trial), as no call jumps.
    assert plans[: TRIAL_SAMPLES] == ["split"] + ["trial"] * (TRIAL_SAMPLES - 1)
    assert plans[TRIAL_SAMPLES:] == ["recompute"] * (40 - TRIAL_SAMPLES)
    assert model.disk.samples == TRIAL_SAMPLES and model.disk.settled == TRIAL_SAMPLES
    assert declines_by_prices(model)


def test_one_slow_call_in_a_settled_meter_is_tried_again() -> None:
    # A busy device: one read 6x slower than the warm disk, after eight warm ones that split.
    model = settled_model()
    for pages in (1, 5, 31, 12, 31, 3, 8, 20):
        model.disk.update(pages * PAGE_BYTES, warm_read(pages))
    assert serve_hits(model, warm_read, 1) == ["split"]
    model.disk.update(12 * PAGE_BYTES, 6 * warm_read(12))
    assert model.disk.settled == 1 and declines_by_prices(model)  # a jump: the count starts again
    plans = serve_hits(model, warm_read, 12)
    assert plans[0] == "trial" and "recompute" not in plans
    settled = plans.index("split")
    assert settled < TRIAL_SAMPLES and plans[settled:] == ["split"] * (len(plans) - settled)


def test_a_disk_that_became_slow_for_good_ends_its_trials() -> None:
    model = settled_model()
    for pages in (1, 5, 31, 12, 31, 3, 8, 20):
        model.disk.update(pages * PAGE_BYTES, warm_read(pages))
    plans = serve_hits(model, slow_read, 60, sizes=(12, 5, 20))
    # Each slow call jumps until the prediction catches up; then the count runs out: recompute.
    end = len(plans) - plans[::-1].index("trial")
    assert plans.count("trial") <= 2 * TRIAL_SAMPLES
    assert end < 30 and plans[end:] == ["recompute"] * (len(plans) - end)
    assert model.disk.settled >= TRIAL_SAMPLES and declines_by_prices(model)


@pytest.mark.parametrize("samples", [1, TRIAL_SAMPLES - 1, TRIAL_SAMPLES, 500])
def test_a_restored_meter_is_settled_by_its_saved_count(samples: int) -> None:
    # The rates file keeps each meter's count: a restart does not start the trials again, and a
    # meter restored young goes on offering them until it has its calls.
    model = settled_model()
    fresh = CostModel(clock=lambda: 0.0)
    meters = model.meters()
    rates = {name: (meter.rate or 0.0, meter.samples) for name, meter in meters.items() if name != "disk"}
    fits = {name: fit for name, meter in meters.items() if name != "disk" and (fit := meter.saved_fit()) is not None}
    rates["disk"] = (10e6, samples)  # 10 MB/s: every disk hit declined by its prices
    fresh.restore(SavedRates(rates, (), fits))
    assert fresh.disk.settled == samples
    est = fresh.estimate(0, MATCH_PAGES, PAGE_TOKENS, PAGE_BYTES)
    assert est.trial is (samples < TRIAL_SAMPLES)
    assert declines_by_prices(fresh)
