"""Review 212: a copy hung for good kept ``asyncio.run`` from returning through every SIGTERM.

A worker's teardown waited for its running copies through any number of cancels (review 203: a
cut drain let the manager free slots under a running copy). A copy that never ends (a wedged GPU
or host copy) then held the teardown, and ``asyncio.run``'s own cancel of every task, for good:
the application's SIGTERM handler cancelled every task again and again, the process never exited.

Now a teardown cancelled while it waits for copies gives them ``TPConfig.abandon_copies_s`` more,
then abandons them to the process's exit: no CLOSED, the pool left mapped (a copy may still write
it), the link left open (review 216), no hello from this process for the rank. The manager keeps
the load in flight while the process lives and fails it once it is gone (a miss, never wrong KV).

A real rank process (tp_size 1) on ``asyncio.run``, an application SIGTERM handler that cancels
every task, its LOAD's copy held by the test (:mod:`held_rank`), and real SIGTERMs from the test.
``asyncio.run`` must return within the bound while the copy is still held. (The CPU copy thread
is a ``concurrent.futures`` worker, which the interpreter joins at exit: the process exits once
the held copy is let go; a CUDA rank's waiters are daemon threads.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing.connection
import os
import signal
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from child_procs import end_child, fork_context
from held_rank import Held
from loop_probes import until_thread
from shutdown_helpers import RankChild, new_held, segment_held
from test_adv_rev197_farewell_race import MHA, RANK_CONFIG, T
from tp_helpers import CONFIG

from aiokv.pool import PagePool
from aiokv.tp import Direction, RankGroup, RankStatus, RankWorker, TPConfig

ABANDON_S = 1.0
CHILD_CONFIG = dataclasses.replace(RANK_CONFIG, abandon_copies_s=ABANDON_S)
BOUND_S = 20.0
SIGNALS = 3


def _rank_main(ctrl: multiprocessing.connection.Connection, address: str, config: TPConfig, held: Held,
               pool_name: str) -> None:
    passes = [0]
    passed = threading.Condition()
    child = RankChild(ctrl, address, config, held, waits=("attached",), sets=(), commands={
        "pid": os.getpid,
        "ended": lambda: dict(child.report) if child.events["ended"].wait(BOUND_S) else None,
    })

    def wait_passes(count: int) -> bool:
        with passed:
            return passed.wait_for(lambda: passes[0] >= count, BOUND_S)

    for count in range(1, SIGNALS + 1):
        child.commands[f"passes {count}"] = lambda count=count: wait_passes(count)  # type: ignore[misc]
    worker: list[RankWorker] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def cancel_all() -> None:  # the application's SIGTERM handler: cancel every task
            for task in asyncio.all_tasks(loop):
                task.cancel()
            with passed:
                passes[0] += 1
                passed.notify_all()

        loop.add_signal_handler(signal.SIGTERM, cancel_all)
        async with RankWorker(address, 0, 1, MHA, child.kv, config) as rank:
            worker.append(rank)
            await rank.wait_attached()
            child.events["attached"].set()
            await asyncio.Event().wait()  # serve until the SIGTERM

    child.start()
    child.run(main)
    # asyncio.run returned: say so, then let the process exit (no wait for the test).
    child.report["held"] = segment_held(pool_name)
    child.report["abandoned"] = worker[0].statistics().copies_abandoned if worker else None
    child.report["copies"] = held.finished_copies()
    child.events["ended"].set()


class _Child:
    def __init__(self, proc: Any, pipe: multiprocessing.connection.Connection) -> None:
        self.proc, self.pipe = proc, pipe

    async def ask(self, command: object) -> Any:
        self.pipe.send(command)
        async with asyncio.timeout(BOUND_S + 5.0):
            return await asyncio.to_thread(self.pipe.recv)


@contextlib.asynccontextmanager
async def _rank_child(group: RankGroup, held: Held, pool_name: str) -> AsyncIterator[_Child]:
    parent, end = fork_context().Pipe()
    proc = fork_context().Process(target=_rank_main, args=(end, os.fspath(group.address), CHILD_CONFIG, held,
                                                           pool_name), daemon=True)
    proc.start()
    end.close()
    child = _Child(proc, parent)
    try:
        async with asyncio.timeout(BOUND_S * 2):
            assert (await asyncio.to_thread(parent.recv))[0] == "started"
            assert await child.ask("attached")
            await group.wait_attached()
        yield child
    finally:
        held.release(8)
        with contextlib.suppress(Exception):
            parent.send("end")
        end_child(proc, 30)


@pytest.mark.asyncio
async def test_sigterms_end_asyncio_run_under_a_hung_copy_and_the_manager_holds_the_rank(
        tmp_path: Path, pool: PagePool) -> None:
    pool.pages[0] = 3.0
    held = new_held()
    slots = list(range(T))
    async with (RankGroup(MHA, 1, pool.name, pool.num_pages, CONFIG, tmp_path / "m") as group,
                _rank_child(group, held, pool.name) as child):
        pid = await child.ask("pid")
        load = group.submit_nowait(group.spec(Direction.LOAD, [0], torch.tensor(slots)))
        assert await asyncio.to_thread(held.entered.acquire, True, BOUND_S), "the copy never began"
        for sent in range(1, SIGNALS + 1):  # real SIGTERMs; the copy stays held throughout
            os.kill(pid, signal.SIGTERM)
            assert await child.ask(f"passes {sent}"), f"SIGTERM {sent} never reached the handler"
        report = await child.ask("ended")
        assert report is not None, (
            f"asyncio.run did not return within {BOUND_S} s of {SIGNALS} SIGTERMs under a hung copy "
            f"(abandon_copies_s={ABANDON_S})")
        assert report["copies"] == 0, "the held copy ended before the test let it"
        assert report["abandoned"] == 1, report
        assert report["held"], "the pool was unmapped under a copy still running"
        # The process lives (its copy thread is joined at exit): its link is left open (review 216:
        # closed, a manager that cannot watch the process freed the job under the copy), the load waits.
        stats = group.statistics()
        assert stats.attached == frozenset({0}) and stats.worker_closes == 0, stats
        assert not load.done(), "the load ended under a running copy"
        held.release()  # the copy ends; the process exits
        child.proc.join(BOUND_S)
        assert child.proc.exitcode is not None, "the rank process did not exit once its copy ended"
        async with asyncio.timeout(BOUND_S):
            outcome = await load.wait()
        assert [f.status for f in outcome.failures] == [RankStatus.RANK_LOST], outcome
        await until_thread(lambda: not group.statistics().attached, "the manager freeing the rank", BOUND_S)


def test_abandon_copies_s_must_be_positive_and_finite() -> None:
    assert TPConfig().abandon_copies_s == 30.0
    for bad in (0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="abandon_copies_s"):
            TPConfig(abandon_copies_s=bad)
