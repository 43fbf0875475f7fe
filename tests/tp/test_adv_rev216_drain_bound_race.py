"""Review 216: a worker's teardown drain whose copies ended in the same turn of the loop as its
abandon bound (``TPConfig.abandon_copies_s``, armed by a cancel) took itself for abandoned.

The bound's callback ran first and ended the drain False with nothing in flight: the worker then
skipped CLOSED and its farewell, and the manager held the rank until the process exited. Both
callbacks are made to land in one turn (the loop held past both, the copies' end due first): the
drain must say drained.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from aiokv.tp.cancels import Cancels
from aiokv.tp.worker import RankWorker

ABANDON_S = 0.05


class _Executor:
    """What the drain reads of a RankExecutor: its count in flight and its drained future."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.in_flight = 1
        self.done: asyncio.Future[None] = loop.create_future()

    def drained(self) -> asyncio.Future[None]:
        return self.done

    def copies_end(self) -> None:
        self.in_flight = 0
        self.done.set_result(None)


@pytest.mark.asyncio
async def test_copies_ending_in_the_turn_of_the_abandon_bound_are_drained() -> None:
    loop = asyncio.get_running_loop()
    executor = _Executor(loop)
    worker = SimpleNamespace(config=SimpleNamespace(abandon_copies_s=ABANDON_S))
    drain = asyncio.ensure_future(RankWorker._drain(worker, executor, Cancels()))  # type: ignore[arg-type]
    await asyncio.sleep(0)  # the drain waits
    drain.cancel()  # a teardown's cancel: arms the bound
    await asyncio.sleep(0)
    assert not drain.done()
    # The copies' end is due 10 ms before the bound; the loop is held past both, so they run in
    # one turn, the copies' end first, and the drained future's callback only in the next turn.
    loop.call_later(ABANDON_S - 0.01, executor.copies_end)
    loop.call_soon(time.sleep, 2 * ABANDON_S)
    drained = await asyncio.wait_for(drain, 5)
    assert drained is True, "the drain took copies that had ended for abandoned"
