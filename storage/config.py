"""Configuration and statistics of the disk tier."""

from __future__ import annotations

import enum
import errno
import logging
from dataclasses import dataclass, field
from pathlib import Path

from .safefiles import UnsafeFileError

log = logging.getLogger("aiokv.storage.disk")


class DiskBackend(enum.Enum):
    """How page bytes move between pool memory and page files."""

    AUTO = "auto"
    """The best that works here, falling back with one logged warning per step."""
    URING_FIXED = "uring_fixed"
    """io_uring with the pool registered as fixed buffers."""
    URING = "uring"
    """io_uring with plain (unregistered) buffers."""
    THREADS = "threads"
    """``os.preadv``/``os.pwritev`` in a thread pool."""


class ErrorKind(enum.Enum):
    """Kinds of I/O faults counted by the tier."""

    ENOSPC = "enospc"
    EIO = "eio"
    EPERM = "eperm"
    UNSAFE = "unsafe"
    """A symlink, special file, directory or foreign file where a page file should be (refused)."""
    OTHER = "other"


class ReadOnly(enum.Enum):
    """Why a tier serves reads but refuses writes."""

    FILE_SYSTEM = "read-only file system"
    """Mounted read-only (at start, or an EROFS answer since)."""
    NOT_WRITABLE = "directory not writable"
    """We may not create files in the layout directory."""
    LOCKED = "held by another cache"
    """Another cache (process) holds the directory's lock: it alone writes and evicts there."""


@dataclass(frozen=True)
class DiskConfig:
    """Settings of one :class:`~aiokv.storage.DiskTier`."""

    directory: Path
    """Root directory of the page files (created 0700); each layout uses its own subdirectory."""
    capacity_bytes: int
    """Byte budget for page files of this layout (header included); LRU eviction keeps within it."""
    backend: DiskBackend = DiskBackend.AUTO
    """Which I/O path to use; a forced one that cannot work makes :meth:`DiskTier.start` raise."""
    direct_io: bool | None = None
    """O_DIRECT on page files; None: where the file system allows it (tmpfs does not)."""
    queue_depth: int = 32
    """Page I/Os in flight at once (each page is a header plus a payload request)."""
    write_behind_depth: int = 256
    """Pages the write-behind queue holds before ``write_behind_nowait`` reports it full."""
    write_behind_workers: int = 8
    """Concurrent writes draining the write-behind queue."""
    threads: int = 4
    """Worker threads of the THREADS backend."""
    ring_entries: int = 128
    """SQ entries of the io_uring, raised to 6 x queue_depth (a page is a chain of up to 6 SQEs);
    the CQ has twice as many; more requests wait in a FIFO."""
    sync_writes: bool = False
    """fdatasync each page file before publishing it. Off: a process crash never loses an
    acknowledged page (the page cache survives it), and a power-loss torn page fails its checksum."""
    recycle_files: bool = True
    """A write that must evict renames the evicted file to its temporary name and overwrites it:
    creating a file costs ~0.8 ms of kernel CPU on ext4 here, overwriting an allocated one almost none."""
    drain_on_close: bool = True
    """``aclose`` writes out queued write-behind pages; False drops them (counted as dropped)."""
    min_free_bytes: int = 256 << 20
    """Free space left to others on the file system: the effective capacity is
    min(capacity_bytes, our files + free space - this), taken at start, on ENOSPC and (while below
    capacity_bytes) again at most every ``free_space_recheck_s``."""
    free_space_recheck_s: float = 1.0
    """Least seconds between two free-space checks while the file system limits the tier."""
    enospc_retries: int = 2
    """Times a write that met ENOSPC evicts least recently used files and tries again."""

    def __post_init__(self) -> None:
        if not isinstance(self.directory, Path):
            raise TypeError(f"directory must be a pathlib.Path, got {type(self.directory).__name__}")
        if not isinstance(self.backend, DiskBackend):
            raise TypeError(f"backend must be a DiskBackend, got {self.backend!r}")
        if self.direct_io is not None and not isinstance(self.direct_io, bool):
            raise TypeError(f"direct_io must be bool or None, got {self.direct_io!r}")
        positive = ("capacity_bytes", "queue_depth", "write_behind_depth", "write_behind_workers", "threads",
                    "ring_entries")
        for name in (*positive, "min_free_bytes", "enospc_retries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < (1 if name in positive else 0):
                raise ValueError(f"{name} must be {'positive' if name in positive else '>= 0'}, got {value}")
        if isinstance(self.free_space_recheck_s, bool) or not isinstance(self.free_space_recheck_s, (int, float)):
            raise TypeError(f"free_space_recheck_s must be a number, got {type(self.free_space_recheck_s).__name__}")
        if not self.free_space_recheck_s >= 0:
            raise ValueError(f"free_space_recheck_s must be >= 0, got {self.free_space_recheck_s}")


@dataclass(frozen=True)
class DiskStatistics:
    """A snapshot of the tier: contents, traffic, faults and queues."""

    backend: DiskBackend
    """Backend in use (AUTO before :meth:`DiskTier.start`)."""
    direct_io: bool
    """Whether page files are opened with O_DIRECT."""
    pages: int
    """Page files in the index."""
    bytes_stored: int
    """Bytes of those files (and of writes in flight, which hold their room)."""
    capacity_bytes: int
    """The configured budget."""
    reads: int
    """Read attempts that reached the disk."""
    writes: int
    """Pages stored."""
    bytes_read: int
    bytes_written: int
    hits: int
    misses: int
    """Reads that returned False: absent, corrupt or failed."""
    corrupt: int
    """Files refused by header or checksum checks (each deleted)."""
    dropped: int
    """Writes dropped for capacity, a full write-behind queue at close, or a closed tier."""
    errors: dict[ErrorKind, int] = field(default_factory=dict)
    """I/O faults by kind."""
    write_behind_queued: int = 0
    """Pages waiting in the write-behind queue."""
    in_flight: int = 0
    """Page reads and writes in progress."""
    evictions: int = 0
    """Files removed (or recycled) to make room."""
    recycled: int = 0
    """Evicted files overwritten by a new page instead of being deleted and created anew."""
    temp_files_removed: int = 0
    """Leftover temporary files removed at start."""
    effective_capacity_bytes: int = 0
    """The budget in force: ``capacity_bytes`` or less when the file system has less room."""
    read_only: ReadOnly | None = None
    """Why writes are refused, or None when the tier writes."""
    writes_refused: int = 0
    """Writes refused because the tier is read-only."""
    skipped_at_scan: int = 0
    """Fan-out directories and files that could not be read at start (their faults are in ``errors``)."""


_KINDS = {
    errno.ENOSPC: ErrorKind.ENOSPC, errno.EDQUOT: ErrorKind.ENOSPC, errno.EIO: ErrorKind.EIO,
    errno.EPERM: ErrorKind.EPERM, errno.EACCES: ErrorKind.EPERM, errno.EROFS: ErrorKind.EPERM,
    errno.ELOOP: ErrorKind.UNSAFE,  # O_NOFOLLOW met a symlink
}


class FaultCounter:
    """I/O faults counted by kind, each kind logged once."""

    def __init__(self) -> None:
        self._counts = dict.fromkeys(ErrorKind, 0)
        self._logged: set[object] = set()

    def first(self, what: object) -> bool:
        """True the first time ``what`` is seen (log it then, count it only afterwards)."""
        if what in self._logged:
            return False
        self._logged.add(what)
        return True

    def count(self, exc: OSError, what: str) -> None:
        """Count ``exc`` by its errno (an :class:`UnsafeFileError` as UNSAFE); log the first of each kind."""
        kind = ErrorKind.UNSAFE if isinstance(exc, UnsafeFileError) else _KINDS.get(exc.errno or 0, ErrorKind.OTHER)
        self._counts[kind] += 1
        if self.first(kind):
            log.warning("disk tier: %s failed: %s (further %s errors counted only)", what, exc, kind.value)

    def unexpected(self, what: str) -> None:
        """Count a bug-shaped failure (not an OSError) as OTHER, with its traceback."""
        self._counts[ErrorKind.OTHER] += 1
        log.exception("disk tier: unexpected failure in %s", what)

    def snapshot(self) -> dict[ErrorKind, int]:
        return dict(self._counts)
