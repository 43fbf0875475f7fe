"""Review 239: the rank group's own accept loop (8e967e0) under a loop-wide cancel, on both loops.

Each accepted connection's transport is made in a task (``loop.connect_accepted_socket``). A
loop-wide cancel (an application's SIGTERM handler cancelling every task) that lands on that task
after the loop called the link's ``connection_made`` but before the task's next step makes the
loop close the transport. asyncio's ``transport.close()`` then tells the protocol
(``connection_lost``); uvloop's ``transport._close()`` does not, and an ``abort()`` after it does
nothing: the link stayed in the group's links with its ``closed`` never set, and the group's close
waited for it for good. The old ``asyncio.Server`` (uvloop's own server under uvloop) made
transports in no task: nothing to cut.

Real sockets; the client is a plain socket (what a worker's connect does first). The loop is the
test's own (``asyncio.Runner``): the TP suite runs under asyncio's loop only.
"""

from __future__ import annotations

import asyncio
import gc
import os
import select
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import uvloop
from loop_probes import no_loop_reports, until
from tp_helpers import CONFIG

from aiokv import KVLayout
from aiokv.tp.group import RankGroup

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
BOUND_S = 10.0
CUT_TURNS = 5
"""Loop turns after the accept swept for the cut: before the making's first step, before the link
is made, after it (the window), after the making ended."""
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop,
}


def _ended(client: socket.socket) -> bool:
    """Whether the group's end of ``client``'s connection is closed (EOF or reset waiting now)."""
    if not select.select([client], [], [], 0)[0]:
        return False
    try:
        return client.recv(1) == b""
    except ConnectionResetError:
        return True


def _cancel_every_task_but_mine() -> int:
    """An application's shutdown step: every task of the loop but the caller's is cancelled."""
    me = asyncio.current_task()
    others = [task for task in asyncio.all_tasks() if task is not me]
    for task in others:
        task.cancel()
    return len(others)


async def _cut_at(directory: Path, turns: int) -> bool:
    """Accept one connection, cut its making ``turns`` loop turns after the accept, close the group.
    Returns whether the cut landed after the link was made and before the making ended."""
    group = RankGroup(LAYOUT, 2, "/aiokv-accept-cut", 4, CONFIG, directory)
    await group.start()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(os.fspath(group.address))
        # The listener is readable: the loop accepts and starts the transport's making in a task.
        await until(lambda: bool(group._connecting))
        (making,) = group._connecting
        for _ in range(turns):
            await asyncio.sleep(0)
        made_not_done = bool(group._links) and not making.done()
        assert _cancel_every_task_but_mine() == (0 if making.done() else 1)
        async with asyncio.timeout(BOUND_S):
            await asyncio.wait({making})
        async with asyncio.timeout(BOUND_S):
            await group.aclose()  # before: waited for the cut link's connection_lost for good (uvloop)
        assert not group._links and not group._connecting
        assert _ended(client), f"the connection cut {turns} turns after its accept was left open"
        return made_not_done
    finally:
        client.close()


async def _sweep(tmp_path: Path) -> list[int]:
    # The Runner's loop: the suite's loop_hygiene fixture watches only the loop of async tests.
    async with no_loop_reports():
        return [turns for turns in range(CUT_TURNS) if await _cut_at(tmp_path / f"mgr{turns}", turns)]


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_connection_cut_by_a_loop_wide_cancel_at_any_turn_of_its_making_ends(tmp_path: Path, loop: str) -> None:
    seen: list[Any] = []
    previous = sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
            windows = runner.run(_sweep(tmp_path))
        gc.collect()
    finally:
        sys.unraisablehook = previous
    # The turn that failed before (link made, its making not ended) is among those swept.
    assert windows, "no cut landed between the link's connection_made and its making's end"
    assert not seen, [str(u.exc_value) for u in seen]  # no socket left to the collector
