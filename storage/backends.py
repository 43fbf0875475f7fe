"""Byte movers: whole page files between pool memory and disk, through io_uring or threads.

Each backend offers the same coroutines — take over a recycled file, publish a page file (temp
write + rename), read a page file, unlink — and raises ``OSError`` for faults. Bookkeeping lives in :mod:`.disk`.
:func:`open_backend` picks one, falling back (one warning each) from registered buffers to plain
buffers when registration fails, and from io_uring to threads when the kernel refuses io_uring.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import ctypes
import enum
import errno
import logging
import mmap
import os
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.shm import lower_thread_priority, populate

from . import uring
from .config import DiskBackend, DiskConfig
from .pagefile import HEADER_BYTES
from .safefiles import (
    OPEN_FLAGS,
    UnsafeFileError,
    check_page_fd,
    classify_open_error,
    open_page_file,
    ready_for_io,
)

log = logging.getLogger(__name__)

CHAIN_MAX = 6
"""SQEs one page may hold at once: its chain (header, page, fsync, close, rename) or its open, plus
one unlink or rename of an evicted file."""


class IOOp(enum.Enum):
    """Operations a fault can be injected into."""

    OPEN = "open"
    READ = "read"
    WRITE = "write"
    FSYNC = "fsync"
    RENAME = "rename"
    UNLINK = "unlink"


_OPCODES = {
    uring.OP_OPENAT: IOOp.OPEN, uring.OP_READ: IOOp.READ, uring.OP_READ_FIXED: IOOp.READ,
    uring.OP_WRITE: IOOp.WRITE, uring.OP_WRITE_FIXED: IOOp.WRITE, uring.OP_FSYNC: IOOp.FSYNC,
    uring.OP_RENAMEAT: IOOp.RENAME, uring.OP_UNLINKAT: IOOp.UNLINK,
}


class FaultPlan:
    """Errors to inject into the next operations of a kind (tests). On io_uring the request still
    travels through the ring (as a NOP) and fails at completion; threads raise before the syscall."""

    def __init__(self) -> None:
        self._plan: Counter[IOOp] = Counter()
        self._errno: dict[IOOp, int] = {}

    def inject(self, op: IOOp, err: int, times: int = 1) -> None:
        """Make the next ``times`` operations ``op`` fail with ``err``."""
        self._plan[op] += times
        self._errno[op] = err

    def take(self, op: IOOp) -> int | None:
        """The errno to fail this ``op`` with, or None."""
        if self._plan[op] <= 0:
            return None
        self._plan[op] -= 1
        return self._errno[op]

    def uring_hook(self, opcode: int) -> int | None:
        op = _OPCODES.get(opcode)
        err = None if op is None else self.take(op)
        return None if err is None else -err


class HeaderSlots:
    """Page-aligned 4096-byte buffers for headers (O_DIRECT needs aligned memory), one per I/O slot."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._map = mmap.mmap(-1, count * HEADER_BYTES)
        self.buffer = memoryview(self._map)
        probe = ctypes.c_char.from_buffer(self._map)
        self.address = ctypes.addressof(probe)
        del probe
        self.views = [self.buffer[i * HEADER_BYTES : (i + 1) * HEADER_BYTES] for i in range(count)]

    def close(self) -> None:
        for view in self.views:
            view.release()
        self.views = []
        self.buffer.release()
        self._map.close()


class PageIO(Protocol):
    """What :class:`~aiokv.storage.DiskTier` needs from a backend.

    Names are relative to the layout directory's descriptor (``dir_fd``). Every open goes through
    :mod:`.safefiles`: ``O_NOFOLLOW|O_NONBLOCK``, then a regular file of ours, or
    :class:`~aiokv.storage.safefiles.UnsafeFileError`. Callers are the tier's own job tasks, which
    are never cancelled (a cancelled caller of the tier is shielded from them)."""

    kind: DiskBackend
    direct: bool
    faults: FaultPlan

    async def take_over(self, victim: str, temp: str) -> int:
        """Open the page file ``victim`` for overwriting (our regular file, one link), then rename it
        to ``temp``: a recycled file is checked before the rename moves it. Returns the open fd."""
        ...

    async def publish(self, temp: str, final: str, slot: int, page: int, sync: bool, fd: int | None) -> None:
        """Write header slot ``slot`` and pool page ``page`` into ``temp``, then rename it to ``final``.

        ``fd``: ``temp`` opened by :meth:`take_over` (closed here); None: create ``temp`` exclusively.
        On failure ``temp`` is removed. A short write is ENOSPC (the file system is full)."""
        ...

    async def load(self, name: str, slot: int, page: int) -> int:
        """Read ``name`` into header slot ``slot`` and pool page ``page``; returns bytes read."""
        ...

    async def unlink(self, name: str) -> None: ...

    async def aclose(self) -> None: ...


def _chain_error(results: list[int], expect: list[int]) -> OSError:
    """The first failure of a write chain (later ops report ECANCELED)."""
    for res, want in zip(results, expect, strict=True):
        if res < 0 and res != -errno.ECANCELED:
            return OSError(-res, os.strerror(-res))
        if res != want:
            return _short_write(res, want) if res >= 0 else OSError(-res, os.strerror(-res))
    return OSError(errno.EIO, f"write chain failed: {results}")


def _planted_temp(temp: str) -> UnsafeFileError:
    # Temporary names are fresh and random: whatever already holds one was put there (left alone:
    # O_CREAT|O_EXCL never follows or opens it; the next start removes it).
    return UnsafeFileError(errno.EEXIST, f"{temp} exists already: something was planted under a temporary name")


def _short_write(got: int, want: int) -> OSError:
    # A regular file takes fewer bytes than asked only when the file system (or quota) is full.
    return OSError(errno.ENOSPC, f"short write ({got} of {want} bytes): file system full")


class UringPageIO:
    """Page files through one io_uring; pool pages as fixed buffers when ``regions`` are given
    (from :func:`register_pool`: pool regions, then the header-slot region).

    A page costs two submissions: an OPENAT (into a normal fd, so that it can be checked with
    ``fstat`` before any byte moves), then one linked chain — WRITE header, WRITE page, [FSYNC],
    CLOSE, RENAMEAT for a write; READ, READ, CLOSE for a read."""

    def __init__(self, engine: uring.UringEngine, pool: PagePool, slots: HeaderSlots, direct: bool,
                 regions: list[list[uring.Region]] | None, dir_fd: int) -> None:
        self.engine = engine
        self.kind = DiskBackend.URING_FIXED if regions is not None else DiskBackend.URING
        self.direct = direct
        self.faults = FaultPlan()
        engine.fault_hook = self.faults.uring_hook
        self._pool = pool
        self._slots = slots
        self._dir = dir_fd
        self._page_bytes = pool.layout.page_bytes
        self._base = pool.memory.segment.address
        self._pool_regions: list[uring.Region] = regions[0] if regions is not None else []
        self._slot_region: uring.Region | None = regions[1][0] if regions is not None else None
        self._starts = [r.address for r in self._pool_regions]
        self._registering: asyncio.Task[None] | None = None

    def register_in_background(self) -> None:
        """Register the pool as fixed buffers in a thread, region by region; each region's pages use
        fixed-buffer I/O as soon as it is registered, the rest plain I/O until then."""
        self._registering = asyncio.ensure_future(self._register())

    async def _register(self) -> None:
        pb = self._pool.layout.page_bytes
        spans = [(self._base, self._pool.num_pages * pb, pb), (self._slots.address, self._slots.count * HEADER_BYTES,
                                                              HEADER_BYTES)]
        # The kernel's table holds at most 16384 buffers: larger regions for a pool beyond 512 GiB.
        region_bytes = max(REGISTER_REGION_BYTES, -(-self._pool.num_pages * pb // MAX_REGISTER_REGIONS))
        plan = self.engine.plan_regions(spans, region_bytes)
        loop = asyncio.get_running_loop()
        stop = threading.Event()

        def adopt(region: uring.Region, slot: bool) -> None:
            if slot:
                self._slot_region = region
            else:
                self._pool_regions.append(region)
                self._starts.append(region.address)

        def register() -> None:
            # Header slots first (tiny), then the pool in address order: each update holds the
            # ring's lock only while it pins one region, already faulted in.
            self.engine.register_sparse_buffers(sum(len(r) for r in plan))
            for region, slot in [(r, True) for r in plan[1]] + [(r, False) for r in plan[0]]:
                if stop.is_set():
                    return
                populate(region.address, region.length)
                self.engine.update_buffer(region)
                loop.call_soon_threadsafe(adopt, region, slot)

        # A thread of its own at lower priority: faulting in is kernel CPU work that would otherwise
        # take turns with the loop's thread on a small machine.
        executor = ThreadPoolExecutor(1, thread_name_prefix="aiokv-register", initializer=lower_thread_priority)
        job = loop.run_in_executor(executor, register)
        executor.shutdown(wait=False)
        try:
            await asyncio.shield(job)
        except asyncio.CancelledError:
            stop.set()
            await asyncio.wait({job})  # the ring must outlive the syscall using it
            raise
        except OSError as exc:
            log.warning("disk tier: cannot register the pool as fixed buffers (%s; memlock, or a kernel "
                        "before 5.19); pages registered so far stay fixed, the rest use plain buffers", exc)
            return
        self.kind = DiskBackend.URING_FIXED

    async def wait_registered(self) -> None:
        """Wait until the background registration (if any) is over, successful or not."""
        if self._registering is not None:
            await asyncio.wait({self._registering})

    def _page_region(self, address: int) -> uring.Region | None:
        # Regions are adopted in address order: a page past the last one is not registered yet.
        at = bisect.bisect_right(self._starts, address) - 1
        if at < 0:
            return None
        region = self._pool_regions[at]
        return region if address < region.address + region.length else None

    def _io_op(self, write: bool, fd: int, address: int, length: int, offset: int,
               region: uring.Region | None) -> uring.Op:
        if region is None:
            return uring.Op(uring.OP_WRITE if write else uring.OP_READ, fd, address, length, offset)
        return uring.Op(uring.OP_WRITE_FIXED if write else uring.OP_READ_FIXED, fd, address, length, offset,
                        buf_index=region.index)

    def _transfer(self, write: bool, fd: int, slot: int, page: int) -> list[uring.Op]:
        address = self._base + page * self._page_bytes
        return [
            self._io_op(write, fd, self._slots.address + slot * HEADER_BYTES, HEADER_BYTES, 0, self._slot_region),
            self._io_op(write, fd, address, self._page_bytes, HEADER_BYTES, self._page_region(address)),
        ]

    async def _open(self, name: str, flags: int, mode: int, write: bool) -> int:
        # O_NONBLOCK: opening a FIFO must not park an io_uring worker (nor aclose) forever.
        try:
            fd = await self.engine.openat(name.encode(), flags | OPEN_FLAGS, mode, dir_fd=self._dir)
        except OSError as exc:
            raise classify_open_error(exc, name) from None
        try:
            check_page_fd(fd, name, write)
            ready_for_io(fd, self.direct)
        except BaseException:
            os.close(fd)  # nothing was read or written through it
            raise
        return fd

    async def _close_quiet(self, fd: int) -> None:
        # A broken chain skipped its CLOSE.
        with contextlib.suppress(OSError):
            await self.engine.close_fd(fd)

    async def _unlink_quiet(self, name: str) -> None:
        with contextlib.suppress(OSError):
            await self.engine.unlinkat(name.encode(), dir_fd=self._dir)

    async def take_over(self, victim: str, temp: str) -> int:
        fd = await self._open(victim, os.O_WRONLY, 0, write=True)
        try:
            await self.engine.renameat(victim.encode(), temp.encode(), dir_fd=self._dir)
        except BaseException:
            os.close(fd)
            raise
        return fd

    async def publish(self, temp: str, final: str, slot: int, page: int, sync: bool, fd: int | None) -> None:
        if fd is None:
            try:
                fd = await self._open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, write=True)
            except OSError as exc:
                if exc.errno == errno.EEXIST:
                    raise _planted_temp(temp) from None
                await self._unlink_quiet(temp)  # it may exist now (an O_DIRECT refusal after creating)
                raise
        tmp, fin = ctypes.create_string_buffer(temp.encode()), ctypes.create_string_buffer(final.encode())
        ops = self._transfer(True, fd, slot, page)
        if sync:
            ops.append(uring.Op(uring.OP_FSYNC, fd, op_flags=uring.IORING_FSYNC_DATASYNC))
        ops.append(uring.Op(uring.OP_CLOSE, fd))
        ops.append(uring.Op(uring.OP_RENAMEAT, self._dir, ctypes.addressof(tmp), self._dir & 0xFFFFFFFF,
                            ctypes.addressof(fin)))
        results = await self.engine.chain(ops, (tmp, fin, self._slots, self._pool))
        expect = [HEADER_BYTES, self._page_bytes] + [0] * (len(ops) - 2)
        if results == expect:
            return
        if results[-2] == -errno.ECANCELED:
            await self._close_quiet(fd)
        await self._unlink_quiet(temp)
        raise _chain_error(results, expect)

    async def load(self, name: str, slot: int, page: int) -> int:
        fd = await self._open(name, os.O_RDONLY, 0, write=False)
        ops = [*self._transfer(False, fd, slot, page), uring.Op(uring.OP_CLOSE, fd)]
        results = await self.engine.chain(ops, (self._slots, self._pool))
        if results[2] == -errno.ECANCELED:
            await self._close_quiet(fd)
        got = 0
        for res in results[:2]:
            if res == -errno.ECANCELED:
                break  # a short read broke the chain: the file is truncated
            if res < 0:
                raise OSError(-res, os.strerror(-res))
            got += res
        return got

    async def unlink(self, name: str) -> None:
        await self.engine.unlinkat(name.encode(), dir_fd=self._dir)

    async def aclose(self) -> None:
        if self._registering is not None:
            # The ring must outlive the registration syscall (register_pool waits for it).
            self._registering.cancel()
            await asyncio.gather(self._registering, return_exceptions=True)
        await self.engine.aclose()


class ThreadPageIO:
    """Page files through ``os.pwritev``/``os.preadv`` in a thread pool (io_uring refused)."""

    kind = DiskBackend.THREADS

    def __init__(self, pool: PagePool, slots: HeaderSlots, direct: bool, threads: int, dir_fd: int) -> None:
        self.direct = direct
        self.faults = FaultPlan()
        self._pool = pool
        self._slots = slots
        self._dir = dir_fd
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="aiokv-disk")
        self._jobs: set[asyncio.Future[object]] = set()

    def _fault(self, op: IOOp) -> None:
        err = self.faults.take(op)
        if err is not None:
            raise OSError(err, os.strerror(err))

    async def _run(self, fn: object, *args: object) -> object:
        loop = asyncio.get_running_loop()
        job: asyncio.Future[object] = loop.run_in_executor(self._executor, fn, *args)  # type: ignore[arg-type]
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)
        # A cancelled caller must not return while the thread still touches the page: wait it out.
        return await asyncio.shield(job)

    def _open(self, name: str, flags: int, write: bool) -> int:
        self._fault(IOOp.OPEN)
        return open_page_file(name, flags, self._dir, write, self.direct)

    def _take_over(self, victim: str, temp: str) -> int:
        fd = self._open(victim, os.O_WRONLY, write=True)
        try:
            self._fault(IOOp.RENAME)
            os.rename(victim, temp, src_dir_fd=self._dir, dst_dir_fd=self._dir)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _publish(self, temp: str, final: str, slot: int, page: int, sync: bool, fd: int | None) -> None:
        if fd is None:
            try:
                fd = self._open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, write=True)
            except OSError as exc:
                if exc.errno == errno.EEXIST:
                    raise _planted_temp(temp) from None
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=self._dir)
                raise
        try:
            self._fault(IOOp.WRITE)
            views = [self._slots.views[slot], self._pool.memory.page_view(page)]
            want = HEADER_BYTES + len(views[1])
            got = os.pwritev(fd, views, 0)
            if got != want:
                raise _short_write(got, want)
            if sync:
                self._fault(IOOp.FSYNC)
                os.fdatasync(fd)
            os.close(fd)
            fd = -1
            self._fault(IOOp.RENAME)
            os.rename(temp, final, src_dir_fd=self._dir, dst_dir_fd=self._dir)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=self._dir)
            raise

    def _load(self, name: str, slot: int, page: int) -> int:
        fd = self._open(name, os.O_RDONLY, write=False)
        try:
            self._fault(IOOp.READ)
            return os.preadv(fd, [self._slots.views[slot], self._pool.memory.page_view(page)], 0)
        finally:
            os.close(fd)

    def _unlink(self, name: str) -> None:
        self._fault(IOOp.UNLINK)
        os.unlink(name, dir_fd=self._dir)

    async def take_over(self, victim: str, temp: str) -> int:
        result = await self._run(self._take_over, victim, temp)
        assert isinstance(result, int)
        return result

    async def publish(self, temp: str, final: str, slot: int, page: int, sync: bool, fd: int | None) -> None:
        await self._run(self._publish, temp, final, slot, page, sync, fd)

    async def load(self, name: str, slot: int, page: int) -> int:
        result = await self._run(self._load, name, slot, page)
        assert isinstance(result, int)
        return result

    async def unlink(self, name: str) -> None:
        await self._run(self._unlink, name)

    async def aclose(self) -> None:
        while self._jobs:
            await asyncio.wait(set(self._jobs))
        self._executor.shutdown(wait=False)


async def open_backend(config: DiskConfig, pool: PagePool, slots: HeaderSlots, direct: bool,
                       dir_fd: int) -> PageIO:
    """The backend ``config`` asks for, working in the directory ``dir_fd``; AUTO falls back step
    by step with one warning each."""
    want = config.backend
    if want is DiskBackend.THREADS:
        return ThreadPageIO(pool, slots, direct, config.threads, dir_fd)
    try:
        # Room for every I/O slot's SQEs at once.
        engine = uring.UringEngine.open(max(config.ring_entries, CHAIN_MAX * config.queue_depth))
    except OSError as exc:
        if want is not DiskBackend.AUTO:
            raise
        log.warning("disk tier: io_uring refused (%s); using the thread-pool backend", exc)
        return ThreadPageIO(pool, slots, direct, config.threads, dir_fd)
    try:
        if want is DiskBackend.URING_FIXED:
            # Forced: registration must work (or the tier does not start), so wait for it.
            return UringPageIO(engine, pool, slots, direct, await register_pool(engine, pool, slots), dir_fd)
        io = UringPageIO(engine, pool, slots, direct, None, dir_fd)
        if want is DiskBackend.AUTO:
            # Registering pins (faults in) the whole pool: ~1 s/GiB of untouched memory, a minute
            # for a large pool. Serve with unregistered buffers meanwhile; switch when it is done.
            io.register_in_background()
        return io
    except BaseException:
        await engine.aclose()
        raise


async def register_pool(engine: uring.UringEngine, pool: PagePool, slots: HeaderSlots) -> list[list[uring.Region]]:
    """Register pool memory and header slots as fixed buffers, in a thread: pinning faults in every
    page of the pool (~1 s/GiB for memory never touched), which must not stall the loop."""
    pb = pool.layout.page_bytes
    spans = [(pool.memory.segment.address, pool.num_pages * pb, pb),
             (slots.address, slots.count * HEADER_BYTES, HEADER_BYTES)]
    job = asyncio.get_running_loop().run_in_executor(None, _populate_then_register, engine, spans)
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        await asyncio.wait({job})  # the ring must outlive the syscall using it
        raise


REGISTER_REGION_BYTES = 64 << 20
"""Pool memory registered per io_uring update in the background. The ring's lock and the process's
mmap lock are held while the kernel pins it (~20 ms/GiB once faulted in): 256 MiB stalled the loop's
submissions and allocations ~5 ms per region, 64 MiB ~1 ms."""

MAX_REGISTER_REGIONS = 8192
"""Regions the background registration plans at most (the kernel's table takes 16384)."""


def _populate_then_register(engine: uring.UringEngine, spans: list[tuple[int, int, int]]) -> list[list[uring.Region]]:
    """Fault the spans in first (MADV_POPULATE_WRITE), then register them.

    The kernel holds the ring's lock for the whole registration, and the loop's submissions wait
    on it: pinning memory never touched costs ~1 s/GiB, pinning touched memory ~20 ms/GiB. So the
    slow part (first touch) happens here, outside the lock, 256 MiB at a time."""
    step = 256 << 20
    for address, length, _unit in spans:
        for offset in range(0, length, step):
            populate(address + offset, min(step, length - offset))
    return engine.register_buffers(spans)


def describe_layout_io(layout: KVLayout, io: PageIO) -> str:
    """One log line: backend, O_DIRECT and page geometry."""
    return f"disk tier: {io.kind.value}, {'O_DIRECT' if io.direct else 'buffered'}, {layout.describe()}"
