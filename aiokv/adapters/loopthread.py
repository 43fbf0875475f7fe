"""An asyncio event loop on a thread of its own, for engines that call synchronously from theirs.

The engine's threads hand coroutines over with :meth:`LoopThread.submit` (never blocks: one
``call_soon_threadsafe``) and either poll the returned future or wait on it (:meth:`LoopThread.run`).
All aiokv state (the disk tier, its io_uring) lives on the loop and is touched only there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """A daemon thread running one event loop until :meth:`close`."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._started.wait()
        self._closed = False

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._started.set)
        try:
            self._loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop (use only from coroutines running on it)."""
        return self._loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; returns at once. Raises ``RuntimeError`` once closed."""
        if self._closed:
            coro.close()
            raise RuntimeError("loop thread is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run the plain function ``fn`` on the loop; returns at once. Raises ``RuntimeError`` once closed."""
        if self._closed:
            raise RuntimeError("loop thread is closed")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return future

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (from any thread but the loop's)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.run called from its own loop: it would deadlock")
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        """Stop the loop and join the thread. Idempotent; tasks still pending are cancelled."""
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
