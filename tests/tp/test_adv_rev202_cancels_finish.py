"""Review 202: a thread step of a teardown (``cancels.in_thread``: the unmap, the reclaim, the
bridge's close) is a plain future, which a loop's shutdown does not cancel: the teardown's await
goes on through it. (The file's other tests pinned ``Cancels.finish``, a step's task run anew a
bounded number of times; review 203 removed it from every teardown and then from the code.)
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from aiokv.tp.cancels import Cancels, in_thread

BOUND_S = 10.0


def test_a_thread_step_outlives_the_loop_s_shutdown() -> None:
    """asyncio.run ends while a thread step runs: the step's await goes on (a plain future, which
    the shutdown does not cancel) and the code after it runs once it is over."""
    entered, gate = threading.Event(), threading.Event()
    after: list[str] = []

    def work() -> str:
        entered.set()
        assert gate.wait(BOUND_S)
        return "unmapped"

    async def teardown() -> None:
        cancels = Cancels()
        after.append(await cancels.outlast(in_thread(work)))
        after.append(f"cancelled {cancels.cancelled}")

    async def watch() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            gate.set()  # the shutdown's cancel: it reached teardown() too, before the thread ends

    async def main() -> None:
        loop = asyncio.get_running_loop()
        left = {loop.create_task(teardown()), loop.create_task(watch())}  # left to the shutdown
        assert await asyncio.to_thread(entered.wait, BOUND_S)
        assert not any(task.done() for task in left)

    with contextlib.suppress(asyncio.CancelledError):
        asyncio.run(main())
    assert after == ["unmapped", "cancelled True"]
