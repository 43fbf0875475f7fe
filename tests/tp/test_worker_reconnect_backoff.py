"""A rank worker backs off from a manager that drops every session right after attaching (no
tight reconnect loop mapping the pool each time), and still reconnects at once after a session
that lasted (a manager restart)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from test_adv_rev107_hostile_manager import LAYOUT, PAGES, SLOTS, FakeManager
from tp_helpers import full_kv, new_pool, rank_kv

from aiokv.pool import PagePool
from aiokv.tp import RankWorker, TPConfig

BACKOFF = TPConfig(reconnect_initial_s=0.05, reconnect_max_s=0.4, handshake_timeout_s=10.0)


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[PagePool]:
    pool = await new_pool(PAGES, 8)
    yield pool
    await pool.aclose()


@pytest.mark.asyncio
async def test_sessions_dropped_at_once_are_retried_with_backoff(tmp_path: Path, pool: PagePool) -> None:
    kv = rank_kv(full_kv(LAYOUT, 3, SLOTS), LAYOUT, 0, 2)
    async with FakeManager(tmp_path / "mgr") as manager, RankWorker(manager.address, 0, 2, LAYOUT, kv, BACKOFF):
        attaches = 0
        loop = asyncio.get_running_loop()
        end = loop.time() + 1.5
        while loop.time() < end:
            _reader, writer, attached = await manager.welcome(pool.name)
            assert attached.ok
            attaches += 1
            writer.close()  # dropped right after attaching
        # Delays 0.05, 0.1, 0.2, 0.4, 0.4, ...: about 6 sessions in 1.5 s (each attach maps the
        # pool: a few ms); without backing off it reconnected at once, dozens of times.
        assert attaches <= 9, attaches
        # A session that lasts resets the backoff: the next one comes at once.
        _reader, writer, attached = await manager.welcome(pool.name)
        await asyncio.sleep(BACKOFF.reconnect_max_s + 0.1)
        writer.close()
        started = loop.time()
        _reader, writer, attached = await manager.welcome(pool.name)
        # (backing off, it would wait reconnect_max_s: the delay had doubled up to it)
        assert attached.ok and loop.time() - started < BACKOFF.reconnect_max_s / 2
        writer.close()
