"""Bridge from CUDA events to asyncio futures, without polling on the loop thread.

Each *lane* (one per copy direction) is a waiter thread fed through a queue: it blocks in
``event.synchronize()`` (which releases the GIL) and resolves the future with
``loop.call_soon_threadsafe``. Events of one lane come from one side stream and complete in
order, so a FIFO per lane never waits behind an unrelated copy.

On a CPU KV buffer copies are plain torch calls; :meth:`CompletionBridge.run_cpu` runs them on one
worker thread so a large copy never stalls the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class Lane(enum.Enum):
    """Independent completion queues: copies of one direction complete in order."""

    OFFLOAD = "offload"
    LOAD = "load"
    CONTROL = "control"
    """Small reads of caller data (slot indices) for validation."""


_Item = tuple[torch.cuda.Event, asyncio.AbstractEventLoop, "asyncio.Future[None]"] | None


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return  # the waiter was cancelled; the copy finished anyway
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class CompletionBridge:
    """Turns CUDA events into awaitables; one instance per cache. Close with :meth:`close`."""

    def __init__(self) -> None:
        self._queues: dict[Lane, queue.SimpleQueue[_Item]] = {}
        self._threads: list[threading.Thread] = []
        self._cpu: concurrent.futures.ThreadPoolExecutor | None = None
        self._cpu_jobs: dict[asyncio.Future[Any], concurrent.futures.Future[Any]] = {}
        self._closed = False
        self.completed = 0

    def _lane(self, lane: Lane) -> queue.SimpleQueue[_Item]:
        q = self._queues.get(lane)
        if q is None:
            q = queue.SimpleQueue()
            thread = threading.Thread(target=self._wait_loop, args=(q,), name=f"aiokv-cuda-{lane.value}", daemon=True)
            thread.start()
            self._queues[lane] = q
            self._threads.append(thread)
        return q

    def _wait_loop(self, q: queue.SimpleQueue[_Item]) -> None:
        while (item := q.get()) is not None:
            event, loop, future = item
            error: BaseException | None = None
            try:
                event.synchronize()
            except BaseException as exc:  # a CUDA error surfaces in the awaiting coroutine
                error = exc
            self.completed += 1
            try:
                loop.call_soon_threadsafe(_resolve, future, error)
            except RuntimeError:
                pass  # the loop is closed: nobody is waiting any more

    def wait(self, event: torch.cuda.Event | None, lane: Lane) -> asyncio.Future[None]:
        """A future that resolves when ``event`` has completed (at once for None)."""
        if self._closed:
            raise RuntimeError("completion bridge is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        if event is None:
            future.set_result(None)
        else:
            self._lane(lane).put((event, loop, future))
        return future

    def run_cpu(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run a CPU copy on the copy thread (copies stay in submission order).

        Cancelling the returned future does NOT stop the copy: use :meth:`withdraw`, which tells
        whether the copy can still run.
        """
        if self._closed:
            raise RuntimeError("completion bridge is closed")
        if self._cpu is None:
            self._cpu = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="aiokv-copy")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        job = self._cpu.submit(fn)
        self._cpu_jobs[future] = job

        def done(_: concurrent.futures.Future[T]) -> None:
            try:
                loop.call_soon_threadsafe(self._settle_cpu, future, job)
            except RuntimeError:
                pass  # the loop is closed: nobody is waiting any more

        job.add_done_callback(done)
        return future

    def _settle_cpu(self, future: asyncio.Future[T], job: concurrent.futures.Future[T]) -> None:
        self._cpu_jobs.pop(future, None)
        if future.done():
            return
        if job.cancelled():
            future.cancel()
        elif (error := job.exception()) is not None:
            future.set_exception(error)
        else:
            future.set_result(job.result())

    def withdraw(self, future: asyncio.Future[Any]) -> bool:
        """Stop a CPU copy from :meth:`run_cpu` that has not started; True when it never runs.

        False means the copy is running or over: its future resolves when it is over.
        """
        job = self._cpu_jobs.get(future)
        if job is None or not job.cancel():
            return future.cancelled()
        self._cpu_jobs.pop(future, None)
        future.cancel()
        return True

    def close(self) -> None:
        """Stop the waiter threads after the events queued so far. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for q in self._queues.values():
            q.put(None)
        for thread in self._threads:
            thread.join()
        if self._cpu is not None:
            self._cpu.shutdown(wait=True)
