"""`CacheConfig`: the one configuration tree of a cache, each setting's default defined once.

Settings of the cache itself are fields of :class:`CacheConfig`; those of the disk tier live in the
nested :class:`~aiokv.storage.DiskConfig` (``CacheConfig.disk``), where each has its only default.
Six common disk settings keep flat names (``disk_dir``, ``disk_bytes``, ...): constructor shortcuts
that fill the nested config and read-only views of it, never a second copy.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from aiokv import pool as _pool
from aiokv.kernels import TransferPath
from aiokv.kernels.paths import DEFAULT_STAGING_PAGES
from aiokv.keys import encoded
from aiokv.launches import DEFAULT_LAUNCH_BYTES, DEFAULT_LAUNCH_TURN_S
from aiokv.paths import path_setting
from aiokv.pool import DEFAULT_CHUNK_BYTES, DEFAULT_WORKERS
from aiokv.rates_file import RATE_BOUNDS
from aiokv.reclaim import SegmentInfo, SegmentState, scan
from aiokv.shm import shm_free_bytes
from aiokv.storage.config import DiskBackend, DiskConfig, GiB, check_disk_setting, default_disk_dir

MAX_SETTING = 2**63 - 1
"""Largest value of an int setting of :class:`CacheConfig` (sizes and counts reach the kernel and
numpy as 64-bit values)."""
DEFAULT_READ_GROUP_BYTES = 16 << 20
"""Default of :attr:`CacheConfig.read_group_bytes`."""
DEFAULT_STREAM_READAHEAD_BYTES = 128 << 20
"""Default of :attr:`CacheConfig.stream_readahead_bytes`."""

__all__ = ["DISK_SHORTCUTS", "Admission", "CacheConfig", "default_cpu_bytes", "default_disk", "default_disk_dir"]

log = logging.getLogger(__name__)


class Admission(enum.Enum):
    """Which pool pages the write-behind sends to disk."""

    ALL = "all"
    """Every page stored in the pool is also written to disk."""
    SEEN_TWICE = "seen_twice"
    """Only pages whose key was offloaded or looked up before (spares SSD wear on one-off prompts)."""


class _Unset(enum.Enum):
    """Marks a constructor argument that was not given (None is a meaningful value for some)."""

    TOKEN = "unset"

    def __repr__(self) -> str:
        return "<default>"  # how help(CacheConfig) shows a parameter's default


# Typed Any so that it can be the default of parameters of any type (it never outlives __init__).
_UNSET: Any = _Unset.TOKEN

DISK_SHORTCUTS: Mapping[str, str] = MappingProxyType({
    "disk_dir": "directory",
    "disk_bytes": "capacity_bytes",
    "disk_backend": "backend",
    "disk_direct_io": "direct_io",
    "disk_queue_depth": "queue_depth",
    "write_behind_depth": "write_behind_depth",
})
"""Flat ``CacheConfig`` names of ``DiskConfig`` fields (constructor shortcuts and read-only views)."""


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 * GiB


def default_cpu_bytes(fraction: float = 0.25, cap: int = 64 * GiB) -> int:
    """A quarter of RAM, at most 64 GiB, and at most 80% of the shared memory a pool could get.

    That is the free shared memory plus the segments of dead creators (a pool's start reclaims
    them). A dead creator's segment still held (mapped by a live process: a TP rank finishing a
    copy, a driver letting go, right after a crash) counts once it is let go: when it could raise
    the budget, this waits for that, up to :data:`aiokv.pool.RECLAIM_SETTLE_S` (in the caller's
    thread), as the pool's start would; never on a thread running an event loop, where such
    segments are not counted, and where the segments are examined at all (no room without them),
    for at most :data:`LOOP_SCAN_S`. One still held then (another pid namespace's live pool looks
    the same) is not counted, and not waited for again by this process.
    """
    budget = min(int(_ram_bytes() * fraction), cap)
    if shm_free_bytes() is not None:
        budget = min(budget, int(_shm_obtainable(int(budget / 0.8) + 1) * 0.8))
    return max(budget, 0)


LOOP_SCAN_S = 0.002
"""How long :func:`default_cpu_bytes` examines shared-memory segments on an event loop's thread."""

_outlasted: set[str] = set()
"""Segments held by the dead that outlasted a whole wait of :func:`_shm_obtainable` here."""


def _shm_obtainable(wanted: int) -> int:
    """Free shared memory plus what reclaiming would free, once the dead creators' segments still
    held are let go (waited for only while they could bring the total up to ``wanted``)."""
    on_loop = _on_event_loop()

    def count() -> tuple[int, list[SegmentInfo]]:
        # On a loop's thread the scan stops after LOOP_SCAN_S: thousands of entries named like
        # segments (another user's, planted) stalled the loop ~0.2 s (review 122); what is left
        # unexamined is not counted (a smaller budget, never a larger one).
        found = scan(deadline=time.monotonic() + LOOP_SCAN_S if on_loop else None)
        # The memory a dead pool holds, not its size (sparse after a crash mid-preparation; a hard
        # link keeps it): counting sizes promised a budget /dev/shm could not hold (review 122).
        dead = sum(s.frees for s in found if s.state is SegmentState.DEAD)
        held = [s for s in found
                if s.state is SegmentState.LIVE and not s.creator_alive and s.name not in _outlasted]
        return (shm_free_bytes() or 0) + dead, held

    free = shm_free_bytes() or 0
    if free >= wanted:
        # Room enough without reclaiming: no scan (an open, fstat and lock per entry, ~45 us each:
        # thousands of entries named like segments stalled a loop building CacheConfig() 0.2 s).
        return free
    # Before review 117 a held one was never counted: a budget taken right after a crash came out
    # smaller than one taken a moment later, while the pool's start waits for such segments anyway.
    obtainable, held = count()
    if not held or obtainable >= wanted or on_loop:
        # On a loop's thread (``CacheConfig()`` or ``KVCache(None)`` in a coroutine) a wait of
        # up to RECLAIM_SETTLE_S would stall the loop: the held segments are not counted there.
        return obtainable
    deadline = time.monotonic() + _pool.RECLAIM_SETTLE_S
    while held and time.monotonic() < deadline:
        time.sleep(min(_pool.RECLAIM_RETRY_S, max(0.0, deadline - time.monotonic())))
        obtainable, held = count()
        if obtainable >= wanted:
            return obtainable
    _outlasted.update(s.name for s in held)
    return obtainable


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def default_disk() -> DiskConfig | None:
    """A disk tier with every ``DiskConfig`` default under :func:`default_disk_dir`; None (no disk
    tier) when that directory is not writable."""
    directory = default_disk_dir()
    return DiskConfig(directory=directory) if directory is not None else None


def _disk_default(name: str) -> Any:
    """``DiskConfig``'s own default of ``name`` (what a view reads when there is no disk tier)."""
    (f,) = (f for f in fields(DiskConfig) if f.name == name)
    return f.default


@dataclass(frozen=True, init=False)
class CacheConfig:
    """Configuration of a :class:`aiokv.KVCache`; every field has a working default.

    Keyword arguments only. ``disk`` configures the disk tier (None: none); the shortcuts
    ``disk_dir``, ``disk_bytes``, ``disk_backend``, ``disk_direct_io``, ``disk_queue_depth`` and
    ``write_behind_depth`` fill the fields of a ``disk`` that is not given (``disk_dir=None`` turns
    the tier off), and read back from ``disk``. Raises ``TypeError``/``ValueError`` naming the field
    for a bad value, and ``ValueError`` when a shortcut disagrees with a ``disk`` given beside it
    (``dataclasses.replace(config, disk_bytes=...)`` is such a case: replace ``disk`` instead), when
    ``disk_dir`` is an empty path (it would mean the working directory), and when disk shortcuts
    are given without ``disk_dir`` where the default directory is not writable (the settings could
    not be honoured), or beside ``disk_dir=None`` or ``disk=None`` (which turn the tier off alone).
    """

    cpu_bytes: int = field(default_factory=default_cpu_bytes)
    """Byte budget of the shared-memory page pool (pages = cpu_bytes // page bytes)."""

    disk: DiskConfig | None = field(default_factory=default_disk)
    """The disk tier's settings (see :class:`~aiokv.storage.DiskConfig`); None disables the tier.
    Page files go under ``<disk.directory>/<layout fingerprint>/``."""

    namespace: str = "default"
    """Model namespace mixed into every key: different models never share pages."""

    admission: Admission = Admission.ALL
    """Which pages the write-behind persists."""

    seen_window: int = 1 << 16
    """Keys remembered for ``Admission.SEEN_TWICE``."""

    transfer_path: TransferPath | None = None
    """GPU <-> pool copy path; None picks STAGING for a CUDA KV buffer and REFERENCE on the CPU."""

    staging_pages: int = DEFAULT_STAGING_PAGES
    """Pages of GPU staging buffer per direction (staging path)."""

    launch_pages: int = 2
    """Pages whose copies are launched per event-loop turn at least; bounds the loop's stall on long
    transfers. A group grows past it while the loop time its pages add to the group's fixed launch
    cost (both measured) fits ``launch_turn_s`` and its bytes fit ``launch_bytes`` (small pages:
    fewer turns; ``aiokv.launches``)."""

    launch_bytes: int = DEFAULT_LAUNCH_BYTES
    """At most this many page bytes per launch group once it grows past ``launch_pages`` (64 MiB:
    an 8B model's two 32 MiB pages, what ``launch_pages`` gave it). Larger groups are fewer turns
    and fewer copy-thread hand-overs, but a cancelled call waits for its launched groups."""

    launch_turn_s: float = DEFAULT_LAUNCH_TURN_S
    """Loop seconds a launch group's pages may add to its fixed cost (validation, launches,
    bookkeeping, measured per group and fitted as a fixed cost plus a cost per page); 0 keeps every
    group at ``launch_pages``."""

    pool_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Pool memory is prepared (and CUDA-registered) in chunks of this many bytes (raised so that a
    pool has at most ``aiokv.pool.MAX_CHUNKS`` chunks)."""

    pool_workers: int = DEFAULT_WORKERS
    """Threads that prepare pool chunks in the background."""

    tp_rank: int = 0
    """This process's tensor-parallel rank."""

    tp_size: int = 1
    """Tensor-parallel world size (each rank moves its own slice of every page's heads)."""

    prefill_tokens_per_s: float | None = None
    """The engine's prefill rate, if known (else learned from stream loads and ``note_prefill``);
    within ``aiokv.rates_file.RATE_BOUNDS["prefill"]`` (1 to 1e9 tokens/s), as ``note_prefill``."""

    offload_wait: float = 5.0
    """Seconds an offload may wait, each time the pool is full, for write-behind to free pages
    before it drops the rest of its pages (counted as pool_exhausted)."""

    commit_wait: float = 5.0
    """Seconds a call waits in all for pages another call is still writing into the pool (an
    offload, a promotion from disk): a ``match``, and a load, prefetch or stream, whose waits share
    one budget of time spent waiting (its waits for its own promotions' reads are not counted);
    then it stops there (a shorter hit or load, counted as commit_wait_expired; not counted when 0,
    which never waits). A commit is a copy away; a writer that is stopped (a SIGSTOPped TP rank, a
    stuck driver call) held every lookup sharing its pages for as long (reviews 114, 115, 214, 217)."""

    close_timeout: float = 30.0
    """Seconds ``aclose()`` waits for write-behind and background copies before giving up on them
    (finite, as ``offload_wait`` and ``commit_wait``, and more than 0: no close ends in no time)."""

    read_group_bytes: int = DEFAULT_READ_GROUP_BYTES
    """A load's or prefetch's disk pages are read in groups of about this many bytes (at least one
    page, at most 32 pages), each group one ``DiskTier.read_many`` batch: per page the loop ran two
    tasks and two shields and a wake-up each (#14). A load copies a group's pages once the whole
    group landed, so larger groups delay its first and last copies by the rest of their group."""

    stream_readahead_bytes: int = DEFAULT_STREAM_READAHEAD_BYTES
    """Disk bytes a :class:`~aiokv.stream.LoadStream` keeps in flight ahead of its front (at least 2
    pages, at most the disk queue depth). Too few starve the device: with 32 MiB pages (an 8B
    model's 256 tokens) 32 MiB meant 2 reads in flight, and the H200 host's disk delivered 37 ms a
    page inside an 8K split against 17.6 ms in a plain load's deep queue; too many delay the first
    page and waste the reads the engine overtakes (sixteen 32 MiB reads landed together after ~300
    ms there). A disk that needs a deeper queue (network storage) wants more."""

    def __init__(
        self,
        *,
        cpu_bytes: int = _UNSET,
        disk: DiskConfig | None = _UNSET,
        namespace: str = _UNSET,
        admission: Admission = _UNSET,
        seen_window: int = _UNSET,
        transfer_path: TransferPath | None = _UNSET,
        staging_pages: int = _UNSET,
        launch_pages: int = _UNSET,
        launch_bytes: int = _UNSET,
        launch_turn_s: float = _UNSET,
        pool_chunk_bytes: int = _UNSET,
        pool_workers: int = _UNSET,
        tp_rank: int = _UNSET,
        tp_size: int = _UNSET,
        prefill_tokens_per_s: float | None = _UNSET,
        offload_wait: float = _UNSET,
        commit_wait: float = _UNSET,
        close_timeout: float = _UNSET,
        read_group_bytes: int = _UNSET,
        stream_readahead_bytes: int = _UNSET,
        disk_dir: str | os.PathLike[str] | None = _UNSET,
        disk_bytes: int = _UNSET,
        disk_backend: DiskBackend = _UNSET,
        disk_direct_io: bool | None = _UNSET,
        disk_queue_depth: int = _UNSET,
        write_behind_depth: int = _UNSET,
    ) -> None:
        # Written by hand (dataclass init=False) so that the shortcuts are arguments, not fields:
        # fields would be a second copy of the disk settings, and dataclasses.replace would pass
        # their stale values back beside a new ``disk``. Defaults stay those of the fields above.
        arguments = dict(locals())
        for f in fields(self):
            if f.name == "disk":
                continue
            value = arguments[f.name]
            if value is _UNSET:
                factory = f.default_factory
                value = factory() if callable(factory) else f.default
            object.__setattr__(self, f.name, value)
        self._check()
        given = {short: arguments[short] for short in DISK_SHORTCUTS if arguments[short] is not _UNSET}
        object.__setattr__(self, "disk", _resolve_disk(disk, given))

    # -- read-only views of the disk settings (the shortcuts' names) ------------------------------

    @property
    def disk_dir(self) -> Path | None:
        """``disk.directory``; None when there is no disk tier."""
        return self.disk.directory if self.disk is not None else None

    @property
    def disk_bytes(self) -> int:
        """``disk.capacity_bytes`` (``DiskConfig``'s default when there is no disk tier)."""
        return int(self._disk_value("capacity_bytes"))

    @property
    def disk_backend(self) -> DiskBackend:
        """``disk.backend`` (``DiskConfig``'s default when there is no disk tier)."""
        value = self._disk_value("backend")
        assert isinstance(value, DiskBackend)
        return value

    @property
    def disk_direct_io(self) -> bool | None:
        """``disk.direct_io`` (``DiskConfig``'s default when there is no disk tier)."""
        value = self._disk_value("direct_io")
        return None if value is None else bool(value)

    @property
    def disk_queue_depth(self) -> int:
        """``disk.queue_depth`` (``DiskConfig``'s default when there is no disk tier)."""
        return int(self._disk_value("queue_depth"))

    @property
    def write_behind_depth(self) -> int:
        """``disk.write_behind_depth`` (``DiskConfig``'s default when there is no disk tier)."""
        return int(self._disk_value("write_behind_depth"))

    def _disk_value(self, name: str) -> Any:
        return getattr(self.disk, name) if self.disk is not None else _disk_default(name)

    # -- validation -------------------------------------------------------------------------------

    def _check(self) -> None:
        """Validate the cache's own fields (the disk tier's are DiskConfig's to check)."""
        for name in ("cpu_bytes", "seen_window", "staging_pages", "launch_pages", "launch_bytes", "pool_chunk_bytes",
                     "pool_workers", "tp_size", "read_group_bytes", "stream_readahead_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"CacheConfig.{name} must be an int, got {type(value).__name__}")
            if value <= 0:
                raise ValueError(f"CacheConfig.{name} must be positive, got {value}")
            if value > MAX_SETTING:
                # cpu_bytes=10**400 raised OverflowError at start (the pool's size in GiB as a float).
                raise ValueError(f"CacheConfig.{name} must be at most 2**63 - 1, got an int of "
                                 f"{value.bit_length()} bits")
        if isinstance(self.tp_rank, bool) or not isinstance(self.tp_rank, int):
            raise TypeError(f"CacheConfig.tp_rank must be an int, got {type(self.tp_rank).__name__}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"CacheConfig.tp_rank {self.tp_rank} out of range for tp_size {self.tp_size}")
        if not isinstance(self.namespace, str):
            raise TypeError(f"CacheConfig.namespace must be a str, got {type(self.namespace).__name__}")
        encoded(self.namespace, "CacheConfig.namespace")  # keyed as UTF-8: a lone surrogate failed every call
        if self.transfer_path is not None and not isinstance(self.transfer_path, TransferPath):
            raise TypeError(f"CacheConfig.transfer_path must be a TransferPath or None, got {self.transfer_path!r}")
        if not isinstance(self.admission, Admission):
            raise TypeError(f"CacheConfig.admission must be an Admission, got {self.admission!r}")
        rate = self.prefill_tokens_per_s
        if rate is not None:
            low, high = RATE_BOUNDS["prefill"]
            if not low <= _number("prefill_tokens_per_s", rate) <= high:  # NaN fails too
                # As note_prefill refuses: inf made every recompute free and the rates file unsavable.
                raise ValueError(f"CacheConfig.prefill_tokens_per_s must be None or in [{low:g}, {high:g}] tokens/s, "
                                 f"got {rate}")
        for name in ("offload_wait", "commit_wait", "close_timeout", "launch_turn_s"):
            value = _number(name, getattr(self, name))
            if not value >= 0:  # NaN fails too
                raise ValueError(f"CacheConfig.{name} must be a non-negative number of seconds, got {value}")
            if name != "launch_turn_s" and value == math.inf:
                # Waits are bounded (an infinite close_timeout failed the disk tier's close).
                raise ValueError(f"CacheConfig.{name} must be a finite number of seconds, got {value}")
            if name == "close_timeout" and value == 0:
                # No close ends in no time: with 0 every aclose(), an idle cache's too, logged disk I/O
                # stuck in the kernel and counted close_timeout (the vLLM tier refuses 0 likewise).
                raise ValueError(f"CacheConfig.close_timeout must be > 0 seconds, got {value}: aclose() "
                                 "waits that long for the disk tier's close")


def _number(name: str, value: object) -> float:
    """``value`` as a float; ``TypeError`` unless it is an int or a float (not a bool), ``ValueError``
    for an int too large for a float (it raised ``OverflowError`` where it was added to a clock)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"CacheConfig.{name} must be a number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        bits = value.bit_length() if isinstance(value, int) else 0
        raise ValueError(f"CacheConfig.{name} is too large for a float, got an int of {bits} bits") from None


def _shortcut_value(short: str, value: object) -> object:
    """``value`` of shortcut ``short`` as the ``DiskConfig`` field holds it (a str path becomes a
    Path), after checking it against that field's rules."""
    label = f"CacheConfig.{short}"
    if short == "disk_dir":
        if not isinstance(value, (str, os.PathLike)):
            raise TypeError(f"{label} must be a path or None, got {type(value).__name__}")
        if isinstance(value, str) and not value:
            # Path("") is the working directory: an unset variable would put page files there.
            raise ValueError(f"{label} is an empty path (for no disk tier pass disk_dir=None)")
        value = path_setting(value, label)  # a path-like giving bytes, a lone surrogate: named here
    check_disk_setting(DISK_SHORTCUTS[short], value, label)
    return value


def _resolve_disk(disk: object, given: dict[str, object]) -> DiskConfig | None:
    """The one ``DiskConfig`` (or None) from the ``disk`` argument and the shortcuts ``given``."""
    if disk is not _UNSET and disk is not None and not isinstance(disk, DiskConfig):
        raise TypeError(f"CacheConfig.disk must be a DiskConfig or None, got {type(disk).__name__}")
    off = "disk_dir" in given and given["disk_dir"] is None
    values = {DISK_SHORTCUTS[s]: _shortcut_value(s, v) for s, v in given.items() if not (s == "disk_dir" and off)}
    if disk is _UNSET:
        if off:
            named = [s for s in given if s != "disk_dir"]
            if named:
                # Once silently no tier: a size meant for a directory that a variable left None
                # gave a cache without disk, reading disk_bytes back as DiskConfig's default.
                raise ValueError(
                    f"CacheConfig.{named[0]} is given but disk_dir=None turns the disk tier off: "
                    "pass a directory, or drop the disk settings (disk=None) for no disk tier"
                )
            return None
        if not values:
            return default_disk()  # the field's default
        directory = values.pop("directory", None) or default_disk_dir()
        if directory is None:
            # A disk setting without a directory where the default one is not writable: refused,
            # not dropped (without any disk setting there is simply no tier: see default_disk).
            raise ValueError(
                f"CacheConfig.{next(iter(given))} is given but there is no disk directory "
                "($XDG_CACHE_HOME/aiokv is not writable): pass disk_dir=, or disk=None for no disk tier"
            )
        return DiskConfig(directory=directory, **values)  # type: ignore[arg-type]  # each checked above
    if disk is None:
        # disk_dir=None agrees with disk=None; a directory beside it was once silently no tier.
        named = [s for s in given if not (s == "disk_dir" and off)]
        if named:
            raise ValueError(f"CacheConfig.{named[0]} is given but disk=None turns the disk tier off")
        return None
    assert isinstance(disk, DiskConfig)
    if off:
        raise ValueError("CacheConfig.disk_dir=None turns the disk tier off, but disk= configures one: give one")
    for short in given:
        name = DISK_SHORTCUTS[short]
        if values[name] != getattr(disk, name):
            raise ValueError(
                f"CacheConfig.{short}={values[name]!r} disagrees with disk.{name}={getattr(disk, name)!r}: "
                f"give one of them (to change a config, replace its disk: "
                f"dataclasses.replace(config, disk=dataclasses.replace(config.disk, {name}=...)))"
            )
    return disk
