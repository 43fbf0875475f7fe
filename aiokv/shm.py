"""A POSIX shared-memory segment for the page pool, prepared in chunks in the background.

Created with ``O_CREAT | O_EXCL`` and mode 0600 under a unique name (never reusing a leftover
segment); other processes (tensor-parallel workers) attach by name; only the creator unlinks.
Opened through ``shm_open`` directly rather than ``multiprocessing.shared_memory``, whose resource
tracker would unlink the segment when an attaching worker exits (Python < 3.13).

Ownership: every process that has a segment open holds a shared ``flock`` on its descriptor, so the
lock disappears with the last such process, however it dies (SIGKILL included). The name is
``/<prefix>-<pid>-<start>-<random>`` (creator's pid and start time in clock ticks since boot, which
tell pid reuse apart; tmpfs does not survive a reboot, so no boot id is needed).
:mod:`aiokv.reclaim` reclaims segments whose lock nobody holds.

Preparing a chunk reserves its tmpfs pages (``posix_fallocate``: a too-small ``/dev/shm`` becomes
a counted chunk failure, never a SIGBUS on first touch) and, with CUDA, faults it in and registers it
as pinned, device-mapped memory. Registration of untouched memory costs ~1 s/GiB, so it runs in
worker threads, chunk by chunk, and the pool hands out pages of ready chunks only.
"""

from __future__ import annotations

import _posixshmem  # type: ignore[import-not-found]
import concurrent.futures
import ctypes
import ctypes.util
import fcntl
import logging
import mmap
import os
import secrets
import threading
from dataclasses import dataclass
from typing import Any, Protocol, cast

log = logging.getLogger(__name__)

SHM_NAME_PREFIX = "aiokv"
SHM_DIR = "/dev/shm"
"""Where Linux (glibc) keeps POSIX shared-memory names: ``shm_open("/x")`` is ``SHM_DIR + "/x"``."""
MADV_DONTNEED = 4
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; faults pages in without touching them from Python
CUDA_HOST_REGISTER_PORTABLE = 1
CUDA_HOST_REGISTER_MAPPED = 2


class _ShmModule(Protocol):
    def shm_open(self, path: str, flags: int, mode: int = ...) -> int: ...
    def shm_unlink(self, path: str) -> None: ...


_shm = cast(_ShmModule, _posixshmem)
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


class SegmentSpaceError(OSError):
    """The shared-memory file system cannot hold the requested segment."""


def shm_free_bytes() -> int | None:
    """Free bytes of the shared-memory file system (None where it cannot be asked)."""
    # shm_open's segments live in SHM_DIR on Linux; elsewhere we cannot ask.
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def process_start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot; None when there is no such process.

    Together with the pid it names one process: a reused pid has another start time.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 22; the command name (field 2) may hold spaces and parentheses, so split after its last ')'.
    try:
        return int(stat.rsplit(b")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def segment_name(prefix: str = SHM_NAME_PREFIX) -> str:
    """A fresh segment name ``/<prefix>-<pid>-<start ticks>-<16 hex>`` for this process."""
    pid = os.getpid()
    return f"/{prefix}-{pid}-{process_start_ticks(pid) or 0}-{secrets.token_hex(8)}"


@dataclass(frozen=True)
class ChunkResult:
    """Outcome of preparing one chunk: ``error`` is None when its pages may be used."""

    index: int
    offset: int
    length: int
    registered: bool
    error: BaseException | None


class SharedSegment:
    """One mapped shared-memory segment.

    ``create`` makes a new one (this process unlinks it at :meth:`close`); ``attach`` maps an
    existing one by name. ``buffer`` is the writable mapping; ``address`` its virtual address.
    """

    def __init__(self, name: str, fd: int, size: int, owner: bool) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._fd = fd
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.buffer = memoryview(self._map)
        probe = ctypes.c_char.from_buffer(self._map)
        self.address = ctypes.addressof(probe)
        del probe  # the address stays valid for the life of the mapping
        self._closed = False
        self._unlinked = not owner  # only the creator unlinks
        self._registered: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    @classmethod
    def create(cls, size: int, prefix: str = SHM_NAME_PREFIX) -> SharedSegment:
        """Create a segment of ``size`` bytes (mode 0600, unique name).

        Raises ``ValueError`` for a non-positive size and :class:`SegmentSpaceError` when the
        shared-memory file system has less free space than ``size``.
        """
        if size <= 0:
            raise ValueError(f"segment size must be positive, got {size}")
        free = shm_free_bytes()
        if free is not None and free < size:
            raise SegmentSpaceError(
                f"/dev/shm has {free / 2**30:.2f} GiB free but the page pool needs {size / 2**30:.2f} GiB: "
                "lower the pool budget or enlarge /dev/shm (e.g. docker --shm-size)"
            )
        name = segment_name(prefix)
        fd = _shm.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Lock before sizing: a reclaimer that takes the lock first sees an empty segment and leaves
            # it alone (it holds the lock only for a moment, so blocking here is brief).
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.ftruncate(fd, size)
            return cls(name, fd, size, owner=True)
        except BaseException:
            _shm.shm_unlink(name)
            os.close(fd)
            raise

    @classmethod
    def attach(cls, name: str) -> SharedSegment:
        """Map an existing segment by name; this process never unlinks it.

        Raises ``FileNotFoundError`` when there is no such segment or it is being reclaimed (its
        creator died and no process holds it).
        """
        if not isinstance(name, str) or not name.startswith("/"):
            raise ValueError(f"segment name must be a str starting with '/', got {name!r}")
        fd = _shm.shm_open(name, os.O_RDWR, 0)
        try:
            try:
                # Holding the owner lock keeps the segment from being reclaimed while we use it.
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise FileNotFoundError(f"segment {name} is being reclaimed (its creator is gone)") from None
            size = os.fstat(fd).st_size
            if size <= 0:
                raise ValueError(f"segment {name} is empty")
            return cls(name, fd, size, owner=False)
        except BaseException:
            os.close(fd)
            raise

    def prepare_chunk(self, index: int, offset: int, length: int, register_cuda: bool) -> ChunkResult:
        """Reserve (and with ``register_cuda`` populate and register) ``[offset, offset + length)``.

        Runs in a worker thread; never raises, the error is in the result.
        """
        try:
            os.posix_fallocate(self._fd, offset, length)
            registered = False
            if register_cuda:
                # Populating first lets registration skip its own (slower) page faults; best effort.
                populate(self.address + offset, length)
                _cuda_host_register(self.address + offset, length)
                with self._lock:
                    if self._closed:
                        _cuda_host_unregister(self.address + offset)
                        raise RuntimeError("segment closed while registering")
                    self._registered.append((offset, length))
                registered = True
            return ChunkResult(index, offset, length, registered, None)
        except BaseException as exc:  # reported to the pool, which counts and logs it
            return ChunkResult(index, offset, length, False, exc)

    def unlink_name(self) -> None:
        """Remove the name now (the creator only; others: nothing), the mapping and the owner lock
        staying until :meth:`close`: a pool closed while I/O stuck in the kernel may still use its
        memory keeps the memory, never a name in /dev/shm (which would outlive the process if that
        I/O never ends). Nobody can attach after this. Idempotent."""
        with self._lock:
            if self._unlinked:
                return
            self._unlinked = True
        try:
            _shm.shm_unlink(self.name)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unregister, unmap and (for the creator) unlink. Idempotent.

        If some other object still holds an export of the mapping (a tensor, an io_uring iovec),
        the mapping stays until that object is collected; the name is unlinked regardless.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            registered, self._registered = self._registered, []
        for offset, _length in registered:
            _cuda_host_unregister(self.address + offset)
        # munmap holds the process's mmap lock for writing while it tears down every page table
        # entry (~200 ms for 1 GiB here), and the loop's thread waits on it for any fault or
        # allocation: drop the entries a step at a time first (the data stays in the segment), so
        # the unmap itself is quick.
        unpopulate(self.address, self.size)
        try:
            self.buffer.release()
            self._map.close()
        except BufferError:
            log.debug("segment %s still exported; unmapped when its last view is collected", self.name)
        self.unlink_name()
        # Closing drops the owner lock: only after the unlink, so the name never looks abandoned.
        os.close(self._fd)

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed


def _cudart() -> Any:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _init_cuda_driver() -> None:
    """``cuInit`` through ctypes, which releases the GIL for the call.

    The first ``torch.cuda.is_available()`` of a process initializes the driver inside a call that
    holds the GIL (~11 ms on an H200 host): from a helper thread that stalled the engine's loop.
    With the driver already initialized, torch's check is quick. No driver library: nothing to do.
    """
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        driver.cuInit(ctypes.c_uint(0))
    except (OSError, AttributeError):
        pass


def cuda_available() -> bool:
    """True when a CUDA device is usable (registration makes sense)."""
    import torch

    _init_cuda_driver()
    return bool(torch.cuda.is_available())


def _cuda_host_register(address: int, length: int) -> None:
    rt = _cudart()
    if rt is None:
        raise RuntimeError("CUDA is not available")
    flags = CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED
    err = rt.cudaHostRegister(address, length, flags)
    if int(err) != 0:
        raise OSError(f"cudaHostRegister({length} bytes) failed with CUDA error {int(err)}")


def _cuda_host_unregister(address: int) -> None:
    rt = _cudart()
    if rt is not None:
        rt.cudaHostUnregister(address)


PREPARE_NICE = 10
"""Nice increment of background threads (chunk preparation, reclaim): the event loop's thread wins the CPU."""


def lower_thread_priority() -> None:
    """Lower the calling thread's priority by :data:`PREPARE_NICE` (best effort; Linux nice is per thread)."""
    # A thread id names one thread for setpriority; raising one's own nice needs no privilege.
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREPARE_NICE)
    except (AttributeError, OSError):
        pass


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def prepare_in_background(
    segment: SharedSegment,
    chunks: list[tuple[int, int]],
    register_cuda: bool,
    workers: int,
) -> tuple[concurrent.futures.ThreadPoolExecutor, list[concurrent.futures.Future[ChunkResult]]]:
    """Submit every chunk ``(offset, length)`` to ``workers`` threads; returns the executor and futures.

    Preparation is kernel work (zeroing, pinning) that takes a CPU per thread: at most one thread
    fewer than this process's CPUs, so the event loop's thread keeps one (on a 2-CPU VM, 2-4 threads
    filled no faster than 1 and stalled the loop 4-5 ms instead of 1), and at lower priority
    (:data:`PREPARE_NICE`).
    """
    # No more threads than chunks: the executor starts a thread on the submitting thread when none
    # is idle, so spare capacity made a later submit from the loop (run_in_background, the close)
    # start one there and wait until it ran (seen on a 16-core host while a chunk was preparing).
    threads = max(1, min(workers, _cpus() - 1, len(chunks)))
    executor = concurrent.futures.ThreadPoolExecutor(
        max_workers=threads, thread_name_prefix="aiokv-pool", initializer=lower_thread_priority
    )
    futures = [
        executor.submit(segment.prepare_chunk, index, offset, length, register_cuda)
        for index, (offset, length) in enumerate(chunks)
    ]
    return executor, futures


POPULATE_STEP = 2 << 20
"""Bytes faulted in per madvise call. The kernel holds the process's mmap lock for a whole call
(~1 s/GiB of untouched tmpfs), and any mmap/munmap in another thread, the loop's included (an
allocation of a large object, a new thread's stack), waits for it: 256 MiB per call stalled the
loop ~250 ms, 16 MiB still 6-16 ms; 2 MiB keeps each wait near 2 ms at worst."""


def unpopulate(address: int, length: int) -> None:
    """Drop the page table entries of ``length`` bytes of a shared mapping at ``address``
    (MADV_DONTNEED, :data:`POPULATE_STEP` at a time); the segment's data stays, a later access
    faults it back in."""
    for offset in range(0, length, POPULATE_STEP):
        _libc.madvise(ctypes.c_void_p(address + offset), min(POPULATE_STEP, length - offset), MADV_DONTNEED)


def populate(address: int, length: int) -> None:
    """Fault in ``length`` bytes of a shared mapping at ``address`` without touching them from
    Python (MADV_POPULATE_WRITE), :data:`POPULATE_STEP` at a time; a no-op where the kernel lacks
    it (before 5.14)."""
    for offset in range(0, length, POPULATE_STEP):
        _libc.madvise(ctypes.c_void_p(address + offset), min(POPULATE_STEP, length - offset), MADV_POPULATE_WRITE)
