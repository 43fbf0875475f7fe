"""Review 196: when a closing worker says hello once more (its farewell), and when it does not.

A manager holds a rank whose connection ended without a CLOSED it took until the rank's process
says hello again; a closing worker never reconnects, so it says one hello after its copies are over
when its last CLOSED may not have got through: not written, the link ended by an error, or the
manager did not end the link within ``handshake_timeout_s`` (it may have found the CLOSED wanting).
A close the manager acknowledged (it ended the link on reading the CLOSED) sends none.

A real ``RankWorker`` against ``FakeManager`` (the test plays the manager frame by frame).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from test_adv_rev107_hostile_manager import BOUND_S, LAYOUT, PAGES, SLOTS, FakeManager
from tp_helpers import full_kv, new_pool, rank_kv

from aiokv.pool import PagePool
from aiokv.tp import RankWorker, TPConfig
from aiokv.tp.wire import Closed, FrameKind, Hello, read_frame


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[PagePool]:
    pool = await new_pool(PAGES, 8)
    yield pool
    await pool.aclose()


async def _next_accepted(manager: FakeManager) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    async with asyncio.timeout(BOUND_S):
        return await manager.connections.get()


@pytest.mark.asyncio
async def test_a_close_the_manager_never_acknowledged_is_followed_by_one_hello(tmp_path: Path, pool: PagePool) -> None:
    kv = rank_kv(full_kv(LAYOUT, 3, SLOTS), LAYOUT, 0, 2)
    async with FakeManager(tmp_path / "mgr") as manager, \
            RankWorker(manager.address, 0, 2, LAYOUT, kv, TPConfig(handshake_timeout_s=1.0)) as worker:
        reader, _, attached = await manager.welcome(pool.name)
        assert attached.ok, attached
        closing = asyncio.ensure_future(worker.aclose())
        async with asyncio.timeout(BOUND_S):
            kind, payload = await read_frame(reader, 1 << 20)
            assert kind is FrameKind.CLOSED and Closed.decode(payload) == Closed(0, 0)
            await closing  # the link never ended by this manager: the bound ended the wait
        farewell, _ = await _next_accepted(manager)
        async with asyncio.timeout(BOUND_S):
            kind, payload = await read_frame(farewell, 1 << 20)
            assert kind is FrameKind.HELLO and Hello.decode(payload).rank == 0
            assert await farewell.read() == b""  # no reply awaited: a silent manager holds nothing


@pytest.mark.asyncio
async def test_a_close_the_manager_acknowledged_sends_no_farewell(tmp_path: Path, pool: PagePool) -> None:
    kv = rank_kv(full_kv(LAYOUT, 3, SLOTS), LAYOUT, 0, 2)
    async with FakeManager(tmp_path / "mgr") as manager:
        async with manager.worker(kv, TPConfig(handshake_timeout_s=BOUND_S)) as worker:
            _, _, attached = await manager.welcome(pool.name)
            assert attached.ok, attached
        assert manager.closed_frames == 1 and not worker.attached
        # Connections are accepted in the order they were made: a farewell would come before this probe.
        _, probe = await asyncio.open_unix_connection(os.fspath(manager.address))
        try:
            first, _ = await _next_accepted(manager)
            probe.close()
            async with asyncio.timeout(BOUND_S):
                assert await first.read() == b"", "a farewell hello came after an acknowledged close"
        finally:
            probe.close()
