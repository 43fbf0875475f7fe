"""Review 212: a farewell whose hello failed to go out was taken for said, and its debt dropped.

A closing worker whose last session ended without its CLOSED reaching the manager owes one more
hello (its farewell): the manager holds the rank while the process lives until it says one. The
farewell connected, wrote the hello and closed without looking at how the close ended: a write
that failed (the socket shut down by a third party between the connect and the write) was lost
in silence, and the manager held the rank (its jobs, the group's close) while the process lived.

Now the close's end is awaited: a connection that ended with an error has its hello tried again
(a fresh connect) until ``handshake_timeout_s``; past it the loss is counted (``farewells_lost``).

A real rank process (tp_size 1): worker A's socket shut down for real under a held copy (the
manager holds the rank), its ``run()`` cancelled and the copy let go, so its teardown owes the
farewell; the farewell's first connection is shut down for real right after its connect. Oracle:
the manager frees A's rank while the process lives.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing.connection
import os
from pathlib import Path
from typing import Any

import pytest
from held_rank import Held
from loop_probes import until_thread
from shutdown_helpers import BOUND_S, RankChild, new_held, rank_child, sever_under_held_copy
from test_adv_rev197_farewell_race import MHA, RANK_CONFIG, T, _sever
from tp_helpers import CONFIG

from aiokv.pool import PagePool
from aiokv.tp import RankGroup, RankWorker, TPConfig
from aiokv.tp import worker as worker_module

SHORT = dataclasses.replace(RANK_CONFIG, handshake_timeout_s=2.0)  # the farewell's deadline, when every try fails


def _rank_main(ctrl: multiprocessing.connection.Connection, address: str, config: TPConfig, held: Held,
               every: bool) -> None:
    state: dict[str, Any] = {"armed": False, "severed": 0}
    worker: list[RankWorker] = []
    child = RankChild(ctrl, address, config, held, waits=("attached",), sets=("cancel",), commands={
        "returned": lambda: ({**state, "lost": worker[0].statistics().farewells_lost}
                             if child.events["ended"].wait(BOUND_S) else None)})
    check_manager = worker_module._check_manager

    def check_then_sever(transport: Any) -> None:
        check_manager(transport)
        if state["armed"]:  # the farewell's (first) connection: shut down for real before its hello
            state["armed"] = every
            state["severed"] += _sever(address, set())

    worker_module._check_manager = check_then_sever  # type: ignore[attr-defined]

    async def first() -> None:
        loop = asyncio.get_running_loop()
        rank = RankWorker(address, 0, 1, MHA, child.kv, config)
        worker.append(rank)
        run = loop.create_task(rank.run())
        await rank.wait_attached()
        child.events["attached"].set()
        await asyncio.to_thread(child.events["cancel"].wait, BOUND_S)
        state["armed"] = True  # the session's connect is long over: the next one is the farewell's
        run.cancel()  # the engine cancels the worker's run: the teardown drains, then owes the farewell
        await asyncio.wait({run}, timeout=BOUND_S)

    child.start()
    child.run(first)
    child.finish()  # the process lives on: only a hello frees the manager's hold


@pytest.mark.asyncio
async def test_a_farewell_whose_hello_failed_to_go_out_is_said_again(tmp_path: Path, pool: PagePool) -> None:
    held = new_held()
    async with (RankGroup(MHA, 1, pool.name, pool.num_pages, CONFIG, tmp_path / "m") as group,
                rank_child(group, held, _rank_main, os.fspath(group.address), RANK_CONFIG, held, False) as link):
        await sever_under_held_copy(group, link, held, list(range(T)))
        assert await link.ask("cancel")
        held.release()
        state = await link.ask("returned")
        assert state is not None, "A's run() never ended"
        assert state["severed"] == 1, f"the farewell's connection was not shut down: {state}"
        await until_thread(lambda: group.statistics().held_ranks == 0,
                           "the manager freeing A's rank (the farewell's hello, said again)", 10.0)
        assert state["lost"] == 0, state


@pytest.mark.asyncio
async def test_a_farewell_that_never_goes_out_is_counted_lost(tmp_path: Path, pool: PagePool) -> None:
    """Every try's connection shut down: past ``handshake_timeout_s`` the loss is counted, and the
    manager still holds the rank (the process lives: its copies could, for all it knows)."""
    held = new_held()
    async with (RankGroup(MHA, 1, pool.name, pool.num_pages, CONFIG, tmp_path / "m") as group,
                rank_child(group, held, _rank_main, os.fspath(group.address), SHORT, held, True) as link):
        await sever_under_held_copy(group, link, held, list(range(T)))
        assert await link.ask("cancel")
        held.release()
        state = await link.ask("returned")
        assert state is not None, "A's run() never ended"
        assert state["severed"] >= 2, f"the farewell was not tried again: {state}"
        assert state["lost"] == 1, state
        assert group.statistics().held_ranks == 1
