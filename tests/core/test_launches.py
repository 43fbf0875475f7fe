"""LaunchSizer: launch groups grow past ``launch_pages`` while the loop time their pages add fits the
turn's budget and the bytes fit ``launch_bytes``; never below the floor; a slow group shrinks them
at once; a group's fixed cost (most of a GPU launch's) does not keep them at the floor."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable

import pytest

from aiokv import CacheConfig
from aiokv.launches import DEFAULT_LAUNCH_BYTES, PROBE_EVERY, LaunchSizer

MiB = 1 << 20


def test_nothing_measured_is_the_floor() -> None:
    sizer = LaunchSizer(2, 64 * MiB, 250e-6, MiB)
    assert sizer.pages() == 2 and sizer.per_page_s is None


def test_fast_groups_grow_to_what_fits_the_turn() -> None:
    sizer = LaunchSizer(2, 1 << 40, 250e-6, 4096)
    sizer.record(2, 20e-6)  # 10 us a page, or 20 us of fixed cost: unknown from one size
    assert sizer.pages() == 27  # growth by one turn's budget, were it all per page
    sizer.record(27, 270e-6)  # all per page: no fixed cost
    assert sizer.pages() == 25


def test_bytes_cap_the_group() -> None:
    sizer = LaunchSizer(2, 64 * MiB, 250e-6, 2 * MiB)
    sizer.record(2, 2e-6)
    assert sizer.pages() == 32  # 64 MiB of 2 MiB pages, though 125 would fit the time
    # An 8B model's 32 MiB pages: the ceiling is the floor, whatever the clock says.
    big = LaunchSizer(2, DEFAULT_LAUNCH_BYTES, 250e-6, 32 * MiB)
    big.record(2, 1e-7)
    assert big.pages() == 2


def test_slow_groups_never_go_below_the_floor_and_recover() -> None:
    sizer = LaunchSizer(3, 1 << 40, 250e-6, 4096)
    sizer.record(3, 30e-6)
    assert sizer.pages() == 28
    sizer.record(28, 280e-6)
    assert sizer.pages() == 25
    sizer.record(25, 0.5)  # a compile or a stall in the middle: capped at a turn's budget a page
    assert sizer.per_page_s is not None and sizer.per_page_s <= 250e-6
    assert sizer.pages() == 3
    for _ in range(8):
        sizer.record(sizer.pages(), sizer.pages() * 10e-6)
    assert sizer.pages() >= 20  # forgotten within a few groups


def test_zero_turn_budget_keeps_the_floor() -> None:
    sizer = LaunchSizer(2, 1 << 40, 0.0, 4096)
    sizer.record(2, 1e-9)
    assert sizer.pages() == 2


def test_an_infinite_turn_budget_is_the_byte_ceiling() -> None:
    sizer = LaunchSizer(2, 40 * 4096, math.inf, 4096)
    sizer.record(2, 1e-3)
    assert sizer.pages() == 40
    assert CacheConfig(disk=None, launch_turn_s=math.inf).launch_turn_s == math.inf


def test_a_clock_that_saw_nothing_gives_the_byte_ceiling() -> None:
    sizer = LaunchSizer(2, 40 * 4096, 250e-6, 4096)
    sizer.record(2, 0.0)
    assert sizer.pages() == 40


@pytest.mark.parametrize("args", [(0, MiB, 1e-4, 4096), (2, 0, 1e-4, 4096), (2, MiB, -1.0, 4096),
                                  (2, MiB, math.nan, 4096), (2, MiB, 1e-4, 0)])
def test_bad_sizes_are_refused(args: tuple[int, int, float, int]) -> None:
    with pytest.raises(ValueError, match="bad launch sizes"):
        LaunchSizer(*args)


@pytest.mark.parametrize(("field", "value", "error"), [
    ("launch_bytes", 0, ValueError), ("launch_bytes", -1, ValueError), ("launch_bytes", 1.5, TypeError),
    ("launch_bytes", True, TypeError), ("launch_turn_s", -1e-3, ValueError), ("launch_turn_s", math.nan, ValueError),
    ("launch_turn_s", "1", TypeError), ("launch_turn_s", False, TypeError),
])
def test_config_checks_the_launch_fields(field: str, value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=field):
        CacheConfig(disk=None, **{field: value})  # type: ignore[arg-type]


def test_config_defaults() -> None:
    config = CacheConfig(disk=None)
    assert config.launch_bytes == 64 * MiB and config.launch_turn_s == 250e-6
    assert CacheConfig(disk=None, launch_turn_s=0).launch_turn_s == 0


def _run(sizer: LaunchSizer, cost: Callable[[int], float], groups: int) -> list[tuple[int, float]]:
    """``groups`` groups sized by ``sizer`` whose loop time is ``cost(pages)``: (pages, seconds) each."""
    seen = []
    for _ in range(groups):
        pages = sizer.pages()
        seconds = cost(pages)
        sizer.record(pages, seconds)
        seen.append((pages, seconds))
    return seen


def test_a_fixed_cost_per_group_does_not_keep_groups_at_the_floor() -> None:
    # The H200's load groups (bench_launch --group-costs, 2 MiB pages): ~200 us whatever the size,
    # ~20 us more a page. Per page, two pages cost 120 us: the first sizer kept every group at 2.
    turn = 250e-6

    def cost(pages: int) -> float:
        return 200e-6 + 20e-6 * pages

    sizer = LaunchSizer(2, 1 << 40, turn, 2 << 20)
    seen = _run(sizer, cost, 12)
    assert 10 <= seen[-1][0] <= 13, seen  # pages x 20 us within the 250 us budget: 12
    for (_, before), (_, after) in itertools.pairwise(seen):
        assert after <= before + turn + 1e-12, seen  # each step adds at most a turn's budget


def test_time_all_per_page_grows_to_what_fits_the_turn_and_stays() -> None:
    sizer = LaunchSizer(2, 1 << 40, 250e-6, 4096)
    seen = _run(sizer, lambda pages: 10e-6 * pages, 10)
    assert [p for p, _ in seen] == [2, 27] + [25] * 8


def test_a_cost_that_does_not_grow_with_pages_reaches_the_ceiling_a_turn_at_a_time() -> None:
    turn = 250e-6
    sizer = LaunchSizer(2, 64 * 4096, turn, 4096)
    seen = _run(sizer, lambda pages: 300e-6, 12)
    assert seen[-1][0] == 64, seen
    for (before, seconds), (after, _) in itertools.pairwise(seen):
        # Were the newest group's 300 us all per page, the next adds at most a turn's budget.
        assert after <= before + turn * before / seconds + 0.5, seen  # (to the nearest page)


def test_a_stall_in_a_grown_group_sends_the_next_to_the_floor_whatever_the_fixed_cost() -> None:
    sizer = LaunchSizer(2, 1 << 40, 250e-6, 4096)
    _run(sizer, lambda pages: 200e-6 + 20e-6 * pages, 10)
    assert sizer.pages() > 8
    sizer.record(sizer.pages(), 0.05)  # a GIL hand-over or a compile in the middle of a group
    assert sizer.pages() == 2
    seen = _run(sizer, lambda pages: 200e-6 + 20e-6 * pages, 10)
    assert seen[-1][0] > 8  # and it grows back


def test_a_step_rounds_to_the_nearest_page() -> None:
    # The H200's offload groups (bench_launch --group-costs): ~380 us, ~70 us more a page. A step
    # of 2.96 pages truncated to 2 kept them at the floor; rounded, they reach what fits (3).
    sizer = LaunchSizer(2, 1 << 40, 250e-6, 4096)
    seen = _run(sizer, lambda pages: 380e-6 + 70e-6 * pages, 8)
    assert [p for p, _ in seen][1:] == [3] * 7, seen


def test_a_busy_gpu_host_s_first_groups_are_no_stall() -> None:
    # The H200's offload groups with 16 test processes beside them: ~0.7 ms of fixed cost. Taken
    # for stalls (past a turn's budget a page) they kept every group at the floor.
    sizer = LaunchSizer(2, 1 << 40, 250e-6, 4096)
    seen = _run(sizer, lambda pages: 680e-6 + 70e-6 * pages, 8)
    assert [p for p, _ in seen][1:] == [3] * 7, seen


def test_time_all_per_page_past_the_budget_probes_once_then_keeps_the_floor() -> None:
    # 400 us a page, no fixed cost: one group one page larger tells the two apart, then the floor.
    sizer = LaunchSizer(2, 1 << 40, 250e-6, 4096)
    seen = _run(sizer, lambda pages: 400e-6 * pages, 10)
    assert [p for p, _ in seen] == [2, 3] + [2] * 8, seen



# Review 128: a slow first group, NaN and inf times, a fixed cost past two turns, a fixed cost
# that rises once learned. Each failed before its fix.

def _run_k(sizer: LaunchSizer, cost: Callable[[int, int], float], groups: int) -> list[int]:
    """As ``_run``, with the group's number passed to ``cost`` (a cost that changes over time)."""
    seen = []
    for k in range(groups):
        pages = sizer.pages()
        sizer.record(pages, cost(k, pages))
        seen.append(pages)
    return seen


def _unprobed(seen: list[int]) -> list[int]:
    """The sizes of the groups that are not the every-PROBE_EVERY-th probe."""
    return [p for k, p in enumerate(seen) if k % PROBE_EVERY != PROBE_EVERY - 1]


def _probes(seen: list[int]) -> list[int]:
    return [p for k, p in enumerate(seen) if k % PROBE_EVERY == PROBE_EVERY - 1]


def _h200(k: int, pages: int) -> float:
    return 200e-6 + 20e-6 * pages


@pytest.mark.parametrize("first", [5e-3, 0.1, 3.0])
def test_one_slow_first_group_does_not_lock_groups_past_the_budget(first: float) -> None:
    # 2 MiB pages, 64 MiB: ceiling 32; 12 x 20 us fit 250 us. A first group that compiled made the
    # line's intercept its whole time: pages looked free, every group 32 pages (840 us) for good.
    sizer = LaunchSizer(2, 64 * MiB, 250e-6, 2 * MiB)
    sizer.record(2, first)
    seen = _run_k(sizer, _h200, 200)
    assert 10 <= seen[-1] <= 13, seen[-10:]


def test_one_compile_does_not_lock_per_page_groups_past_the_budget() -> None:
    sizer = LaunchSizer(2, 1 << 40, 250e-6, 4096)
    sizer.record(2, 3.0)
    seen = _run_k(sizer, lambda k, pages: 50e-6 * pages, 300)
    assert seen[-1] * 50e-6 <= 300e-6, seen[-10:]  # 5 pages fit 250 us (one more by rounding)


@pytest.mark.parametrize("seconds", [math.nan, math.inf])
def test_a_time_that_is_not_a_number_is_a_stall_and_spoils_nothing(seconds: float) -> None:
    sizer = LaunchSizer(2, 1 << 40, 250e-6, 2 * MiB)
    sizer.record(2, seconds)
    assert sizer.pages() == 2  # NaN raised ValueError here before
    seen = _run_k(sizer, _h200, 100)
    assert 10 <= seen[-1] <= 13, seen[-10:]  # inf had made the sums NaN for good


@pytest.mark.parametrize(("floor", "cost"), [(2, lambda k, pages: 1.2e-3),
                                             (1, lambda k, pages: 600e-6 + 10e-6 * pages)])
def test_a_fixed_cost_past_two_turns_does_not_keep_the_floor(floor: int, cost: Callable[[int, int], float]) -> None:
    # The step (a turn's budget over the newest group, were it all per page) rounded to no page.
    sizer = LaunchSizer(floor, 1 << 40, 250e-6, 4096)
    seen = _run_k(sizer, cost, 40)
    assert seen[-1] > floor, seen


def test_a_fixed_cost_that_rises_once_learned_is_relearned() -> None:
    # Learned at 200 us + 20 us a page (groups of 12), then the host gets busy: 1 ms more a group.
    # Every floor group was a stall, and a stall never reached the line: the floor for good.
    sizer = LaunchSizer(2, 1 << 40, 250e-6, 4096)
    seen = _run_k(sizer, lambda k, pages: 200e-6 + (1e-3 if k >= 15 else 0) + 20e-6 * pages, 80)
    assert seen[14] == 12 and _unprobed(seen)[-1] >= 10, seen


def test_one_spike_at_the_floor_does_not_relearn_the_fixed_cost() -> None:
    # 400 us a page, past the budget: the floor. A spike of one group (a GIL hand-over) looked like
    # a risen fixed cost: relearned, then a probe group past the budget (seen on the H200).
    sizer = LaunchSizer(2, 1 << 40, 250e-6, 4096)
    seen = _run_k(sizer, lambda k, pages: 250e-6 + 400e-6 * pages + (1e-3 if k in (20, 40) else 0), 60)
    assert seen[:2] == [2, 3] and _unprobed(seen)[2:] == [2] * 55 and _probes(seen) == [3] * 3, seen


def test_a_probe_whose_line_noise_spoiled_goes_back_to_the_floor() -> None:
    # 400 us a page (past the budget) on a loaded host whose fixed cost jumps: the floor group
    # 1.2 ms of it, the probe one page larger 0.4 ms. The two made a line with a negative slope,
    # thrown away; with no fixed cost known and a step that rounds to no page, the probe's size was
    # kept for good (3 pages, 1.6 ms of the loop a group: the H200 under 16 test processes).
    sizer = LaunchSizer(2, 1 << 40, 250e-6, 4096)
    seen = _run_k(sizer, lambda k, pages: (1.2e-3 if k == 0 else 400e-6) + 400e-6 * pages, 20)
    assert seen[:2] == [2, 3] and _unprobed(seen)[2:] == [2] * 17 and _probes(seen) == [3], seen


@pytest.mark.parametrize("seed", range(40))
def test_noise_never_creeps_costly_groups_past_the_budget(seed: int) -> None:
    # 0.8 ms a group and 400 us a page (past the budget: the floor is right) under lognormal noise
    # (sigma 0.5). Past the floor with no fixed cost read (sizes a page apart spread too little for
    # the line), a step rounded up to a page each group crept seed 1's groups to 430 pages.
    rng = random.Random(seed)
    sizer = LaunchSizer(2, 1 << 40, 250e-6, 4096)
    seen = _run_k(sizer, lambda k, pages: (800e-6 + 400e-6 * pages) * rng.lognormvariate(0, 0.5), 600)
    assert max(seen) <= 8, (max(seen), seen[-10:])


# Review 129: a spike that bent the line, a fixed cost that falls slowly. Each failed before the
# probes (PROBE_EVERY) and the stalls that are learned from when the line is off (LINE_OFF).

def test_one_spike_in_the_probe_group_does_not_keep_the_floor_for_good() -> None:
    # The H200's load groups (12 pages fit). A 1 ms spike in the floor's probe made the line's
    # fixed cost 0 and pages 520 us: every floor group then looked like 120 us a page, the floor
    # for good (sizes of one group say nothing new about the line).
    sizer = LaunchSizer(2, 64 * MiB, 250e-6, 2 * MiB)
    seen = _run_k(sizer, lambda k, pages: 200e-6 + 20e-6 * pages + (1e-3 if k == 1 else 0), 500)
    assert _unprobed(seen)[-1] >= 10, [*seen[:8], "...", *seen[-4:]]


def test_a_spike_that_makes_every_floor_group_a_stall_is_unlearned() -> None:
    # 600 us + 5 us a page (49 pages fit); a 4 ms spike in the probe: fixed 0, pages 4 ms. Every
    # floor group (610 us) passed the limit (0 + 500 us), a stall never learned from, far under
    # the line's 8 ms: the floor for good.
    sizer = LaunchSizer(2, 1 << 40, 250e-6, 4096)
    seen = _run_k(sizer, lambda k, pages: 600e-6 + 5e-6 * pages + (4e-3 if k == 1 else 0), 300)
    assert _unprobed(seen)[-1] >= 40, [*seen[:8], "...", *seen[-4:]]


def test_a_fixed_cost_that_falls_slowly_does_not_grow_groups_far_past_the_budget() -> None:
    # Learned at 4 ms + 20 us a page, the fixed cost falls to 1 ms over 100 groups: groups grew so
    # that each still took ~4.2 ms, a line with no slope, the old fixed cost kept: 118 pages
    # (~9.4 turns' budget of pages).
    sizer = LaunchSizer(2, 1 << 40, 250e-6, 4096)
    seen = _run_k(sizer, lambda k, pages: max(1e-3, 4e-3 - 3e-3 * max(0, k - 50) / 100) + 20e-6 * pages, 300)
    assert max(seen) * 20e-6 <= 4 * 250e-6, (max(seen), seen[40:160:10])


def test_groups_sized_but_not_recorded_are_not_all_probes() -> None:
    # Review 130: a paced CUDA offload sizes groups it queues but records only launched ones. The
    # probe was picked by a count only record() moved: once at the probe's turn, every queued group
    # of that offload was the probe's size (the floor) instead of the learned 12 pages.
    sizer = LaunchSizer(2, 64 * MiB, 250e-6, 2 * MiB)
    for _ in range(PROBE_EVERY - 1):
        pages = sizer.pages()
        sizer.record(pages, _h200(0, pages))
    deferred = [sizer.pages() for _ in range(50)]
    assert deferred.count(2) <= 50 // PROBE_EVERY + 1, deferred
    assert deferred.count(12) >= 40, deferred


# Helper-132: a fixed cost of 0.7-2 ms under 5-10% noise kept cheap pages at the floor (probes a
# page apart cannot show 5-20 us a page under ~100 us of noise). Upward probes now double their
# span while their pages fit the budget beyond the floor groups' noise, and hold the size shown.

def _stuck_seeds(fixed: float, per_page: float, sigma: float, seeds: int = 20) -> int:
    """Seeds whose groups, past the first 300 of 500, are mostly at <= 3 pages."""
    stuck = 0
    for seed in range(seeds):
        rng = random.Random(seed)
        sizer = LaunchSizer(2, 1 << 40, 250e-6, 4096)
        seen = _run_k(sizer, lambda k, pages, rng=rng: (fixed + per_page * pages) * rng.lognormvariate(0, sigma), 500)
        stuck += sorted(_unprobed(seen)[280:])[len(_unprobed(seen)[280:]) // 2] <= 3
    return stuck


@pytest.mark.parametrize(("fixed", "per_page"), [(800e-6, 20e-6), (1e-3, 5e-6), (2e-3, 5e-6)])
def test_a_large_fixed_cost_under_noise_does_not_keep_cheap_pages_at_the_floor(fixed: float, per_page: float) -> None:
    # 12, 50 and 50 pages fit the budget; the line stayed at 2-3 in 20 of 20 seeds each before.
    assert _stuck_seeds(fixed, per_page, 0.05) <= 2
    assert _stuck_seeds(fixed, per_page, 0.1) <= (8 if fixed >= 2e-3 else 2)


@pytest.mark.parametrize("per_page", [120e-6, 400e-6])
def test_dear_pages_under_a_large_noisy_fixed_cost_stay_near_the_floor(per_page: float) -> None:
    # 2 ms a group, 10% noise: two pages fit (the floor's probe of 3 is past the budget by design).
    # The probes' doubling must not hold them far larger: groups past 3 pages whose pages take past
    # 4 turns' budget, at most 1% (20 seeds), and none past 10 turns.
    seen = []
    for seed in range(20):
        rng = random.Random(seed)
        sizer = LaunchSizer(2, 1 << 40, 250e-6, 4096)
        cost = lambda k, pages, rng=rng: (2e-3 + per_page * pages) * rng.lognormvariate(0, 0.1)  # noqa: E731
        seen += _run_k(sizer, cost, 500)[100:]
    past = [pages for pages in seen if pages > 3 and pages * per_page > 4 * 250e-6]
    assert len(past) <= 0.01 * len(seen) and max(seen) * per_page <= 10 * 250e-6, (len(past), max(seen))


def test_a_probe_cut_below_the_floor_is_no_upward_probe() -> None:
    # A transfer's last group can hold fewer pages than the probe asked: one page, fast, looked
    # like a probe past the floor far cheaper than the floor groups (a negative cost a page), and
    # doubled the next probe's span (the hold-the-loop launch test saw a group of 4 pages of 400 us).
    sizer = LaunchSizer(2, 1 << 40, 250e-6, 4096)
    _run_k(sizer, lambda k, pages: 35e-6 + 400e-6 * pages, PROBE_EVERY - 1)
    assert sizer.pages() == 3  # the probe
    sizer.record(1, 435e-6)
    seen = _run_k(sizer, lambda k, pages: 35e-6 + 400e-6 * pages, 3 * PROBE_EVERY)
    assert max(seen) <= 3 and seen.count(3) <= 3, seen


# Review of d674a13 (helper-133): the held size and the probes' span on simulated clocks. Each
# failed before its fix; e29173f (no held size, probes a page past the floor) passed them.

def _regimes(seed: int, first: tuple[float, float, float], then: tuple[float, float, float], switch: int,
             groups: int, recorded: float = 1.0, floor: int = 2) -> list[tuple[int, float]]:
    """Groups under the regime ``first`` (fixed s, s a page, lognormal sigma) until group ``switch``,
    then ``then``: (pages, the seconds its pages took) of each group from the switch on. With
    ``recorded`` < 1, that share of the groups is recorded (a paced offload's queued ones are not)."""
    rng = random.Random(seed)
    sizer = LaunchSizer(floor, 1 << 40, 250e-6, 4096)
    seen = []
    for k in range(groups):
        fixed, per_page, sigma = first if k < switch else then
        pages = sizer.pages()
        seconds = (fixed + per_page * pages) * rng.lognormvariate(0, sigma)
        if rng.random() < recorded:
            sizer.record(pages, seconds)
        if k >= switch:
            seen.append((pages, per_page * pages))
    return seen


@pytest.mark.parametrize(("first", "then", "recorded", "floor"), [
    ((2e-3, 60e-6, 0.0), (200e-6, 120e-6, 0.0), 1.0, 2),  # 10 pages of 120 us held for good
    ((2e-3, 20e-6, 0.0), (700e-6, 400e-6, 0.0), 1.0, 1),  # floor 1: 2 pages of 400 us for good
    ((2e-3, 5e-6, 0.0), (50e-6, 120e-6, 0.1), 0.5, 2),  # a paced offload: 20% of groups past 4 turns
    ((2e-3, 1e-6, 0.1), (0.0, 120e-6, 0.1), 1.0, 2),
    ((2e-3, 1e-6, 0.1), (700e-6, 120e-6, 0.0), 0.5, 2),  # probes faster than the old floor held 10
])
def test_a_fixed_cost_that_falls_does_not_hold_dear_pages(first: tuple[float, float, float],
                                                          then: tuple[float, float, float], recorded: float,
                                                          floor: int) -> None:
    # The held size is weighed against the floor groups' mean time, which only floor groups move.
    # Past a held size whose span is larger, every probe was upward and no group was at the floor:
    # a fixed cost that fell left that mean high, the held groups' pages looked free (faster than
    # the old floor groups) and groups of 10 pages of 120 us (4.8 turns' budget) stayed for good.
    past = 0
    groups = 0
    for seed in range(6):
        seen = _regimes(seed, first, then, 300, 700, recorded, floor)[100:]
        groups += len(seen)
        past += sum(pages > floor and took > 4 * 250e-6 for pages, took in seen)
        assert max(took for _, took in seen) <= 8 * 250e-6, (seed, seen)
    assert past <= 0.01 * groups, past


def test_a_held_size_taken_down_takes_the_probes_span_down() -> None:
    # Pages 80 times dearer under a noisy 2 ms fixed cost: a group at the held size far past the
    # budget took the held size to the floor but left the probes' span (up to 114 pages), and the
    # next upward probe (4 groups later) took 116 pages of 400 us, 46 ms of the loop (185 turns).
    worst = 0.0
    for seed in range(20):
        seen = _regimes(seed, (2e-3, 5e-6, 0.1), (2e-3, 400e-6, 0.1), 400, 700)
        # (The first group past the floor after the change is sized before it: one of the first two.)
        worst = max(worst, *(took for _, took in seen[2:]))
    assert worst <= 8 * 250e-6, worst / 250e-6


def test_a_held_size_never_passes_the_byte_ceiling() -> None:
    # record() is told the pages a group had, not what pages() asked: a caller's own group of 30
    # pages recorded after an upward probe (record() without its pages(), the probe unrecorded),
    # as fast as the floor groups, was held, and every later group was 30 pages over a 4-page cap.
    sizer = LaunchSizer(2, 4 * 4096, 250e-6, 4096)
    seen = _run_k(sizer, lambda k, pages: 400e-6 * pages, PROBE_EVERY - 1)
    assert seen[-1] == 2 and sizer.pages() == 3  # the probe
    sizer.record(30, 800e-6)
    assert max(_run_k(sizer, lambda k, pages: 100e-6 * pages, 3 * PROBE_EVERY)) <= 4


# Twenty-fourth session: the hold-the-loop launch-group test failed on the H200 under 14 test
# processes, and on the CPU VM beside two spinning threads (three groups of 3 where one probe is
# allowed): two preempted floor groups in a row read as a risen fixed cost, and every relearn
# launched a group a page past the floor at once, dear pages or not.

def test_spikes_in_pairs_at_dear_pages_add_no_group_past_the_floor_but_the_probes() -> None:
    # 400 us a page (past the budget: the floor is right); two floor groups in a row 5 ms late
    # every 10 groups. HEAD gave a group of 3 two groups after every pair, 1 in 5 past the floor.
    sizer = LaunchSizer(2, 1 << 40, 250e-6, 4096)
    spikes = {k for start in range(20, 200, 10) for k in (start, start + 1)}
    seen = _run_k(sizer, lambda k, pages: 20e-6 + 400e-6 * pages + (5e-3 if k in spikes else 0), 200)
    assert _unprobed(seen)[2:] == [2] * (len(_unprobed(seen)) - 2), seen
    assert set(_probes(seen)) <= {2, 3}, seen


def test_a_fixed_cost_that_rises_under_cheap_pages_is_relearned_at_once() -> None:
    # The same relearn where pages are cheap (20 us, 12 fit): the group a page past the floor comes
    # right after the relearn, not at the next periodic probe (groups back past 10 within a probe's
    # interval of the rise).
    sizer = LaunchSizer(2, 1 << 40, 250e-6, 4096)
    seen = _run_k(sizer, lambda k, pages: 200e-6 + (1e-3 if k >= 20 else 0) + 20e-6 * pages, 20 + PROBE_EVERY)
    assert seen[19] >= 10 and 3 in seen[20:26] and max(_unprobed(seen)[-4:]) >= 10, seen
