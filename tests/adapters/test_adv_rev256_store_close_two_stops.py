"""Review 256: since cf3160b the store's ``close()`` stops its own loop thread itself once the close
ended, beside the close future's own stop (an ``aiokv-store-stop`` thread): two ``LoopThread.close``
at once, each dropping the work posted but never picked up (a parked loop: ``idle_poll_s`` 0).

Both saw the inbox non-empty and both popped: the second ``popleft`` raised ``IndexError``, out of
``close()`` (vLLM's ``shutdown``) after a close that went well, or out of the stop thread. The test
chooses the moment (the GIL switching between the look and the pop): each closer's look waits for
the other's; the stop thread pops first.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import threading
from pathlib import Path
from typing import Any

from store_helpers import wait_for

from aiokv.adapters.store import PageFileStore, StoreConfig

BOUND_S = 30.0
PAGE_BYTES = 8192


class _Inbox(collections.deque[Any]):
    """The loop's inbox; once armed, each closer's look (off the loop thread) waits for the other's."""

    def __init__(self, loop_thread: threading.Thread) -> None:
        super().__init__()
        self.loop_thread = loop_thread
        self.armed = False
        self.both = threading.Barrier(2)

    def __len__(self) -> int:
        n = super().__len__()
        if self.armed and n and threading.current_thread() is not self.loop_thread:
            try:
                self.both.wait(BOUND_S)
            except threading.BrokenBarrierError:
                pass  # one closer only: nothing races
            if threading.current_thread().name != "aiokv-store-stop":
                wait_for(lambda: super(_Inbox, self).__len__() == 0, "the stop thread popped", BOUND_S)
        return n


def test_close_and_its_stop_thread_drop_the_inbox_once(tmp_path: Path) -> None:
    config = StoreConfig.from_options({"disk_dir": str(tmp_path / "cache"), "disk_bytes": 64 * PAGE_BYTES,
                                       "idle_poll_s": 0, "close_timeout": BOUND_S})
    store = PageFileStore(config, "test", {"model": "m"}, PAGE_BYTES)
    thread = store.thread
    inbox = _Inbox(thread._thread)
    thread.call(lambda: setattr(thread, "_inbox", inbox)).result()
    wait_for(lambda: thread.parked, "the loop parked", BOUND_S)

    async def never() -> None:
        await asyncio.sleep(0)

    posted = never()
    thread.post(posted)  # no wake: a parked loop never picks it up
    assert thread.pending() == 1
    inbox.armed = True
    store.close()  # raised IndexError when the stop thread popped first
    assert not thread._thread.is_alive()
    wait_for(lambda: inspect.getcoroutinestate(posted) == inspect.CORO_CLOSED, "the posted work closed", BOUND_S)
    assert not inbox
