"""Fixtures of the adapter tests (no engine imported here: each engine's tests skip without it)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def managers() -> Iterator[list[Any]]:
    """vLLM managers a test makes; every one is shut down at the end (tiers first, as vLLM does)."""
    made: list[Any] = []
    yield made
    for manager in made:
        manager.shutdown()


@pytest.fixture
def backends() -> Iterator[list[Any]]:
    """SGLang backends a test makes; every one is closed at the end."""
    made: list[Any] = []
    yield made
    for backend in made:
        backend.close()
