"""Fixtures shared by the TP tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio
import torch
from adv_helpers import AdvRanks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool

ONE_RANK_MHA = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4).for_tp(1)


@pytest_asyncio.fixture
async def ranks_left() -> AsyncIterator[list[AdvRanks]]:
    """Rank process groups a test started: each is resumed (SIGCONT, it may be stopped) and killed
    at the end, whatever the test did to them."""
    groups: list[AdvRanks] = []
    yield groups
    for ranks in groups:
        await ranks.continue_and_kill_all()


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[PagePool]:
    """A 4-page pool of a small MHA layout on one rank (``ONE_RANK_MHA``), closed after the test:
    the pool of the worker-side tests (a file that needs another defines its own ``pool``)."""
    pool = PagePool.create(ONE_RANK_MHA, 4 * ONE_RANK_MHA.page_bytes, register_cuda=False)
    await pool.wait_ready()
    yield pool
    await pool.aclose()
