"""Adversarial (helper 281, after review 276): ``close_timeout=0`` for a ``KVCache`` was accepted, and
then every ``aclose()`` of a cache with a disk tier, an idle one included, logged "I/O still stuck in
the kernel after 0.0 s at close" and counted a ``close_timeout`` error (and ``rates_not_saved``): the
close waits that long for the tier's close and the rates file's save, which no close ends in no time.
Refused when the config is made, naming it, as the vLLM tier's ``close_timeout=0`` is (af863b0)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from cache_helpers import config

from aiokv import CacheConfig


@pytest.mark.parametrize("value", [0, 0.0, -0.0])
def test_a_close_timeout_of_zero_is_refused_by_name(tmp_path: Path, value: float) -> None:
    with pytest.raises(ValueError, match=r"CacheConfig\.close_timeout must be > 0"):
        config(tmp_path / "disk", close_timeout=value)
    with pytest.raises(ValueError, match=r"CacheConfig\.close_timeout must be > 0"):
        dataclasses.replace(CacheConfig(), close_timeout=value)
    assert list(tmp_path.iterdir()) == []

