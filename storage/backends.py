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

CHAIN_MAX = 6
"""Most SQEs one page needs: open, header, page, fsync, close, rename."""


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


def _chain_error(results: list[int], expect: list[int], what: str) -> OSError:
    """The first failure of a chain (later ops report ECANCELED)."""
    for res, want in zip(results, expect, strict=True):
        if res < 0 and res != -errno.ECANCELED:
            return OSError(-res, os.strerror(-res))
        if res != want:
            return _short(what, res, want) if res >= 0 else OSError(-res, os.strerror(-res))
    return OSError(errno.EIO, f"{what} chain failed: {results}")


def _short(what: str, got: int, want: int) -> OSError:
    return OSError(errno.EIO, f"short {what}: {got} of {want} bytes")


class UringPageIO:
    """Page files through one io_uring; pool pages as fixed buffers when ``regions`` are given
    (from :func:`register_pool`: pool regions, then the header-slot region)."""

    def __init__(self, engine: uring.UringEngine, pool: PagePool, slots: HeaderSlots, direct: bool,
                 regions: list[list[uring.Region]] | None) -> None:
        self.engine = engine
        self.kind = DiskBackend.URING_FIXED if regions is not None else DiskBackend.URING
        self.direct = direct
        self.faults = FaultPlan()
        engine.fault_hook = self.faults.uring_hook
        self._pool = pool
        self._slots = slots
        self._page_bytes = pool.layout.page_bytes
        self._base = pool.memory.segment.address
        self._pool_regions: list[uring.Region] = regions[0] if regions is not None else []
        self._slot_region: uring.Region | None = regions[1][0] if regions is not None else None
        self._starts = [r.address for r in self._pool_regions]
        self._flags = os.O_DIRECT if direct else 0
        engine.register_files(slots.count)  # one fixed-file slot per I/O slot

    def _page_region(self, address: int) -> uring.Region | None:
        if not self._pool_regions:
            return None
        return self._pool_regions[bisect.bisect_right(self._starts, address) - 1]

    def _io_op(self, write: bool, slot: int, address: int, length: int, offset: int,
               region: uring.Region | None) -> uring.Op:
        # fd is the file-table slot the chain's OPENAT filled.
        if region is None:
            return uring.Op(uring.OP_WRITE if write else uring.OP_READ, slot, address, length, offset,
                            fixed_file=True)
        return uring.Op(uring.OP_WRITE_FIXED if write else uring.OP_READ_FIXED, slot, address, length, offset,
                        buf_index=region.index, fixed_file=True)

    def _transfer(self, write: bool, slot: int, page: int) -> list[uring.Op]:
        address = self._base + page * self._page_bytes
        return [
            self._io_op(write, slot, self._slots.address + slot * HEADER_BYTES, HEADER_BYTES, 0, self._slot_region),
            self._io_op(write, slot, address, self._page_bytes, HEADER_BYTES, self._page_region(address)),
        ]

    async def _release_slot(self, slot: int) -> None:
        # A broken chain skipped its CLOSE: free the file-table slot before the I/O slot is reused
        # (SQEs of different submissions are not ordered, so this must complete first).
        await self.engine.chain([uring.Op(uring.OP_CLOSE, 0, file_index=slot + 1)], None)

    async def publish(self, temp: str, final: str, slot: int, page: int, sync: bool, create: bool) -> None:
        # One linked chain, one submission, one wake-up: open into a fixed-file slot, write header
        # and page, (fdatasync,) close, rename. A failure cancels the rest of the chain.
        # No O_CLOEXEC: the kernel refuses it for an open into a fixed-file slot (there is no fd).
        mode = os.O_WRONLY | (os.O_CREAT | os.O_EXCL if create else 0) | self._flags
        tmp, fin = ctypes.create_string_buffer(temp.encode()), ctypes.create_string_buffer(final.encode())
        ops = [uring.Op(uring.OP_OPENAT, uring.AT_FDCWD, ctypes.addressof(tmp), 0o600, op_flags=mode,
                        file_index=slot + 1)]
        ops += self._transfer(True, slot, page)
        if sync:
            ops.append(uring.Op(uring.OP_FSYNC, slot, op_flags=uring.IORING_FSYNC_DATASYNC, fixed_file=True))
        ops.append(uring.Op(uring.OP_CLOSE, 0, file_index=slot + 1))
        ops.append(uring.Op(uring.OP_RENAMEAT, uring.AT_FDCWD, ctypes.addressof(tmp),
                            uring.AT_FDCWD & 0xFFFFFFFF, ctypes.addressof(fin)))
        results = await self.engine.chain(ops, (tmp, fin, self._slots, self._pool))
        expect = [0, HEADER_BYTES, self._page_bytes] + [0] * (len(ops) - 3)
        if results == expect:
            return
        if results[0] == 0 and results[-2] != 0:
            await self._release_slot(slot)
        if results[0] == 0 or not create:
            await self._unlink_quiet(temp)
        raise _chain_error(results, expect, "write")

    async def rename(self, source: str, target: str) -> None:
        await self.engine.renameat(source.encode(), target.encode())

    async def _unlink_quiet(self, path: str) -> None:
        with contextlib.suppress(OSError):
            await self.engine.unlinkat(path.encode())

    async def load(self, path: str, slot: int, page: int) -> int:
        name = ctypes.create_string_buffer(path.encode())
        ops = [uring.Op(uring.OP_OPENAT, uring.AT_FDCWD, ctypes.addressof(name), 0,
                        op_flags=os.O_RDONLY | self._flags, file_index=slot + 1)]
        ops += self._transfer(False, slot, page)
        ops.append(uring.Op(uring.OP_CLOSE, 0, file_index=slot + 1))
        results = await self.engine.chain(ops, (name, self._slots, self._pool))
        if results[0] == 0 and results[3] != 0:
            await self._release_slot(slot)
        if results[0] < 0:
            raise OSError(-results[0], os.strerror(-results[0]))
        got = 0
        for res in results[1:3]:
            if res == -errno.ECANCELED:
                break  # a short read broke the chain: the file is truncated
            if res < 0:
                raise OSError(-res, os.strerror(-res))
            got += res
        return got

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
        # A page is a chain of up to 6 SQEs: room for every I/O slot's chain at once.
        engine = uring.UringEngine.open(max(config.ring_entries, CHAIN_MAX * config.queue_depth))
    except OSError as exc:
        if want is not DiskBackend.AUTO:
            raise
        log.warning("disk tier: io_uring refused (%s); using the thread-pool backend", exc)
        return ThreadPageIO(pool, slots, direct, config.threads)
    try:
        regions = None
        if want is not DiskBackend.URING:
            try:
                regions = await register_pool(engine, pool, slots)
            except OSError as exc:
                if want is not DiskBackend.AUTO:
                    raise
                log.warning("disk tier: cannot register the pool as fixed buffers (%s; memlock?); "
                            "using unregistered buffers", exc)
        return UringPageIO(engine, pool, slots, direct, regions)
    except BaseException:
        await engine.aclose()
        raise


async def register_pool(engine: uring.UringEngine, pool: PagePool, slots: HeaderSlots) -> list[list[uring.Region]]:
    """Register pool memory and header slots as fixed buffers, in a thread: pinning faults in every
    page of the pool (~1 s/GiB for memory never touched), which must not stall the loop."""
    pb = pool.layout.page_bytes
    spans = [(pool.memory.segment.address, pool.num_pages * pb, pb),
             (slots.address, slots.count * HEADER_BYTES, HEADER_BYTES)]
    job = asyncio.get_running_loop().run_in_executor(None, engine.register_buffers, spans)
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        await asyncio.wait({job})  # the ring must outlive the syscall using it
        raise


def describe_layout_io(layout: KVLayout, io: PageIO) -> str:
    """One log line: backend, O_DIRECT and page geometry."""
    return f"disk tier: {io.kind.value}, {'O_DIRECT' if io.direct else 'buffered'}, {layout.describe()}"
