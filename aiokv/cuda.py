"""Bridge from CUDA events to asyncio futures, without polling on the loop thread.

Each *lane* (one per copy direction) is a waiter thread fed through a queue: it blocks in
``event.synchronize()`` (which releases the GIL) and resolves the future with
``loop.call_soon_threadsafe``. Events of one lane come from one side stream and complete in
order, so a FIFO per lane never waits behind an unrelated copy.

On a CPU KV buffer copies are plain torch calls; :meth:`CompletionBridge.run_cpu` runs them on one
worker thread so a large copy never stalls the loop.

:func:`memcpy_async` queues a raw ``cudaMemcpyAsync`` through the runtime torch loaded
(the layer-wise load issues thousands of small copies; torch's ``copy_`` costs too much host time).
:func:`memcpy2d_batch_async` queues many 2-D copies in one ``cudaMemcpy3DBatchAsync`` (CUDA 12.8+,
:class:`BatchCopier`) when switched on (``AIOKV_MEMCPY_BATCH=1``), one ``cudaMemcpy2DAsync`` each
otherwise and where the batch is missing or refused.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import ctypes
import enum
import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from .storage.outcomes import future_error

T = TypeVar("T")
log = logging.getLogger(__name__)


class Lane(enum.Enum):
    """Independent completion queues: copies of one direction complete in order."""

    OFFLOAD = "offload"
    LOAD = "load"
    CONTROL = "control"
    """Small reads of caller data (slot indices) for validation."""


class _Inbox:
    """Completions waiting for one loop, handed over in batches.

    Waiter threads :meth:`post`; the first post after a drain schedules one :meth:`drain` with
    ``call_soon_threadsafe`` (a self-pipe write, a loop wake-up), later ones only append until that
    drain runs. N events completing while the loop is busy or asleep cost one wake-up, one handle
    and one callback, not N: each wake-up is also the waiter taking the GIL from the loop thread.
    """

    __slots__ = ("_errors", "_futures", "_lock", "_pending", "_values", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._futures: collections.deque[asyncio.Future[Any]] = collections.deque()
        self._errors: dict[asyncio.Future[Any], BaseException] = {}
        self._values: dict[asyncio.Future[Any], object] = {}  # results other than None
        self._pending = False
        # Waiters of several lanes post to one inbox: the flag's check-and-set is atomic under it,
        # so two of them never both schedule a drain for the same batch.
        self._lock = threading.Lock()

    def post(self, futures: list[asyncio.Future[Any]], error: BaseException | None) -> None:
        """From a waiter thread: ``futures`` completed (the last one with ``error``, if any)."""
        with self._lock:
            self._futures.extend(futures)
            if error is not None:
                self._errors[futures[-1]] = error
            if self._pending:
                return  # the drain already scheduled has not started: it takes these too
            self._pending = True
        self._wake()

    def post_value(self, future: asyncio.Future[T], value: T) -> None:
        """From any thread: ``future`` is to resolve with ``value``."""
        with self._lock:
            self._futures.append(future)
            if value is not None:
                self._values[future] = value
            if self._pending:
                return
            self._pending = True
        self._wake()

    def _wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.drain)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            with self._lock:
                self._pending = False
                self._futures.clear()
                self._errors.clear()
                self._values.clear()

    def drain(self) -> None:
        """On the loop: resolve every future posted so far, in the order posted."""
        with self._lock:
            # Cleared before taking the batch: a post from here on schedules a drain of its own.
            self._pending = False
            futures, self._futures = self._futures, collections.deque()
            errors, self._errors = self._errors, {}
            values, self._values = self._values, {}
        for future in futures:
            if future.done():
                continue  # the waiter was cancelled; the copy finished anyway
            error = errors.get(future) if errors else None
            if error is None:
                future.set_result(values.get(future) if values else None)
            else:
                future.set_exception(future_error(error))  # (a StopIteration would end the drain)


_Item = tuple[torch.cuda.Event, _Inbox, "asyncio.Future[None]"] | None


def _completed(event: torch.cuda.Event) -> bool:
    """Whether ``event`` completed, without waiting (a CUDA query: cheap, holds the GIL). An error
    reads as not completed: ``synchronize`` then raises it for the waiting coroutine."""
    try:
        return bool(event.query())  # type: ignore[no-untyped-call]
    except Exception:
        return False


class CompletionBridge:
    """Turns CUDA events into awaitables; one instance per cache. Close with :meth:`close`."""

    def __init__(self) -> None:
        self._queues: dict[Lane, queue.SimpleQueue[_Item]] = {}
        self._threads: list[threading.Thread] = []
        self._cpu: concurrent.futures.ThreadPoolExecutor | None = None
        self._cpu_jobs: dict[asyncio.Future[Any], concurrent.futures.Future[Any]] = {}
        self._closed = False
        # The loop futures are resolved on (one per bridge in practice: a cache's or a rank's). A
        # wait from another loop replaces it; items queued already keep the inbox they were given.
        self._inbox: _Inbox | None = None
        # wait()'s check and put, close()'s flag and sentinels, and lane creation are atomic under
        # it: an item put after a lane's sentinel would never resolve, and a lane made after close
        # would keep its thread for ever.
        self._lock = threading.Lock()
        self.completed = 0

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (nothing new is accepted)."""
        return self._closed

    def prestart(self, cuda: bool) -> None:
        """Start the threads the bridge will use (the copy thread; with ``cuda`` the waiters).

        Call before a cache's background preparation begins: ``Thread.start`` waits until the new
        thread runs, and creating one maps its stack under the process's mmap lock, which pool
        preparation holds in long stretches: started lazily on the loop during start-up, one thread
        start stalled the loop 20-60 ms on the 2-vCPU VM. A closed bridge starts nothing.
        """
        with self._lock:
            if self._closed:
                return
            job = self._cpu_executor().submit(int)
        job.result()  # the one copy thread exists from here on
        if cuda:
            for lane in Lane:
                with self._lock:
                    if self._closed:
                        return  # closed meanwhile (a cancelled start): start no more threads
                    self._lane(lane)

    def _cpu_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._cpu is None:
            self._cpu = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="aiokv-copy")
        return self._cpu

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
        """One lane's waiter: blocks (GIL released) on the queue, then in ``synchronize()`` on the
        oldest event (blocking-sync events sleep there; events of one lane complete in order).
        Those queued behind it that completed too go in the same batch: one hand-over to the loop
        for events that finish together, such as a layer-wise load's layers."""
        item = q.get()
        while item is not None:
            event, inbox, future = item
            error: BaseException | None = None
            try:
                event.synchronize()
            except BaseException as exc:  # a CUDA error surfaces in the awaiting coroutine
                error = exc
            batch = [future]
            held = False  # whether ``item`` is the next one to wait for, already taken off the queue
            while error is None:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                if item is not None and item[1] is inbox and _completed(item[0]):
                    batch.append(item[2])
                    continue
                held = True  # the sentinel, another loop's, or still running: waited for next
                break
            self.completed += len(batch)
            inbox.post(batch, error)
            if not held:
                item = q.get()

    def wait(self, event: torch.cuda.Event | None, lane: Lane) -> asyncio.Future[None]:
        """A future that resolves when ``event`` has completed (at once for None)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._closed:
                raise RuntimeError("completion bridge is closed")
            if event is None:
                future.set_result(None)
            else:
                self._lane(lane).put((event, self._inbox_for(loop), future))
        return future

    def _inbox_for(self, loop: asyncio.AbstractEventLoop) -> _Inbox:
        """The inbox of ``loop`` (a new one replaces another loop's); call under ``_lock``."""
        inbox = self._inbox
        if inbox is None or inbox.loop is not loop:
            inbox = self._inbox = _Inbox(loop)
        return inbox

    def resolve_threadsafe(self, future: asyncio.Future[T], value: T) -> None:
        """From any thread: resolve ``future`` with ``value`` on its loop (unless it is done by
        then), in the same hand-over as the event completions: a thread that settles many futures
        in a row (a paced load's layers as it queues them) wakes the loop once, not once each.
        Nothing happens once the future's loop is closed."""
        loop = future.get_loop()
        inbox = self._inbox
        if inbox is None or inbox.loop is not loop:
            with self._lock:
                inbox = self._inbox_for(loop)
        inbox.post_value(future, value)

    def run_cpu(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run a CPU copy on the copy thread (copies stay in submission order).

        Cancelling the returned future does NOT stop the copy: use :meth:`withdraw`, which tells
        whether the copy can still run. Outcomes reach the loop through the inbox, as event
        completions do: copies ending before the loop took the first one's wake-up go with it (one
        self-pipe write, one loop wake-up, one GIL hand-over to the loop for all of them).
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._lock:
            if self._closed:
                raise RuntimeError("completion bridge is closed")
            job = self._cpu_executor().submit(fn)
            inbox = self._inbox_for(loop)
        self._cpu_jobs[future] = job
        future.add_done_callback(self._forget_cpu)

        def done(_: concurrent.futures.Future[T]) -> None:
            if job.cancelled():
                return  # withdrawn: withdraw() cancelled the future itself
            error = job.exception()
            if error is None:
                inbox.post_value(future, job.result())
            else:
                inbox.post([future], error)

        job.add_done_callback(done)
        return future

    def _forget_cpu(self, future: asyncio.Future[Any]) -> None:
        # Resolved by its copy's outcome (the copy is over), or withdrawn (withdraw() dropped it).
        # One its caller cancelled keeps its job: withdraw() must still stop the copy, or say that
        # it may run (dropped here, withdraw() answered True for a copy that then ran).
        if not future.cancelled():
            self._cpu_jobs.pop(future, None)

    def withdraw(self, future: asyncio.Future[Any]) -> bool:
        """Stop a CPU copy from :meth:`run_cpu` that has not started; True when it never runs.

        False means the copy is running or over: its future resolves when it is over (unless its
        caller cancelled it).
        """
        job = self._cpu_jobs.get(future)
        if job is None:
            return future.cancelled()  # withdrawn before (a copy's own outcome drops it: over)
        if not job.cancel():
            return False
        self._cpu_jobs.pop(future, None)
        future.cancel()
        return True

    def close(self) -> None:
        """Stop the waiter threads after the events queued so far. Idempotent."""
        stopped = self._stop()
        if stopped is None:
            return
        threads, cpu = stopped
        for thread in threads:
            thread.join()
        if cpu is not None:
            cpu.shutdown(wait=True)

    def close_nowait(self) -> None:
        """:meth:`close` without waiting (callable on the loop): the threads end by themselves once
        the work queued so far is over. Idempotent."""
        stopped = self._stop()
        if stopped is not None and stopped[1] is not None:
            stopped[1].shutdown(wait=False)

    def _stop(self) -> tuple[list[threading.Thread], concurrent.futures.ThreadPoolExecutor | None] | None:
        """Accept nothing more and queue each waiter's end; the threads and the copy executor, or
        None when closed already."""
        with self._lock:
            if self._closed:
                return None
            self._closed = True
            for q in self._queues.values():
                q.put(None)
            return list(self._threads), self._cpu


# -- raw copies through the CUDA runtime that torch loaded ---------------------------------------

_CUDA_MEMCPY_DEFAULT = 4
"""``cudaMemcpyDefault``: the direction follows from the addresses (unified addressing)."""
_runtime: ctypes.CDLL | None = None
_runtime_looked_up = False


def _runtime_library() -> ctypes.CDLL | None:
    """The ``libcudart`` this process already mapped (torch's), or None where there is none.

    Torch's bindings do not expose ``cudaMemcpyAsync``; its ``copy_`` costs ~10-15 µs of host time
    per call, which bounds a copy of thousands of 1 MiB layer slabs by the host, not by PCIe. The
    same library as torch's: a second runtime copy would keep its own notion of the current device.
    """
    global _runtime, _runtime_looked_up
    if _runtime_looked_up:
        return _runtime
    _runtime_looked_up = True
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if not os.path.basename(path).startswith("libcudart") or not os.path.exists(path):
            continue
        try:
            lib = ctypes.CDLL(path)
            memcpy = lib.cudaMemcpyAsync
        except (OSError, AttributeError):
            continue
        memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        memcpy.restype = ctypes.c_int
        try:
            memcpy2d = lib.cudaMemcpy2DAsync
        except AttributeError:
            continue
        memcpy2d.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                             ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        memcpy2d.restype = ctypes.c_int
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        _runtime = lib
        break
    return _runtime


def memcpy2d_async(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
                   stream: torch.cuda.Stream) -> None:
    """Queue ``cudaMemcpy2DAsync``: ``height`` rows of ``width`` bytes, row i from ``src + i * spitch``
    to ``dst + i * dpitch``, on ``stream`` (as :func:`memcpy_async`; the host rows must lie in one
    ``cudaHostRegister`` range). One call for many slabs: the runtime's per-call host cost, not
    PCIe, bounded a layer-wise load of thousands of 1 MiB slabs one call each."""
    lib = _required_runtime()
    err = lib.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, _CUDA_MEMCPY_DEFAULT, stream.cuda_stream)
    _check(lib, err, f"cudaMemcpy2DAsync({height} x {width} bytes)")


def _required_runtime() -> Any:
    lib = _runtime_library()
    if lib is None:
        raise RuntimeError("no CUDA runtime library is loaded in this process")
    return lib


def _check(lib: Any, err: int, what: str) -> None:
    """Raise ``RuntimeError`` with CUDA's message for a non-zero runtime error code."""
    if err != 0:
        # The refused call also left its error as this thread's last one: cleared, or torch's next
        # kernel-launch check (cudaGetLastError) would raise it as that launch's own failure.
        lib.cudaGetLastError()
        message = lib.cudaGetErrorString(err) or b"?"
        raise RuntimeError(f"{what} failed: CUDA error {err} ({message.decode()})")


def raw_memcpy_available() -> bool:
    """Whether :func:`memcpy_async` can call the CUDA runtime directly (else use ``copy_``)."""
    return torch.cuda.is_available() and _runtime_library() is not None


def memcpy_async(dst: int, src: int, nbytes: int, stream: torch.cuda.Stream) -> None:
    """Queue ``cudaMemcpyAsync`` of ``nbytes`` from address ``src`` to address ``dst`` on ``stream``
    (direction from the addresses), for the device current on this thread: the caller runs under
    ``torch.cuda.stream(stream)``.

    Host memory must be pinned (or registered) for the copy to be asynchronous, and one copy may
    not cross two ``cudaHostRegister`` ranges. Raises ``RuntimeError`` with CUDA's message if the
    runtime refuses the copy, ``RuntimeError`` too where :func:`raw_memcpy_available` is False.
    """
    lib = _required_runtime()
    err = lib.cudaMemcpyAsync(dst, src, nbytes, _CUDA_MEMCPY_DEFAULT, stream.cuda_stream)
    _check(lib, err, f"cudaMemcpyAsync({nbytes} bytes)")


# -- batched 2-D copies: cudaMemcpy3DBatchAsync ------------------------------------------------------

BATCH_ENV = "AIOKV_MEMCPY_BATCH"
"""Set to ``1`` to queue run copies in ``cudaMemcpy3DBatchAsync`` batches instead of one
``cudaMemcpy2DAsync`` each. Off by default: bit-exact on an H100 (CUDA 13) but no faster there in
two A/B runs of 8K-32K pool hits (forty-fourth session, ``docs/measurements.md``), and very large
batches hung elsewhere (vllm#49276)."""
BATCH_MAX_OPS = 64
"""Copies per ``cudaMemcpy3DBatchAsync`` call, more go in several calls: very large batches hung
(vllm#49276, torch 2.11 + CUDA 13)."""
_BATCH_MIN_VERSION = 12080
"""The runtime that brought ``cudaMemcpy3DBatchAsync`` (12.8: ``failIdx`` its third argument; 13.0
dropped it)."""
_OPERAND_POINTER = 1  # cudaMemcpyOperandTypePointer
_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: the source is read in stream order


class Copy2D(Protocol):
    """A 2-D copy: ``height`` rows of ``width`` bytes, row i from ``src + i * spitch`` to
    ``dst + i * dpitch`` (``slotruns.RunCopy``)."""

    @property
    def dst(self) -> int: ...
    @property
    def dpitch(self) -> int: ...
    @property
    def src(self) -> int: ...
    @property
    def spitch(self) -> int: ...
    @property
    def width(self) -> int: ...
    @property
    def height(self) -> int: ...


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _PointerOperand(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("rowLength", ctypes.c_size_t), ("layerHeight", ctypes.c_size_t),
                ("locHint", _MemLocation)]


class _ArrayOperand(ctypes.Structure):
    _fields_ = [("array", ctypes.c_void_p), ("x", ctypes.c_size_t), ("y", ctypes.c_size_t), ("z", ctypes.c_size_t)]


class _OperandUnion(ctypes.Union):
    _fields_ = [("ptr", _PointerOperand), ("array", _ArrayOperand)]


class Memcpy3DOperand(ctypes.Structure):
    """``struct cudaMemcpy3DOperand``: a pointer operand (``rowLength``, ``layerHeight`` in elements,
    one byte each between pointers) or an array one."""

    _fields_ = [("type", ctypes.c_int), ("op", _OperandUnion)]


class Extent(ctypes.Structure):
    """``struct cudaExtent`` (width in bytes between pointers)."""

    _fields_ = [("width", ctypes.c_size_t), ("height", ctypes.c_size_t), ("depth", ctypes.c_size_t)]


class Memcpy3DBatchOp(ctypes.Structure):
    """``struct cudaMemcpy3DBatchOp`` (``driver_types.h``, CUDA 12.8 and 13)."""

    _fields_ = [("src", Memcpy3DOperand), ("dst", Memcpy3DOperand), ("extent", Extent),
                ("srcAccessOrder", ctypes.c_int), ("flags", ctypes.c_uint)]


# The layout the runtime reads: a wrong size would make it read the ops at the wrong places.
assert ctypes.sizeof(Memcpy3DBatchOp) == 112, ctypes.sizeof(Memcpy3DBatchOp)


def batch_ops(copies: Sequence[Copy2D]) -> ctypes.Array[Memcpy3DBatchOp]:
    """The ops of one ``cudaMemcpy3DBatchAsync`` doing what ``cudaMemcpy2DAsync`` would for each of
    ``copies``: ``height`` rows of ``width`` bytes, row i from ``src + i * spitch`` to
    ``dst + i * dpitch``; a pitch is a row length in one-byte elements, one layer of ``height``
    rows. The copies must not overlap one another (a batch runs its ops in no particular order)."""
    ops = (Memcpy3DBatchOp * len(copies))()
    for op, c in zip(ops, copies, strict=True):
        op.src.type = op.dst.type = _OPERAND_POINTER
        op.src.op.ptr.ptr, op.src.op.ptr.rowLength, op.src.op.ptr.layerHeight = c.src, c.spitch, c.height
        op.dst.op.ptr.ptr, op.dst.op.ptr.rowLength, op.dst.op.ptr.layerHeight = c.dst, c.dpitch, c.height
        op.extent.width, op.extent.height, op.extent.depth = c.width, c.height, 1
        op.srcAccessOrder = _SRC_ACCESS_ORDER_STREAM
    return ops


def batch_parts(count: int) -> list[int]:
    """Sizes of the batch calls for ``count`` copies: the fewest within :data:`BATCH_MAX_OPS`, their
    sizes within one of each other (65 copies: 33 and 32, not 64 and a batch of one)."""
    calls = -(-count // BATCH_MAX_OPS)
    base, extra = divmod(count, calls) if calls else (0, 0)
    return [base + (i < extra) for i in range(calls)]


class BatchCopier:
    """Queues 2-D copies through ``cudaMemcpy3DBatchAsync`` (:func:`batch_parts`), or one
    ``cudaMemcpy2DAsync`` each where the runtime lacks it (below 12.8), it is switched off
    (:data:`BATCH_ENV`, :attr:`enabled`), or a batch call failed once: the failed call's copies are
    then queued again one by one (the same bytes to the same places) and batches stay off.
    Shared by the process's feeding threads: refusals on several at once keep (and log) the first.

    ``lib``: the runtime (:func:`_runtime_library`'s, or a stand-in in tests)."""

    def __init__(self, lib: Any, enabled: bool = True) -> None:
        self._lib = lib
        self.enabled = enabled
        self.batch_calls = 0
        """``cudaMemcpy3DBatchAsync`` calls that succeeded."""
        self.failure: str | None = None
        """Why batches were turned off for good (the first refused call), None while they are not."""
        self._lock = threading.Lock()
        self._fn: Any = None
        self._fail_index = False
        self.version = 0
        version = ctypes.c_int(0)
        if lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0:
            return
        self.version = version.value
        if self.version < _BATCH_MIN_VERSION:
            return
        try:
            fn = lib.cudaMemcpy3DBatchAsync
        except AttributeError:
            return
        self._fail_index = self.version < 13000
        if self._fail_index:
            fn.argtypes = [ctypes.c_size_t, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_ulonglong,
                           ctypes.c_void_p]
        else:
            fn.argtypes = [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        self._fn = fn

    @property
    def available(self) -> bool:
        """Whether the runtime has the batch call (and none of it failed)."""
        return self._fn is not None and self.failure is None

    @property
    def active(self) -> bool:
        """Whether :meth:`copy` batches now."""
        return self.enabled and self.available

    def copy(self, copies: Sequence[Copy2D], stream: torch.cuda.Stream) -> None:
        """Queue ``copies`` (non-overlapping) on ``stream``, in stream order as a whole: a single copy
        as a 2-D copy (a batch of one saves no call), more in :func:`batch_parts`. Raises
        ``RuntimeError`` with CUDA's message where a 2-D copy is refused (a batch refused falls back)."""
        i = 0
        parts = batch_parts(len(copies)) if len(copies) > 1 else []
        for size in parts:
            if not self.active:
                break
            part = copies[i : i + size]
            err = self._issue_batch(part, stream)
            if err != 0:
                self._lib.cudaGetLastError()  # as _check: not torch's next launch's error
                message = self._lib.cudaGetErrorString(err) or b"?"
                failure = f"cudaMemcpy3DBatchAsync({len(part)} ops) failed: CUDA error {err} ({message.decode()})"
                with self._lock:  # feeding threads share the copier: the first refusal kept, logged once
                    first = self.failure is None
                    if first:
                        self.failure = failure
                if first:
                    log.warning("%s; run copies go by cudaMemcpy2DAsync from now on", failure)
                break  # this part again, one 2-D copy each (what the batch queued is copied again)
            with self._lock:  # (a += of two threads at once may lose one)
                self.batch_calls += 1
            i += size
        for c in copies[i:]:
            memcpy2d_async(c.dst, c.dpitch, c.src, c.spitch, c.width, c.height, stream)

    def _issue_batch(self, copies: Sequence[Copy2D], stream: torch.cuda.Stream) -> int:
        """One ``cudaMemcpy3DBatchAsync`` of ``copies``; its error code."""
        ops = batch_ops(copies)
        if self._fail_index:
            failed = ctypes.c_size_t(0)
            return int(self._fn(len(copies), ops, ctypes.byref(failed), 0, stream.cuda_stream))
        return int(self._fn(len(copies), ops, 0, stream.cuda_stream))


_batch_copier: BatchCopier | None = None


def batch_copier() -> BatchCopier:
    """The process's :class:`BatchCopier` on torch's runtime, on only where :data:`BATCH_ENV` is ``1``.
    Raises ``RuntimeError`` where no runtime is loaded."""
    global _batch_copier
    if _batch_copier is None:
        _batch_copier = BatchCopier(_required_runtime(), enabled=os.environ.get(BATCH_ENV, "0") == "1")
    return _batch_copier


def memcpy2d_batch_async(copies: Sequence[Copy2D], stream: torch.cuda.Stream) -> None:
    """Queue ``copies`` (each as :func:`memcpy2d_async` would, none overlapping another) on
    ``stream`` through :func:`batch_copier`: a few runtime calls for all of them, not one each."""
    batch_copier().copy(copies, stream)
