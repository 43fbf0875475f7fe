"""Helpers of the tests that raise a real SIGINT inside the ring's and the checksums' code: a loop
of the test's own with Python's default SIGINT handler, bounded runs, idle turns, page views."""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import signal
import sys
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from aiokv.storage.uring import UringEngine

T = TypeVar("T")


def interrupt() -> None:
    """A real SIGINT to this process: Python's handler raises KeyboardInterrupt here, in this thread."""
    signal.raise_signal(signal.SIGINT)


@contextlib.contextmanager
def private_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A new loop, with Python's default SIGINT handler installed while it lives (and any profile
    hook a test left removed at its end)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    loop = asyncio.new_event_loop()
    try:
        yield loop
    finally:
        sys.setprofile(None)
        loop.close()
        signal.signal(signal.SIGINT, previous)


def run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    """``coro`` on ``loop``, bounded: a hang (the bug) fails instead of waiting for pytest's timeout."""
    return loop.run_until_complete(asyncio.wait_for(coro, 5))


async def idle_turns(count: int = 5) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def open_engine() -> UringEngine:
    return UringEngine.open(8)


async def wait(future: asyncio.Future[T]) -> T:
    return await future


@contextlib.contextmanager
def page_views(count: int, page: int, fill: bool = True) -> Iterator[list[memoryview]]:
    """``count`` views of ``page`` bytes each over one anonymous mapping (filled with a byte ramp
    unless ``fill`` is False), released at the end."""
    data = mmap.mmap(-1, count * page)
    if fill:
        data.write(bytes(range(256)) * (count * page // 256))
    whole = memoryview(data)
    views = [whole[i * page : (i + 1) * page] for i in range(count)]
    try:
        yield views
    finally:
        for view in views:
            view.release()
        whole.release()
        data.close()
