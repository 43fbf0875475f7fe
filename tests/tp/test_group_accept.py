"""The rank group's accept loop: every connection it accepts is closed by the group's close.

Regression: the group listened through an ``asyncio.Server``. A connection accepted in the loop
turn before ``Server.close()`` has its transport made a turn later, in a task, where
``Server._attach``'s assert (CPython 3.11-3.13) fails silently: the socket stayed open until the
garbage collector found it ("unclosed transport" and "unclosed socket" ResourceWarnings, and the
worker never saw its connection end). Seen in ``test_tp_close_fence.py`` (2 runs of the file in 8,
and once in CI): a fenced rank reconnected as the close began.

The sockets are real; the client is a plain socket (what a worker's reconnect does first).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import resource
import select
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from loop_probes import until_thread
from tp_helpers import CONFIG

from aiokv import KVLayout
from aiokv.tp import group as group_module
from aiokv.tp.group import RankGroup

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
BOUND_S = 10.0


def _group(tmp_path: Path) -> RankGroup:
    # No pool is mapped by anyone here: the group only listens and closes.
    return RankGroup(LAYOUT, 2, "/aiokv-accept-test", 4, CONFIG, tmp_path / "mgr")


def _connect(group: RankGroup) -> socket.socket:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(os.fspath(group.address))  # completes into the backlog: nothing accepted yet
    return client


def _ended(client: socket.socket) -> bool:
    """Whether the group's end of ``client``'s connection is closed (EOF or reset waiting now)."""
    if not select.select([client], [], [], 0)[0]:
        return False
    try:
        return client.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture
def unraisable() -> Iterator[list[Any]]:
    """What ``sys.unraisablehook`` got (a ``__del__``'s ResourceWarning), with the collector off:
    an unclosed socket stays open (as with the old code) until the test collects."""
    seen: list[Any] = []
    previous = sys.unraisablehook
    sys.unraisablehook = seen.append
    gc.disable()
    try:
        yield seen
    finally:
        gc.enable()
        gc.collect()
        sys.unraisablehook = previous


@pytest.mark.asyncio
async def test_a_connection_accepted_as_the_close_begins_is_closed(tmp_path: Path, unraisable: list[Any]) -> None:
    group = _group(tmp_path)
    await group.start()
    client = _connect(group)
    try:
        # The close's task and the listener's accept run in the same loop turn, the accept second:
        # the close's first step (stop listening) then runs before the accepted socket's transport
        # is made, the old code's window.
        closing = asyncio.create_task(group.aclose())
        async with asyncio.timeout(BOUND_S):
            await closing
        assert group.statistics().connections == 0  # ended at once: never a link of the group
        assert _ended(client), "the connection accepted as the close began was left open"
        gc.collect()
        assert not unraisable, [str(u.exc_value) for u in unraisable]
    finally:
        client.close()


@pytest.mark.asyncio
async def test_a_connection_whose_making_was_cancelled_is_closed(tmp_path: Path, unraisable: list[Any]) -> None:
    # A loop-wide cancel (an application's SIGTERM handler) lands on the task that makes an
    # accepted connection's transport before it ran: no transport took the socket; the group
    # closes it.
    group = _group(tmp_path)
    await group.start()
    client = _connect(group)
    try:
        group._accept_ready()  # what the loop calls with the listener readable: one connection
        (making,) = group._connecting
        making.cancel()
        async with asyncio.timeout(BOUND_S):
            await asyncio.wait({making})
        assert making.cancelled()
        assert _ended(client), "an accepted connection no transport took was left open"
        assert not group._connecting
        async with asyncio.timeout(BOUND_S):
            await group.aclose()
        gc.collect()
        assert not unraisable, [str(u.exc_value) for u in unraisable]
    finally:
        client.close()


@pytest.mark.asyncio
async def test_an_accept_out_of_descriptors_pauses_then_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A real EMFILE: the process's descriptor limit lowered to the descriptors open now, so
    # accept() fails. The listener pauses (the socket stays readable: no spin) and accepts the
    # waiting worker once descriptors are back.
    monkeypatch.setattr(group_module, "ACCEPT_RETRY_S", 0.05)
    group = _group(tmp_path)
    await group.start()
    client = _connect(group)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        lowest_free = os.dup(0)  # every descriptor below it is open: a limit there makes accept() fail
        os.close(lowest_free)
        with caplog.at_level(logging.WARNING, logger=group_module.__name__):
            resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
            try:
                group._accept_ready()  # the loop's call with the listener readable
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert any("Too many open files" in r.getMessage() for r in caplog.records), caplog.text
        assert group._accept_retry is not None and not group._connecting  # paused: nothing accepted
        assert group.statistics().connections == 0
        # The retry (a timer) accepts the waiting worker.
        await until_thread(lambda: group.statistics().connections == 1, "the accept after the pause", BOUND_S)
        await group.aclose()
        assert _ended(client)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        client.close()
        await group.aclose()
