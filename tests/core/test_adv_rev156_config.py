"""Adversarial (review 156): ``CacheConfig`` values that were accepted and failed later.

Before the fixes: an int too large for a float as a number of seconds (``close_timeout=10**400``,
``launch_turn_s``, ``prefill_tokens_per_s``) passed the check and raised ``OverflowError`` where it
met a clock (aclose left the write-behind's tasks pending) or at ``KVCache()``;
``close_timeout=inf`` failed the disk tier's close (``RuntimeError``); a prefill rate outside what
``note_prefill`` accepts (``inf``: every recompute free, the rates file unsavable) was taken; a
namespace with a lone surrogate raised ``UnicodeEncodeError`` (naming nothing) at ``KVCache()``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from aiokv import CacheConfig
from aiokv.rates_file import RATE_BOUNDS

HUGE = 10**400


@pytest.mark.parametrize("name", ["offload_wait", "commit_wait", "close_timeout", "launch_turn_s",
                                  "prefill_tokens_per_s"])
def test_an_int_too_large_for_a_float_is_a_value_error_naming_the_field(name: str) -> None:
    with pytest.raises(ValueError, match=f"CacheConfig.{name}"):
        CacheConfig(disk=None, **{name: HUGE})


@pytest.mark.parametrize("name", ["offload_wait", "commit_wait", "close_timeout"])
def test_waits_are_finite(name: str) -> None:
    with pytest.raises(ValueError, match=rf"CacheConfig\.{name} must be a finite"):
        CacheConfig(disk=None, **{name: math.inf})
    assert getattr(CacheConfig(disk=None, **{name: 1e9}), name) == 1e9


def test_an_infinite_launch_turn_is_still_the_byte_ceiling() -> None:
    assert CacheConfig(disk=None, launch_turn_s=math.inf).launch_turn_s == math.inf


@pytest.mark.parametrize("rate", [math.inf, 1e308, 1e10, 0.5, 1e-320, math.nan, -1.0, 0])
def test_a_prefill_rate_outside_the_rates_bounds_is_refused(rate: Any) -> None:
    with pytest.raises(ValueError, match=r"CacheConfig\.prefill_tokens_per_s"):
        CacheConfig(disk=None, prefill_tokens_per_s=rate)


def test_prefill_rates_at_the_bounds_are_taken() -> None:
    low, high = RATE_BOUNDS["prefill"]
    for rate in (low, high, 1234.0, 1000):
        assert CacheConfig(disk=None, prefill_tokens_per_s=rate).prefill_tokens_per_s == rate


@pytest.mark.parametrize("namespace", ["\ud800", "model-\udfff", "\udc80abc"])
def test_a_namespace_that_is_no_utf8_is_refused(namespace: str) -> None:
    with pytest.raises(ValueError, match=r"CacheConfig\.namespace must be encodable as UTF-8"):
        CacheConfig(disk=None, namespace=namespace)
    assert CacheConfig(disk=None, namespace="modèle-✓").namespace == "modèle-✓"
