"""One io_uring per event loop, driven by raw syscalls, completing on the loop through an eventfd.

Why raw syscalls and not the PyPI ``liburing`` wrapper: its abi3 wheel (2026.3.30) executes AVX-512
instructions in ``Ring.__init__``; on a CPU without AVX-512 (the AMD EPYC of the development VM) the
process dies of SIGILL, which no ``try`` can catch. The ring ABI is small and stable, so this module
maps the rings itself (``io_uring_setup``/``io_uring_enter``/``io_uring_register`` through libc's
``syscall``) and writes 64-byte SQEs with ``struct``. No iovec objects exist, so nothing can leak
buffer exports: reads and writes pass raw addresses of pool memory (READ_FIXED/WRITE_FIXED over
registered regions, or plain READ/WRITE), and the engine keeps every buffer alive until its CQE.

Submission: coroutines prepare SQEs as they ask and one ``io_uring_enter`` per loop tick
(``call_soon``) submits them all. Completion: the ring signals an eventfd watched with
``loop.add_reader``; the callback drains the CQ ring and resolves one future per request (a negative
result becomes ``OSError(errno)``). In-flight requests are bounded by the SQ size (the CQ ring is
twice that), so the CQ can never overflow; further requests wait in a FIFO. A cancelled caller's
request still completes and is discarded; :meth:`UringEngine.aclose` waits for every completion
before unmapping, so the kernel never writes into freed memory.

Ordering: without SQPOLL the kernel reads SQEs inside ``io_uring_enter`` on this thread, so plain
stores suffice; CQ tail/head are read and written as aligned 32-bit ctypes values (x86-64 TSO; other
architectures would need acquire/release fences here).
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import ctypes.util
import dis
import errno
import functools
import logging
import mmap
import os
import struct
import threading
import time
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long

# Syscall numbers of the io_uring family are the same on every Linux architecture.
SYS_IO_URING_SETUP = 425
SYS_IO_URING_ENTER = 426
SYS_IO_URING_REGISTER = 427

IORING_OFF_SQ_RING = 0
IORING_OFF_CQ_RING = 0x8000000
IORING_OFF_SQES = 0x10000000
IORING_SETUP_CLAMP = 1 << 4
IORING_REGISTER_BUFFERS = 0
IORING_REGISTER_BUFFERS2 = 15
IORING_REGISTER_BUFFERS_UPDATE = 16
IORING_RSRC_REGISTER_SPARSE = 1
IORING_UNREGISTER_BUFFERS = 1
IORING_REGISTER_EVENTFD = 4
IORING_REGISTER_FILES = 2
IORING_FSYNC_DATASYNC = 1
IOSQE_FIXED_FILE = 1 << 0
IOSQE_IO_LINK = 1 << 2
IOSQE_ASYNC = 1 << 4
IOSQE_CQE_SKIP_SUCCESS = 1 << 6
IORING_FEAT_CQE_SKIP = 1 << 11
AT_FDCWD = -100

OP_NOP = 0
OP_READV = 1
OP_WRITEV = 2
OP_FSYNC = 3
OP_READ_FIXED = 4
OP_WRITE_FIXED = 5
OP_OPENAT = 18
OP_CLOSE = 19
OP_STATX = 21
OP_READ = 22
OP_WRITE = 23
OP_RENAMEAT = 35
OP_UNLINKAT = 36
OP_FIXED_FD_INSTALL = 54
"""Install a fixed file as a normal descriptor of this process (O_CLOEXEC), kernel 6.8."""

SUBMIT_BATCH = 32
"""SQEs handed to one ``io_uring_enter`` (whole chains; a longer chain goes alone)."""

DATA_OPS = frozenset({OP_READV, OP_WRITEV, OP_READ_FIXED, OP_WRITE_FIXED, OP_READ, OP_WRITE})
"""Ops that move page bytes (see :attr:`UringEngine.async_data`)."""

LOUD_TRANSFERS = True
"""In a chain whose successful ops post no CQE, a transfer (``DATA_OPS``) posts its own all the
same, unless the op right after it posts one (the reporting op, or the chain's last: it runs in
the same task work). Read at each chain's preparation; False: silent, as before (A/B runs).

An O_DIRECT transfer completes in the loop thread's task work, which the kernel runs by waking
the thread out of the loop's ``epoll_wait`` (EINTR). Silent, nothing was ready after it, and
CPython's ``epoll.poll`` slept again for the remaining timeout rounded up to a whole ms: a loop
asleep for a timer due in 0.2 ms woke 1.5-2 ms later (#14: at 1 MiB pages ~0.3 such wake-ups a
page, 45% of them with nothing posted). Posted, the retried poll returns at once with the
ring's eventfd ready."""

DRAIN_TURN_S = 0.5e-3
"""Completions handled in one turn of the loop are cut off after this long (the rest in the next
turn): 32 pages completing at once ran every page's completion work in one callback, which held
the loop ~4 ms at queue depth 32 (loop-lag budget: p99 1.2 ms, max 3 ms)."""

MAX_REGION_BYTES = 1 << 30
"""A registered buffer larger than 1 GiB fails with EFAULT: register in regions up to this size."""

# struct io_uring_sqe: opcode, flags, ioprio, fd, off/addr2, addr, len, op_flags, user_data,
# buf_index, personality, splice_fd_in, addr3, pad.
_SQE = struct.Struct("<BBHiQQIIQHHiQQ")
_CQE = struct.Struct("<QiI")
assert _SQE.size == 64
assert _CQE.size == 16


_U32 = ctypes.c_uint32


class _SqOff(ctypes.Structure):
    _fields_ = [("head", _U32), ("tail", _U32), ("ring_mask", _U32), ("ring_entries", _U32),
                ("flags", _U32), ("dropped", _U32), ("array", _U32), ("resv1", _U32),
                ("user_addr", ctypes.c_uint64)]


class _CqOff(ctypes.Structure):
    _fields_ = [("head", _U32), ("tail", _U32), ("ring_mask", _U32), ("ring_entries", _U32),
                ("overflow", _U32), ("cqes", _U32), ("flags", _U32), ("resv1", _U32),
                ("user_addr", ctypes.c_uint64)]


class _Params(ctypes.Structure):
    _fields_ = [("sq_entries", _U32), ("cq_entries", _U32), ("flags", _U32), ("sq_thread_cpu", _U32),
                ("sq_thread_idle", _U32), ("features", _U32), ("wq_fd", _U32), ("resv", _U32 * 3),
                ("sq_off", _SqOff), ("cq_off", _CqOff)]


class IoVec(ctypes.Structure):
    """``struct iovec``."""

    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _check(result: int) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def io_uring_setup(entries: int, params: _Params) -> int:
    """Create a ring; raises ``OSError`` (EPERM/ENOSYS where io_uring is refused). Tests monkeypatch it."""
    return _check(_libc.syscall(SYS_IO_URING_SETUP, ctypes.c_uint(entries), ctypes.byref(params)))


def io_uring_enter(fd: int, to_submit: int) -> int:
    """Submit ``to_submit`` SQEs without waiting; returns how many the kernel took."""
    return _check(_libc.syscall(SYS_IO_URING_ENTER, fd, ctypes.c_uint(to_submit), 0, 0, None, 0))


def io_uring_register(fd: int, opcode: int, arg: ctypes.c_void_p | None, nr: int) -> int:
    """``io_uring_register``; raises ``OSError`` (ENOMEM when memlock is too small for buffers)."""
    return _check(_libc.syscall(SYS_IO_URING_REGISTER, fd, ctypes.c_uint(opcode), arg, ctypes.c_uint(nr)))


_U32S = struct.Struct("<I")

_ABANDONED: list[object] = []
"""What the requests in flight of engines dropped unclosed named (their ``keep``): the kernel may
still write it, so it is never freed."""


def _close_cell(cell: list[int]) -> None:
    fd, cell[0] = cell[0], -1
    if fd >= 0:
        os.close(fd)


class RingMaps:
    """One io_uring made with ``io_uring_setup`` (``params``: its flags in, filled in by the kernel)
    and its three shared maps: the SQ ring, the CQ ring and the SQEs (``IORING_OFF_*``), with the
    ctypes views of the head and tail words, which the rings' users read and store (x86-64 TSO:
    see the module's note on ordering). The SQ index array is the identity (slot i is SQE i).

    The views export the maps, so :meth:`close` drops them before unmapping: a user keeps no view
    of its own (it reads ``maps.sq_tail`` and co.; the maps themselves and the plain values it may
    keep). It owns the descriptor: :meth:`close` closes it, so does a failed setup, and so does a
    finalizer when it is dropped unclosed (the maps then go with it). What the kernel may still
    write (the users' buffers) is no business of it: a user closes it, or drops it, only with no
    request in flight, or keeps those buffers for good. Raises ``OSError`` (the setup's, a map's)."""

    sq: mmap.mmap
    cq: mmap.mmap
    sqes: mmap.mmap
    sq_tail: ctypes.c_uint32
    sq_head: ctypes.c_uint32
    cq_head: ctypes.c_uint32
    cq_tail: ctypes.c_uint32

    def __init__(self, entries: int, params: _Params) -> None:
        # The finalizer is made first and the descriptor stored into its cell in the statement of
        # the setup: a signal handler's exception raised after it (Python runs handlers as calls
        # return) finds it owned. Not one raised as ``io_uring_setup`` itself returns: that one
        # leaks the descriptor (a window as long as the system call, ~0.1 ms for 256 entries).
        cell = [-1]
        self._close_fd = weakref.finalize(self, _close_cell, cell)
        self._close_fd.atexit = False  # the process's exit closes it
        try:
            cell[0] = self.fd = io_uring_setup(entries, params)
            self._map(params)
        except BaseException:
            self.close()
            raise

    def _map(self, p: _Params) -> None:
        self.sq_entries = p.sq_entries
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        self.sq = mmap.mmap(self.fd, p.sq_off.array + p.sq_entries * 4, flags, prot, offset=IORING_OFF_SQ_RING)
        self.cq = mmap.mmap(self.fd, p.cq_off.cqes + p.cq_entries * 16, flags, prot, offset=IORING_OFF_CQ_RING)
        self.sqes = mmap.mmap(self.fd, p.sq_entries * 64, flags, prot, offset=IORING_OFF_SQES)
        # Read and written without a ctypes view: one that a traceback keeps (an exception raised
        # here, a signal handler's) would keep exporting the map, and its close would fail.
        (self.sq_mask,) = _U32S.unpack_from(self.sq, p.sq_off.ring_mask)
        (self.cq_mask,) = _U32S.unpack_from(self.cq, p.cq_off.ring_mask)
        self.cqes_off = p.cq_off.cqes
        struct.pack_into(f"<{p.sq_entries}I", self.sq, p.sq_off.array, *range(p.sq_entries))
        self.sq_tail = ctypes.c_uint32.from_buffer(self.sq, p.sq_off.tail)
        self.sq_head = ctypes.c_uint32.from_buffer(self.sq, p.sq_off.head)
        self.cq_head = ctypes.c_uint32.from_buffer(self.cq, p.cq_off.head)
        self.cq_tail = ctypes.c_uint32.from_buffer(self.cq, p.cq_off.tail)

    @property
    def closed(self) -> bool:
        return not self._close_fd.alive

    def close(self) -> None:
        """Drop the views, unmap and close the descriptor (idempotent). The descriptor is closed
        even if an unmapping fails (a map the kernel keeps until it is unmapped)."""
        try:
            for name in ("sq_tail", "sq_head", "cq_head", "cq_tail"):
                if hasattr(self, name):
                    delattr(self, name)  # the views export the maps: dropped first
            for name in ("sq", "cq", "sqes"):
                m = getattr(self, name, None)
                if m is not None:
                    m.close()
        finally:
            self._close_fd()


class _RsrcRegister(ctypes.Structure):
    _fields_ = (("nr", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("resv2", ctypes.c_uint64),
                ("data", ctypes.c_uint64), ("tags", ctypes.c_uint64))


class _RsrcUpdate2(ctypes.Structure):
    _fields_ = (("offset", ctypes.c_uint32), ("resv", ctypes.c_uint32), ("data", ctypes.c_uint64),
                ("tags", ctypes.c_uint64), ("nr", ctypes.c_uint32), ("resv2", ctypes.c_uint32))


@dataclass(frozen=True)
class Region:
    """One registered buffer: ``[address, address + length)`` with index ``index``."""

    index: int
    address: int
    length: int


@dataclass(frozen=True)
class Op:
    """One SQE of a chain: see :meth:`UringEngine.chain`."""

    opcode: int
    fd: int = -1
    addr: int = 0
    length: int = 0
    off: int = 0
    op_flags: int = 0
    buf_index: int = 0
    file_index: int = 0
    """For OPENAT/CLOSE: fixed-file slot + 1 (0: a normal fd)."""
    fixed_file: bool = False
    """``fd`` is a slot of the registered file table."""


SqeFields = tuple[int, int, int, int, int, int, int, int, int, int, int, int, int, int]
"""An SQE as packed, ``user_data`` (index 8) left 0: see :func:`sqe`."""

ChainDone = Callable[[list[int]], None]
"""Called on the loop with every op's raw result once a chain completed (see :meth:`UringEngine.submit`)."""


def sqe(opcode: int, fd: int = -1, addr: int = 0, length: int = 0, off: int = 0, op_flags: int = 0,
        buf_index: int = 0, file_index: int = 0, fixed_file: bool = False) -> SqeFields:
    """The fields of one SQE (same meaning as :class:`Op`), cheap to build on the hot path."""
    return (opcode, IOSQE_FIXED_FILE if fixed_file else 0, 0, fd, off, addr, length, op_flags, 0,
            buf_index, 0, file_index, 0, 0)


class _Request:
    __slots__ = ("callback", "future", "injected", "keep", "last", "ops", "pending", "report", "results", "single",
                 "skip")

    def __init__(self, ops: list[SqeFields], future: asyncio.Future[Any] | None, callback: ChainDone | None,
                 keep: object, injected: list[int | None] | None, single: bool, expect: list[int] | None,
                 report: int = -1) -> None:
        self.ops = ops
        self.future = future
        self.callback = callback
        self.keep = keep  # buffers and paths the kernel uses: alive until the last CQE arrives
        self.injected = injected
        self.single = single
        # ``skip``: every op but the last posts a CQE only when it fails (IOSQE_CQE_SKIP_SUCCESS);
        # the results of those that stay silent are what the caller expects of a success.
        self.skip = expect is not None and len(ops) > 1
        self.results = list(expect) if expect is not None else [0] * len(ops)
        self.pending = len(ops)  # ops whose CQE has not arrived (silent successes included)
        self.last = len(ops) - 1  # (read by _complete, which must call nothing before a CQE is consumed)
        # ``report``: an op of a silent chain that posts its CQE on success too (its result, an fd,
        # is not known in advance): -ECANCELED until it arrives (the chain broke before the op).
        self.report = report if self.skip and 0 <= report < len(ops) - 1 else -1
        if self.report >= 0:
            self.results[self.report] = -errno.ECANCELED


FaultHook = Callable[[int], int | None]
"""Called with the opcode of each request (tests): when it returns a negative errno, the request
goes through the ring as a READ of fd -1 (no side effect; it fails, so a chain breaks there as it
would on a real fault) and completes with the injected result."""


class LoopTurns(threading.local):
    """The loop's turns as this thread's rings see them, for the disk tier's per-turn budgets
    (asyncio counts no turns). One per thread (a loop runs on one thread at a time).

    ``stamp`` advances when a ring's wake-up callback starts (one per ring per turn, right after
    the loop's poll) and again when it ends: what is keyed on the stamp seen during one lasts for
    that callback only. ``waking`` is True while one runs. What is asked for with
    :meth:`call_after_wake` during one runs at its end, in the same turn, before the ring submits
    what the wake-up prepared: work that would otherwise need a turn of its own (#14).

    A wake-up callback runs after the turn's queued callbacks (the callers' task steps among them);
    after it, in the same turn, only other ready file descriptors' callbacks and due timers."""

    def __init__(self) -> None:
        self.stamp = 0
        self.waking = False
        self.deadline = 0.0
        """While ``waking``: when the wake-up's drain time ends (``time.perf_counter()``); the
        calls at its end keep within it (at least one step each)."""
        self.after_wake: list[Callable[[], None]] = []

    def call_after_wake(self, fn: Callable[[], None]) -> bool:
        """``fn()`` at the end of the ring wake-up callback running now (before its submission);
        False, and nothing asked, when none runs. ``fn`` should not raise (a bug: logged); it is
        a drain (safe to call again): a KeyboardInterrupt out of it runs it again next turn."""
        if not self.waking:
            return False
        self.after_wake.append(fn)
        return True


TURNS = LoopTurns()
"""This thread's :class:`LoopTurns` (its attributes are per thread)."""

_RESUME = dis.opmap.get("RESUME", -1)


def not_started(fn: Callable[..., object] | None, exc: BaseException) -> bool:
    """Whether ``exc``, caught by the caller of ``fn`` (a Python function or bound method), left
    ``fn`` before its first instruction ran: Python raises a signal's KeyboardInterrupt at the
    first check for pending signals, which is a function's entry too; a turn call dropped there
    never ran (a hash batch's flag then stayed set and no page was hashed inline ever again).
    Its frame then shows it at its entry (``RESUME``), or is absent (a profile hook raised at its
    ``call`` event). False for a call that ran part of its body (never run twice: its own guard
    hands on what it did not do) and for a C callable (no frame to tell).

    Sound for a call Python inlines (a plain call of a function or bound method, no ``*args``):
    nothing checks for signals as it returns. A ``functools.partial`` is looked through, but its
    call is not inlined: the check as it returns raises with the function's frame gone, which
    reads as not started, so what is called through one must ignore a second call (the disk
    tier's page-job steps do: :attr:`~.jobs.Job.step`)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    tb = exc.__traceback__
    if not isinstance(code, types.CodeType) or tb is None or _RESUME < 0:
        return False
    entry: int = code.co_code[::2].find(bytes([_RESUME])) * 2  # RESUME's offset (after MAKE_CELL & co.)
    tb = tb.tb_next  # the caller's frame is first
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return tb.tb_lasti <= entry
        tb = tb.tb_next
    return True


def _close_quietly(fd: int) -> int:
    """``close(fd)`` as a CLOSE op reports it: 0, or the negative errno."""
    try:
        os.close(fd)
    except OSError as exc:
        return -(exc.errno or errno.EIO)
    return 0


class UringEngine:
    """One io_uring bound to the running loop. Create with :meth:`open` inside the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, entries: int) -> None:
        params = _Params()
        params.flags = IORING_SETUP_CLAMP
        self._loop = loop
        # Held while a thread writes the eventfd and while it stops being watched or is closed:
        # a write after the close could land in whatever file took its number since.
        self._wake_lock = threading.Lock()
        self._wakeable = False  # see wake_threadsafe
        self._announced = False  # a thread woke the loop for on_wake since it last ran
        self._next_id = 1
        # One entry per request (not per op): an op's user_data is its request's id shifted left by
        # ``_index_bits``, plus the op's index in the chain.
        self._inflight: dict[int, _Request] = {}
        self._ops_inflight = 0  # SQEs prepared or submitted whose CQE may still come
        self._waiting: collections.deque[_Request] = collections.deque()
        self._prepared = 0  # SQEs written to the ring but not yet taken by the kernel
        # SQEs per prepared chain not yet taken by the kernel, in order: replaced whole (one store)
        # once the kernel took some, so a KeyboardInterrupt never leaves it half updated.
        self._chains: list[int] = []
        self._cqe_taken = True  # see _drain
        self._submit_scheduled = False
        self._turn_calls: list[Callable[[], None]] = []  # see call_next_turn
        self._drain_due = False  # a _drain_again is scheduled (CQEs left over by a drain cut short)
        self._waking = False  # in _on_eventfd: what is prepared goes out at its end, no _submit queued
        self.async_data = False
        """Issue page reads and writes from the kernel's io-wq workers (IOSQE_ASYNC), never inline in
        ``io_uring_enter``: an O_DIRECT op issued inline blocks the submitting thread once the
        device's request slots are used up, and with 32 MiB pages at queue depth 32 one submit held
        the loop 0.7-0.8 s. Off (inline, cheaper) for small pages."""
        self._closed = False
        self._idle: asyncio.Future[None] | None = None
        self.fault_hook: FaultHook | None = None
        self.submits = 0
        self.submit_max_s = 0.0
        self.enter_failures = 0
        """Submissions the kernel refused (``io_uring_enter`` failed other than EAGAIN/EBUSY/EINTR):
        the first is logged, the rest only counted (the tier counts each failed I/O by kind)."""
        self.on_wake: Callable[[float], None] | None = None
        """Runs on the loop after each wake-up's completion drain, with the drain's deadline
        (``time.perf_counter()``): what other threads announced with :meth:`wake_threadsafe`
        (the checksum threads' results). Should not raise (a bug: logged)."""
        self._drain_deadline = 0.0
        self._rings = RingMaps(entries, params)
        self._fd = self._rings.fd
        self._efd = -1
        try:
            self._map_rings()
            self._index_bits = max(1, self.sq_entries.bit_length())
            self._index_mask = (1 << self._index_bits) - 1
            self.skip_success = bool(params.features & IORING_FEAT_CQE_SKIP)
            """The kernel can leave out the CQEs of linked ops that succeed (5.17): see :meth:`submit`."""
            self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            efd = ctypes.c_int32(self._efd)
            efd_ptr = ctypes.cast(ctypes.byref(efd), ctypes.c_void_p)
            io_uring_register(self._fd, IORING_REGISTER_EVENTFD, efd_ptr, 1)
            loop.add_reader(self._efd, self._on_eventfd)
            self._wakeable = True
        except BaseException:
            # (a closed loop, a signal handler's exception): the ring, its maps and the eventfd
            # must not leak, nor the loop watch the eventfd of an engine that was never made.
            try:
                if self._efd >= 0:
                    loop.remove_reader(self._efd)
            finally:
                self._unmap()
            raise

    @classmethod
    def open(cls, entries: int) -> UringEngine:
        """A ring of at least ``entries`` SQEs on the running loop; raises ``OSError`` if refused."""
        return cls(asyncio.get_running_loop(), entries)

    def _map_rings(self) -> None:
        rings = self._rings  # its views are read through it (see RingMaps)
        self.sq_entries = rings.sq_entries
        self._cq, self._sqes = rings.cq, rings.sqes
        self._sq_mask, self._cq_mask, self._cqes_off = rings.sq_mask, rings.cq_mask, rings.cqes_off
        self._tail = rings.sq_tail.value

    def wake_threadsafe(self) -> bool:
        """From any thread: wake the loop through the ring's eventfd, so that :attr:`on_wake` runs
        in its next turn (with the drain of whatever completed meanwhile: one wake-up for both).
        False once the engine is closing (nothing watches the eventfd any more): then the caller
        wakes the loop its own way."""
        with self._wake_lock:
            if not self._wakeable:
                return False
            self._announced = True
            os.eventfd_write(self._efd, 1)
        return True

    def _unmap(self) -> None:
        """Close the ring (its maps, its descriptor) and the eventfd; idempotent. No number is kept
        once its file is closed (each is let go before the close: a signal's exception after it
        finds nothing to close twice), so a later :meth:`register_buffers` and co. fail (fd -1:
        EBADF, or EINVAL where the kernel has blind registrations) rather than reach a file that
        took the number since (another engine's ring)."""
        with self._wake_lock:
            self._wakeable = False
        self._fd = -1  # RingMaps closes it
        try:
            self._rings.close()
        finally:
            efd, self._efd = self._efd, -1
            if efd >= 0:
                os.close(efd)

    def __del__(self, _close: Callable[[int], None] = os.close, _kept: list[object] = _ABANDONED) -> None:
        # Dropped without aclose() (its loop closed under it): the ring goes with its maps'
        # finalizer, which does not stop a transfer in progress, so what the requests in flight
        # name stays alive for good. No thread writes the eventfd now: each holds the engine
        # (wake_threadsafe). (Defaults bound at definition: it may run as the interpreter ends.)
        inflight: dict[int, _Request] | None = getattr(self, "_inflight", None)
        if inflight:
            _kept.append([request.keep for request in inflight.values()])
        efd, self._efd = getattr(self, "_efd", -1), -1
        if efd >= 0:
            _close(efd)

    # -- registered buffers ---------------------------------------------------------------------

    def register_buffers(self, spans: list[tuple[int, int, int]]) -> list[list[Region]]:
        """Register each ``(address, length, unit)`` span as fixed buffers, cut into regions of
        <= 1 GiB holding whole ``unit``-byte pages; one call for all spans (the kernel allows one
        registration per ring). Raises ``OSError`` (ENOMEM: memlock too small)."""
        out = self.plan_regions(spans)
        flat = [region for regions in out for region in regions]
        iovs = (IoVec * len(flat))(*[IoVec(r.address, r.length) for r in flat])
        io_uring_register(self._fd, IORING_REGISTER_BUFFERS, ctypes.cast(iovs, ctypes.c_void_p), len(flat))
        return out

    @staticmethod
    def plan_regions(spans: list[tuple[int, int, int]], max_bytes: int = MAX_REGION_BYTES) -> list[list[Region]]:
        """Cut each ``(address, length, unit)`` span into regions of <= ``max_bytes`` holding whole
        ``unit``-byte pages, indexed in order across spans (the buffer table's slots)."""
        out: list[list[Region]] = []
        index = 0
        for address, length, unit in spans:
            per_region = max(unit, max_bytes // unit * unit)
            regions: list[Region] = []
            for offset in range(0, length, per_region):
                regions.append(Region(index, address + offset, min(per_region, length - offset)))
                index += 1
            out.append(regions)
        return out

    def register_sparse_buffers(self, count: int) -> None:
        """An empty fixed-buffer table of ``count`` slots (kernel >= 5.19), filled later one region at
        a time by :meth:`update_buffer`. Raises ``OSError`` (EINVAL on older kernels)."""
        arg = _RsrcRegister(count, IORING_RSRC_REGISTER_SPARSE, 0, 0, 0)
        io_uring_register(self._fd, IORING_REGISTER_BUFFERS2, ctypes.cast(ctypes.pointer(arg), ctypes.c_void_p),
                          ctypes.sizeof(arg))

    def update_buffer(self, region: Region) -> None:
        """Register ``region`` in its slot of a sparse table (:meth:`update_buffers` of one region).
        Raises ``OSError``."""
        self.update_buffers([region])

    def update_buffers(self, regions: Sequence[Region]) -> int:
        """Register ``regions`` (consecutive slots of a sparse table, in slot order) in one call: the
        kernel pins them one after another, holding the ring's lock meanwhile (fault them in first and
        keep regions small) but taking the mmap lock per region. Returns how many were registered:
        the first ones; fewer than ``len(regions)`` when the kernel refused the next one (the call
        reports an error only when it refused the first: call again from there to get it). Raises
        ``ValueError`` for non-consecutive slots, ``OSError`` when the first region is refused."""
        if not regions:
            return 0
        first = regions[0].index
        if any(r.index != first + i for i, r in enumerate(regions)):
            raise ValueError(f"regions must take consecutive slots: {[r.index for r in regions]}")
        iovs = (IoVec * len(regions))(*[IoVec(r.address, r.length) for r in regions])
        arg = _RsrcUpdate2(first, 0, ctypes.addressof(iovs), 0, len(regions), 0)
        return io_uring_register(self._fd, IORING_REGISTER_BUFFERS_UPDATE,
                                 ctypes.cast(ctypes.pointer(arg), ctypes.c_void_p), ctypes.sizeof(arg))

    def register_files(self, count: int) -> None:
        """A table of ``count`` empty fixed-file slots (OPENAT with ``file_index`` fills one)."""
        fds = (ctypes.c_int32 * count)(*([-1] * count))
        io_uring_register(self._fd, IORING_REGISTER_FILES, ctypes.cast(fds, ctypes.c_void_p), count)

    # -- requests -------------------------------------------------------------------------------

    def _start(self, opcode: int, fd: int, addr: int, length: int, off: int, op_flags: int,
               buf_index: int, keep: object) -> asyncio.Future[int]:
        future: asyncio.Future[int] = self._loop.create_future()
        self._enqueue([sqe(opcode, fd, addr, length, off, op_flags, buf_index)], keep, future, None, True)
        return future

    def chain(self, ops: Sequence[Op], keep: object) -> asyncio.Future[list[int]]:
        """Submit ``ops`` as one linked chain (IOSQE_IO_LINK): each starts when the previous one
        succeeded; after a failure (or a short read/write) the rest complete with -ECANCELED.
        One future for the whole chain, resolved with every op's raw result (negative errno on
        failure) once all of them completed. ``keep`` stays referenced until then."""
        future: asyncio.Future[list[int]] = self._loop.create_future()
        fields = [sqe(op.opcode, op.fd, op.addr, op.length, op.off, op.op_flags, op.buf_index, op.file_index,
                      op.fixed_file) for op in ops]
        self.submit(fields, keep, None, future)
        return future

    def submit(self, ops: list[SqeFields], keep: object, callback: ChainDone | None,
               future: asyncio.Future[list[int]] | None = None, expect: list[int] | None = None,
               report: int = -1) -> None:
        """As :meth:`chain`, without a future per chain: ``callback(results)`` runs on the loop from
        the completion drain (all chains completed by one eventfd wake-up are handled in one
        callback). Build ``ops`` with :func:`sqe`. ``callback`` must not raise (a bug: logged).

        ``expect``: each op's result on success (bytes for a transfer, else 0). Where the kernel
        can (:attr:`skip_success`), only the last op, the transfers (:data:`LOUD_TRANSFERS`: but
        one right before the last or the reporting op) and failing ones post a CQE: a page's chain
        costs one to three completions instead of one per op. The results then hold ``expect`` for
        the ops that succeeded silently, the failure (a negative errno, or a short transfer) where
        one broke the chain, and ``-ECANCELED`` for the ops after it, as always.

        ``report``: the index of an op (not the last) whose result on success is not known in
        advance (an installed fd): it posts its CQE all the same, its ``expect`` is ignored, and
        its result is ``-ECANCELED`` when the chain broke before it. When it fails itself, the
        ops after it report ``-ECANCELED`` through CQEs of their own, which the chain waits for."""
        count = len(ops)
        if not 0 < count <= self.sq_entries:
            raise ValueError(f"a chain has 1 to {self.sq_entries} ops, got {count}")
        if self.fault_hook is None and not self._closed and not self._waiting \
                and self._ops_inflight + count <= self.sq_entries:
            # The common case, without _enqueue's call (once per page): room in the ring, no fault plan.
            self._prepare(_Request(ops, future, callback, keep, None, False, expect if self.skip_success else None,
                                   report))
            return
        self._enqueue(ops, keep, future, callback, False, expect if self.skip_success else None, report)

    def _enqueue(self, ops: list[SqeFields], keep: object, future: asyncio.Future[Any] | None,
                 callback: ChainDone | None, single: bool, expect: list[int] | None = None,
                 report: int = -1) -> None:
        if self._closed:
            raise RuntimeError("io_uring engine is closed")
        injected: list[int | None] | None = None
        fields = ops
        if self.fault_hook is not None:
            injected = []
            fields = []
            broken = False
            for op in ops:
                # Ops after an injected failure never run (ECANCELED), so they take no injection either.
                err = None if broken else self.fault_hook(op[0])
                injected.append(err)
                if err is not None:
                    broken = True
                    op = sqe(OP_READ)  # fd -1: fails with EBADF, breaking a chain like a real fault
                fields.append(op)
        request = _Request(fields, future, callback, keep, injected, single, expect, report)
        if self._ops_inflight + len(fields) <= self.sq_entries and not self._waiting:
            self._prepare(request)
        else:
            self._waiting += (request,)  # not append: no call (where a signal's exception comes) after it

    def _prepare(self, request: _Request) -> None:
        """Write ``request``'s SQEs into the ring (a chain's together: a submit never splits them).

        All or nothing under a signal's KeyboardInterrupt, which Python raises at calls: the
        submission is asked for first (an interrupt after it leaves a submission with nothing new),
        the SQEs are written past the tail, and the request is counted in a block without a call.
        So a :meth:`submit` that raises handed the ring nothing (its callback never runs) and one
        that returned will complete (before, an interrupt after the request was registered left it
        in flight for ever, and one at the scheduling's entry left the flag set with nothing
        scheduled: no submission ever again)."""
        ops = request.ops
        last = len(ops) - 1
        if not self._submit_scheduled and not self._waking:
            self._loop.call_soon(self._submit)
            self._submit_scheduled = True
        rid = self._next_id
        base = rid << self._index_bits
        linked = IOSQE_IO_LINK | IOSQE_CQE_SKIP_SUCCESS if request.skip else IOSQE_IO_LINK
        report = request.report
        injected = request.injected
        loud_transfers = LOUD_TRANSFERS
        sqes, mask, tail, async_data = self._sqes, self._sq_mask, self._tail, self.async_data
        for index, fields in enumerate(ops):
            flags = fields[1]
            data = fields[0] in DATA_OPS
            if index < last:
                # Every op but the last is linked to the next one, silently but for the reporting
                # op and the transfers (see LOUD_TRANSFERS), unless the op after the transfer posts
                # (the reporting op, the last: in the same task work) or it stands for an injected fault.
                loud = index == report or (loud_transfers and data and index + 1 != report and index + 1 != last
                                           and (injected is None or injected[index] is None))
                flags |= IOSQE_IO_LINK if loud else linked
            if async_data and data:
                flags |= IOSQE_ASYNC
            _SQE.pack_into(sqes, (tail & mask) * 64, fields[0], flags, fields[2], fields[3], fields[4], fields[5],
                           fields[6], fields[7], base + index, fields[9], fields[10], fields[11], fields[12],
                           fields[13])
            tail = (tail + 1) & 0xFFFFFFFF
        self._next_id = rid + 1
        self._inflight[rid] = request
        self._tail = tail
        self._ops_inflight += last + 1
        self._prepared += last + 1
        self._chains += (last + 1,)  # not append: no call after the count (list += tuple: none either)

    def call_next_turn(self, fn: Callable[[], None]) -> None:
        """``fn()`` early in the loop's next turn, from the submission callback (which runs then
        anyway when something was prepared this turn: no loop callback of its own); SQEs that
        ``fn`` prepares go out in that same submission. ``fn`` should not raise (a bug: logged).
        ``fn`` is a drain (safe to call again): a KeyboardInterrupt out of it runs it again.
        The submission is asked for before ``fn`` is added (with no call after: a signal's
        exception comes at calls), so neither is left without the other."""
        if not self._submit_scheduled:
            self._loop.call_soon(self._submit)
            self._submit_scheduled = True
        self._turn_calls += (fn,)

    def _submit(self) -> None:
        calls = self._turn_calls
        if calls:
            # Still marked scheduled while they run: what they prepare goes out below.
            self._turn_calls = []
            ran = 0
            try:
                for fn in calls:
                    ran += 1
                    try:
                        fn()
                    except Exception:
                        log.exception("io_uring turn callback failed")
            except BaseException as exc:
                # A signal's KeyboardInterrupt (or a bug's BaseException) out of one: the calls
                # after it and this submission run in the next turn, the loop's next run (before,
                # the flag stayed set with nothing queued: no submission and no turn call ran ever
                # again, and what was prepared waited for an unrelated wake-up, aclose with it).
                # The interrupted one too if it never started (see not_started).
                self._turn_calls[:0] = calls[ran - 1 if not_started(calls[ran - 1], exc) else ran :]
                self._loop.call_soon(self._submit)
                raise
        self._submit_scheduled = False
        if self._turn_calls:  # asked for again by the calls above: in the turn after this one
            self._loop.call_soon(self._submit)
            self._submit_scheduled = True  # asked for first: an interrupt in between leaves it unset
        if self._prepared:
            try:
                self._enter()
            except BaseException:
                self._submit_later()  # (a signal's KeyboardInterrupt, maybe at its entry)
                raise

    def _submit_later(self) -> None:
        """Prepared SQEs a submission left (a KeyboardInterrupt in :meth:`_enter`, or at its entry):
        submitted in the next turn, not when something else happens to be prepared."""
        if self._prepared and not self._submit_scheduled:
            self._loop.call_soon(self._submit)
            self._submit_scheduled = True

    def _enter(self) -> None:
        """Hand the kernel the next batch of prepared chains (one ``io_uring_enter``); the rest in
        a later turn.

        A KeyboardInterrupt (a signal, raised by Python at calls) loses nothing: what the kernel
        took is accounted once, in a block without a call (``_prepared`` and the chains left,
        replaced whole), from the call's answer or else from the SQ head, which only this call
        moves; its callers then ask for a submission of what is left. Before, an interrupt as a
        chain's count was popped lost it (as many SQEs never went out: their callers and aclose
        hung), and one before the call, or at this method's entry, left the prepared SQEs
        waiting for an unrelated submission."""
        try:
            self._rings.sq_tail.value = self._tail
            # Whole chains only (a split chain would lose its links), about SUBMIT_BATCH SQEs per call:
            # the kernel issues direct I/O inline, so one huge submit would stall the loop.
            chains = self._chains
            count = end = 0
            n = len(chains)
            while end < n and (count == 0 or count + chains[end] <= SUBMIT_BATCH):
                count += chains[end]
                end += 1
            t0 = time.perf_counter()  # not loop.time(): a Python method, twice per turn
            try:
                taken = io_uring_enter(self._fd, count)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EBUSY, errno.EINTR):
                    self._fail_prepared(exc)
                    return
                taken = 0
            if taken == count:  # the common case, accounted inline: no call until it is
                self._chains = chains[end:]
                self._prepared -= taken
            else:
                self._took(taken)  # the kernel was short of resources: the rest goes out later
        except BaseException:
            # (a signal's KeyboardInterrupt) maybe as io_uring_enter returned (it may block in the
            # kernel for ms): the SQ head says what the kernel took and we did not account yet
            # (0 when the interrupt came before the call, or after the accounting above). The
            # callers ask for a submission of the rest (:meth:`_submit_later`).
            taken = (self._rings.sq_head.value - (self._tail - self._prepared)) & 0xFFFFFFFF
            if taken:
                self._took(taken)
            raise
        self.submits += 1
        spent = time.perf_counter() - t0
        if spent > self.submit_max_s:
            self.submit_max_s = spent
        if self._prepared and not self._submit_scheduled:
            # Let other callbacks run, then submit the next batch.
            self._submit_scheduled = True
            self._loop.call_soon(self._submit)

    def _took(self, taken: int) -> None:
        """The kernel took ``taken`` more prepared SQEs (from the oldest chain on): ``_prepared``
        and the chains left follow, computed first and changed with no call after (a chain it took
        part of goes out whole later: its rest counted as one)."""
        chains = self._chains
        done = 0
        left = taken
        while done < len(chains) and chains[done] <= left:
            left -= chains[done]
            done += 1
        rest = chains[done:]
        if left and rest:
            rest[0] -= left
        self._chains = rest
        self._prepared -= taken

    def _fail_prepared(self, exc: OSError) -> None:
        # Rare (EBADF/EFAULT on a broken ring; EPERM where a seccomp filter came after the ring's
        # setup): fail the requests nobody took. Logged once: a ring refused for good fails every
        # submission, and the chaos soak's cache logged 1,506 lines in 4 s (review 284).
        self.enter_failures += 1
        if self.enter_failures == 1:
            log.error("io_uring_enter failed: %s (further failures of this ring are only counted)", exc)
        consumed = self._rings.sq_head.value
        pending = (self._tail - consumed) & 0xFFFFFFFF
        # The SQEs nobody took are still in the ring, with their user_data.
        untaken = [_SQE.unpack_from(self._sqes, ((consumed + i) & self._sq_mask) * 64) for i in range(pending)]
        # The ring forgets them before their callbacks run: what those prepare (a chain's follow-up,
        # the next page on a freed slot) lands after ``consumed`` and must survive this reset.
        self._tail = consumed
        self._prepared = 0
        self._chains = []
        failed = -(exc.errno or errno.EIO)
        # A chain refused whole completes op by op, as where every op posts its CQE: where successes
        # are silent, its first op's failure ended it with the rest -ECANCELED ("skipped"), also a
        # plain CLOSE run just below, which its owner then closed again: another file's descriptor
        # by then, maybe (review 289). (A chain the kernel took part of keeps the silent rule.)
        refused: dict[int, int] = {}
        for fields in untaken:
            rid = fields[8] >> self._index_bits
            refused[rid] = refused.get(rid, 0) + 1
        for rid, count in refused.items():
            request = self._inflight.get(rid)
            if request is not None and request.skip and request.pending == count:
                request.skip = False
        for fields in untaken:
            if fields[0] == OP_CLOSE and not fields[1] & IOSQE_FIXED_FILE and not fields[11]:
                # A plain descriptor's CLOSE: run here, as the kernel would have. Its owner counts on
                # it: a chain's CLOSE that answers anything but -ECANCELED ran (review 284: each
                # refused read leaked its file's descriptor, 8,492 in the chaos soak).
                self._complete(fields[8], _close_quietly(fields[3]))
            else:
                self._complete(fields[8], failed)
        # Their room is free: the requests waiting for it go in now (no completion may be left to
        # drain, the other place that prepares them).
        self._prepare_waiting()
        if self._idle is not None and not self._inflight and not self._waiting and not self._idle.done():
            self._idle.set_result(None)

    def _prepare_waiting(self) -> None:
        """Prepare the requests that waited for room in the ring, in order, while it has room. One
        leaves the queue only once prepared (no call between: an interrupt never loses one)."""
        waiting = self._waiting
        while waiting and self._ops_inflight + len(waiting[0].ops) <= self.sq_entries:
            self._prepare(waiting[0])
            del waiting[0]

    def _on_eventfd(self) -> None:
        """The wake-up: drain the completions, deliver what threads announced, run what those asked
        for at the wake-up's end (:meth:`LoopTurns.call_after_wake`), then submit what all of it
        prepared (the next pages' SQEs), all in this one turn. Before, those SQEs and the turn's
        inline hashes went out from a submission callback queued for the next turn: two turns of
        the loop per page, each an epoll call and ~20 calls of asyncio's own (#14)."""
        turns = TURNS
        turns.stamp += 1  # a new turn for the budgets keyed on wake-ups (IOSlots, Checksums)
        turns.waking = self._waking = True
        try:
            try:  # not contextlib.suppress: three calls more on every wake-up
                os.eventfd_read(self._efd)
            except BlockingIOError:
                pass
            self._drain()
            # Only after a thread's wake-up (a flag, not a call, on the completions' own wake-ups); one
            # that comes after this check wrote the eventfd again: the next wake-up runs the hook.
            if self._announced:
                self._run_hook()
            calls = turns.after_wake
            if calls:
                turns.after_wake = []
                # Within the drain's time only: a drain that used it up leaves them to the next turn
                # (a turn's work stays bounded by one drain and one round of these calls).
                turns.deadline = self._drain_deadline
                ran = 0
                try:
                    if time.perf_counter() > self._drain_deadline:
                        ran = len(calls)  # (before they are queued: an interrupt at len's return finds ran 0)
                        turns.after_wake[:0] = calls  # all of them in the next turn (below)
                    for fn in calls[ran:]:
                        ran += 1
                        try:
                            fn()
                        except Exception:
                            log.exception("io_uring wake-up call failed")
                except BaseException as exc:
                    # (a signal's KeyboardInterrupt): the calls after it in the next turn (below),
                    # not forgotten (a page's hash batch among them: its read never ended), and the
                    # interrupted one too if it never started (see not_started); all of them when
                    # the clock read before the first was interrupted (before, none of them).
                    first = ran - 1 if ran and not_started(calls[ran - 1], exc) else ran
                    turns.after_wake[:0] = calls[first:]
                    raise
        except BaseException:
            # (a signal's KeyboardInterrupt) anywhere above, the eventfd read before the drain ended
            # (its clock read, a callback): no wake-up comes for the CQEs already posted, so they
            # are drained in the next turn; before, their requests waited for an unrelated
            # completion (for ever when none was in flight: callers and aclose hung).
            self._drain_later()
            raise
        finally:
            turns.waking = self._waking = False
            turns.stamp += 1  # budgets opened in this wake-up end with it
            if turns.after_wake:  # asked for by the calls above (or left by a failure): the next turn
                # call_next_turn of each, inline: the submission asked for first, then the calls
                # moved over in one block without a call (an interrupt at a call per call lost the
                # calls after it: a page's hash batch, and every inline hash after it).
                if not self._submit_scheduled:
                    self._loop.call_soon(self._submit)
                    self._submit_scheduled = True
                self._turn_calls += turns.after_wake
                turns.after_wake = []
            if self._prepared:  # nothing queued a submission for them (even if a bug raised above)
                try:
                    self._enter()
                except BaseException:
                    self._submit_later()  # (a signal's KeyboardInterrupt, maybe at its entry)
                    raise

    def _drain(self) -> None:
        """Handle the CQEs posted, for at most ``DRAIN_TURN_S`` (the rest next turn).

        Each CQE is handled at least once and consumed once under a KeyboardInterrupt (a signal,
        raised by Python at calls): :meth:`_complete` consumes it in a block without a call right
        after its lookup (``_cqe_taken``), so an interrupt at its entry or lookup leaves the CQE
        to be read again next turn, and one later finds it consumed (before, an interrupt at
        ``_complete``'s entry, or at a call of its before the request was updated, lost the CQE:
        its page's job never ended)."""
        rings = self._rings  # (no view of it kept: see RingMaps)
        head = rings.cq_head.value
        tail = rings.cq_tail.value
        deadline = self._drain_deadline = time.perf_counter() + DRAIN_TURN_S
        self._cqe_taken = True
        try:
            while head != tail:
                user_data, res, _flags = _CQE.unpack_from(self._cq, self._cqes_off + (head & self._cq_mask) * 16)
                head = (head + 1) & 0xFFFFFFFF
                self._cqe_taken = False
                self._complete(user_data, res)
                if tail == head:
                    tail = rings.cq_tail.value
                elif time.perf_counter() > deadline:
                    # The eventfd will not fire again for CQEs already posted: drain them next turn.
                    if not self._drain_due:
                        self._drain_due = True
                        self._loop.call_soon(self._drain_again)
                    break
        except BaseException:
            # A callback let a BaseException through (``_complete`` guards Exception only), or a
            # signal's KeyboardInterrupt: what was consumed stays consumed (handled twice, a
            # chain's silent ops would count twice), a CQE not yet consumed is read again, and
            # the rest is drained next turn (no wake-up comes for CQEs already posted).
            if not self._cqe_taken:
                head = (head - 1) & 0xFFFFFFFF
            rings.cq_head.value = head
            if not self._drain_due:
                self._drain_due = True
                self._loop.call_soon(self._drain_again)
            raise
        rings.cq_head.value = head
        self._prepare_waiting()
        if self._idle is not None and not self._inflight and not self._waiting and not self._idle.done():
            self._idle.set_result(None)

    def _drain_later(self) -> None:
        """The CQEs posted now are drained in the next turn (no wake-up comes for them)."""
        if not self._drain_due:
            self._drain_due = True
            self._loop.call_soon(self._drain_again)

    def _run_hook(self) -> None:
        """The wake-up hook (:attr:`on_wake`: the threads' results), once per announcement, within
        what is left of the drain's time (at least one result). One a signal's KeyboardInterrupt
        stopped at its entry runs at the next drain (the threads write no other wake-up until their
        results are taken)."""
        hook = self.on_wake
        if hook is None:
            return
        self._announced = False
        try:
            hook(self._drain_deadline)
        except Exception:
            log.exception("io_uring wake-up hook failed")
        except BaseException as exc:
            if not_started(hook, exc):
                self._announced = True
            raise

    def _drain_again(self) -> None:
        self._drain_due = False
        if self._efd >= 0:  # not unmapped by aclose meanwhile (another drain took the rest)
            try:
                self._drain()
                # A wake-up cut short (an interrupt in a completion's callback) before its hook ran:
                # the threads announced results with that eventfd write and write no other until
                # they are taken (before, a checksum thread's results waited for ever).
                if self._announced:
                    self._run_hook()
            except BaseException:  # (an interrupt before the drain's own guard): next turn again
                self._drain_later()
                raise

    def _complete(self, user_data: int, res: int) -> None:
        """One CQE: its request updated, and once all of a chain's ops are in, its callback run (or
        its future resolved). The CQE is consumed (``_cqe_taken``) right after the lookup, and all
        up to the callback runs without a call (a signal's KeyboardInterrupt comes at calls): an
        interrupt comes before the CQE counts (``_drain`` reads it again) or at the callback."""
        rid = user_data >> self._index_bits
        request = self._inflight.get(rid)
        self._cqe_taken = True
        if request is None:
            return  # a CQE of a chain already completed (its silent ops were counted done)
        index = user_data & self._index_mask
        self._ops_inflight -= 1
        request.pending -= 1
        if request.injected is not None:
            injected = request.injected[index]
            if injected is not None:
                res = injected
        if request.skip:
            last = request.last
            results = request.results
            if index == last:
                results[index] = res  # the last op: it always reports, and ends the chain
            elif index == request.report:
                results[index] = res
                if res >= 0:
                    return  # its success reported: the chain goes on
                # It failed and posted its CQE: so do the ops cancelled after it (no silent links),
                # while the ops before it succeeded, silently but for the transfers, whose CQEs came
                # first (LOUD_TRANSFERS): the ones still counted pending will post nothing.
                request.skip = False
                silent = request.pending - (request.last - index)
                request.pending -= silent
                self._ops_inflight -= silent
                if request.pending:
                    return
            else:
                # Whether a chain whose successful ops post no CQE is complete. The last op always
                # reports unless an earlier one failed: a failing op (a negative errno, or a short
                # transfer) posts its CQE and the kernel then cancels the rest of the chain silently
                # (``REQ_F_SKIP_LINK_CQES``), so their results are ``-ECANCELED`` without a CQE. The
                # chain leaves the in-flight table then: a late CQE of one of its ops is ignored.
                if res == results[index]:
                    return  # a success reported after all: the chain goes on
                results[index] = res
                results[index + 1 :] = [-errno.ECANCELED] * (last - index)
            # The ops that stay silent will post nothing: their SQ/CQ room is free.
            self._ops_inflight -= request.pending
            request.pending = 0
        else:
            request.results[index] = res
            if request.pending:
                return
        del self._inflight[rid]
        callback = request.callback
        if callback is not None:
            try:
                callback(request.results)
            except Exception:
                log.exception("io_uring completion callback failed")
            except BaseException as exc:
                # A signal's KeyboardInterrupt at the callback's entry: it never ran (its CQE is
                # consumed), so it runs in the next turn; one that ran part of its body hands on
                # what it did not do itself (before, its request was forgotten: a page's job hung).
                # Callbacks are functions Python inlines (no functools.partial: see not_started).
                if not_started(callback, exc):
                    self._loop.call_soon(callback, request.results)
                raise
            return
        future = request.future
        if future is None or future.done():
            return  # a cancelled caller's result is discarded
        if not request.single:
            future.set_result(request.results)
        elif (res := request.results[0]) < 0:
            future.set_exception(OSError(-res, os.strerror(-res)))
        else:
            future.set_result(res)

    def read(self, fd: int, address: int, length: int, offset: int, keep: object,
             region: Region | None = None) -> asyncio.Future[int]:
        """Read ``length`` bytes at ``offset`` into memory at ``address`` (inside ``region`` when fixed)."""
        if region is None:
            return self._start(OP_READ, fd, address, length, offset, 0, 0, keep)
        return self._start(OP_READ_FIXED, fd, address, length, offset, 0, region.index, keep)

    def write(self, fd: int, address: int, length: int, offset: int, keep: object,
              region: Region | None = None) -> asyncio.Future[int]:
        """Write ``length`` bytes from ``address`` at ``offset``; bytes written is the result."""
        if region is None:
            return self._start(OP_WRITE, fd, address, length, offset, 0, 0, keep)
        return self._start(OP_WRITE_FIXED, fd, address, length, offset, 0, region.index, keep)

    def openat(self, path: bytes, flags: int, mode: int, dir_fd: int = AT_FDCWD) -> asyncio.Future[int]:
        """``openat(dir_fd, path, flags | O_CLOEXEC, mode)``; the result is the new fd."""
        buf = ctypes.create_string_buffer(path)
        return self._start(OP_OPENAT, dir_fd, ctypes.addressof(buf), mode, 0, flags | os.O_CLOEXEC, 0, buf)

    def close_fd(self, fd: int) -> asyncio.Future[int]:
        """``close(fd)`` through the ring."""
        return self._start(OP_CLOSE, fd, 0, 0, 0, 0, 0, None)

    def fsync(self, fd: int, datasync: bool = True) -> asyncio.Future[int]:
        """``fdatasync``/``fsync`` through the ring."""
        return self._start(OP_FSYNC, fd, 0, 0, 0, IORING_FSYNC_DATASYNC if datasync else 0, 0, None)

    def renameat(self, old: bytes, new: bytes, dir_fd: int = AT_FDCWD) -> asyncio.Future[int]:
        """``renameat(dir_fd, old, dir_fd, new)``: atomic within one file system."""
        a, b = ctypes.create_string_buffer(old), ctypes.create_string_buffer(new)
        # The new dir fd travels in ``len`` and the new path in ``off`` (addr2).
        return self._start(OP_RENAMEAT, dir_fd, ctypes.addressof(a), dir_fd & 0xFFFFFFFF,
                           ctypes.addressof(b), 0, 0, (a, b))

    def unlinkat(self, path: bytes, dir_fd: int = AT_FDCWD) -> asyncio.Future[int]:
        """``unlinkat(dir_fd, path, 0)``."""
        buf = ctypes.create_string_buffer(path)
        return self._start(OP_UNLINKAT, dir_fd, ctypes.addressof(buf), 0, 0, 0, 0, buf)

    def nop(self) -> asyncio.Future[int]:
        """A no-op round trip through the ring (probe)."""
        return self._start(OP_NOP, -1, 0, 0, 0, 0, 0, None)

    @property
    def in_flight(self) -> int:
        """Requests submitted or waiting for a slot."""
        return self._ops_inflight + len(self._waiting)

    async def aclose(self) -> None:
        """Wait for every completion (the kernel must be done with our memory), then close.
        Idempotent, and a call that an exception ended part-way (a signal's KeyboardInterrupt) is
        finished by the next one: it waits and closes what is left (before, the next returned at
        once, with requests in flight and the ring and eventfd open). Concurrent calls all wait."""
        self._closed = True
        cancelled = False
        if self._inflight or self._waiting:
            idle = self._idle
            if idle is None or idle.done():
                idle = self._idle = self._loop.create_future()
            while not idle.done():
                try:
                    await asyncio.shield(idle)
                except asyncio.CancelledError:
                    # Unmapping with I/O in flight would let the kernel write into freed memory.
                    cancelled = True
        if self._efd >= 0:
            with self._wake_lock:  # threads wake the loop their own way from now on
                self._wakeable = False
            self._loop.remove_reader(self._efd)
            hook = self.on_wake
            if hook is not None:  # announced through the eventfd before it stopped being watched
                try:
                    hook(time.perf_counter() + DRAIN_TURN_S)
                except Exception:
                    log.exception("io_uring wake-up hook failed")
        self._unmap()
        if cancelled:
            raise asyncio.CancelledError
