"""Byte movers: whole page files between pool memory and disk, through io_uring or threads.

Each backend offers the same operations — publish a new page file (temp write + rename), overwrite
a recycled one, read one (started now, completed by a callback on the loop), unlink, register a
caller's memory — and reports faults as ``OSError``. Bookkeeping lives in :mod:`.disk`.
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
import functools
import logging
import mmap
import os
import queue
import stat
import threading
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, Protocol

from aiokv.layout import KVLayout
from aiokv.pool import PagePool, PoolClosedError, run_in_new_thread
from aiokv.shm import populate

from . import memory, uring
from .config import DiskBackend, DiskConfig
from .memory import (
    EXTERNAL_REGION_SLOTS,
    MAX_REGISTER_REGIONS,
    REGISTER_REGION_BYTES,
    BufferTable,
    PageBuffer,
    populate_then_register,
    register_pool,
    update_in_batches,
    wait_uncancelled,
)
from .outcomes import Outcomes, again_after_interrupt
from .pagefile import HEADER_BYTES
from .safefiles import (
    OPEN_FLAGS,
    READ_FLAGS,
    CachedOpen,
    UnsafeFileError,
    check_page_fd,
    classify_open_error,
    classify_read_open_error,
    open_page_file,
    ready_for_io,
)
from .uring import not_started

log = logging.getLogger(__name__)

P = ParamSpec("P")

CHAIN_MAX = 7
"""SQEs one page may hold at once: its chain (open, header, page, fsync, close, rename), plus one
unlink or rename of an evicted file."""

CHAIN_READS = True
"""Whether a cold O_DIRECT read is one chain from its open (:attr:`UringPageIO.chain_reads`)."""

WRITE_PAGE_FIRST = True
"""Whether a write's fixed-buffer ops put the page before the header (:attr:`UringPageIO.page_first`)."""

COLD_READ_STREAK = 32
"""After a read whose name was not in the kernel's lookup caches (its ``openat2`` with
``RESOLVE_CACHED`` answered EAGAIN), this many reads that can go as one chain from the open skip
that look (cold names come in runs: after a cache drop, every one is). Then the loop looks again."""

_INSTALL_WANTS_ROOM = frozenset({-errno.EMFILE, -errno.ENFILE, -errno.ENOMEM})
"""What a cold chain's FIXED_FD_INSTALL answers when no descriptor can be made now (the process's
or the system's limit, memory): a fault of that read, not a kernel that cannot install files."""


Published = Callable[[BaseException | None], None]
"""Completion of :meth:`PageIO.start_publish`: None when published, else the fault."""

Recycled = Callable[[BaseException | None, bool], None]
"""Completion of :meth:`PageIO.start_recycle`: the fault or None, and whether the victim's file
was taken over (opened and checked: bytes may have been written into it)."""

Loaded = Callable[[int | BaseException], None]
"""Completion of :meth:`PageIO.start_load`: bytes read, or the fault."""


def _ignore(_results: list[int]) -> None:
    """Completion of a request whose result nobody needs (a CLOSE the broken chain skipped)."""


def _fault_later(done: Callable[..., None], *rest: object) -> None:
    """``done(EINTR fault, *rest)`` in the next turn: a start or a completion that a signal's
    KeyboardInterrupt left before its I/O went to the kernel (nothing touches the slot or the page
    then), or before it surely called ``done``. The disk tier's steps run once: a second
    completion is ignored, so whoever cannot tell whether ``done`` ran delivers this."""
    asyncio.get_running_loop().call_soon(done, InterruptedError(errno.EINTR, "interrupted by a signal"), *rest)


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
    uring.OP_READV: IOOp.READ, uring.OP_WRITE: IOOp.WRITE, uring.OP_WRITE_FIXED: IOOp.WRITE,
    uring.OP_WRITEV: IOOp.WRITE, uring.OP_FSYNC: IOOp.FSYNC,
    uring.OP_RENAMEAT: IOOp.RENAME, uring.OP_UNLINKAT: IOOp.UNLINK,
}


class FaultPlan:
    """Errors to inject into the next operations of a kind (tests). On io_uring the request still
    travels through the ring (as a NOP) and fails at completion; threads raise before the syscall."""

    def __init__(self, arm: Callable[[], None] | None = None) -> None:
        self._plan: Counter[IOOp] = Counter()
        self._errno: dict[IOOp, int] = {}
        # Called at the first injection: the engine looks at every op only once a test asked for it.
        self._arm = arm

    def inject(self, op: IOOp, err: int, times: int = 1) -> None:
        """Make the next ``times`` operations ``op`` fail with ``err``."""
        self._plan[op] += times
        self._errno[op] = err
        if self._arm is not None:
            self._arm()
            self._arm = None

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


PATH_BYTES = 256
"""Per I/O slot, room for a page file's name (relative to its directory) and its terminating NUL."""


class HeaderSlots:
    """Page-aligned 4096-byte buffers for headers (O_DIRECT needs aligned memory), one per I/O slot;
    per slot a two-entry iovec (header, page) for vectored I/O and two name buffers for its chains
    (kept here: the kernel reads them until the slot's chain completed)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._map = mmap.mmap(-1, count * HEADER_BYTES)
        self.buffer = memoryview(self._map)
        probe = ctypes.c_char.from_buffer(self._map)
        self.address = ctypes.addressof(probe)
        del probe
        self.views = [self.buffer[i * HEADER_BYTES : (i + 1) * HEADER_BYTES] for i in range(count)]
        self.iovecs = (uring.IoVec * (2 * count))()
        self.iovec_address = ctypes.addressof(self.iovecs)
        for i in range(count):
            self.iovecs[2 * i].base = self.address + i * HEADER_BYTES
            self.iovecs[2 * i].len = HEADER_BYTES
        # Two names per slot (a write chain's old and new name), written through a memoryview:
        # a ctypes buffer allocated per name cost ~2 us a page and garbage for the collector.
        self._paths = ctypes.create_string_buffer(2 * count * PATH_BYTES)
        self._paths_address = ctypes.addressof(self._paths)
        self._paths_view = memoryview(self._paths).cast("B")

    def path(self, slot: int, name: bytes, second: bool = False) -> int | None:
        """The address of ``slot``'s first (or ``second``) name buffer holding ``name``
        NUL-terminated, or None when it does not fit (then the caller allocates one)."""
        size = len(name)
        if size >= PATH_BYTES:
            return None
        at = (2 * slot + second) * PATH_BYTES
        self._paths_view[at : at + size + 1] = name + b"\0"
        return self._paths_address + at

    def iovec(self, slot: int, address: int, length: int) -> int:
        """The address of ``slot``'s iovec pair, its second entry set to ``[address, +length)``."""
        entry = self.iovecs[2 * slot + 1]
        entry.base = address
        entry.len = length
        return self.iovec_address + 2 * slot * ctypes.sizeof(uring.IoVec)

    def close(self) -> None:
        for view in self.views:
            view.release()
        self.views = []
        self._paths_view.release()
        self.buffer.release()
        self._map.close()


class PageIO(Protocol):
    """What :class:`~aiokv.storage.DiskTier` needs from a backend.

    Names are relative to a directory descriptor (a fan-out directory, opened and checked at start:
    no path walk per operation). Every open goes through
    :mod:`.safefiles`: ``O_NOFOLLOW|O_NONBLOCK``, then a regular file of ours, or
    :class:`~aiokv.storage.safefiles.UnsafeFileError`. Callers are the tier's own job tasks, which
    are never cancelled (a cancelled caller of the tier is shielded from them).

    A KeyboardInterrupt (a signal, raised by Python at a function's entry or as a call returns)
    that leaves a ``start_*`` it had entered, or a completion of theirs, never loses the job: its
    ``done`` runs anyway, at least once — with the outcome, or an ``InterruptedError`` when the I/O
    never went to the kernel (and no descriptor is left open). Its caller tells an interrupt at the
    entry (``uring.not_started``: nothing started) and ignores a second ``done``."""

    kind: DiskBackend
    direct: bool
    faults: FaultPlan

    def start_publish(self, dir_fd: int, temp: str, final: str, slot: int, page: PageBuffer, sync: bool,
                      done: Published) -> None:
        """Create ``temp`` exclusively, write header slot ``slot`` and ``page`` into it, then rename it
        to ``final`` (both names in the directory ``dir_fd``); ``done(None)`` on the loop once
        published, or ``done(OSError)``, never from inside this call. ``page`` is read until ``done``
        runs; O_DIRECT only where it is ``aligned``. On failure ``temp`` is removed before ``done``
        runs. A short write is ENOSPC (file system full)."""
        ...

    def start_recycle(self, victim_dir: int, victim: str, dir_fd: int, final: str, slot: int,
                      page: PageBuffer, sync: bool, done: Recycled) -> None:
        """As :meth:`start_publish`, overwriting the evicted page file ``victim`` instead of creating
        one: open it for writing (checked: our regular file, one link), write header and page into
        it, close it and rename it to ``final`` (one rename, no temporary name). A crash mid-write
        leaves a torn file under the victim's name, which its checksums refuse on read (the victim
        is out of the index, and a new write of its key waits for ``done``). ``done(error,
        taken)``: ``taken`` False when the victim was not taken over (gone, not ours, or the open
        failed: nothing was written); on a fault after the take-over the victim's name is removed."""
        ...

    def start_load(self, dir_fd: int, name: str, slot: int, page: PageBuffer, done: Loaded) -> None:
        """Read ``name`` into header slot ``slot`` and ``page``; ``done(bytes read)`` on the loop once
        nothing writes into the page any more, or ``done(OSError)``, never from inside this call."""
        ...

    async def unlink(self, dir_fd: int, name: str) -> None: ...

    def call_next_turn(self, fn: Callable[[], None]) -> None:
        """``fn()`` early in the loop's next turn, where the backend has a callback running then
        anyway (the ring's submission), else as a loop callback of its own."""
        ...

    def thread_waker(self, deliver: Callable[[float], None]) -> Callable[[], bool] | None:
        """A function other threads call to have ``deliver(deadline)`` run on the loop through the
        backend's own wake-up (the ring's eventfd: one wake-up for completions and the threads'
        results), or None where it has none. It returns False once it cannot wake the loop."""
        ...

    async def register_memory(self, view: memoryview, address: int) -> bool:
        """Register ``[address, +len(view))`` (a caller's region) for I/O with fixed buffers; False
        when this backend cannot (no registered-buffer table, memlock, table full): plain buffers then.
        The kernel holds the pages pinned until :meth:`aclose`. ``view`` (the tier's own) is kept
        until then where something was pinned, else released before this returns or raises: a
        cancelled call's frames outlive it in its traceback, and so would the caller's export."""
        ...

    async def aclose(self) -> None: ...


BACKGROUND_REGION_BYTES = REGISTER_REGION_BYTES
"""Pool memory pinned per region by the background registration (see ``REGISTER_REGION_BYTES``)."""

ADOPT_BYTES = 64 << 20
"""Pinned pool memory the background registration hands to the loop at once (one wake-up)."""

_PAGEMAP_PRESENT = 0x80
"""Bit 63 of a ``/proc/self/pagemap`` entry (little-endian: the top bit of its last byte): the page
is mapped. Readable without privileges (only the frame numbers are hidden)."""


def _open_pagemap() -> int | None:
    """A descriptor of this process's page map, or None where there is none (then always populate)."""
    try:
        return os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _faulted_in(pagemap: int, address: int, length: int) -> bool:
    """Whether every base page of ``[address, +length)`` is mapped in this process (one read of
    8 bytes per page: 16 KiB for 8 MiB, ~10x cheaper than populating mapped memory again)."""
    first = address // mmap.PAGESIZE
    count = (address + length - 1) // mmap.PAGESIZE - first + 1
    try:
        entries = os.pread(pagemap, 8 * count, 8 * first)
    except OSError:
        return False
    return len(entries) == 8 * count and min(entries[7::8]) >= _PAGEMAP_PRESENT


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



def _bytes_read(results: list[int]) -> int | OSError:
    """Bytes a read chain's transfers moved, or the error of the first that failed; a short read
    broke the chain (the ops after it answer ECANCELED): the file is truncated, the sum says so."""
    got = 0
    for res in results:
        if res == -errno.ECANCELED:
            break
        if res < 0:
            return OSError(-res, os.strerror(-res))
        got += res
    return got

class UringPageIO:
    """Page files through one io_uring; pool pages as fixed buffers when ``regions`` are given
    (from :func:`register_pool`: pool regions, then the header-slot region).

    A new page file is one linked chain: OPENAT (``O_CREAT|O_EXCL|O_NOFOLLOW`` into the I/O slot's
    fixed-file entry: only a new regular file of ours can come out of it), header and page, [FSYNC],
    CLOSE, RENAMEAT. A cold O_DIRECT read (its name not in the kernel's lookup caches) is one chain
    too: OPENAT (``O_NOFOLLOW|O_NONBLOCK|O_DIRECT``, refused for anything but a regular file) into
    the slot's fixed-file entry, header and page, FIXED_FD_INSTALL, CLOSE; the installed fd is
    ``fstat``-checked before the bytes count (:meth:`_load_chain`). The overwrite of a recycled
    file, and other reads, open the existing name first
    (into a normal fd, ``fstat``-checked before any byte moves: on the loop where the name is in the
    kernel's lookup caches, else by an OPENAT through the ring), then one chain: header and page,
    CLOSE (and for an overwrite RENAMEAT to the new name). Header and page move in one vectored op
    (READV/WRITEV) with plain buffers, or as two fixed-buffer ops once the page's region is
    registered (a write: the page first, so a new file is extended once)."""

    def __init__(self, engine: uring.UringEngine, pool: PagePool, slots: HeaderSlots, direct: bool,
                 regions: list[list[uring.Region]] | None) -> None:
        self.engine = engine
        self.kind = DiskBackend.URING_FIXED if regions is not None else DiskBackend.URING
        self.direct = direct
        self.faults = FaultPlan(arm=self._arm_faults)
        self._cached = CachedOpen()
        self.chain_reads = CHAIN_READS
        self._cold_streak = 0  # reads left that skip the look on the loop (see start_load)
        self.page_first = WRITE_PAGE_FIRST
        """Cold O_DIRECT reads as one chain from the open (:meth:`_load_chain`), checked on the file
        it opened (an installed fd's ``fstat``). An earlier chain checked a STATX of the *name*: a
        rename race inside the directory (RENAME_EXCHANGE in a loop) made it approve our file while
        it read another owner's (review: 7 of 220 reads served a forged page as a hit). Turns
        itself off where the kernel cannot install fixed files (before 6.8) or after an EAGAIN read."""
        self._uid = os.geteuid()
        self._pool = pool
        self._slots = slots
        self._page_bytes = pool.layout.page_bytes
        self._base = pool.memory.segment.address
        self._pool_regions: list[uring.Region] = regions[0] if regions is not None else []
        self._slot_region: uring.Region | None = regions[1][0] if regions is not None else None
        self._starts = [r.address for r in self._pool_regions]
        self._pool_end = self._base + pool.num_pages * self._page_bytes
        # Callers' regions (register_memory), sorted by address, and the views that keep them mapped.
        self._ext_regions: list[uring.Region] = []
        self._ext_starts: list[int] = []
        self._ext_views: list[memoryview] = []
        pb = self._page_bytes
        # The kernel's table holds at most 16384 buffers: larger regions for a pool beyond 64 GiB.
        region_bytes = max(BACKGROUND_REGION_BYTES, -(-pool.num_pages * pb // MAX_REGISTER_REGIONS))
        pool_plan = self.engine.plan_regions([(self._base, pool.num_pages * pb, pb)], region_bytes)[0]
        # All header slots in one region, whatever the pool's region size: an op on any slot names
        # that region's buffer (_transfer). Cut at 8 MiB, a queue depth above 2048 split them in two
        # and ops on the first region's slots failed (EFAULT, counted), dropping writes and reads.
        slot_bytes = slots.count * HEADER_BYTES
        if slot_bytes > uring.MAX_REGION_BYTES:
            raise ValueError(f"{slots.count} header slots exceed one fixed buffer ({uring.MAX_REGION_BYTES} bytes)")
        self._plan = [pool_plan, [uring.Region(len(pool_plan), slots.address, slot_bytes)]]
        planned = sum(len(r) for r in self._plan)
        # Empty (no slot for callers' regions) unless registering in the background: a forced
        # URING_FIXED registers a full table, a forced URING none.
        self._table = BufferTable(engine, 0, planned)
        self._registering: asyncio.Task[None] | None = None
        # register_memory calls still pinning, and the flag that stops each between pieces.
        self._ext_jobs: dict[asyncio.Future[None], threading.Event] = {}

    def _arm_faults(self) -> None:
        # Only once a fault is injected: otherwise every op would pay a hook call for nothing.
        self.engine.fault_hook = self.faults.uring_hook

    def register_in_background(self) -> None:
        """Register the pool as fixed buffers in a thread, region by region; each region's pages use
        fixed-buffer I/O as soon as it is registered, the rest plain I/O until then."""
        planned = sum(len(r) for r in self._plan)
        self._table = BufferTable(self.engine, planned + EXTERNAL_REGION_SLOTS, planned)
        self._registering = asyncio.ensure_future(self._register())

    async def _register(self) -> None:
        plan = self._plan
        loop = asyncio.get_running_loop()
        stop = threading.Event()

        def adopt(region: uring.Region, slot: bool) -> None:
            if slot:
                self._slot_region = region
            else:
                self._pool_regions.append(region)
                self._starts.append(region.address)

        def adopt_all(regions: list[tuple[uring.Region, bool]]) -> None:
            for region, slot in regions:
                adopt(region, slot)

        def register() -> None:
            try:
                self._table.ensure()
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                register_whole()
                return
            # Header slots first (tiny), then the pool in address order: each update holds the
            # ring's lock only while it pins a few regions, already faulted in (other threads'
            # munmap waits for one region's pin at a time). A pool prepared for
            # CUDA is (each chunk populated, then pinned by CUDA): populating it again, or even
            # asking /proc/self/pagemap, takes the mmap lock 2 MiB at a time, and another thread's
            # munmap waits for each (that thread blocked in 4-7% of its iterations here).
            pool_mapped = self._pool.register_cuda
            pagemap = _open_pagemap()
            # Handed to the loop ADOPT_BYTES at a time: each hand-over wakes the loop's thread,
            # which takes the GIL from whichever thread runs Python (the engine's).
            pinned: list[tuple[uring.Region, bool]] = []
            pinned_bytes = 0

            def fault_in(region: uring.Region, known: bool = False) -> None:
                if not known and (pagemap is None or not _faulted_in(pagemap, region.address, region.length)):
                    populate(region.address, region.length)

            try:
                # Header slots first (they sit after the pool's regions in the table: a batch of
                # their own), then the pool, REGIONS_PER_UPDATE regions to a call.
                for regions, slot in ((plan[1], True), (plan[0], False)):
                    prepare = functools.partial(fault_in, known=pool_mapped and not slot)
                    for done in update_in_batches(self.engine, regions, stop, prepare):
                        pinned.extend((region, slot) for region in done)
                        pinned_bytes += sum(region.length for region in done)
                        if slot or pinned_bytes >= ADOPT_BYTES:
                            loop.call_soon_threadsafe(adopt_all, pinned)
                            pinned, pinned_bytes = [], 0
            finally:
                if pagemap is not None:
                    os.close(pagemap)
                if pinned:
                    loop.call_soon_threadsafe(adopt_all, pinned)

        def register_whole() -> None:
            # Kernels 5.15-5.18 refuse sparse tables (EINVAL): register the pool and the header
            # slots in one call, as a forced URING_FIXED does (faulted in first: the ring's lock is
            # held for the whole call). No slot is left for callers' regions.
            self._table.refuse()
            pb = self._page_bytes
            pool_regions, slot_regions = populate_then_register(
                self.engine, [(self._base, self._pool.num_pages * pb, pb),
                              (self._slots.address, self._slots.count * HEADER_BYTES, HEADER_BYTES)])
            for region, slot in [(r, True) for r in slot_regions] + [(r, False) for r in pool_regions]:
                loop.call_soon_threadsafe(adopt, region, slot)

        # On the pool's own preparation threads (nice +10, already running): faulting in is kernel
        # CPU work that would otherwise take turns with the loop's thread on a small machine, and
        # starting a thread of its own from the loop stalled it 10-20 ms under load.
        try:
            work = self._pool.run_in_background(register)
        except PoolClosedError:
            return
        job = asyncio.wrap_future(work)
        try:
            await asyncio.shield(job)
        except asyncio.CancelledError:
            stop.set()
            if not work.cancel():  # not started yet (queued behind chunk preparation): nothing to wait for
                # The ring must outlive the syscall using it, even when cancelled again meanwhile (a
                # loop-wide cancel cutting the close: before, the next close unmapped the ring under
                # the thread, and its error was never retrieved). Nobody else takes its outcome.
                job.add_done_callback(_registration_cut)
                await wait_uncancelled(job)
            raise
        except OSError as exc:
            log.warning("disk tier: cannot register the pool as fixed buffers (%s; memlock, or a kernel "
                        "before 5.19); pages registered so far stay fixed, the rest use plain buffers", exc)
            return
        self.kind = DiskBackend.URING_FIXED

    async def register_memory(self, view: memoryview, address: int) -> bool:
        length = len(view)
        pb = self._page_bytes
        # Regions overlap by one page, so that every page-sized buffer in the span lies whole inside
        # one of them (a fixed-buffer op must not cross a region's end) whatever the caller's page
        # boundaries; the overlap costs at most 1/8 more pinned memory.
        region_bytes = min(uring.MAX_REGION_BYTES, max(memory.REGISTER_REGION_BYTES, 8 * pb))
        free = self._table.free
        if free and length > free * (region_bytes - pb):
            # More pieces than the table has slots left (beyond ~32 GiB at 8 MiB a piece): larger
            # pieces, one slot each, rather than none registered at all.
            region_bytes = min(uring.MAX_REGION_BYTES, -(-(-(-length // free) + pb) // 4096) * 4096)
        stride = region_bytes - pb
        bounds: list[tuple[int, int]] = []
        start = 0
        while True:
            end = min(start + region_bytes, length)
            bounds.append((address + start, end - start))
            if end == length:
                break
            start += stride
        first = self._table.take(len(bounds))
        if first is None:
            view.release()
            return False
        regions = [uring.Region(first + i, a, n) for i, (a, n) in enumerate(bounds)]
        done: list[uring.Region] = []
        # Set by a cancelled caller or by aclose: a large region takes seconds to minutes to pin.
        stop = threading.Event()

        def register() -> None:
            # In a thread: faulting in and pinning take ~20 ms/GiB even for touched memory.
            self._table.ensure()
            pagemap = _open_pagemap()

            def fault_in(region: uring.Region) -> None:
                # Memory the caller has touched is pinned as it is (asking costs ~1/10 of populating).
                if pagemap is None or not _faulted_in(pagemap, region.address, region.length):
                    with contextlib.suppress(OSError):  # read-only memory: the update says so (EFAULT)
                        populate(region.address, region.length)

            try:
                for pinned in update_in_batches(self.engine, regions, stop, fault_in):
                    done.extend(pinned)
            finally:
                if pagemap is not None:
                    os.close(pagemap)

        # A thread of its own, started without the loop waiting for it (``asyncio.to_thread``'s
        # first call starts the default executor's thread on the loop, and ``Thread.start`` waits
        # there until it runs). Nothing to undo for a caller that is gone: what was pinned stays
        # registered until the ring closes.
        job = run_in_new_thread(register, "aiokv-register-memory", _keep_registered)
        self._ext_jobs[job] = stop
        job.add_done_callback(self._ext_jobs.pop)
        try:
            cut = await wait_uncancelled(job, stop)
        finally:
            # What was pinned is used, even by a cancelled caller: the kernel holds it either way.
            for region in done:
                at = bisect.bisect_right(self._ext_starts, region.address)
                self._ext_starts.insert(at, region.address)
                self._ext_regions.insert(at, region)
            if done:
                self._ext_views.append(view)
            else:
                view.release()
            del view  # kept by the tier or released: not by this frame, which a traceback may keep
        if cut:
            # The thread's error is logged for a caller that is gone (it was never retrieved before).
            _pinning_cut(job, length, address)
            raise asyncio.CancelledError
        error = job.exception()
        if error is not None:
            if not isinstance(error, OSError):
                raise error
            log.warning("disk tier: cannot register %d bytes at %#x as fixed buffers (%s); plain buffers there",
                        length, address, error)
            return False
        # Stopped by aclose: the pieces pinned so far are used, the rest goes through plain buffers.
        return len(done) == len(regions)

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

    def _external_region(self, address: int) -> uring.Region | None:
        # External regions overlap by a page (see register_memory): the last one starting at or
        # before ``address`` ends last, so it holds the page if any does.
        at = bisect.bisect_right(self._ext_starts, address) - 1
        if at < 0:
            return None
        region = self._ext_regions[at]
        return region if address + self._page_bytes <= region.address + region.length else None

    def _transfer(self, write: bool, fd: int, fixed_file: bool, slot: int, page: PageBuffer) -> list[uring.SqeFields]:
        """Header and page in one vectored op (plain buffers), or two fixed-buffer ops where the
        page's region is registered (fixed buffers spare the kernel pinning the page per I/O).

        The SQEs are tuples laid out as :func:`uring.sqe` builds them, written out here: this runs
        once per page, and a call per op was a fifth of the chain's set-up (#14)."""
        address = page.address
        if self._base <= address < self._pool_end:
            # _page_region, inline (once per page): regions are adopted in address order.
            at = bisect.bisect_right(self._starts, address) - 1
            region = self._pool_regions[at] if at >= 0 else None
            if region is not None and address >= region.address + region.length:
                region = None
        else:
            region = self._external_region(address) if self._ext_regions else None
        flags = uring.IOSQE_FIXED_FILE if fixed_file else 0
        pb = self._page_bytes
        slot_region = self._slot_region
        if region is None or slot_region is None:
            opcode = uring.OP_WRITEV if write else uring.OP_READV
            iovec = self._slots.iovec(slot, address, pb)
            return [(opcode, flags, 0, fd, 0, iovec, 2, 0, 0, 0, 0, 0, 0, 0)]
        opcode = uring.OP_WRITE_FIXED if write else uring.OP_READ_FIXED
        header = (opcode, flags, 0, fd, 0, self._slots.address + slot * HEADER_BYTES, HEADER_BYTES, 0, 0,
                  slot_region.index, 0, 0, 0, 0)
        body = (opcode, flags, 0, fd, HEADER_BYTES, address, pb, 0, 0, region.index, 0, 0, 0, 0)
        # A write puts the page first: on ext4 an O_DIRECT write that extends the file runs
        # synchronously, so header-then-page paid two such writes in a new file's chain; the page
        # write extends it once, the header then fills the hole before it (the file is under its
        # temporary name, or being overwritten, until the chain's rename either way).
        return [body, header] if write and self.page_first else [header, body]

    def _moved(self, transfer: list[uring.SqeFields]) -> list[int]:
        """What :meth:`_transfer`'s ops return when they succeed (bytes moved), as a new list: one
        vectored op moves header and page, two fixed-buffer ops one each (in their order)."""
        if len(transfer) == 1:
            return [HEADER_BYTES + self._page_bytes]
        return [transfer[0][6], transfer[1][6]]

    def _names(self, slot: int, first: bytes, second: bytes | None) -> tuple[int, int, object]:
        """Addresses of ``first`` and ``second`` (0 if None) NUL-terminated in ``slot``'s name
        buffers (read by the kernel until the slot's chain completed: the slot is held until
        then), and what to keep alive for a name too long for them (a buffer of its own)."""
        slots = self._slots
        a = slots.path(slot, first)
        b = 0 if second is None else slots.path(slot, second, True)
        if a is not None and b is not None:
            return a, b, None
        one = ctypes.create_string_buffer(first)
        two = ctypes.create_string_buffer(second or b"")
        return ctypes.addressof(one), 0 if second is None else ctypes.addressof(two), (one, two)

    def _submit(self, ops: list[uring.SqeFields], keep: object) -> asyncio.Future[list[int]]:
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self.engine.submit(ops, keep, None, future)
        return future

    async def _close_quiet(self, fd: int) -> None:
        # A broken chain skipped its CLOSE.
        with contextlib.suppress(OSError):
            await self.engine.close_fd(fd)

    async def _unlink_quiet(self, dir_fd: int, name: str) -> None:
        with contextlib.suppress(OSError):
            await self.engine.unlinkat(name.encode(), dir_fd=dir_fd)

    def start_publish(self, dir_fd: int, temp: str, final: str, slot: int, page: PageBuffer, sync: bool,
                      done: Published) -> None:
        try:
            self._publish_chain(dir_fd, temp, final, slot, page, sync, done)
        except BaseException as exc:
            if not isinstance(exc, Exception):  # (a signal's KeyboardInterrupt: the ring took nothing)
                _fault_later(done)
            raise

    def _publish_chain(self, dir_fd: int, temp: str, final: str, slot: int, page: PageBuffer, sync: bool,
                       done: Published) -> None:
        # A fresh O_EXCL|O_NOFOLLOW create can only make a new regular file of ours with one link,
        # so it needs no fstat check: open, write, close and rename go in one chain, through the
        # I/O slot's fixed-file entry (the fd does not exist before the chain runs). No O_CLOEXEC:
        # the kernel refuses it for a fixed-file slot (which no exec can inherit anyway).
        tmp, fin, names = self._names(slot, temp.encode(), final.encode())
        direct = os.O_DIRECT if self.direct and page.aligned else 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | direct
        moves = self._transfer(True, slot, True, slot, page)
        moved = self._moved(moves)
        # SQE tuples as uring.sqe lays them out (see _transfer): OPENAT into the fixed-file entry.
        ops = [(uring.OP_OPENAT, 0, 0, dir_fd, 0, tmp, 0o600, flags, 0, 0, 0, slot + 1, 0, 0), *moves]
        # What each op returns when it succeeds (the OPENAT into a fixed-file slot: 0).
        expect = [0, *moved]
        if sync:
            ops.append(uring.sqe(uring.OP_FSYNC, slot, op_flags=uring.IORING_FSYNC_DATASYNC, fixed_file=True))
            expect.append(0)
        # CLOSE of the entry, RENAMEAT (new dir fd in ``len``, new name in ``off``).
        ops += [(uring.OP_CLOSE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, slot + 1, 0, 0),
                (uring.OP_RENAMEAT, 0, 0, dir_fd, fin, tmp, dir_fd & 0xFFFFFFFF, 0, 0, 0, 0, 0, 0, 0)]
        expect += (0, 0)

        def written(results: list[int]) -> None:
            try:
                if results == expect:
                    done(None)
                    return
                # A fault: rare, so its clean-up (skipped CLOSE, temp unlink) may take a coroutine.
                self._cleanup(self._publish_failed(ops, results, dir_fd, temp, slot), done)
            except BaseException as exc:
                if not isinstance(exc, Exception):  # (a signal's KeyboardInterrupt)
                    if results == expect:
                        asyncio.get_running_loop().call_soon(done, None)
                    elif not_started(self._cleanup, exc):
                        _fault_later(done)
                raise

        self.engine.submit(ops, (names, self._slots, self._pool, page.view), written, expect=expect)

    def start_recycle(self, victim_dir: int, victim: str, dir_fd: int, final: str, slot: int,
                      page: PageBuffer, sync: bool, done: Recycled) -> None:
        # The victim is opened into a normal fd (O_NONBLOCK: a FIFO must not block the open) and
        # fstat-checked on the loop (a chain cannot look at the file): at once where its name is in
        # the kernel's lookup caches (openat2 RESOLVE_CACHED, a few microseconds, no I/O), else by
        # an OPENAT through the ring first. Then one chain: header and page, [FSYNC], CLOSE,
        # RENAMEAT victim -> final.
        fd = -1  # opened here, until _overwrite has it (from its start)
        try:
            name = victim.encode()
            flags = os.O_WRONLY | OPEN_FLAGS
            try:
                opened_now = self._open_cached(victim_dir, name, flags)
            except OSError as exc:
                asyncio.get_running_loop().call_soon(done, classify_open_error(exc, victim), False)
                return
            if opened_now is not None:
                fd = opened_now
                self._overwrite(fd, victim_dir, victim, name, dir_fd, final, slot, page, sync, done, True)
                return
            path, _, keep = self._names(slot, name, None)

            def opened(results: list[int]) -> None:
                fd = results[0]
                try:
                    if fd < 0:
                        done(classify_open_error(OSError(-fd, os.strerror(-fd)), victim), False)
                        return
                    self._overwrite(fd, victim_dir, victim, name, dir_fd, final, slot, page, sync, done, False)
                except BaseException as exc:
                    if not isinstance(exc, Exception):  # (a signal's KeyboardInterrupt)
                        if fd >= 0 and not_started(self._overwrite, exc):
                            os.close(fd)
                        _fault_later(done, False)
                    raise

            self.engine.submit([uring.sqe(uring.OP_OPENAT, victim_dir, path, 0, 0, flags)], (keep, self._slots),
                               opened)
        except BaseException as exc:
            if not isinstance(exc, Exception):  # (a signal's KeyboardInterrupt: the ring took nothing)
                if fd >= 0 and not_started(self._overwrite, exc):
                    os.close(fd)
                _fault_later(done, False)
            raise

    def _overwrite(self, fd: int, victim_dir: int, victim: str, name: bytes, dir_fd: int, final: str, slot: int,
                   page: PageBuffer, sync: bool, done: Recycled, now: bool) -> None:
        """Check the victim's open ``fd``, then write it and rename it to ``final`` in one chain.
        ``now``: called from inside :meth:`start_recycle` (``done`` must then wait for the loop).
        Owns ``fd`` from its start: closed unless its chain took it (also after an interrupt)."""
        owned = fd
        try:
            try:
                check_page_fd(fd, victim, True)
                ready_for_io(fd, self.direct and page.aligned, os.O_WRONLY | OPEN_FLAGS)
            except Exception as exc:
                owned = -1
                os.close(fd)  # nothing was written through it
                if now:
                    asyncio.get_running_loop().call_soon(done, exc, False)
                else:
                    done(exc, False)
                return
            ops = self._transfer(True, fd, False, slot, page)
            expect = self._moved(ops)
            if sync:
                ops.append(uring.sqe(uring.OP_FSYNC, fd, op_flags=uring.IORING_FSYNC_DATASYNC))
                expect.append(0)
            old, fin, names = self._names(slot, name, final.encode())
            # CLOSE, RENAMEAT victim -> final (SQE tuples as uring.sqe lays them out: see _transfer).
            ops += [(uring.OP_CLOSE, 0, 0, fd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
                    (uring.OP_RENAMEAT, 0, 0, victim_dir, fin, old, dir_fd & 0xFFFFFFFF, 0, 0, 0, 0, 0, 0, 0)]
            expect += (0, 0)

            def written(results: list[int]) -> None:
                try:
                    if results == expect:
                        done(None, True)
                        return
                    # A fault after the take-over: the victim's name holds a torn file, removed before ``done``.
                    self._cleanup(self._recycle_failed(ops, results, expect, victim_dir, victim, fd),
                                  functools.partial(_taken, done))
                except BaseException as exc:
                    if not isinstance(exc, Exception):  # (a signal's KeyboardInterrupt)
                        if results == expect:
                            asyncio.get_running_loop().call_soon(done, None, True)
                        elif not_started(self._cleanup, exc):
                            _fault_later(done, True)
                    raise

            self.engine.submit(ops, (names, self._slots, self._pool, page.view), written, expect=expect)
        except BaseException as exc:
            if not isinstance(exc, Exception):  # (a signal's KeyboardInterrupt: the ring took nothing)
                if owned >= 0:
                    os.close(owned)
                _fault_later(done, False)
            raise

    def _open_cached(self, dir_fd: int, name: bytes, flags: int) -> int | None:
        """An existing file opened on the loop where that needs no I/O, else None (open it through
        the ring). Once a test injects faults, every open goes through the ring, where they land."""
        if self.engine.fault_hook is not None:
            return None
        return self._cached.open(dir_fd, name, flags)

    def _cleanup(self, job: Coroutine[Any, Any, None], done: Published) -> None:
        """Run a failed chain's clean-up coroutine (it raises the fault it met), then ``done(fault)``
        (once this started, also after an interrupt: a callback added twice calls ``done`` twice,
        which the tier ignores)."""
        task = None
        try:
            task = asyncio.ensure_future(job)
            task.add_done_callback(functools.partial(_cleaned_up, done=done))
        except BaseException as exc:
            if not isinstance(exc, Exception):  # (a signal's KeyboardInterrupt)
                if task is None:
                    job.close()
                    _fault_later(done)
                else:
                    task.add_done_callback(functools.partial(_cleaned_up, done=done))
            raise

    async def _publish_failed(self, ops: list[uring.SqeFields], results: list[int], dir_fd: int, temp: str,
                              slot: int) -> None:
        """Clean up after a broken new-file chain; raises the fault it met."""
        first = results[0]
        if first < 0:
            if first == -errno.EEXIST:
                raise _planted_temp(temp)
            raise classify_open_error(OSError(-first, os.strerror(-first)), temp)
        if results[-2] == -errno.ECANCELED:  # the chain broke before its CLOSE
            with contextlib.suppress(OSError):
                await self._submit([uring.sqe(uring.OP_CLOSE, 0, file_index=slot + 1)], None)
        await self._unlink_quiet(dir_fd, temp)
        raise _chain_error(results[1:], self._expect(ops[1:]))

    async def _recycle_failed(self, ops: list[uring.SqeFields], results: list[int], expect: list[int],
                              victim_dir: int, victim: str, fd: int) -> None:
        """Clean up after a broken overwrite chain (the victim's name holds a torn file, or the new
        page under the old name); raises the fault."""
        if results[-2] == -errno.ECANCELED:  # the chain broke before its CLOSE
            await self._close_quiet(fd)
        await self._unlink_quiet(victim_dir, victim)
        raise _chain_error(results, expect)

    def _expect(self, ops: list[uring.SqeFields]) -> list[int]:
        # What each op of a write chain returns when it succeeds: bytes for transfers, else 0.
        want = []
        for op in ops:
            if op[0] in (uring.OP_WRITEV, uring.OP_READV):
                want.append(HEADER_BYTES + self._page_bytes)
            elif op[0] in (uring.OP_WRITE_FIXED, uring.OP_READ_FIXED):
                want.append(op[6])
            else:
                want.append(0)
        return want

    def start_load(self, dir_fd: int, name: str, slot: int, page: PageBuffer, done: Loaded) -> None:
        # Opened on the loop where that needs no I/O (the name in the kernel's lookup caches), then
        # one chain; a cold name (after a cache drop, or never looked up) is one chain from its open.
        fd = -1  # opened here, until _read_file has it (from its start)
        try:
            encoded = name.encode()
            chain = self.chain_reads and self.direct and page.aligned
            if chain and self._cold_streak:
                # The last look on the loop found a cold name: the next reads go straight to the chain
                # (as safe: it checks the file it opened), sparing a failed openat2 each (#14).
                self._cold_streak -= 1
                self._load_chain(dir_fd, name, encoded, slot, page, done)
                return
            # Where a chain could read it, opened with O_DIRECT at once: the file then needs no
            # fcntl before its read (one GIL release less a page on the loop), and it stays
            # O_NONBLOCK, as a chain's file does. O_DIRECT refuses a FIFO or character device
            # (EINVAL, after an O_NONBLOCK open that cannot block): opened again without it, the
            # check below tells what it is.
            flags = READ_FLAGS | os.O_DIRECT if chain else READ_FLAGS
            try:
                try:
                    opened = self._open_cached(dir_fd, encoded, flags)
                except OSError as exc:
                    if not (chain and exc.errno == errno.EINVAL):
                        raise
                    flags = READ_FLAGS
                    opened = self._open_cached(dir_fd, encoded, flags)
            except OSError as exc:
                asyncio.get_running_loop().call_soon(done, classify_read_open_error(exc, dir_fd, name))
                return
            if opened is not None:
                fd = opened
                self._read_file(fd, dir_fd, name, slot, page, done, True, flags)
            elif chain:
                if self._cached.available and self.engine.fault_hook is None:
                    self._cold_streak = COLD_READ_STREAK
                self._load_chain(dir_fd, name, encoded, slot, page, done)
            else:
                self._open_then_read(dir_fd, name, encoded, slot, page, done)
        except BaseException as exc:
            # (a signal's KeyboardInterrupt) before the ring took the read: every chain's submit
            # is the last call of its path (and a submit that raises took nothing).
            if not isinstance(exc, Exception):
                if fd >= 0 and not_started(self._read_file, exc):
                    os.close(fd)
                _fault_later(done)
            raise

    def _load_chain(self, dir_fd: int, name: str, encoded: bytes, slot: int, page: PageBuffer,
                    done: Loaded) -> None:
        """A cold read as one submission: OPENAT into the slot's fixed-file entry
        (``O_NOFOLLOW|O_NONBLOCK|O_DIRECT``), header and page, FIXED_FD_INSTALL (the opened file as
        a normal fd of ours, its number reported), CLOSE of the entry. Then on the loop the
        installed fd is ``fstat``-checked (:func:`check_page_fd`: a regular file of our uid) and
        closed: the check looks at the file the chain opened and read, never at a name, so a rename
        race in the directory cannot pass another file off (it could when a STATX of the name was
        the check). The bytes count only after that check; the caller then verifies header and
        checksum. The install comes after the transfer so that its CQE (it reports: the fd's
        number is not known in advance) and the CLOSE's post together: one wake-up of the loop per
        page; installed first, its CQE woke the loop once more while the page was still being read
        (#14).

        The open itself is as safe as the checked way's: a symlink fails it (ELOOP), a socket
        too (ENXIO), and ``O_NONBLOCK`` opens a FIFO at once, which ``O_DIRECT`` then refuses
        (EINVAL), as it refuses character devices. An EINVAL open (what it is needs a look), an
        install the kernel does not know (before 6.8) and a file system answering EAGAIN to
        ``O_NONBLOCK`` reads go the checked way (the last two: from then on, every read). So does
        a short transfer (the chain broke before its install: what was read is not looked at),
        where the checked way tells a truncated page file of ours from anything else; an errno from
        the transfer is the read's fault (a counted miss; no byte counts)."""
        slots = self._slots
        path = slots.path(slot, encoded)
        keep: object = (slots, self._pool, page.view)
        if path is None:
            buffer = ctypes.create_string_buffer(encoded)
            path, keep = ctypes.addressof(buffer), (buffer, keep)
        # READ_FLAGS without O_CLOEXEC (see start_publish).
        flags = (READ_FLAGS & ~os.O_CLOEXEC) | os.O_DIRECT
        moves = self._transfer(False, slot, True, slot, page)
        # OPENAT into the entry, the transfer, FIXED_FD_INSTALL, CLOSE of the entry (SQE tuples as
        # uring.sqe lays them out: see _transfer); what each returns on success (_moved, inline).
        if len(moves) == 1:
            ops = [(uring.OP_OPENAT, 0, 0, dir_fd, 0, path, 0, flags, 0, 0, 0, slot + 1, 0, 0), moves[0],
                   (uring.OP_FIXED_FD_INSTALL, uring.IOSQE_FIXED_FILE, 0, slot, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
                   (uring.OP_CLOSE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, slot + 1, 0, 0)]
            moved = HEADER_BYTES + self._page_bytes
            expect = [0, moved, 0, 0]
        else:
            first, second = moves
            ops = [(uring.OP_OPENAT, 0, 0, dir_fd, 0, path, 0, flags, 0, 0, 0, slot + 1, 0, 0), first, second,
                   (uring.OP_FIXED_FD_INSTALL, uring.IOSQE_FIXED_FILE, 0, slot, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
                   (uring.OP_CLOSE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, slot + 1, 0, 0)]
            expect = [0, first[6], second[6], 0, 0]
            moved = first[6] + second[6]
        uid = self._uid

        def read(results: list[int]) -> None:
            try:
                installed = results[-2]
                if installed >= 0:  # every op before it succeeded: the whole page was read
                    try:
                        # check_page_fd's test, inline (once per page); it raises what a refusal says.
                        st = os.fstat(installed)
                        if st.st_mode & 0o170000 != stat.S_IFREG or st.st_uid != uid:
                            check_page_fd(installed, name, False)
                    except OSError as exc:
                        done(exc)  # whatever the read did: its bytes never count
                        return
                    finally:
                        os.close(installed)
                    done(moved)
                    return
                if results[0] >= 0 and results[-1] == -errno.ECANCELED:
                    # A broken chain skipped its CLOSE: the entry is closed first, as it must be empty
                    # before the slot goes to another page's chain.

                    def closed(_: list[int]) -> None:
                        # A function, not a ``functools.partial``: the ring runs a callback again
                        # only when it never started, which it cannot tell for a partial (whose
                        # call's return is where an interrupt comes after it ran: a second read
                        # the checked way went into the slot and page after the read's end).
                        try:
                            self._chain_failed(results, dir_fd, name, slot, page, done)
                        except BaseException as exc:
                            if not isinstance(exc, Exception):  # (a signal's KeyboardInterrupt): once, at most
                                _fault_later(done)
                            raise

                    self.engine.submit([uring.sqe(uring.OP_CLOSE, 0, file_index=slot + 1)], None, closed)
                    return
                self._chain_failed(results, dir_fd, name, slot, page, done)
            except BaseException as exc:
                if not isinstance(exc, Exception):  # (a signal's KeyboardInterrupt): done ignores a second call
                    _fault_later(done)
                raise

        self.engine.submit(ops, keep, read, expect=expect, report=len(ops) - 2)

    def _chain_failed(self, results: list[int], dir_fd: int, name: str, slot: int, page: PageBuffer,
                      done: Loaded) -> None:
        """A broken or refused read chain whose install did not run (its fixed-file entry closed):
        the fault, or the checked way where the chain cannot tell (an EINVAL open, no install, an
        EAGAIN read, a short read)."""
        opened, installed = results[0], results[-2]
        if opened < 0 and opened != -errno.ECANCELED and results.count(opened) == len(results):
            # A submission the kernel refused (io_uring_enter failed: every op answers its errno,
            # none ran): this read's fault, a counted miss. Says nothing of the chain: taken for
            # "cannot install", a passing refusal turned chain reads off for good (review 289).
            done(OSError(-opened, os.strerror(-opened)))
            return
        if opened >= 0 and installed in _INSTALL_WANTS_ROOM:
            # The install found no free descriptor (the process's limit, for now): this read alone
            # goes the checked way. Taken for "cannot install here", one moment at the limit sent
            # every later cold read through an OPENAT round trip and a look on the loop for good.
            self._open_then_read(dir_fd, name, name.encode(), slot, page, done)
            return
        if opened == -errno.ECANCELED or installed != -errno.ECANCELED:
            # The kernel refused the chain: an op it does not know fails the whole chain at its
            # submission (FIXED_FD_INSTALL before 6.8: nothing ran), or the install itself failed
            # (its entry closed) for a reason that lasts. The checked way, from now on.
            self.chain_reads = False
            log.info("disk tier: io_uring cannot install opened files here (%s): opening page files before "
                     "reading them from now on", os.strerror(-installed if opened >= 0 else -opened))
            self._open_then_read(dir_fd, name, name.encode(), slot, page, done)
            return
        if opened < 0:
            if opened == -errno.EINVAL:
                self._open_then_read(dir_fd, name, name.encode(), slot, page, done)
            else:
                done(classify_read_open_error(OSError(-opened, os.strerror(-opened)), dir_fd, name))
            return
        got = _bytes_read(results[1:-2])
        if isinstance(got, OSError):
            if got.errno != errno.EAGAIN:
                done(got)  # an I/O fault: a counted miss, whatever the file (none of its bytes count)
                return
            # This file system answers O_NONBLOCK reads with EAGAIN: the checked way from now on.
            self.chain_reads = False
            log.info("disk tier: io_uring reads of O_NONBLOCK files answer EAGAIN here: opening "
                     "page files before reading them from now on")
        # A short read (or EAGAIN): the checked way opens the name again, looks at the file, then
        # reads it (a truncated page file of ours is refused then, anything else is not ours).
        self._open_then_read(dir_fd, name, name.encode(), slot, page, done)

    def _open_then_read(self, dir_fd: int, name: str, encoded: bytes, slot: int, page: PageBuffer,
                        done: Loaded) -> None:
        """A cold read the checked way: an OPENAT through the ring into a normal fd (O_NONBLOCK: a
        FIFO must not block the open), ``fstat``-checked on the loop, then one chain: header and
        page, CLOSE."""
        path, _, keep = self._names(slot, encoded, None)

        def opened(results: list[int]) -> None:
            fd = results[0]
            try:
                if fd < 0:
                    done(classify_read_open_error(OSError(-fd, os.strerror(-fd)), dir_fd, name))
                    return
                self._read_file(fd, dir_fd, name, slot, page, done, False, READ_FLAGS)
            except BaseException as exc:
                if not isinstance(exc, Exception):  # (a signal's KeyboardInterrupt)
                    if fd >= 0 and not_started(self._read_file, exc):
                        os.close(fd)
                    _fault_later(done)
                raise

        self.engine.submit([uring.sqe(uring.OP_OPENAT, dir_fd, path, 0, 0, READ_FLAGS)],
                           (keep, self._slots), opened)

    def _read_file(self, fd: int, dir_fd: int, name: str, slot: int, page: PageBuffer, done: Loaded, now: bool,
                   flags: int) -> None:
        """Check the open ``fd`` of ``name`` (in ``dir_fd``), then read header and page and close it in one chain.
        ``now``: called from inside :meth:`start_load` (``done`` must then wait for the loop).
        ``flags``: those it was opened with; opened with O_DIRECT, it stays O_NONBLOCK (no fcntl),
        as a chain's file does, and a file system answering such reads with EAGAIN sends this read
        and every later one the checked way (as :meth:`_chain_failed`).
        Owns ``fd`` from its start: closed unless its chain took it (also after an interrupt)."""
        owned = fd
        kept_nonblock = bool(flags & os.O_DIRECT)
        try:
            try:
                check_page_fd(fd, name, False)
                if not kept_nonblock:
                    ready_for_io(fd, self.direct and page.aligned, flags)
            except Exception as exc:
                owned = -1
                os.close(fd)  # nothing was read through it
                if now:
                    asyncio.get_running_loop().call_soon(done, exc)
                else:
                    done(exc)
                return
            ops = self._transfer(False, fd, False, slot, page)
            expect = self._moved(ops)
            ops.append((uring.OP_CLOSE, 0, 0, fd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))  # as uring.sqe(OP_CLOSE, fd)
            expect.append(0)

            def read(results: list[int]) -> None:
                try:
                    if results[-1] == -errno.ECANCELED:  # a broken chain skipped its CLOSE
                        try:
                            self.engine.submit([uring.sqe(uring.OP_CLOSE, fd)], None, _ignore)
                        except BaseException:
                            os.close(fd)  # (a signal's KeyboardInterrupt: the ring took nothing)
                            raise
                    if kept_nonblock and -errno.EAGAIN in results[:-1]:
                        # This file system answers O_NONBLOCK reads with EAGAIN: the checked way
                        # (its file's O_NONBLOCK cleared) now and from now on; no byte counted.
                        self.chain_reads = False
                        log.info("disk tier: io_uring reads of O_NONBLOCK files answer EAGAIN here: opening "
                                 "page files before reading them from now on")
                        self._open_then_read(dir_fd, name, name.encode(), slot, page, done)
                        return
                    done(_bytes_read(results[:-1]))
                except BaseException as exc:
                    if not isinstance(exc, Exception):  # (a signal's KeyboardInterrupt): done ignores a second call
                        _fault_later(done)
                    raise

            self.engine.submit(ops, (self._slots, self._pool, page.view), read, expect=expect)
        except BaseException as exc:
            if not isinstance(exc, Exception):  # (a signal's KeyboardInterrupt: the ring took nothing)
                if owned >= 0:
                    os.close(owned)
                _fault_later(done)
            raise

    async def unlink(self, dir_fd: int, name: str) -> None:
        await self.engine.unlinkat(name.encode(), dir_fd=dir_fd)

    def call_next_turn(self, fn: Callable[[], None]) -> None:
        self.engine.call_next_turn(fn)

    def thread_waker(self, deliver: Callable[[float], None]) -> Callable[[], bool] | None:
        self.engine.on_wake = deliver
        return self.engine.wake_threadsafe

    async def aclose(self) -> None:
        if self._registering is not None:
            # The ring must outlive the registration syscall (register_pool waits for it).
            self._registering.cancel()
            await asyncio.gather(self._registering, return_exceptions=True)
        while self._ext_jobs:  # register_memory calls still pinning: stopped after their piece
            for stop in self._ext_jobs.values():
                stop.set()
            await asyncio.wait(set(self._ext_jobs))
        await self.engine.aclose()
        for view in self._ext_views:  # unpinned with the ring: the caller may unmap its regions now
            view.release()
        self._ext_views.clear()


def _registration_cut(job: asyncio.Future[None]) -> None:
    """The pool's registration, stopped by the close, ended: its error is logged, not left unretrieved."""
    error = None if job.cancelled() else job.exception()
    if isinstance(error, OSError):
        log.warning("disk tier: registering the pool as fixed buffers failed as the close stopped it: %s", error)
    elif error is not None:
        log.error("disk tier: registering the pool as fixed buffers ended with %r", error)


def _pinning_cut(job: asyncio.Future[None], length: int, address: int) -> None:
    """A cancelled ``register_memory``'s thread ended: its error is logged, not left unretrieved."""
    error = None if job.cancelled() else job.exception()
    if isinstance(error, OSError):
        log.warning("disk tier: cannot register %d bytes at %#x as fixed buffers (%s); plain buffers there",
                    length, address, error)
    elif error is not None:
        log.error("disk tier: registering %d bytes at %#x as fixed buffers ended with %r", length, address, error)


def _keep_registered(_: None) -> None:
    """A caller's region registered after its loop closed: the ring drops it when it closes."""


def _taken(done: Recycled, error: BaseException | None) -> None:
    """A recycle's ``done`` after its victim was taken over."""
    done(error, True)


def _cleaned_up(task: asyncio.Task[None], done: Published) -> None:
    # A cancelled clean-up (its loop is going away) is a failed write too: ``task.exception()``
    # would raise, ``done`` would never run and the page's job would never end.
    try:
        if task.cancelled():
            error: BaseException = OSError(errno.ECANCELED, "write clean-up cancelled")
        else:
            error = task.exception() or OSError(errno.EIO, "write chain failed")
            if not isinstance(error, Exception):  # a signal's KeyboardInterrupt cut it short
                error = InterruptedError(errno.EINTR, "write clean-up interrupted by a signal")
        done(error)
    except BaseException as exc:
        if not isinstance(exc, Exception):  # (a signal's KeyboardInterrupt) again next turn: done ignores a second call
            asyncio.get_running_loop().call_soon(_cleaned_up, task, done)
        raise


class _NotTaken(Exception):
    """The victim of a recycling write was not taken over (threads backend): ``error`` says why."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error)
        self.error = error


_Work = tuple[Callable[..., object], tuple[object, ...], Outcomes, asyncio.Future[object]]
"""A job of :class:`ThreadPageIO`'s workers: a function, its arguments, and where its outcome goes."""


class ThreadPageIO:
    """Page files through ``os.pwritev``/``os.preadv`` in worker threads (io_uring refused).

    Create with ``await ThreadPageIO.open(...)``: its workers are started from a thread of their
    own, so that the loop never waits in ``Thread.start`` (which waits until the new thread runs: ms
    on a loaded machine, #11). Reads and writes have ``threads`` workers each (``aiokv-disk_<i>``: the
    first ``threads`` read), each kind fed in the order started through an unbounded queue of its
    own (the tier bounds what it has in flight): a write stuck in the kernel (a frozen file system
    blocks writes, not reads) never holds up a read (#11: one shared queue made a load wait 14 s,
    until the thaw). Unlinks are writes. Outcomes reach the loop through :class:`~.outcomes.Outcomes`:
    jobs ending before the loop drained the first one's share its wake-up."""

    kind = DiskBackend.THREADS

    def __init__(self, pool: PagePool, slots: HeaderSlots, direct: bool, threads: int) -> None:
        self.direct = direct
        self.faults = FaultPlan()
        self._pool = pool
        self._slots = slots
        self._reads: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._writes: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        # Daemons, as the checksum threads: a tier never closed must not hold the interpreter's
        # exit (a write cut there leaves a temporary name or a torn file, as a crash does).
        # Readers first: ``aiokv-disk_<i>``, i < threads reads, the rest writes.
        queues = [self._reads] * threads + [self._writes] * threads
        self._threads = [(threading.Thread(target=self._work, args=(jobs,), name=f"aiokv-disk_{i}", daemon=True), jobs)
                         for i, jobs in enumerate(queues)]
        self._started: list[tuple[threading.Thread, queue.SimpleQueue[_Work | None]]] = []
        self._closed = False
        self._stopped: asyncio.Future[None] | None = None  # the join of the stopped workers
        self._jobs: set[asyncio.Future[object]] = set()
        self._outcomes: Outcomes | None = None  # the running loop's (a new loop gets its own)

    def outcomes(self, loop: asyncio.AbstractEventLoop) -> Outcomes:
        """Where the workers post the outcomes of jobs started on ``loop``."""
        outcomes = self._outcomes
        if outcomes is None or outcomes.loop is not loop:
            outcomes = self._outcomes = Outcomes(loop)
        return outcomes

    @classmethod
    async def open(cls, pool: PagePool, slots: HeaderSlots, direct: bool, threads: int) -> ThreadPageIO:
        """A backend with its workers running. ``RuntimeError`` when one cannot start (no thread
        left: those started have ended first). A cancelled call waits for the starting thread, then
        until the workers it started have ended (even if cancelled again), then raises
        ``CancelledError``."""
        io = cls(pool, slots, direct, threads)
        job = run_in_new_thread(io._start_workers, "aiokv-disk-start-workers", io._stop_orphaned)
        try:
            await asyncio.shield(job)
        except asyncio.CancelledError:
            await wait_uncancelled(job)  # (its failure, retrieved there, is no one's: the start was cut)
            await io._end_workers()
            raise
        return io

    def _start_workers(self) -> None:
        """In a thread of its own: start every worker, or none (those started are stopped and
        joined before the error goes to the caller)."""
        try:
            for thread, jobs in self._threads:
                thread.start()
                self._started.append((thread, jobs))
        except BaseException:
            _join(self._stop_workers())
            raise

    def _stop_workers(self) -> list[threading.Thread]:
        """Tell the started workers to stop once the queued jobs are done; returns them, to join."""
        started, self._started = self._started, []
        for _, jobs in started:
            jobs.put(None)
        return [thread for thread, _ in started]

    def _stop_orphaned(self, _: None) -> None:
        # Workers started for a caller whose loop closed first: nobody will close this backend.
        self._stop_workers()

    @staticmethod
    def _work(jobs: queue.SimpleQueue[_Work | None]) -> None:
        """A worker: run ``jobs`` until told to stop, each outcome handed to its future on its loop."""
        while (work := jobs.get()) is not None:
            fn, args, outcomes, future = work
            result: object = None
            error: BaseException | None = None
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the job's future, as an executor does
                error = exc
            # Outcomes ending before the loop drained the first share its wake-up (outcomes.py).
            outcomes.post(future, result, error)
            # Not held while waiting for the next job: its page may be a caller's memory it unmaps.
            del work, fn, args, future, result, error

    def _fault(self, op: IOOp) -> None:
        err = self.faults.take(op)
        if err is not None:
            raise OSError(err, os.strerror(err))

    def _start(self, fn: Callable[..., object], *args: object, read: bool = False) -> asyncio.Future[object]:
        if self._closed:
            raise RuntimeError("disk I/O threads are closed")
        loop = asyncio.get_running_loop()
        job: asyncio.Future[object] = loop.create_future()
        # Its removal added before it is counted: a signal's KeyboardInterrupt as a call returns
        # never leaves a job counted for ever (aclose would wait on it again every turn).
        job.add_done_callback(self._jobs.discard)
        self._jobs.add(job)
        (self._reads if read else self._writes).put((fn, args, self.outcomes(loop), job))
        return job

    def _begin(self, fn: Callable[..., object], args: tuple[object, ...], read: bool,
               finished: Callable[[asyncio.Future[object]], None], fault: Callable[[], None]) -> None:
        """Queue ``fn(*args)`` for a worker; ``finished(job)`` on the loop with its outcome. Once
        this started, a KeyboardInterrupt (a signal) never loses it: queued, it finishes as usual;
        not queued yet, ``fault()`` is called (it reports the interrupt in the next turn)."""
        queued = False
        job: asyncio.Future[object] | None = None
        try:
            if self._closed:
                raise RuntimeError("disk I/O threads are closed")
            loop = asyncio.get_running_loop()
            job = loop.create_future()
            job.add_done_callback(finished)
            job.add_done_callback(self._jobs.discard)
            self._jobs.add(job)
            outcomes = self.outcomes(loop)
            queued = True  # no call before the put: an interrupt raised as it returns finds this set
            (self._reads if read else self._writes).put((fn, args, outcomes, job))
        except BaseException as exc:
            if not queued and not isinstance(exc, Exception):
                if job is not None:
                    self._jobs.discard(job)  # never settled: aclose must not wait for it
                fault()
            raise

    async def _run(self, fn: Callable[..., object], *args: object) -> object:
        # A cancelled caller must not return while the thread still touches the page: wait it out.
        job = self._start(fn, *args)
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            # shield forgets the job once its caller is cancelled first: a failure landing later
            # (an unlink held in a frozen file system, then EISDIR) was logged by asyncio as
            # "Future exception was never retrieved" (review 284). Its outcome is nobody's now.
            job.add_done_callback(_retrieve)
            raise

    def _open(self, dir_fd: int, name: str, flags: int, write: bool, direct: bool) -> int:
        self._fault(IOOp.OPEN)
        return open_page_file(name, flags, dir_fd, write, self.direct and direct)

    def _recycle(self, victim_dir: int, victim: str, dir_fd: int, final: str, slot: int, page: PageBuffer,
                 sync: bool) -> None:
        try:
            fd = self._open(victim_dir, victim, os.O_WRONLY, write=True, direct=page.aligned)
        except OSError as exc:
            raise _NotTaken(exc) from None
        self._write_rename(fd, victim_dir, victim, dir_fd, final, slot, page, sync)

    def _publish(self, dir_fd: int, temp: str, final: str, slot: int, page: PageBuffer, sync: bool) -> None:
        try:
            fd = self._open(dir_fd, temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, write=True, direct=page.aligned)
        except OSError as exc:
            if exc.errno == errno.EEXIST:
                raise _planted_temp(temp) from None
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
            raise
        self._write_rename(fd, dir_fd, temp, dir_fd, final, slot, page, sync)

    def _write_rename(self, fd: int, src_dir: int, src: str, dir_fd: int, final: str, slot: int, page: PageBuffer,
                      sync: bool) -> None:
        """Header and page into ``fd`` (the file named ``src``), [fdatasync], close, rename ``src`` to
        ``final``; on a fault ``src`` is removed (it holds a torn or misnamed file)."""
        try:
            self._fault(IOOp.WRITE)
            views = [self._slots.views[slot], page.view]
            want = HEADER_BYTES + len(views[1])
            got = os.pwritev(fd, views, 0)
            if got != want:
                raise _short_write(got, want)
            if sync:
                self._fault(IOOp.FSYNC)
                os.fdatasync(fd)
            # Forget the number before closing: a close that fails (EIO on NFS) has still released
            # it, and closing it again below could close another thread's new file.
            closing, fd = fd, -1
            os.close(closing)
            self._fault(IOOp.RENAME)
            os.rename(src, final, src_dir_fd=src_dir, dst_dir_fd=dir_fd)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(src, dir_fd=src_dir)
            raise

    def _load(self, dir_fd: int, name: str, slot: int, page: PageBuffer) -> int:
        fd = self._open(dir_fd, name, READ_FLAGS, write=False, direct=page.aligned)
        try:
            self._fault(IOOp.READ)
            return os.preadv(fd, [self._slots.views[slot], page.view], 0)
        finally:
            os.close(fd)

    def _unlink(self, dir_fd: int, name: str) -> None:
        self._fault(IOOp.UNLINK)
        os.unlink(name, dir_fd=dir_fd)

    def start_publish(self, dir_fd: int, temp: str, final: str, slot: int, page: PageBuffer, sync: bool,
                      done: Published) -> None:
        try:
            self._begin(self._publish, (dir_fd, temp, final, slot, page, sync), False,
                        functools.partial(_published, done), functools.partial(_fault_later, done))
        except BaseException as exc:
            if not isinstance(exc, Exception) and not_started(self._begin, exc):  # (a signal's KeyboardInterrupt)
                _fault_later(done)
            raise

    def start_recycle(self, victim_dir: int, victim: str, dir_fd: int, final: str, slot: int,
                      page: PageBuffer, sync: bool, done: Recycled) -> None:
        try:
            self._begin(self._recycle, (victim_dir, victim, dir_fd, final, slot, page, sync), False,
                        functools.partial(_recycled, done), functools.partial(_fault_later, done, False))
        except BaseException as exc:
            if not isinstance(exc, Exception) and not_started(self._begin, exc):  # (a signal's KeyboardInterrupt)
                _fault_later(done, False)
            raise

    def start_load(self, dir_fd: int, name: str, slot: int, page: PageBuffer, done: Loaded) -> None:
        try:
            self._begin(self._load, (dir_fd, name, slot, page), True, functools.partial(_loaded, done),
                        functools.partial(_fault_later, done))
        except BaseException as exc:
            if not isinstance(exc, Exception) and not_started(self._begin, exc):  # (a signal's KeyboardInterrupt)
                _fault_later(done)
            raise

    async def unlink(self, dir_fd: int, name: str) -> None:
        await self._run(self._unlink, dir_fd, name)

    def call_next_turn(self, fn: Callable[[], None]) -> None:
        asyncio.get_running_loop().call_soon(fn)

    def thread_waker(self, deliver: Callable[[float], None]) -> Callable[[], bool] | None:
        return None  # the threads' results wake the loop through call_soon_threadsafe

    async def register_memory(self, view: memoryview, address: int) -> bool:
        view.release()  # not kept: no fixed buffers without io_uring (plain pwritev/preadv)
        return False

    async def aclose(self) -> None:
        """Wait for the jobs started, then stop the workers and wait until they have ended (joined
        on a thread started without the loop waiting). Idempotent. A cancelled call still waits
        until the workers have ended (after the jobs queued: nothing touches a page any more),
        then raises ``CancelledError``."""
        self._closed = True
        try:
            while self._jobs:
                await asyncio.wait(set(self._jobs))
        finally:
            await self._end_workers()

    async def _end_workers(self) -> None:
        """Stop the started workers and wait until they have ended (a cancelled call still waits)."""
        workers = self._stop_workers()
        if workers:
            self._stopped = run_in_new_thread(functools.partial(_join, workers), "aiokv-join-disk-workers", _ended)
        if self._stopped is None:
            return
        try:
            await asyncio.shield(self._stopped)
        except asyncio.CancelledError:
            await wait_uncancelled(self._stopped)
            raise


@again_after_interrupt
def _loaded(done: Loaded, job: asyncio.Future[object]) -> None:
    """A worker's load ended: ``done`` with the bytes read or the fault (``done`` ignores a second
    call: see :func:`~.outcomes.again_after_interrupt`)."""
    done(job.exception() or job.result())  # type: ignore[arg-type]


@again_after_interrupt
def _published(done: Published, job: asyncio.Future[object]) -> None:
    """A worker's publish ended (as :func:`_loaded`)."""
    done(job.exception())


def _retrieve(job: asyncio.Future[object]) -> None:
    """The outcome of a job whose caller was cancelled: retrieved, so a failure is not logged
    as never retrieved (the caller counted nothing: it never learnt of it)."""
    if not job.cancelled():
        job.exception()


@again_after_interrupt
def _recycled(done: Recycled, job: asyncio.Future[object]) -> None:
    """A worker's recycle ended: not taken over, or taken (as :func:`_loaded`)."""
    exc = job.exception()
    if isinstance(exc, _NotTaken):
        done(exc.error, False)
    else:
        done(exc, True)


def _join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join()


def _ended(_: None) -> None:
    """The workers were joined after their loop closed: nothing is left to do."""


async def open_backend(config: DiskConfig, pool: PagePool, slots: HeaderSlots, direct: bool) -> PageIO:
    """The backend ``config`` asks for; AUTO falls back step by step with one warning each."""
    want = config.backend
    if want is DiskBackend.THREADS:
        return await ThreadPageIO.open(pool, slots, direct, config.threads)
    try:
        # Room for every I/O slot's SQEs at once.
        engine = uring.UringEngine.open(max(config.ring_entries, CHAIN_MAX * config.queue_depth))
        engine.async_data = issue_async(pool.layout.page_bytes, config.queue_depth)
        try:
            # One fixed-file entry per I/O slot: a new page file is opened, written, closed and
            # renamed in one chain (kernel >= 5.15).
            engine.register_files(config.queue_depth)
        except BaseException:
            await engine.aclose()
            raise
    except OSError as exc:
        if want is not DiskBackend.AUTO:
            raise
        log.warning("disk tier: io_uring refused (%s); using the thread-pool backend", exc)
        return await ThreadPageIO.open(pool, slots, direct, config.threads)
    try:
        if want is DiskBackend.URING_FIXED:
            # Forced: registration must work (or the tier does not start), so wait for it.
            return UringPageIO(engine, pool, slots, direct, await register_pool(engine, pool, slots))
        io = UringPageIO(engine, pool, slots, direct, None)
        if want is DiskBackend.AUTO:
            # Registering pins (faults in) the whole pool: ~1 s/GiB of untouched memory, a minute
            # for a large pool. Serve with unregistered buffers meanwhile; switch when it is done.
            io.register_in_background()
        return io
    except BaseException:
        await engine.aclose()
        raise


ASYNC_PAGE_BYTES = 8 << 20
"""Pages this large or larger move through io-wq workers (``UringEngine.async_data``): inline
issue of a large O_DIRECT op can block ``io_uring_enter`` (and so the loop) for hundreds of ms."""

ASYNC_INFLIGHT_BYTES = 64 << 20
"""So do smaller pages when the I/O slots can hold this many page bytes in flight at once
(``queue_depth`` x page): inline issue waits in ``io_uring_enter`` for the device once it holds
that much (#14, ext4 on a loop device: 4 MiB pages at queue depth 32, 128 MiB, slept 70-120 ms in
one submit, the loop thread off the CPU, never at 32 MiB in flight: 4 MiB x 8, 1 MiB x 32)."""


def issue_async(page_bytes: int, queue_depth: int) -> bool:
    """Whether page reads and writes go through io-wq (IOSQE_ASYNC) rather than inline."""
    return page_bytes >= ASYNC_PAGE_BYTES or page_bytes * queue_depth >= ASYNC_INFLIGHT_BYTES

def describe_layout_io(layout: KVLayout, io: PageIO) -> str:
    """One log line: backend, O_DIRECT and page geometry."""
    return f"disk tier: {io.kind.value}, {'O_DIRECT' if io.direct else 'buffered'}, {layout.describe()}"
