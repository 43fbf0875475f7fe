"""Adversarial (helper-219): the call's ``commit_wait`` budget through overlapping and cancelled waits.

Review 217 (fd9a8d7) made a call's ``commit_wait`` the time spent while any of its waits runs
(``LoadPath._wait_call``: a count of running waits, the start of the current stretch, the time
spent before it). Suspected: a wait cancelled while another of the call's waits runs leaves the
count behind (the stretch never ends, nothing is ever added to ``spent``) or restarts the stretch,
so a later wait takes a fresh bound and the call waits past ``commit_wait`` in all; or the expiry
is counted twice between the waits. None found: this pins it. The writers are page-table
reservations (as a TP rank's copy holds one); the waits are the call's own ``CommitWaits``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from cache_helpers import DEVICE, LAYOUT, config, errors_of, make_kv, prompt
from loop_probes import until, waiting_in

from aiokv import KVCache
from aiokv.loadpath import CommitWaits, LoadPath

T = LAYOUT.page_tokens
WAIT_S = 0.5
"""commit_wait."""
BOUND_S = 10.0
TURNS = 20
"""Loop turns a wait with a fresh bound is still running after (microseconds, against WAIT_S)."""

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU KV buffer")


@pytest.mark.asyncio
async def test_a_cancelled_wait_beside_another_neither_stalls_nor_restarts_the_calls_budget(tmp_path: Path) -> None:
    tokens = prompt(2190, 2 * T)
    async with KVCache(config(tmp_path / "disk", pool_pages=16, commit_wait=WAIT_S), LAYOUT, make_kv(2191)) as cache:
        await cache.pool.wait_ready()
        manager = cache.manager
        assert isinstance(manager, LoadPath)
        table = cache.pool.table
        keys = cache.keys(tokens)
        writers = [res.handle for res in cache.pool.reserve(keys)]
        assert all(h is not None for h in writers), writers
        loop = asyncio.get_running_loop()
        waits = CommitWaits()
        try:
            t0 = loop.time()
            first = asyncio.create_task(manager._wait_call(keys[0], waits, "a load"))
            second = asyncio.create_task(manager._wait_call(keys[1], waits, "a load"))
            await until(lambda: waiting_in(first, "wait_committed") and waiting_in(second, "wait_committed"))
            await asyncio.sleep(WAIT_S / 2)  # the scenario: half the budget spent by both together
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            async with asyncio.timeout(BOUND_S):
                assert not await second  # its writer is stopped
            ended = loop.time() - t0
            assert ended >= WAIT_S - 0.05, ended  # the cancel beside it cut nothing
            # The stretch is over and spent: the cancelled wait left no count behind.
            assert waits.running == 0, waits
            assert waits.spent >= WAIT_S - 0.05, waits
            assert errors_of(cache) == {"commit_wait_expired": 1}, errors_of(cache)
            # A later wait of the call for the stopped writer: nothing left, at once, not counted again.
            t1 = loop.time()
            async with asyncio.timeout(BOUND_S):
                assert not await manager._wait_call(keys[0], waits, "a load")
            assert loop.time() - t1 < WAIT_S / 2, loop.time() - t1
            assert waits.running == 0, waits
            assert errors_of(cache) == {"commit_wait_expired": 1}, errors_of(cache)
            # A page the call's own promotion reads takes a fresh bound (review 217): committed in it.
            waits.reading.add(keys[0])
            own = asyncio.create_task(manager._wait_call(keys[0], waits, "a load"))
            await until(lambda: waiting_in(own, "wait_committed"))
            for _ in range(TURNS):
                await asyncio.sleep(0)  # loop turns, not time: a spent budget's timeout fires in one or two
            assert not own.done(), own  # before the exemption: False at once, the call's budget spent
            writer = writers[0]
            assert writer is not None
            table.commit(writer)
            async with asyncio.timeout(BOUND_S):
                assert await own
            assert waits.running == 0, waits
            assert errors_of(cache) == {"commit_wait_expired": 1}, errors_of(cache)
        finally:
            for handle in writers:
                if handle is not None and not handle.released:
                    table.abort(handle)
