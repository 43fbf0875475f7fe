"""The kernel warm-up thread held in its first launch (tests of ``KVCache``'s and a rank worker's
warm-up): a :func:`record_launches` hook, so every ordering is forced, not timed."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator

from aiokv.kernels.launch import LaunchKey, LaunchRecord, record_launches

WARM = "aiokv-warmup"
"""The warm-up thread's name."""


class Gate:
    """Holds the warm-up thread in its first launch until :meth:`open`; tells the loop when it got there."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fail: bool = False) -> None:
        self.loop = loop
        self.fail = fail
        self.held = asyncio.Event()
        self.other = asyncio.Event()
        """Set when a thread other than the warm-up's launches (a real copy)."""
        self._open = threading.Event()

    def __call__(self, key: LaunchKey) -> None:
        if threading.current_thread().name != WARM:
            self.loop.call_soon_threadsafe(self.other.set)
            return
        if self.fail:
            raise RuntimeError("injected: the warm-up's launch failed")
        if not self.held.is_set():
            self.loop.call_soon_threadsafe(self.held.set)
            assert self._open.wait(60), "the test never opened the gate"

    def open(self) -> None:
        self._open.set()


@contextlib.contextmanager
def warmup_gates() -> Iterator[Callable[..., tuple[Gate, LaunchRecord]]]:
    """Yields ``make(fail=False)``: a new :class:`Gate` on the running loop, installed as the launch
    hook, and the record of launches. Every gate made is opened and removed on exit (a failing
    test never leaves the warm-up thread held)."""
    contexts = []

    def make(fail: bool = False) -> tuple[Gate, LaunchRecord]:
        gate = Gate(asyncio.get_running_loop(), fail)
        context = record_launches(hook=gate)
        contexts.append((gate, context))
        return gate, context.__enter__()

    try:
        yield make
    finally:
        for gate, context in contexts:
            gate.open()
            context.__exit__(None, None, None)


def warm_threads() -> list[threading.Thread]:
    """The warm-up threads alive now."""
    return [t for t in threading.enumerate() if t.name == WARM]


async def open_into_close(gate: Gate, closing: asyncio.Future[None], record: LaunchRecord,
                          thread: threading.Thread) -> None:
    """Let the held warm-up ``thread`` go while a close waits for it, await the close, then check
    that the thread ended and launched nothing after the close returned."""
    gate.open()
    await closing
    launched = len(record.keys)
    thread.join(10)  # it returned its result; only its exit may be left
    assert not thread.is_alive()
    assert len(record.keys) == launched, "the warm-up launched after aclose returned"
