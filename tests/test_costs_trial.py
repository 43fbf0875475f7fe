"""A stale disk rate offers a trial split (``LoadEstimate.trial``), so a disk once measured slow is measured again."""

from __future__ import annotations

import pytest

from aiokv.costs import TRIAL_AFTER_S, CostModel

PAGE_TOKENS, PAGE_BYTES = 256, 32 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def slow_disk_model(clock: Clock) -> CostModel:
    """A disk measured at 10 MB/s (one 32 MiB page: 3.4 s) and a 10K tokens/s prefill (a page: 26 ms):
    every disk hit is declined, a split included (its best is to load nothing)."""
    model = CostModel(prefill_tokens_per_s=10_000.0, clock=clock)
    model.pool.update(50e9, 1.0)
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
