"""Page memory as the kernel sees it: where a page's bytes are for one I/O, and registering memory
(the pool, the header slots, callers' regions) as io_uring fixed buffers.

Registering pins memory: the kernel faults it in and holds the ring's lock (and the process's mmap
lock) while it does, so everything here runs in threads, in bounded pieces, faulted in first.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from aiokv.pool import PagePool, run_in_new_thread
from aiokv.shm import populate

from . import uring
from .pagefile import HEADER_BYTES

if TYPE_CHECKING:
    from .backends import HeaderSlots


class PageBuffer:
    """Where a page's bytes are during one I/O: pool memory or a caller's buffer (``write_from``,
    ``read_into``). ``view``: the whole page (``page_bytes``), ``payload``: its first
    ``payload_bytes`` (what the checksum covers); ``address``: its first byte; ``aligned``: the
    address suits O_DIRECT (4096-byte aligned; the length always is)."""

    __slots__ = ("address", "aligned", "payload", "view")

    def __init__(self, address: int, view: memoryview, payload_bytes: int) -> None:
        self.address = address
        self.view = view
        self.payload = view[:payload_bytes]
        self.aligned = address % DIRECT_ALIGN == 0

    def release(self) -> None:
        """Let go of a caller's memory at once (its owner may unmap it when the call returns; a view
        left to the garbage collector would keep an mmap from closing)."""
        self.payload.release()
        self.view.release()


DIRECT_ALIGN = 4096
"""Buffer alignment O_DIRECT needs (the largest logical block size of common devices)."""


class _PyBuffer(ctypes.Structure):
    # CPython's Py_buffer (stable layout since 3.0): only ``buf`` is read.
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


def buffer_address(view: memoryview) -> int:
    """The address of ``view``'s first byte, read-only views included (``ctypes.from_buffer`` only
    takes writable ones). Valid while ``view`` (which holds its exporter's buffer) is alive."""
    info = _PyBuffer()
    if _get_buffer(view, ctypes.byref(info), 0) != 0:  # PyBUF_SIMPLE; an error is raised as set
        raise BufferError("cannot export the buffer")
    try:
        return int(info.buf or 0)
    finally:
        _release_buffer(ctypes.byref(info))


async def register_pool(engine: uring.UringEngine, pool: PagePool, slots: HeaderSlots) -> list[list[uring.Region]]:
    """Register pool memory and header slots as fixed buffers, in a thread: pinning faults in every
    page of the pool (~1 s/GiB for memory never touched), which must not stall the loop.

    A thread of its own, started without the loop waiting for it (``run_in_executor``'s first call
    starts the default executor's thread on the loop, and ``Thread.start`` waits there until it
    runs). A cancelled call waits for the thread (the ring must outlive the syscall using it),
    even if cancelled again meanwhile, then raises ``CancelledError``."""
    pb = pool.layout.page_bytes
    spans = [(pool.memory.segment.address, pool.num_pages * pb, pb),
             (slots.address, slots.count * HEADER_BYTES, HEADER_BYTES)]
    # Nothing to undo for a caller that is gone: the regions stay registered until the ring closes.
    job = run_in_new_thread(functools.partial(populate_then_register, engine, spans), "aiokv-register-pool",
                            _keep_registered)
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        await wait_uncancelled(job)
        raise


def _keep_registered(_: object) -> None:
    """Regions registered for a caller that is gone: the ring drops them when it closes."""


REGISTER_REGION_BYTES = 8 << 20
"""Memory pinned per region by the pool's background registration and by ``register_memory``.
While the kernel pins a region, other threads' munmap (a freed Python arena, a torch or glibc
allocation returned, a thread stack) waits for it (the pin walks the page tables with interrupts
off, or under the mmap lock on older kernels: the TLB shootdown or the lock waits). 64 MiB regions
took ~2.2 ms each and delayed another thread's 1 MiB mmap+munmap to p99 1.2 ms, p99.9 2.1 ms (6 us
alone); 8 MiB regions ~0.25 ms each, p99 50 us, p99.9 0.3 ms (tools/bench_register_stall.py, 2-vCPU
VM, kernel 6.18)."""

REGIONS_PER_UPDATE = 8
"""Regions pinned per ``io_uring_register`` call (one after another inside it: the window in which
other threads' munmap waits stays one region). Fewer calls: each return from a ctypes call waits for
the GIL (up to the 5 ms switch interval under a GIL-bound thread), and hands it back."""

MAX_REGISTER_REGIONS = 8192
"""Regions the background registration plans at most (the kernel's table takes 16384)."""

EXTERNAL_REGION_SLOTS = 4096
"""Slots of the registered-buffer table kept for callers' regions (``register_memory``)."""


class BufferTable:
    """The ring's sparse registered-buffer table (``size`` slots; 0: none, the pool was registered
    whole): made once, by whichever thread needs it first; the pool's regions and the header slots
    take the first ``first_free`` slots, callers' regions the next ones, in order."""

    def __init__(self, engine: uring.UringEngine, size: int, first_free: int) -> None:
        self._engine = engine
        self.size = size
        self._next = first_free
        self._lock = threading.Lock()
        self._made = False

    def ensure(self) -> None:
        """Register the empty table unless done (blocking; any thread). Raises ``OSError``."""
        with self._lock:
            if not self._made:
                self._engine.register_sparse_buffers(self.size)
                self._made = True

    def refuse(self) -> None:
        """No sparse table here (the pool was registered whole): callers' regions get no slot."""
        with self._lock:
            self.size = 0

    @property
    def free(self) -> int:
        """Slots not taken yet (callers' regions may use them)."""
        with self._lock:
            return max(0, self.size - self._next)

    def take(self, count: int) -> int | None:
        """The first of ``count`` consecutive free slots, or None when the table lacks them."""
        with self._lock:
            if self._next + count > self.size:
                return None
            first, self._next = self._next, self._next + count
            return first


async def wait_uncancelled(job: asyncio.Future[Any], stop: threading.Event | None = None) -> bool:
    """Wait for ``job`` even if cancelled meanwhile (its thread uses what the caller must not
    release under it: the ring, the tier's descriptors); a cancellation sets ``stop`` (the job's
    thread looks at it between pieces). Returns whether this wait was cancelled: the caller
    re-raises ``CancelledError`` then.

    Retrieves the job's outcome: a cancelled caller never reads it, and a failure left unread was
    logged by asyncio as "Future exception was never retrieved" in the engine's loop (review 284:
    a pending-delete save cut while a frozen file system held its thread, failing at the thaw; a
    threads backend's start cut while its workers started, failing to start one)."""
    cancelled = False
    while not job.done():
        try:
            await asyncio.wait({job})
        except asyncio.CancelledError:
            cancelled = True
            if stop is not None:
                stop.set()
    if not job.cancelled():
        job.exception()
    return cancelled


def drop_cancel(task: asyncio.Future[Any]) -> None:
    """A done callback: a task a cancel ended lets go of its ``CancelledError`` at once. CPython
    3.11 keeps it until the cancellation is retrieved, and its traceback's frames hold whatever the
    task's coroutine held (a tier's task: the tier, past its close; review 306)."""
    if task.cancelled():
        try:
            task.exception()
        except asyncio.CancelledError:
            pass


def update_in_batches(engine: uring.UringEngine, regions: Sequence[uring.Region], stop: threading.Event,
                      prepare: Callable[[uring.Region], None]) -> Iterator[list[uring.Region]]:
    """Register ``regions`` (consecutive slots, in order) ``REGIONS_PER_UPDATE`` to a call, each
    batch's regions ``prepare``-d (faulted in) first; yields each call's registered regions (the
    first ones of its batch: a partly refused batch is retried from the refused region, whose error
    the kernel reports then). Once ``stop`` is set, pins the region being faulted in and stops. Raises ``OSError`` for a
    refused region: those yielded before are registered, it and the rest are not."""
    at = 0
    while at < len(regions) and not stop.is_set():
        batch: list[uring.Region] = []
        for region in regions[at : at + REGIONS_PER_UPDATE]:
            prepare(region)
            batch.append(region)
            if stop.is_set():  # faulting in is the slow part: pin the region in progress, none after it
                break
        # Fewer than the batch: the kernel refused the next region. The next call starts there and
        # raises its error (the kernel reports one only for a call's first region).
        done = engine.update_buffers(batch)
        if done <= 0:  # the kernel reports an error for a call's first region; never loop on nothing
            raise OSError(errno.EIO, f"io_uring registered none of {len(batch)} regions and reported no error")
        at += done
        yield list(batch[:done])


def populate_then_register(engine: uring.UringEngine, spans: list[tuple[int, int, int]]) -> list[list[uring.Region]]:
    """Fault the spans in first (MADV_POPULATE_WRITE), then register them.

    The kernel holds the ring's lock for the whole registration, and the loop's submissions wait
    on it: pinning memory never touched costs ~1 s/GiB, pinning touched memory ~20 ms/GiB. So the
    slow part (first touch) happens here, outside the lock, 256 MiB at a time."""
    step = 256 << 20
    for address, length, _unit in spans:
        for offset in range(0, length, step):
            populate(address + offset, min(step, length - offset))
    return engine.register_buffers(spans)
