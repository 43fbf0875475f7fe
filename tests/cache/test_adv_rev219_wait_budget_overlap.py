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
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, errors_of, make_kv, on_disk_only, prompt
from load_gate import LoadGate
from loop_probes import until, until_thread, waiting_in

from aiokv import KVCache, loadpath
from aiokv.loadpath import CommitWaits, LoadPath
from aiokv.pagetable import PageState

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


@pytest.mark.asyncio
@pytest.mark.parametrize("call", ["load", "stream"])
async def test_a_cancelled_call_leaves_no_wait_behind_and_its_adopted_wait_keeps_the_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str) -> None:
    """A load or stream cancelled while its reads are held and it waits for a stopped writer's
    page: the adopted promotions end within ``commit_wait`` (the flush returns), the call's
    ``reading`` is empty and no wait is counted running, one ``commit_wait_expired``."""
    pages = 3
    tokens = prompt(2192, pages * T)
    kv = make_kv(2193)
    made: list[CommitWaits] = []

    def recorded() -> CommitWaits:
        waits = CommitWaits()
        made.append(waits)
        return waits

    async with KVCache(config(tmp_path / "disk", pool_pages=16, commit_wait=WAIT_S), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        table = cache.pool.table
        keys = await on_disk_only(cache, tokens, torch.arange(pages * T))
        match = await cache.match(tokens)
        assert (match.pool_pages, match.disk_pages) == (0, pages), match
        (res,) = cache.pool.reserve(keys[-1:])  # the last page's writer: stopped for good
        writer = res.handle
        assert writer is not None, res
        monkeypatch.setattr(loadpath, "CommitWaits", recorded)
        gate = LoadGate(disk, monkeypatch)
        target = torch.arange(100, 100 + pages * T)
        if call == "load":
            load = asyncio.create_task(cache.load(match, target))
        else:
            stream = await cache.start_load(match, target)
            made.append(stream._waits)
            load = asyncio.create_task(stream.finish())
        try:
            await until_thread(lambda: len(gate.held) >= 1, "a read")
            await until(lambda: any(waiting_in(t, "wait_committed") for t in asyncio.all_tasks()))
            load.cancel()
            with pytest.raises(asyncio.CancelledError):
                await load
            gate.open()
            async with asyncio.timeout(BOUND_S):
                await cache.flush()  # the adopted promotions: over within commit_wait
            assert made, made
            for waits in made:
                assert waits.reading == set() and waits.running == 0, waits
            assert errors_of(cache) == {"commit_wait_expired": 1}, errors_of(cache)
        finally:
            gate.open()
            if not writer.released:
                table.abort(writer)
            if not load.done():
                load.cancel()
        await assert_quiescent(cache)


EARLY_S = 0.1
"""How long before the wait's deadline the loop is held (an engine step), the writer committing at its end."""


@pytest.mark.asyncio
@pytest.mark.parametrize("call", ["match", "prefetch"])
async def test_a_writer_that_commits_as_the_wait_times_out_is_no_expiry(tmp_path: Path, call: str) -> None:
    """The page's writer commits at the end of a long callback (an engine step) that holds the loop
    past the wait's deadline: the commit's wake-up and the timeout's callback run in the next turn,
    the commit's first, so the wait ends in ``TimeoutError`` with the page READY. It was counted
    ``commit_wait_expired`` (a fault, the call's one expiry) and a prefetch then read none of the
    disk pages past it, though its wait returned the page committed."""
    pages = 2
    tokens = prompt(2194, pages * T)
    async with KVCache(config(tmp_path / "disk", pool_pages=16, commit_wait=WAIT_S), LAYOUT, make_kv(2195)) as cache:
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        table = cache.pool.table
        keys = await on_disk_only(cache, tokens, torch.arange(pages * T))
        (res,) = cache.pool.reserve(keys[:1])
        writer = res.handle
        assert writer is not None, res
        loop = asyncio.get_running_loop()
        before = loop.time()
        task = asyncio.create_task(cache.match(tokens) if call == "match" else cache.prefetch(tokens))
        try:
            await until(lambda: waiting_in(task, "wait_committed"))
            after = loop.time()  # the wait's deadline lies in [before, after] + WAIT_S

            def step_then_commit() -> None:
                end = after + WAIT_S + 0.01
                while loop.time() < end:
                    pass  # an engine step holding the loop past the deadline
                table.commit(writer)

            loop.call_at(before + WAIT_S - EARLY_S, step_then_commit)
            async with asyncio.timeout(BOUND_S):
                result = await task
        finally:
            if not writer.released:
                table.abort(writer)
            if not task.done():
                task.cancel()
        assert table.state_of(keys[0]) is PageState.READY
        errors = errors_of(cache)
        if call == "match":
            assert (result.pool_pages, result.disk_pages) == (1, 1), (result, errors)
            result.release()
        else:
            assert (result.pool_pages, result.promoted) == (1, 1), (result, errors)
        assert errors == {}, errors
        await assert_quiescent(cache)
