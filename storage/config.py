"""Configuration and statistics of the disk tier."""

from __future__ import annotations

import enum
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

from aiokv.paths import path_setting


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


GiB = 1 << 30


def default_disk_dir() -> Path | None:
    """``$XDG_CACHE_HOME/aiokv`` (or ``~/.cache/aiokv``), created 0700, when writable; else None."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "aiokv"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK | os.X_OK) else None


def _default_directory() -> Path:
    path = default_disk_dir()
    if path is None:
        raise ValueError("DiskConfig.directory: no writable default ($XDG_CACHE_HOME/aiokv); pass directory=")
    return path


@dataclass(frozen=True)
class DiskConfig:
    """Settings of one :class:`~aiokv.storage.DiskTier`; nested in ``CacheConfig.disk``.

    The one place each disk setting and its default is defined. Raises ``TypeError``/``ValueError``
    naming the field for a bad value.
    """

    directory: Path = field(default_factory=_default_directory)
    """Root directory of the page files (created 0700); each layout uses its own subdirectory.
    Default: ``$XDG_CACHE_HOME/aiokv`` (``ValueError`` when that is not writable)."""
    capacity_bytes: int = 64 * GiB
    """Byte budget for page files of this layout (header included); LRU eviction keeps within it."""
    backend: DiskBackend = DiskBackend.AUTO
    """Which I/O path to use; a forced one that cannot work makes :meth:`DiskTier.start` raise."""
    direct_io: bool | None = None
    """O_DIRECT on page files; None: where the file system allows it (tmpfs does not)."""
    queue_depth: int = 16
    """Page I/Os in flight at once (each page is a header plus a payload request)."""
    write_behind_depth: int = 256
    """Pages the write-behind queue holds before ``write_behind_nowait`` reports it full."""
    write_behind_workers: int = 8
    """Concurrent writes draining the write-behind queue."""
    threads: int = 4
    """Worker threads of the THREADS backend, for reads and again for writes (a blocked write never
    holds up a read)."""
    ring_entries: int = 128
    """SQ entries of the io_uring, raised to 7 x queue_depth (``CHAIN_MAX``: a page's chain of up to
    6 SQEs plus an evicted file's unlink or rename); the CQ has twice as many; more requests wait in
    a FIFO."""
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
    capacity_bytes, or while it knows the file system nearly full) again at most every
    ``free_space_recheck_s``."""
    free_space_recheck_s: float = 1.0
    """Least seconds between two free-space checks while the file system limits the tier (or the
    tier knows it nearly full: docs/storage.md, the file system's room)."""
    enospc_retries: int = 2
    """Times a write that met ENOSPC evicts least recently used files and tries again."""
    follow_interval_s: float = 2.0
    """While another cache holds the directory (``ReadOnly.LOCKED``): seconds between two looks at
    it (on a thread): page files it stored since become hits, files gone are dropped, and once it
    let the lock go this tier takes it and writes. While this tier writes: seconds between checks
    that ``.lock`` still names the file it holds (:mod:`.lockwatch`). 0: the index found at start
    stays as it is, and the lock's name is never checked."""

    def __post_init__(self) -> None:
        directory = self.directory
        if isinstance(directory, (str, os.PathLike)) and not isinstance(directory, Path):
            # A str or other path-like is what users pass; kept as a Path (an empty one would be
            # the working directory: refused).
            try:
                text = os.fspath(directory)
            except TypeError as exc:  # its __fspath__ returned neither str nor bytes
                raise TypeError(f"DiskConfig.directory must be a path: {exc}") from None
            if not isinstance(text, str) or not text:
                raise ValueError(f"DiskConfig.directory must be a non-empty path, got {directory!r}")
            object.__setattr__(self, "directory", Path(text))
        for f in fields(self):
            check_disk_setting(f.name, getattr(self, f.name), f"DiskConfig.{f.name}")


def _check_int(value: object, label: str, least: int, most: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{label} must be an int, got {type(value).__name__}")
    if value < least:
        raise ValueError(f"{label} must be {'positive' if least else '>= 0'}, got {value}")
    if most is not None and value > most:
        raise ValueError(f"{label} must be at most {most}, got {value}")


MAX_QUEUE_DEPTH = 4096
"""Page I/Os in flight: each holds a header slot, iovecs and up to 6 SQEs made at start (on the
loop); io_uring rings hold at most 32,768 SQEs. A depth of 2**20 was accepted and stalled the loop
7 s building them (2**31: a minute and 13 GB)."""
MAX_RING_ENTRIES = 32768
"""The kernel's limit on an io_uring's SQ entries (IORING_MAX_ENTRIES)."""
MAX_WORKERS = 1024
"""Threads of the THREADS backend, concurrent write-behind writes."""
MAX_WRITE_BEHIND_DEPTH = 1 << 20


def _check_bool(value: object, label: str, optional: bool) -> None:
    if not isinstance(value, bool) and not (optional and value is None):
        raise TypeError(f"{label} must be a bool{' or None' if optional else ''}, got {value!r}")


def _check_seconds(value: object, label: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{label} must be a number of seconds, got {type(value).__name__}")
    if not value >= 0:  # NaN fails too
        raise ValueError(f"{label} must be >= 0, got {value}")
    try:
        float(value)
    except OverflowError:  # an int too large for a float: OverflowError where it met a clock (SpareStock)
        raise ValueError(f"{label} is too large for a float, got an int of {int(value).bit_length()} bits") from None


MAX_FOLLOW_INTERVAL_S = 86400.0
"""A look at a locked directory at least once a day (a larger value is surely a unit mistake)."""


MIN_FOLLOW_INTERVAL_S = 0.001
"""Least seconds between two looks when following is on: 1e-300 would have the follow thread list
the directory without pause."""


def _check_interval(value: object, label: str) -> None:
    _check_seconds(value, label)
    assert isinstance(value, (int, float))
    if value > MAX_FOLLOW_INTERVAL_S:
        raise ValueError(f"{label} must be at most {MAX_FOLLOW_INTERVAL_S:g} seconds (0 turns it off), got {value}")
    if 0 < value < MIN_FOLLOW_INTERVAL_S:
        raise ValueError(f"{label} must be 0 (off) or at least {MIN_FOLLOW_INTERVAL_S:g} seconds, got {value}")


def _check_directory(value: object, label: str) -> None:
    if not isinstance(value, Path):
        raise TypeError(f"{label} must be a path (str or os.PathLike), got {type(value).__name__}")
    if str(value) in ("", "."):
        raise ValueError(f"{label} must be a non-empty path, got {str(value)!r}")
    if "\x00" in str(value):  # else refused by the first system call, at start, naming no setting
        raise ValueError(f"{label} must not contain a NUL character, got {str(value)!r}")
    path_setting(str(value), label)  # a lone surrogate: UnicodeEncodeError at start, naming nothing


def _check_backend(value: object, label: str) -> None:
    if not isinstance(value, DiskBackend):
        raise TypeError(f"{label} must be a DiskBackend, got {value!r}")


# One check per DiskConfig field; a field missing here fails every DiskConfig construction (KeyError),
# so a new setting cannot slip in unvalidated.
_CHECKS: dict[str, Callable[[object, str], None]] = {
    "directory": _check_directory,
    "capacity_bytes": functools.partial(_check_int, least=1),
    "backend": _check_backend,
    "direct_io": functools.partial(_check_bool, optional=True),
    "queue_depth": functools.partial(_check_int, least=1, most=MAX_QUEUE_DEPTH),
    "write_behind_depth": functools.partial(_check_int, least=1, most=MAX_WRITE_BEHIND_DEPTH),
    "write_behind_workers": functools.partial(_check_int, least=1, most=MAX_WORKERS),
    "threads": functools.partial(_check_int, least=1, most=MAX_WORKERS),
    "ring_entries": functools.partial(_check_int, least=1, most=MAX_RING_ENTRIES),
    "sync_writes": functools.partial(_check_bool, optional=False),
    "recycle_files": functools.partial(_check_bool, optional=False),
    "drain_on_close": functools.partial(_check_bool, optional=False),
    "min_free_bytes": functools.partial(_check_int, least=0),
    "free_space_recheck_s": _check_seconds,
    "enospc_retries": functools.partial(_check_int, least=0),
    "follow_interval_s": _check_interval,
}


def check_disk_setting(name: str, value: object, label: str) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``label`` unless ``value`` suits ``DiskConfig.<name>``."""
    _CHECKS[name](value, label)


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
    """Files refused by header or checksum checks (each deleted; kept by a read-only tier). While
    following another cache, only files that did not change since they were indexed (the next
    look tells: ``follow_raced`` counts the others)."""
    dropped: int
    """Writes dropped for capacity, a full write-behind queue at close, or a closed tier."""
    errors: dict[ErrorKind, int] = field(default_factory=dict)
    """I/O faults by kind."""
    write_behind_queued: int = 0
    """Pages waiting in the write-behind queue."""
    write_behind_writing: int = 0
    """Pages a write-behind worker took from the queue and has not released yet (waiting for an I/O
    slot, being written): with :attr:`write_behind_queued`, every page the write-behind holds."""
    write_behind_voided: int = 0
    """Write-behinds a ``delete`` of their key discarded (queued before it, dropped when a worker
    took them; not in ``dropped``, where those a close dropped first are)."""
    write_behind_workers_replaced: int = 0
    """Write-behind workers that a cancel the tier did not ask for ended (a loop-wide cancel: an
    application's SIGTERM handler cancelling every task of the loop), each replaced by a new one."""
    in_flight: int = 0
    """Page reads and writes in progress (holding an I/O slot): ``reads_in_flight + writes_in_flight``."""
    reads_in_flight: int = 0
    """Page reads in progress (holding an I/O slot; those waiting for one are not counted)."""
    writes_in_flight: int = 0
    """Page writes in progress (holding an I/O slot; at most ``queue_depth`` minus the reads' share)."""
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
    buffered_fallbacks: int = 0
    """``write_from``/``read_into`` calls whose buffer is not 4096-aligned: buffered I/O instead of O_DIRECT."""
    memory_unregistered: int = 0
    """``register_memory`` calls that could not register the region: plain buffers there."""
    follow_looks: int = 0
    """Looks at the directory while another cache held it (``follow_interval_s``), each ended."""
    followed_in: int = 0
    """Page files that cache stored since this one started, indexed by those looks."""
    followed_out: int = 0
    """Indexed page files those looks found gone (evicted or recycled by the other cache)."""
    follow_withheld: int = 0
    """Pages those looks stopped serving because the other cache's pending-delete record could not
    be read (EIO, damaged: the pages it deleted unknown); indexed again once a look reads it."""
    took_over: int = 0
    """Times this tier took the directory's lock from a cache that let it go and began writing."""
    follow_raced: int = 0
    """Reads refused while following whose file had changed since it was indexed (the other cache
    recycled, replaced or removed it under the read): misses, not corruption."""
    lock_retaken: int = 0
    """Times this tier, writing, found ``.lock`` removed or replaced and took the file there now
    (still the only writer; checked every ``follow_interval_s``)."""
    lock_lost: int = 0
    """Times this tier, writing, found ``.lock`` replaced and held by another cache: it stopped
    writing and evicting and follows that cache (``read_only`` ``LOCKED``)."""
    listings_failed: int = 0
    """Listings of a fan-out directory opened late (put back, or unreadable at start) that failed
    part-way or could not examine an entry (faults in ``errors``): each such directory is listed
    again at a later periodic check (``follow_interval_s``) until a listing completes."""
