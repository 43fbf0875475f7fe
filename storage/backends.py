"""Byte movers: whole page files between pool memory and disk, through io_uring or threads.

Each backend offers the same three coroutines — publish a page file (temp write + rename), read a
page file, unlink — and raises ``OSError`` for faults. Bookkeeping lives in :mod:`.disk`.
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
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from aiokv.layout import KVLayout
from aiokv.pool import PagePool

from . import uring
from .config import DiskBackend, DiskConfig
from .pagefile import HEADER_BYTES

log = logging.getLogger(__name__)


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
    """What :class:`~aiokv.storage.DiskTier` needs from a backend."""

    kind: DiskBackend
    direct: bool
    faults: FaultPlan

    async def publish(self, temp: str, final: str, slot: int, page: int, sync: bool, create: bool) -> None:
        """Write header slot ``slot`` and pool page ``page`` to ``temp``, then rename to ``final``.

        ``create``: make ``temp`` (exclusively); else ``temp`` is a recycled page file to overwrite.
        On failure ``temp`` is removed."""
        ...

    async def rename(self, source: str, target: str) -> None: ...

    async def load(self, path: str, slot: int, page: int) -> int:
        """Read ``path`` into header slot ``slot`` and pool page ``page``; returns bytes read."""
        ...

    async def unlink(self, path: str) -> None: ...

    async def aclose(self) -> None: ...


def _ignore_result(future: asyncio.Future[int]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: a failed close of a read-only fd changes nothing


def _short(what: str, got: int, want: int) -> OSError:
    return OSError(errno.EIO, f"short {what}: {got} of {want} bytes")


class UringPageIO:
    """Page files through one io_uring; pool pages as fixed buffers when ``fixed``."""

    def __init__(self, engine: uring.UringEngine, pool: PagePool, slots: HeaderSlots, direct: bool,
                 fixed: bool) -> None:
        self.engine = engine
        self.kind = DiskBackend.URING_FIXED if fixed else DiskBackend.URING
        self.direct = direct
        self.faults = FaultPlan()
        engine.fault_hook = self.faults.uring_hook
        self._pool = pool
        self._slots = slots
        self._page_bytes = pool.layout.page_bytes
        self._base = pool.memory.segment.address
        self._pool_regions: list[uring.Region] = []
        self._slot_region: uring.Region | None = None
        if fixed:
            size = pool.num_pages * self._page_bytes
            regions = engine.register_buffers(
                [(self._base, size, self._page_bytes),
                 (slots.address, slots.count * HEADER_BYTES, HEADER_BYTES)]
            )
            self._pool_regions = regions[0]
            self._slot_region = regions[1][0]
        self._starts = [r.address for r in self._pool_regions]
        self._flags = os.O_DIRECT if direct else 0

    def _page_region(self, address: int) -> uring.Region | None:
        if not self._pool_regions:
            return None
        return self._pool_regions[bisect.bisect_right(self._starts, address) - 1]

    async def _settle(self, *futures: asyncio.Future[int]) -> list[int]:
        # Wait for every request: the kernel may still touch the buffers of one whose twin failed.
        results = await asyncio.gather(*futures, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return [r for r in results if isinstance(r, int)]

    async def publish(self, temp: str, final: str, slot: int, page: int, sync: bool, create: bool) -> None:
        e = self.engine
        mode = os.O_WRONLY | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = await e.openat(temp.encode(), mode | self._flags, 0o600)
        try:
            address = self._base + page * self._page_bytes
            head = e.write(fd, self._slots.address + slot * HEADER_BYTES, HEADER_BYTES, 0, self._slots,
                           self._slot_region)
            body = e.write(fd, address, self._page_bytes, HEADER_BYTES, self._pool,
                           self._page_region(address))
            wrote = await self._settle(head, body)
            if wrote != [HEADER_BYTES, self._page_bytes]:
                raise _short("write", sum(wrote), HEADER_BYTES + self._page_bytes)
            if sync:
                await e.fsync(fd)
        except BaseException:
            await self._settle(e.close_fd(fd))
            await self._unlink_quiet(temp)
            raise
        try:
            # Close and rename in one submission: renaming an open file is fine, and it saves a round trip.
            await self._settle(e.close_fd(fd), e.renameat(temp.encode(), final.encode()))
        except BaseException:
            await self._unlink_quiet(temp)
            raise

    async def rename(self, source: str, target: str) -> None:
        await self.engine.renameat(source.encode(), target.encode())

    async def _unlink_quiet(self, path: str) -> None:
        with contextlib.suppress(OSError):
            await self.engine.unlinkat(path.encode())

    async def load(self, path: str, slot: int, page: int) -> int:
        e = self.engine
        fd = await e.openat(path.encode(), os.O_RDONLY | self._flags, 0)
        try:
            address = self._base + page * self._page_bytes
            head = e.read(fd, self._slots.address + slot * HEADER_BYTES, HEADER_BYTES, 0, self._slots,
                          self._slot_region)
            body = e.read(fd, address, self._page_bytes, HEADER_BYTES, self._pool, self._page_region(address))
            return sum(await self._settle(head, body))
        finally:
            # Nobody needs to wait for the close (the engine tracks it until its completion).
            e.close_fd(fd).add_done_callback(_ignore_result)

    async def unlink(self, path: str) -> None:
        await self.engine.unlinkat(path.encode())

    async def aclose(self) -> None:
        await self.engine.aclose()


class ThreadPageIO:
    """Page files through ``os.pwritev``/``os.preadv`` in a thread pool (io_uring refused)."""

    kind = DiskBackend.THREADS

    def __init__(self, pool: PagePool, slots: HeaderSlots, direct: bool, threads: int) -> None:
        self.direct = direct
        self.faults = FaultPlan()
        self._pool = pool
        self._slots = slots
        self._flags = os.O_DIRECT if direct else 0
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

    def _publish(self, temp: str, final: str, slot: int, page: int, sync: bool, create: bool) -> None:
        self._fault(IOOp.OPEN)
        mode = os.O_WRONLY | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(temp, mode | self._flags, 0o600)
        try:
            self._fault(IOOp.WRITE)
            views = [self._slots.views[slot], self._pool.memory.page_view(page)]
            want = HEADER_BYTES + len(views[1])
            got = os.pwritev(fd, views, 0)
            if got != want:
                raise _short("write", got, want)
            if sync:
                self._fault(IOOp.FSYNC)
                os.fdatasync(fd)
            os.close(fd)
            fd = -1
            self._fault(IOOp.RENAME)
            os.rename(temp, final)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise

    def _load(self, path: str, slot: int, page: int) -> int:
        self._fault(IOOp.OPEN)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | self._flags)
        try:
            self._fault(IOOp.READ)
            return os.preadv(fd, [self._slots.views[slot], self._pool.memory.page_view(page)], 0)
        finally:
            os.close(fd)

    def _unlink(self, path: str) -> None:
        self._fault(IOOp.UNLINK)
        os.unlink(path)

    def _rename(self, source: str, target: str) -> None:
        self._fault(IOOp.RENAME)
        os.rename(source, target)

    async def publish(self, temp: str, final: str, slot: int, page: int, sync: bool, create: bool) -> None:
        await self._run(self._publish, temp, final, slot, page, sync, create)

    async def rename(self, source: str, target: str) -> None:
        await self._run(self._rename, source, target)

    async def load(self, path: str, slot: int, page: int) -> int:
        result = await self._run(self._load, path, slot, page)
        assert isinstance(result, int)
        return result

    async def unlink(self, path: str) -> None:
        await self._run(self._unlink, path)

    async def aclose(self) -> None:
        while self._jobs:
            await asyncio.wait(set(self._jobs))
        self._executor.shutdown(wait=False)


def probe_direct_io(directory: str) -> bool:
    """Whether files in ``directory`` accept O_DIRECT (tmpfs answers EINVAL). Blocking."""
    path = os.path.join(directory, f".tmp-probe-{os.urandom(6).hex()}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    os.unlink(path)
    return True


async def open_backend(config: DiskConfig, pool: PagePool, slots: HeaderSlots, direct: bool) -> PageIO:
    """The backend ``config`` asks for; AUTO falls back step by step with one warning each."""
    want = config.backend
    if want is DiskBackend.THREADS:
        return ThreadPageIO(pool, slots, direct, config.threads)
    try:
        engine = uring.UringEngine.open(config.ring_entries)
    except OSError as exc:
        if want is not DiskBackend.AUTO:
            raise
        log.warning("disk tier: io_uring refused (%s); using the thread-pool backend", exc)
        return ThreadPageIO(pool, slots, direct, config.threads)
    if want is DiskBackend.URING:
        return UringPageIO(engine, pool, slots, direct, fixed=False)
    try:
        return UringPageIO(engine, pool, slots, direct, fixed=True)
    except OSError as exc:
        if want is not DiskBackend.AUTO:
            await engine.aclose()
            raise
        log.warning("disk tier: cannot register the pool as fixed buffers (%s; memlock?); "
                    "using unregistered buffers", exc)
        return UringPageIO(engine, pool, slots, direct, fixed=False)


def describe_layout_io(layout: KVLayout, io: PageIO) -> str:
    """One log line: backend, O_DIRECT and page geometry."""
    return f"disk tier: {io.kind.value}, {'O_DIRECT' if io.direct else 'buffered'}, {layout.describe()}"
