"""`PagePool`: N pages of one layout in one shared-memory segment, plus the page table.

N = byte budget // page bytes. The segment is prepared in chunks by worker threads (reserve
tmpfs pages; with CUDA, populate and ``cudaHostRegister`` as pinned + mapped); pages of a chunk are
handed to the allocator once it is ready, so a large pool is usable at once and fills in behind.
:meth:`PagePool.open` does all of it off the event loop (segment, page table, reclaiming segments
that dead processes left behind) and returns once the first chunk is usable.

Views of the memory: :attr:`PagePool.pages` is a tensor ``[N, L, T, rows, D]`` of the layout dtype
(rows = 2H for MHA, 1 for MLA) over the padded pages, and :meth:`PagePool.page_view` a writable
``memoryview`` of one whole padded page, made on first use and kept (the disk tier wraps each in one
reusable io_uring iovec).
"""

from __future__ import annotations

import _thread
import asyncio
import collections
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, fields
from typing import TypeVar

import torch

from aiokv import shm
from aiokv.keys import PageKey
from aiokv.layout import KVLayout
from aiokv.pagetable import PageHandle, PageTable, PageTableStatistics, Reservation
from aiokv.reclaim import SegmentInfo, SegmentState, reclaim, scan
from aiokv.shm import SHM_NAME_PREFIX, ChunkResult, SharedSegment, cuda_available, prepare_in_background

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_CHUNK_BYTES = 256 << 20
DEFAULT_WORKERS = 4
"""Preparation threads asked for (capped at one fewer than the process's CPUs)."""
MAX_CHUNKS = 4096
"""A pool is prepared in at most this many chunks (a smaller ``chunk_bytes`` is raised to fit):
each chunk is a task on the preparation threads, and tens of thousands of them held the GIL from
the event loop's thread for hundreds of ms. 4,096 covers 1 TiB in the default 256 MiB chunks."""


class PoolClosedError(RuntimeError):
    """The pool was closed; a closed pool is never reopened (create a new one)."""


@dataclass(frozen=True)
class PoolStatistics:
    """Pool geometry, preparation progress and page-table counts."""

    name: str
    page_bytes: int
    pages: PageTableStatistics
    chunks_total: int
    chunks_ready: int
    chunks_failed: int
    cuda_registered: bool

    @classmethod
    def unopened(cls, page_bytes: int) -> PoolStatistics:
        """A pool that does not exist (yet, or ever: a start not begun, or cut before its pool
        opened): no name, no pages, every count zero."""
        pages = PageTableStatistics(**{f.name: 0 for f in fields(PageTableStatistics)})
        return cls(name="", page_bytes=page_bytes, pages=pages, chunks_total=0, chunks_ready=0,
                   chunks_failed=0, cuda_registered=False)


def _page_tensor(buffer: memoryview, layout: KVLayout, count: int) -> torch.Tensor:
    raw = torch.frombuffer(buffer, dtype=torch.uint8, count=count * layout.page_bytes)
    rows = raw.view(count, layout.page_bytes)[:, : layout.payload_bytes]
    return rows.view(layout.dtype).view(count, *layout.page_shape)


class PageMemory:
    """Tensor and memoryview access to the pages of a segment (shared by pool and attachers)."""

    def __init__(self, segment: SharedSegment, layout: KVLayout) -> None:
        self.segment = segment
        self.layout = layout
        self.num_pages = segment.size // layout.page_bytes
        if self.num_pages <= 0:
            raise ValueError(f"segment of {segment.size} bytes holds no page of {layout.page_bytes} bytes")
        self.pages = _page_tensor(segment.buffer, layout, self.num_pages)
        """``[N, L, T, rows, D]`` of the layout dtype; page i is ``pages[i]``."""
        # Made on first use: one slice per page up front costs ~1 µs each (0.3 s for 256K pages).
        self._views: dict[int, memoryview] = {}

    def page_view(self, page: int) -> memoryview:
        """Writable memoryview of the whole padded page ``page`` (``page_bytes`` long)."""
        view = self._views.get(page)
        if view is None:
            if not 0 <= page < self.num_pages:
                raise IndexError(f"page {page} out of range [0, {self.num_pages})")
            pb = self.layout.page_bytes
            view = self._views[page] = self.segment.buffer[page * pb : (page + 1) * pb]
        return view

    def page_address(self, page: int) -> int:
        """Virtual address of page ``page`` (device-mapped too once its chunk is registered)."""
        return self.segment.address + page * self.layout.page_bytes

    def close(self) -> None:
        """Drop every view, then close the segment. Idempotent."""
        if self.segment.closed:
            return
        for view in self._views.values():
            try:
                view.release()
            except BufferError:
                pass  # an io_uring iovec still exports it; the segment outlives it
        self._views = {}
        self.pages = torch.empty(0)
        self.segment.close()


_cleanups: set[asyncio.Task[None]] = set()
"""Cleanups whose caller was cancelled again while waiting: the loop keeps only weak references."""


def _cleanup_done(task: asyncio.Task[None]) -> None:
    _cleanups.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.error("page pool cleanup failed", exc_info=task.exception())


async def _finish(cleanup: Awaitable[None]) -> None:
    """Run ``cleanup`` to its end; if the caller is cancelled meanwhile it goes on alone. Never raises
    the cleanup's own error (logged), so it cannot hide the exception that made it necessary."""
    task = asyncio.ensure_future(cleanup)
    _cleanups.add(task)
    task.add_done_callback(_cleanup_done)
    await asyncio.wait([task])


RECLAIM_SETTLE_S = 5.0
"""How long a start keeps retrying segments whose creator is gone but whose lock is still held. A
SIGKILLed process's mappings, and with them its lock, can outlive its reaping while a driver lets go
of its memory (on the H200 host the killed creator of a CUDA-registered pool still held it when the
restarted cache scanned, and no longer a moment later: the restart reclaimed nothing). A worker
still attached to a dead creator's pool holds it past this; the next start reclaims it. A start
that needs such a segment's memory waits this long for it in its creating thread (not the loop)."""

RECLAIM_RETRY_S = 0.25
"""Pause between those retries."""


def _held_by_the_dead(segments: list[SegmentInfo]) -> bool:
    return any(s.state is SegmentState.LIVE and not s.creator_alive for s in segments)


def _held_bytes(segments: list[SegmentInfo]) -> int:
    """Memory that the segments whose creator is gone but which some process still holds give back
    once let go: the blocks they hold, not their sizes (a creator killed mid-preparation leaves a
    sparse one: a start waited RECLAIM_SETTLE_S for room its 12 MiB size promised and its 1 MiB of
    blocks could never make)."""
    return sum(s.frees for s in segments if s.state is SegmentState.LIVE and not s.creator_alive)


def _reclaim_for(size: int, prefix: str) -> concurrent.futures.Future[list[SegmentInfo]]:
    """Unlink dead processes' segments: now if a segment of ``size`` bytes needs their memory, else
    in a thread beside the new pool's preparation (so a large leftover never delays start-up). That
    thread retries, for up to :data:`RECLAIM_SETTLE_S`, segments whose creator is gone but which are
    still held. When this pool needs the memory such a segment holds, the caller's thread waits for
    it (up to :data:`RECLAIM_SETTLE_S`): without it the start failed at once for want of room that
    was about to be freed (a TP manager restarted right after a crash, its ranks still finishing a
    copy in the dead one's pool; the H200's driver letting go of a killed creator's memory)."""
    reclaimed: concurrent.futures.Future[list[SegmentInfo]] = concurrent.futures.Future()
    found = scan(prefix)
    dead, held = any(s.state is SegmentState.DEAD for s in found), _held_by_the_dead(found)
    if not dead and not held:
        reclaimed.set_result([])
        return reclaimed
    first: list[SegmentInfo] | None = None
    free = shm.shm_free_bytes()
    if dead and (free is None or free < size):
        first = reclaim(prefix)
        free = shm.shm_free_bytes()
    if held and free is not None and free < size:
        # Wait only while the held segments could make the room (another pid namespace's live
        # pool also looks held by the dead: with too little beside it, fail now, as before).
        first = [] if first is None else first
        deadline = time.monotonic() + RECLAIM_SETTLE_S
        while held and free is not None and size <= free + _held_bytes(found) and free < size:
            if time.monotonic() >= deadline:
                break
            time.sleep(RECLAIM_RETRY_S)
            first += reclaim(prefix)
            found = scan(prefix)
            held, free = _held_by_the_dead(found), shm.shm_free_bytes()
    if first is not None and not held:
        reclaimed.set_result(first)
        return reclaimed

    def run() -> None:
        shm.lower_thread_priority()
        try:
            removed = reclaim(prefix) if first is None else first
            deadline = time.monotonic() + RECLAIM_SETTLE_S
            while time.monotonic() < deadline and _held_by_the_dead(scan(prefix)):
                time.sleep(RECLAIM_RETRY_S)
                removed += reclaim(prefix)
            reclaimed.set_result(removed)
        except BaseException as exc:  # reclaim() logs per segment; anything else ends here
            reclaimed.set_exception(exc)

    # A daemon: an exit mid-way leaves the rest to the next start, never waits for it.
    threading.Thread(target=run, name="aiokv-reclaim", daemon=True).start()
    return reclaimed


def _launch(target: Callable[[], object], name: str, failed: Callable[[BaseException], object] | None = None) -> None:
    """Start a thread named ``name`` running ``target``; the caller does not wait for it to run.

    ``threading.Thread.start`` waits until the new thread runs (the OS's scheduling latency: 0.3-6
    ms on a loaded 2-vCPU VM, where creating it takes ~0.1 ms), and so does the first
    ``run_in_executor``, which starts the loop's default executor's thread. A bare
    ``_thread`` launcher takes that wait off the caller: it starts the named ``threading.Thread``
    and waits for it itself. (The launcher never calls ``threading.current_thread()``, which would
    register it as a dummy thread for good: ``daemon`` is given, so ``Thread`` does not look.)
    When the named thread cannot start (``RuntimeError``: no thread left), ``failed`` gets the error
    in the launcher.
    """

    def launcher() -> None:
        try:
            threading.Thread(target=target, name=name, daemon=False).start()
        except BaseException as exc:  # nothing runs target: whoever waits for it must hear
            if failed is not None:
                failed(exc)

    _thread.start_new_thread(launcher, ())


def run_in_new_thread(fn: Callable[[], T], name: str, orphan: Callable[[T], object]) -> asyncio.Future[T]:
    """``fn()`` on a new thread named ``name``, started without the event loop waiting for it.

    Returns a future of the running loop, resolved with what ``fn`` returns or raises. When nobody
    can take a result any more (the future was cancelled, or the loop closed first), ``orphan``
    gets it on a thread of its own (it may block: close what ``fn`` made).
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.cancelled():
            if error is None:
                _launch(functools.partial(orphan, result), f"{name}-orphan")  # type: ignore[arg-type]
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def deliver(result: T | None, error: BaseException | None) -> None:
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: no one will take the result
            if error is None:
                orphan(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # handed to the awaiting caller
            deliver(None, exc)
        else:
            deliver(result, None)

    _launch(run, name, lambda exc: deliver(None, exc))
    return future


async def _discard(build: asyncio.Future[PagePool]) -> None:
    """Close the pool a creation thread makes for a caller that is gone."""
    try:
        pool = await build
    except Exception:
        return  # create() failed and freed what it had made
    await pool.aclose()


_ChunkOutcome = tuple[int, "str | None"]
"""A chunk's index (-1: not known) and why it is unusable (None: usable)."""


@dataclass(frozen=True, eq=False)
class _ChunkWaiter:
    """A coroutine on ``loop`` waiting for the pool's chunks (every one, or the first usable one)."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    all_chunks: bool


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class PagePool:
    """N pages in shared memory, with a page table; one event loop owns it.

    Create with ``await PagePool.open(...)`` on an event loop (or :meth:`create` in synchronous
    set-up code). Closing is final: every method that hands out pages or views raises
    :class:`PoolClosedError` from the moment :meth:`aclose`/:meth:`close` is called.
    Every page-table method is available on :attr:`table`; the common ones are mirrored here.
    """

    def __init__(
        self,
        segment: SharedSegment,
        layout: KVLayout,
        register_cuda: bool,
        chunk_bytes: int,
        workers: int,
    ) -> None:
        self.layout = layout
        self.memory = PageMemory(segment, layout)
        self.table = PageTable(self.memory.num_pages)
        self.register_cuda = register_cuda
        pages_per_chunk = max(1, chunk_bytes // layout.page_bytes, -(-self.memory.num_pages // MAX_CHUNKS))
        self._chunk_pages: list[range] = [
            range(start, min(start + pages_per_chunk, self.memory.num_pages))
            for start in range(0, self.memory.num_pages, pages_per_chunk)
        ]
        pb = layout.page_bytes
        chunks = [(r.start * pb, len(r) * pb) for r in self._chunk_pages]
        # Chunk completions reach the loop through a queue, and a waiter is woken once, when what
        # it waits for holds: a wrapper and a loop wake-up per chunk stalled the loop for seconds
        # with thousands of chunks (4,096 chunks: 1.3 s in one step).
        self._lock = threading.Lock()
        self._finished_all = threading.Condition(self._lock)  # notified when the last chunk ends
        self._done: collections.deque[_ChunkOutcome] = collections.deque()
        self._finished = 0  # chunks whose preparation ended, counted on the threads (under _lock)
        self._any_usable = False  # one of them prepared without error (under _lock)
        self._waiters: list[_ChunkWaiter] = []  # (under _lock)
        self._absorbed = 0  # chunks taken off _done by the loop
        self._ready = 0
        self._failed = 0
        self._executor, self._futures = prepare_in_background(segment, chunks, register_cuda, workers)
        for future in self._futures:
            future.add_done_callback(self._chunk_done)
        self._closed = False  # no more pages or views handed out
        self._released = False  # memory unmapped and unlinked
        self._closing: asyncio.Task[None] | None = None
        self._unmap: concurrent.futures.Future[None] | None = None  # the release's memory.close, once submitted
        self._release_after: asyncio.Future[None] | None = None  # see close_after
        self.reclaimed: concurrent.futures.Future[list[SegmentInfo]] = concurrent.futures.Future()
        """Segments of dead processes that creating this pool unlinked (see :meth:`create`)."""
        self.reclaimed.set_result([])

    async def wait_reclaimed(self) -> list[SegmentInfo]:
        """Until the reclaim of dead processes' segments that creating this pool started (in a
        thread beside it, see :meth:`create`) ended; returns the segments it unlinked, raises what
        it raised. Cancelling the wait leaves the reclaim running."""
        return await asyncio.shield(asyncio.wrap_future(self.reclaimed))

    @staticmethod
    def _check_arguments(layout: KVLayout, byte_budget: int, chunk_bytes: int) -> None:
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if isinstance(byte_budget, bool) or not isinstance(byte_budget, int):
            raise TypeError(f"byte_budget must be an int, got {type(byte_budget).__name__}")
        if byte_budget < layout.page_bytes:
            raise ValueError(
                f"byte budget {byte_budget} is smaller than one page "
                f"({layout.page_bytes} bytes for {layout.describe()})"
            )
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")

    @classmethod
    def create(
        cls,
        layout: KVLayout,
        byte_budget: int,
        *,
        register_cuda: bool | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        workers: int = DEFAULT_WORKERS,
        name_prefix: str = SHM_NAME_PREFIX,
    ) -> PagePool:
        """A pool of ``byte_budget // layout.page_bytes`` pages; chunks are prepared in the background.

        Blocks for the set-up (page table, segment: milliseconds, up to a second with very many small
        pages); on an event loop use :meth:`open`. Segments that dead processes left behind are
        reclaimed (:mod:`aiokv.reclaim`): first when this pool needs their memory, else beside it in
        a thread (unlinking frees ~75 ms per GiB here); :attr:`reclaimed` resolves to them.
        ``register_cuda=None`` registers with CUDA when a device is present. Raises ``TypeError``
        for a non-int budget, ``ValueError`` when the budget holds no page, and
        :class:`aiokv.shm.SegmentSpaceError` when shared memory is too small.
        """
        cls._check_arguments(layout, byte_budget, chunk_bytes)
        if register_cuda is None:
            register_cuda = cuda_available()
        size = byte_budget // layout.page_bytes * layout.page_bytes
        reclaimed = _reclaim_for(size, name_prefix)
        segment = SharedSegment.create(size, name_prefix)
        try:
            pool = cls(segment, layout, register_cuda, chunk_bytes, workers)
        except BaseException:
            segment.close()
            raise
        pool.reclaimed = reclaimed
        return pool

    @classmethod
    async def open(
        cls,
        layout: KVLayout,
        byte_budget: int,
        *,
        register_cuda: bool | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        workers: int = DEFAULT_WORKERS,
        name_prefix: str = SHM_NAME_PREFIX,
    ) -> PagePool:
        """:meth:`create` in a worker thread, then :meth:`wait_usable`; the loop never blocks on set-up.

        Returns once the first chunk is prepared (or every chunk failed, counted in
        ``statistics().chunks_failed``); later chunks join the free list as they finish. Raises what
        :meth:`create` raises. Cancelled, it closes whatever it had created before re-raising.
        """
        cls._check_arguments(layout, byte_budget, chunk_bytes)
        create = functools.partial(
            cls.create,
            layout,
            byte_budget,
            register_cuda=register_cuda,
            chunk_bytes=chunk_bytes,
            workers=workers,
            name_prefix=name_prefix,
        )
        # On a thread started without the loop waiting for it (run_in_executor's first call waited
        # for the default executor's new thread to run: 1.5-6 ms of loop stall under load).
        build = run_in_new_thread(create, "aiokv-pool-create", PagePool.close)
        try:
            pool = await asyncio.shield(build)
        except asyncio.CancelledError:
            # The thread cannot be stopped: free what it makes before the cancellation propagates.
            await _finish(_discard(build))
            raise
        try:
            await pool.wait_usable()
        except BaseException:
            await _finish(pool.aclose())
            raise
        return pool

    # -- readiness ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError(f"page pool {self.name} is closed")

    def _chunk_done(self, future: concurrent.futures.Future[ChunkResult]) -> None:
        """On the thread that ended the chunk (or cancelled it): queue it, wake waiters whose wait is over."""
        # Read here, on the thread: each of a future's accessors takes its lock.
        if future.cancelled():
            outcome: _ChunkOutcome = (-1, "cancelled at close")
        elif (error := future.exception()) is not None:
            outcome = (-1, repr(error))
        else:
            result = future.result()
            outcome = (result.index, None if result.error is None else f"{result.length} bytes: {result.error}")
        usable = outcome[1] is None
        with self._lock:
            self._done.append(outcome)
            self._finished += 1
            if self._finished == len(self._futures):
                self._finished_all.notify_all()
            self._any_usable = self._any_usable or usable
            woken = [w for w in self._waiters if self._over(w.all_chunks)]
            if woken:
                self._waiters = [w for w in self._waiters if w not in woken]
        for waiter in woken:
            try:
                waiter.loop.call_soon_threadsafe(_resolve, waiter.future)
            except RuntimeError:  # that loop is closed: no one waits any more
                pass

    def _over(self, all_chunks: bool) -> bool:
        """Whether a wait for every chunk (else for the first usable one) is over; under ``_lock``."""
        return self._finished == len(self._futures) or (not all_chunks and self._any_usable)

    async def _wait_chunks(self, all_chunks: bool) -> None:
        with self._lock:
            if self._over(all_chunks):
                return
            waiter = _ChunkWaiter(asyncio.get_running_loop(), asyncio.get_running_loop().create_future(), all_chunks)
            self._waiters.append(waiter)
        try:
            await waiter.future
        finally:
            # Cancelled (asyncio cancels the awaited future first, so it is done then too): stop
            # waking it. A waiter woken meanwhile is no longer in the list.
            if waiter.future.cancelled() or not waiter.future.done():
                with self._lock:
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)

    def _absorb(self) -> None:
        """Take the chunks that ended since the last call: usable ones join the free list, in one
        page-table call per run of neighbouring chunks."""
        done = self._done
        if not done:
            return
        usable: list[int] = []
        while done:
            index, error = done.popleft()
            self._absorbed += 1
            if error is None:
                self._ready += 1
                usable.append(index)
                continue
            self._failed += 1
            if index >= 0:  # (a chunk cancelled at close or a worker's crash is not logged per chunk)
                log.warning("page pool %s: chunk %d unusable (%s)", self.name, index, error)
        usable.sort()
        start = 0
        for i in range(1, len(usable) + 1):
            if i == len(usable) or usable[i] != usable[i - 1] + 1:
                first, last = self._chunk_pages[usable[start]], self._chunk_pages[usable[i - 1]]
                self.table.add_usable(range(first.start, last.stop))
                start = i

    async def wait_ready(self) -> None:
        """Wait until every chunk is prepared (or failed). Raises :class:`PoolClosedError` once closed."""
        self._check_open()
        await self._wait_chunks(all_chunks=True)
        self._check_open()
        self._absorb()

    async def wait_usable(self) -> None:
        """Wait until the first chunk is prepared (or every chunk failed).

        Raises :class:`PoolClosedError` once closed.
        """
        self._check_open()
        await self._wait_chunks(all_chunks=False)
        self._check_open()
        self._absorb()

    def wait_ready_blocking(self) -> None:
        """Block until every chunk is prepared; for set-up code outside the event loop."""
        self._check_open()
        concurrent.futures.wait(self._futures)
        # A future is done before its done-callbacks ran: wait for _chunk_done of every chunk too.
        with self._finished_all:
            self._finished_all.wait_for(lambda: self._finished == len(self._futures))
        self._absorb()

    @property
    def ready(self) -> bool:
        """True once every chunk is prepared."""
        self._absorb()
        return self._absorbed == len(self._futures)

    # -- page table facade ----------------------------------------------------------------------

    def reserve(self, keys: Sequence[PageKey]) -> list[Reservation]:
        """:meth:`PageTable.reserve` over the pages of every chunk prepared so far.

        Raises :class:`PoolClosedError` once closed.
        """
        self._check_open()
        self._absorb()
        return self.table.reserve(keys)

    @property
    def num_pages(self) -> int:
        """Pages in the segment (including chunks not ready yet)."""
        return self.memory.num_pages

    @property
    def chunk_pages(self) -> int:
        """Pages per preparation chunk; chunk i is pages ``[i * chunk_pages, (i + 1) * chunk_pages)``,
        registered with CUDA (pinned) as one range, so one copy may span pages of one chunk only."""
        return len(self._chunk_pages[0])

    @property
    def name(self) -> str:
        """Shared-memory name other processes pass to :meth:`attach`."""
        return self.memory.segment.name

    @property
    def pages(self) -> torch.Tensor:
        """``[N, L, T, rows, D]`` tensor of the layout dtype over all pages."""
        self._check_open()
        return self.memory.pages

    def tensor(self, handle: PageHandle) -> torch.Tensor:
        """``[L, T, rows, D]`` view of a live handle's page; raises ``StaleHandleError`` otherwise."""
        self._check_open()
        return self.memory.pages[self.table.check(handle)]

    def page_view(self, handle: PageHandle) -> memoryview:
        """Writable memoryview of a live handle's padded page."""
        self._check_open()
        return self.memory.page_view(self.table.check(handle))

    def statistics(self) -> PoolStatistics:
        """Geometry, preparation progress and page counts."""
        self._absorb()
        return PoolStatistics(
            name=self.name,
            page_bytes=self.layout.page_bytes,
            pages=self.table.statistics(),
            chunks_total=len(self._chunk_pages),
            chunks_ready=self._ready,
            chunks_failed=self._failed,
            cuda_registered=self.register_cuda,
        )

    # -- lifetime -------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True from the first :meth:`close` or :meth:`aclose` call on; a closed pool is never reopened."""
        return self._closed

    def close(self) -> None:
        """Wait for chunk preparation, unregister, unmap and unlink. Idempotent. After
        :meth:`close_after` the memory is freed only as it says."""
        self._closed = True
        if self._released or self._release_after is not None:
            return
        self._released = True
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.memory.close()

    def run_in_background(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on one of the pool's preparation threads (nice +10), after the chunks queued
        before it. For background work on the pool's memory (the disk tier's io_uring
        registration): its threads exist already, and starting a new one from the loop waits for
        it under load (10-20 ms stalls measured at start-up). Raises ``PoolClosedError`` once the
        pool is closing; a job not started when it closes is cancelled."""
        if self._closed:
            raise PoolClosedError("the page pool is closed")
        return self._executor.submit(fn)

    async def aclose(self) -> None:
        """:meth:`close` without blocking the loop: chunks not started are dropped, running ones
        finish, then the memory is freed in a thread. Idempotent; every caller waits for the end."""
        self._closed = True
        if self._released or self._release_after is not None:
            return  # freed (or to be freed) as close_after says
        # Now, not in the release task: a chunk queued behind a running one would otherwise start
        # in the loop turn before that task first runs.
        self._drop_queued_chunks()
        await asyncio.shield(self._release_running())

    def _release_running(self) -> asyncio.Future[None]:
        """The release's task, started anew when a loop-wide cancel (an application's SIGTERM
        handler cancelling every task, a loop's shutdown) ended it before the memory was freed:
        every later aclose() raised that cancel at once and the segment was never freed."""
        if self._closing is None or (self._closing.cancelled() and not self._released):
            self._closing = self._start_release()
        return self._closing

    def _start_release(self) -> asyncio.Task[None]:
        task = asyncio.ensure_future(self._release())
        task.add_done_callback(self._release_cut)
        return task

    def _release_cut(self, task: asyncio.Task[None]) -> None:
        """A release cut before it handed the unmap to a thread (a loop-wide cancel, the loop's end: its
        first step or its wait for running chunks) hands it over now, to a thread that waits for those
        chunks itself: nobody may run the release again (the loop is ending), and the segment stayed
        mapped and named in /dev/shm until exit. A later aclose()/wait_freed() waits for that unmap."""
        if not task.cancelled() or self._released or (self._unmap is not None and not self._unmap.cancelled()):
            return
        self._drop_queued_chunks()
        try:
            self._unmap = self._executor.submit(self._unmap_when_prepared)
        except RuntimeError:  # no thread may take it any more (interpreter shutdown)
            log.error("page pool %s: its release was cut and no thread may free it: its memory stays mapped "
                      "until exit", self.memory.segment.name)

    def _unmap_when_prepared(self) -> None:
        """On a preparation thread: wait for the chunks still preparing (queued ones were dropped), then
        unmap and unlink."""
        with self._finished_all:
            self._finished_all.wait_for(lambda: self._finished == len(self._futures))
        self.memory.close()

    def close_after(self, io_ended: asyncio.Future[None]) -> None:
        """Close now, free the memory once ``io_ended`` resolved: I/O stuck in the kernel (a disk
        write on a frozen file system) may still read or write pool pages, and memory unmapped (or
        mapped again for something else) under it would fault or be overwritten. Never freed when
        ``io_ended`` is cancelled or fails: the mapping then stays until the process exits. The
        segment's name is removed at once (nobody attaches to a closed pool; a name left in
        /dev/shm would outlive the process). Idempotent; :meth:`aclose` and :meth:`close` then
        return at once."""
        self._closed = True
        if self._released or self._closing is not None or self._release_after is not None:
            return
        self._release_after = io_ended
        self._drop_queued_chunks()
        self.memory.segment.unlink_name()

        def ended(done: asyncio.Future[None]) -> None:
            if done.cancelled() or done.exception() is not None:
                log.error("page pool %s: stuck I/O never reported its end: its memory stays mapped until exit",
                          self.memory.segment.name)
                return
            self._closing = self._start_release()

        io_ended.add_done_callback(ended)

    async def wait_freed(self) -> None:
        """Until the memory is freed after a close: at once after :meth:`close` / :meth:`aclose`;
        after :meth:`close_after`, once its ``io_ended`` resolved and the memory was freed, or as
        soon as ``io_ended`` is cancelled or fails (the memory then stays mapped until exit).
        Raises ``RuntimeError`` before any close."""
        if not self._closed:
            raise RuntimeError("the page pool is not closed")
        if self._release_after is not None:
            # asyncio.wait's callback runs after close_after's (added first), which starts the release.
            await asyncio.wait({self._release_after})
        if self._closing is not None:
            await asyncio.shield(self._release_running())

    def _drop_queued_chunks(self) -> None:
        for future in self._futures:
            future.cancel()  # succeeds only for chunks no thread has started

    async def _release(self) -> None:
        self._drop_queued_chunks()
        await self._wait_chunks(all_chunks=True)  # the running ones
        # Unmapping and unlinking a large segment frees its pages (tens of ms per GiB): in one of the
        # preparation threads, which yield the CPU to the loop's thread.
        if self._unmap is None or self._unmap.cancelled():
            self._unmap = self._executor.submit(self.memory.close)
        # Shielded: a cancel of this task would cancel the unmap still queued for a thread (a rerun
        # awaits the same one; it never runs twice).
        await asyncio.shield(asyncio.wrap_future(self._unmap))
        self._released = True
        self._executor.shutdown(wait=False)  # its threads are idle and exit by themselves

    def __enter__(self) -> PagePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> PagePool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @staticmethod
    def attach(name: str, layout: KVLayout) -> PageMemory:
        """Map another process's pool by name: page bytes only, no page table. Close when done.

        Raises ``FileNotFoundError`` when the pool is gone (or being reclaimed after its creator died).
        """
        segment = SharedSegment.attach(name)
        try:
            return PageMemory(segment, layout)
        except BaseException:
            segment.close()
            raise
