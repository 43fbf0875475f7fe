"""Review 204: a loop-wide cancel of ``RankGroup``'s (and ``TPCache``'s) close task made every
later close raise at once.

``RankGroup.aclose`` runs the close in a task of its own and waits for it shielded: a cancelled
caller raises while the close goes on. An application's SIGTERM handler that cancels every task
(signalled while the group closes, a rank still copying) cancels that task too: the close stopped
where it waited (for the rank's reports), the socket stayed listening, and every later
``aclose()`` raised that cancel at once: the close could never end, the endpoint never removed,
and the caller never learnt when no rank copied into its memory any more. ``TPCache.aclose`` (its
own close task waiting in the group's close) never freed the pool.

A real rank process with its copy held (the worker of ``test_adv_rev201_loop_shutdown_drain``);
the manager on the test's loop; the loop-wide cancel is every task of the loop but the test's own,
cancelled while the close waits for the held copy's report.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from pathlib import Path

import pytest
from loop_probes import cancel_every_task_but_nowait, until_thread
from shutdown_helpers import BOUND_S, held_load, new_held, rank_child
from test_adv_rev197_farewell_race import MHA, RANK_CONFIG, SLOTS, T
from test_adv_rev201_loop_shutdown_drain import _rank_main
from tp_helpers import CONFIG

from aiokv import CacheConfig
from aiokv.pool import PagePool
from aiokv.tp import RankGroup, TPCache

CLOSE_S = 0.2  # close_timeout_s: the close fences the rank soon, then waits for its report


@pytest.mark.asyncio
async def test_a_loop_wide_cancel_of_the_group_s_close_does_not_end_it_for_good(
        tmp_path: Path, pool: PagePool) -> None:
    held = new_held()
    config = dataclasses.replace(CONFIG, close_timeout_s=CLOSE_S)
    group = RankGroup(MHA, 1, pool.name, pool.num_pages, config, tmp_path / "m")
    await group.start()
    address = group.address
    try:
        async with rank_child(group, held, _rank_main, os.fspath(address), RANK_CONFIG, held):
            load = await held_load(group, held, list(range(T)))
            closing = asyncio.ensure_future(group.aclose())
            # The close fenced the rank: it waits for the report.
            await until_thread(lambda: group.statistics().fenced == 1, "the close fencing the rank", BOUND_S)
            cancel_every_task_but_nowait(asyncio.current_task())  # the application's SIGTERM handler
            await asyncio.wait({closing})
            assert closing.cancelled()
            again = asyncio.ensure_future(group.aclose())
            await asyncio.wait({again}, timeout=1.0)  # bounded: it must wait for the held copy
            assert not again.done() or not again.cancelled(), (
                "a later aclose() raised the loop-wide cancel at once: the close never ends")
            assert not again.done() and not load.done(), "the close ended while the rank still copied"
            # Still listening: the held rank's hello would tell its copies are over.
            assert await asyncio.to_thread(os.path.exists, address)
            held.release()
            async with asyncio.timeout(BOUND_S):
                await again
            assert load.done()
            assert not await asyncio.to_thread(os.path.exists, address), "the group's socket is left after its close"
    finally:
        held.release(8)
        with contextlib.suppress(asyncio.CancelledError):  # before the fix: raised at once, left open
            async with asyncio.timeout(BOUND_S):
                await group.aclose()


@pytest.mark.asyncio
async def test_a_loop_wide_cancel_of_the_cache_s_close_does_not_leave_the_pool_for_good(tmp_path: Path) -> None:
    held = new_held()
    config = CacheConfig(cpu_bytes=16 * MHA.page_bytes, disk=None, namespace="tp-rev204",
                         pool_chunk_bytes=4 * MHA.page_bytes)
    tp_config = dataclasses.replace(CONFIG, close_timeout_s=CLOSE_S)
    cache = TPCache(config, MHA, tp_size=1, num_slots=SLOTS, tp_config=tp_config, directory=tmp_path / "m")
    await cache.start()
    group = cache.group
    segment = f"/dev/shm/{group.pool_name.lstrip('/')}"
    try:
        async with rank_child(group, held, _rank_main, cache.address, RANK_CONFIG, held):
            load = await held_load(group, held, list(range(T)))
            closing = asyncio.ensure_future(cache.aclose())
            await until_thread(lambda: group.statistics().fenced == 1, "the close fencing the rank", BOUND_S)
            cancel_every_task_but_nowait(asyncio.current_task())  # the application's SIGTERM handler
            await asyncio.wait({closing})
            again = asyncio.ensure_future(cache.aclose())
            await asyncio.wait({again}, timeout=1.0)  # bounded: it must wait for the held copy
            assert not again.done() or not again.cancelled(), (
                "a later aclose() raised the loop-wide cancel at once: the pool is never freed")
            assert not again.done() and not load.done(), "the close ended while the rank still copied"
            assert await asyncio.to_thread(os.path.exists, segment)
            held.release()
            async with asyncio.timeout(BOUND_S):
                await again
            assert not await asyncio.to_thread(os.path.exists, segment), "the pool is left after the cache's close"
    finally:
        held.release(8)
        with contextlib.suppress(asyncio.CancelledError):  # before the fix: raised at once, left open
            async with asyncio.timeout(BOUND_S):
                await cache.aclose()
