"""Fixtures shared by the TP tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio
from adv_helpers import AdvRanks


@pytest_asyncio.fixture
async def ranks_left() -> AsyncIterator[list[AdvRanks]]:
    """Rank process groups a test started: each is resumed (SIGCONT, it may be stopped) and killed
    at the end, whatever the test did to them."""
    groups: list[AdvRanks] = []
    yield groups
    for ranks in groups:
        await ranks.continue_and_kill_all()
