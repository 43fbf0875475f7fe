"""LaunchSizer: launch groups grow past ``launch_pages`` while the loop time per page fits the turn's
budget and the bytes fit ``launch_bytes``; never below the floor; a slow group shrinks them at once."""

from __future__ import annotations

import math

import pytest

from aiokv import CacheConfig
from aiokv.launches import DEFAULT_LAUNCH_BYTES, LaunchSizer

MiB = 1 << 20


def test_nothing_measured_is_the_floor() -> None:
    sizer = LaunchSizer(2, 64 * MiB, 250e-6, MiB)
    assert sizer.pages() == 2 and sizer.per_page_s is None


def test_fast_groups_grow_to_what_fits_the_turn() -> None:
    sizer = LaunchSizer(2, 1 << 40, 250e-6, 4096)
    sizer.record(2, 20e-6)  # 10 us a page
    assert sizer.pages() == 25
    sizer.record(25, 250e-6)
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
