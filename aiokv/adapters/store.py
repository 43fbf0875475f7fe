"""`PageFileStore`: an engine's pages as checksummed page files of aiokv's disk tier.

Engines hand over pages that live in their own memory (vLLM's shared CPU region, SGLang's host
pool), identified by their own keys. The store keeps them as :class:`~aiokv.storage.DiskTier` page
files, so they get what the disk tier gives aiokv's pool: a header and payload checksum verified on
every read, LRU capacity that survives restarts, crash-safe publication, io_uring (fixed buffers,
O_DIRECT) with fallbacks to plain buffers and threads.

Keys: ``xxh3-128(seed ‖ engine key)``; the seed mixes the engine identity's fingerprint (model,
dtype, page geometry, parallel layout: whatever decides what the bytes mean) and the namespace.
Each identity also has its own directory, ``<directory>/<engine>-<fingerprint hex>``, so two models
never share a page file; its name is predictable, so it is checked as the tier checks its own
directories (never a symlink, ours, 0700) before anything is created in it, and the tier gets the
checked descriptor: nothing looks the name up again, so swapping it afterwards redirects nothing.

Bytes: a page that is one contiguous buffer of the disk layout's size (a 4096-multiple) moves
straight between the engine's memory and its file (``DiskTier.write_from`` / ``read_into``; an
engine region registered with :meth:`PageFileStore.register_memory` uses io_uring fixed buffers).
Other pages (split in the engine's memory, or of other sizes) go through a small staging pool of
the store's (``staging_pages`` pages): copied from the engine's memory into a staging page
(``torch`` copies, the GIL released) and written from there, read into one and copied out.

Sharing (:class:`Sharing`): a directory that several processes serve (SGLang's MLA pages, the
same on every TP rank) has one writer, the process that holds the disk tier's directory lock, and
readers that never take it. A reader's index is rebuilt (the directory rescanned) when a lookup
misses a page whose file the writer has published since, at most every ``reader_refresh_s``; the
files are looked for at most that often too, on one thread the reader keeps for it, through a
descriptor of the layout directory its tier indexes.

Everything runs on the loop of a :class:`LoopThread`; the methods taking coroutines run there.
"""

from __future__ import annotations

import _thread
import asyncio
import concurrent.futures
import contextlib
import enum
import errno
import functools
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import xxhash

from aiokv.config import CacheConfig
from aiokv.keys import PageKey, encoded
from aiokv.layout import KVLayout
from aiokv.pagetable import PageHandle, ReserveOutcome
from aiokv.paths import path_setting
from aiokv.pool import PagePool, run_in_new_thread
from aiokv.storage import DiskBackend, DiskConfig, DiskStatistics, DiskTier
from aiokv.storage.config import MAX_QUEUE_DEPTH, ReadOnly
from aiokv.storage.config import default_disk_dir as _storage_default_dir
from aiokv.storage.pagefile import PageFiles, file_bytes
from aiokv.storage.safefiles import UnsafeDirectoryError

from .aside import Aside
from .loopthread import LoopDied, LoopThread, check_timing, finite_seconds
from .storedirs import ReaderCheck, clear_tree, close_dirs, dir_identity, open_dirs

log = logging.getLogger(__name__)

_DISK_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(DiskConfig)}
DEFAULT_DISK_BYTES: int = _DISK_DEFAULTS["capacity_bytes"]
"""The disk tier's own default budget (one default per setting, defined in ``DiskConfig``)."""
DEFAULT_QUEUE_DEPTH: int = _DISK_DEFAULTS["queue_depth"]
DEFAULT_CLOSE_TIMEOUT: float = CacheConfig.close_timeout
"""The cache's own close bound (one default per setting, defined in ``CacheConfig``)."""
STUCK_REPORT_MIN_S = 1.0
"""Least seconds between two warnings of a close waiting on work stuck in the kernel (they come every
``close_timeout``; a ``close_timeout`` of 0 would log at every loop turn)."""


class Sharing(enum.Enum):
    """How a store shares its directory with stores of other processes (engine ranks)."""

    ALONE = "alone"
    """The directory is this process's: its tier takes the directory lock (if another cache holds
    it, the tier serves what is there read-only, follows that cache's new pages, and takes the
    directory over once that cache lets it go: ``DiskConfig.follow_interval_s``)."""
    WRITER = "writer"
    """The one process that writes a directory other processes read: its tier waits (up to
    ``writer_wait_s``) for the lock while a reader is starting, then writes and evicts there."""
    READER = "reader"
    """Reads a directory another process writes: its tier never takes the lock, refuses writes
    (counted), and is rebuilt from the files when a lookup misses a page the writer published
    since (at most every ``reader_refresh_s``)."""


def default_disk_dir() -> Path:
    """``DiskConfig``'s default directory (``$XDG_CACHE_HOME/aiokv``, created 0700). Raises
    ``ValueError`` when it is not writable: pass ``disk_dir``."""
    path = _storage_default_dir()
    if path is None:
        raise ValueError("no writable default disk directory ($XDG_CACHE_HOME/aiokv): pass disk_dir")
    return path


@dataclass(frozen=True)
class StoreConfig:
    """Settings of a :class:`PageFileStore`; engines pass them as plain options (:meth:`from_options`)."""

    directory: Path
    """Root of the page files; each engine identity uses its own subdirectory."""
    capacity_bytes: int = DEFAULT_DISK_BYTES
    """Byte budget of this identity's page files (LRU eviction keeps within it)."""
    namespace: str = "default"
    """Model namespace mixed into every key."""
    backend: DiskBackend = DiskBackend.AUTO
    """io_uring with fixed buffers, plain io_uring, or threads; AUTO falls back in that order."""
    direct_io: bool | None = None
    """O_DIRECT on page files; None: where the file system allows it."""
    queue_depth: int = DEFAULT_QUEUE_DEPTH
    """Page I/Os in flight at once."""
    staging_pages: int = 0
    """Pages of the staging pool (also the bound on pages being copied or moved); 0: 2 x queue_depth."""
    poll_s: float = 0.001
    """While the store is busy, how often its loop picks up work an engine posted, seconds."""
    linger_s: float = 0.05
    """How long the loop keeps polling after its last posted work, seconds; then it parks."""
    idle_poll_s: float = 0.01
    """How often a parked loop still looks for posted work, seconds. 0: never; the engine's step-end
    hand-over then wakes it (one system call, in which the loop thread may take the GIL first)."""
    zero_copy: bool = True
    """Move a page that is one contiguous buffer of a 4096-multiple size straight between the
    engine's memory and its page file; False: always through a staging page (one copy each way)."""
    writer_wait_s: float = 10.0
    """Shared directories (:class:`Sharing`): how long the writer waits for the directory lock
    while readers start (each holds it shared for its start-up scan), and a reader for a writer
    that is between two tiers, seconds. A writer that waited this long serves read-only."""
    reader_refresh_s: float = 1.0
    """Shared directories: least seconds between two rescans of a reader's index (each one a scan
    of the directory, in a worker thread), made when a lookup misses a page whose file exists, and
    between two looks for such files (on the reader's one check thread)."""
    close_timeout: float = DEFAULT_CLOSE_TIMEOUT
    """Seconds (more than 0) :meth:`PageFileStore.close` waits for disk I/O in flight; past it (writes
    hung in the kernel: a frozen or hung file system) it returns, counted in ``close_timeouts``, and the staging
    pool stays mapped (and the store's own thread runs) until that I/O ended. Also the bound of
    :meth:`PageFileStore.clear` (past it: False, counted in ``clear_timeouts``; the clear goes on)."""

    def __post_init__(self) -> None:
        if not isinstance(self.directory, Path):
            raise TypeError(f"directory must be a pathlib.Path, got {type(self.directory).__name__}")
        if str(self.directory) in ("", ".") or "\0" in str(self.directory):
            # Path("") is the working directory (an unset variable would put page files there);
            # a NUL byte failed only when the store opened, as os's "embedded null byte".
            raise ValueError(f"directory must be a non-empty path without NUL bytes, got {str(self.directory)!r}")
        path_setting(self.directory, "directory")  # a lone surrogate failed only when the store opened
        if not isinstance(self.namespace, str):
            raise TypeError(f"namespace must be a str, got {type(self.namespace).__name__}")
        encoded(self.namespace, "namespace")  # keyed as UTF-8: a lone surrogate failed at the first page
        if not isinstance(self.backend, DiskBackend):
            raise TypeError(f"backend must be a DiskBackend, got {self.backend!r}")
        if not isinstance(self.zero_copy, bool):
            raise TypeError(f"zero_copy must be a bool, got {self.zero_copy!r}")
        for name in ("capacity_bytes", "queue_depth", "staging_pages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < (0 if name == "staging_pages" else 1):
                raise ValueError(f"{name} must be {'>= 0' if name == 'staging_pages' else 'positive'}, got {value}")
            if value > MAX_INT_OPTION:
                raise ValueError(f"{name} must be at most 2**63 - 1, got an int of {value.bit_length()} bits")
        if self.queue_depth > MAX_QUEUE_DEPTH:
            # The disk tier's own bound, refused here rather than when the store opens its files.
            raise ValueError(f"queue_depth must be at most {MAX_QUEUE_DEPTH}, got {self.queue_depth}")
        check_timing(self.poll_s, self.linger_s, self.idle_poll_s)
        for name in ("writer_wait_s", "reader_refresh_s", "close_timeout"):
            value = finite_seconds(getattr(self, name), name)
            # At most what a thread's wait takes: close() joins a reader's check thread for up to
            # close_timeout, and a longer timeout raised OverflowError there.
            if not 0 <= value <= threading.TIMEOUT_MAX:
                raise ValueError(f"{name} must be finite, >= 0 and at most {threading.TIMEOUT_MAX:g} s, "
                                 f"got {getattr(self, name)!r}")
        if self.close_timeout == 0:
            # No close ends in no time: with 0 every close(), an idle store's too, logged disk I/O stuck
            # in the kernel and counted close_timeouts (and the vLLM tier's shutdown always raised).
            raise ValueError("close_timeout must be > 0 seconds, got 0: close() waits that long for the disk "
                             "tier's close")

    @property
    def pages_in_staging(self) -> int:
        """Staging pool size in pages."""
        return self.staging_pages or 2 * self.queue_depth

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> StoreConfig:
        """Build from an engine's JSON-like options: ``disk_dir``, ``disk_bytes``, ``namespace``,
        ``disk_backend`` (``auto``, ``uring_fixed``, ``uring``, ``threads``), ``direct_io``,
        ``queue_depth``, ``staging_pages``, ``poll_s``, ``linger_s``, ``idle_poll_s``, ``zero_copy``,
        ``writer_wait_s``, ``reader_refresh_s``, ``close_timeout``. Unknown names raise ``ValueError`` (a typo must not
        pass silently); wrong types raise ``TypeError``."""
        known = {"disk_dir", "disk_bytes", "namespace", "disk_backend", "direct_io", "queue_depth", "staging_pages",
                 "poll_s", "linger_s", "idle_poll_s", "zero_copy", "writer_wait_s", "reader_refresh_s",
                 "close_timeout"}
        if not isinstance(options, Mapping):
            raise TypeError(f"aiokv options must be a mapping of names to values, got {type(options).__name__}")
        unknown = sorted(map(repr, set(options) - known))  # repr: names of mixed types sort too
        if unknown:
            raise ValueError(f"unknown aiokv options [{', '.join(unknown)}]; known: {sorted(known)}")
        disk_dir = options.get("disk_dir")
        # Named as the option (a NUL, a lone surrogate or a path-like giving bytes were refused as
        # "directory", or by pathlib naming nothing, or at the store's open).
        directory = path_setting(disk_dir, "disk_dir") if disk_dir is not None else default_disk_dir()
        if str(directory) == ".":
            # The working directory (".", "./"): refused by the field too, named here as the option.
            raise ValueError(f"disk_dir must not be the working directory, got {disk_dir!r}")
        backend = options.get("disk_backend", DiskBackend.AUTO.value)
        if not isinstance(backend, str):
            raise TypeError(f"disk_backend must be a str, got {type(backend).__name__}")
        backends = [b.value for b in DiskBackend]
        if backend not in backends:
            raise ValueError(f"disk_backend must be one of {backends}, got {backend!r}")
        direct_io = options.get("direct_io")
        if direct_io is not None and not isinstance(direct_io, bool):
            raise TypeError(f"direct_io must be a bool or null, got {direct_io!r}")
        zero_copy = options.get("zero_copy", True)
        if not isinstance(zero_copy, bool):
            raise TypeError(f"zero_copy must be a bool, got {zero_copy!r}")
        namespace = options.get("namespace", "default")
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
        default: dict[str, Any] = {f.name: f.default for f in fields(cls)}  # each default once: the fields'
        return cls(
            directory=directory,
            capacity_bytes=_int_option(options, "disk_bytes", default["capacity_bytes"], least=1),
            namespace=namespace,
            backend=DiskBackend(backend),
            direct_io=direct_io,
            queue_depth=_int_option(options, "queue_depth", default["queue_depth"]),
            staging_pages=_int_option(options, "staging_pages", default["staging_pages"]),
            poll_s=_float_option(options, "poll_s", default["poll_s"]),
            linger_s=_float_option(options, "linger_s", default["linger_s"]),
            idle_poll_s=_float_option(options, "idle_poll_s", default["idle_poll_s"]),
            zero_copy=zero_copy,
            writer_wait_s=_float_option(options, "writer_wait_s", default["writer_wait_s"]),
            reader_refresh_s=_float_option(options, "reader_refresh_s", default["reader_refresh_s"]),
            close_timeout=_float_option(options, "close_timeout", default["close_timeout"]),
        )


def _int_option(options: Mapping[str, object], name: str, default: int, least: int | None = None) -> int:
    """The int option ``name``; ``least``: its lower bound, checked here to name the option (the
    field it fills may be named otherwise: ``disk_bytes`` is ``capacity_bytes``)."""
    value = options.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if least is not None and value < least:
        raise ValueError(f"{name} must be at least {least}, got {value}")
    if value > MAX_INT_OPTION:
        raise ValueError(f"{name} must be at most 2**63 - 1, got an int of {value.bit_length()} bits")
    return value


MAX_INT_OPTION = 2**63 - 1
"""Largest int setting: sizes and counts reach the kernel and numpy as 64-bit values (a staging pool
of 10**400 pages raised ``OverflowError`` as the store opened)."""


def _float_option(options: Mapping[str, object], name: str, default: float) -> float:
    value = options.get(name, default)
    return finite_seconds(value, name)


def fingerprint(engine: str, facts: Mapping[str, object]) -> bytes:
    """16 bytes naming what an engine's page bytes mean: ``engine`` and its sorted ``facts``."""
    text = "|".join([f"aiokv-adapter-v1|{engine}", *(f"{name}={facts[name]!r}" for name in sorted(facts))])
    return xxhash.xxh3_128_digest(text.encode("utf-8"))


def raw_layout(page_bytes: int) -> KVLayout:
    """The disk tier's layout for opaque pages of ``page_bytes`` bytes (padded to 4096 on disk)."""
    return KVLayout.mla(num_layers=1, latent_dim=page_bytes, dtype=torch.uint8, page_tokens=1)


def open_thread(config: StoreConfig, engine: str, into: list[LoopThread]) -> None:
    """Append to ``into`` a loop thread polling as ``config`` says, for one store or several sharing it.
    Constructed into the list by C code (list.extend over map), where no signal handler runs between
    the constructor's return and the append: returned, an interrupt (a KeyboardInterrupt from a signal
    handler, Ctrl-C at start-up) landing at that return left it running for good, held by nobody."""
    into.extend(map(LoopThread, [f"aiokv-{engine}"], [config.poll_s], [config.linger_s], [config.idle_poll_s]))


def page_file_bytes(page_bytes: int) -> int:
    """Bytes on disk of one page file holding ``page_bytes`` bytes (header, padding)."""
    return file_bytes(raw_layout(page_bytes))


def _nothing(_: object) -> None:
    """Nothing to close for a caller that is gone."""


def _settle_unstarted(closing: concurrent.futures.Future[Any], error: BaseException) -> None:
    """Fail the close's future whose run never started on the loop (one that started answers it)."""
    if closing.running() or closing.done():
        return
    try:
        closing.set_exception(error)
    except concurrent.futures.InvalidStateError:  # answered meanwhile
        pass


def _stuck_of(closing: concurrent.futures.Future[asyncio.Future[None] | None]) -> asyncio.Future[None] | None:
    """What a close that ended left stuck: its I/O's ``io_ended`` (None when nothing, or when it failed)."""
    return None if closing.cancelled() or closing.exception() is not None else closing.result()


def _ended(task: asyncio.Future[Any]) -> asyncio.Future[None]:
    """Resolves (to None) once ``task`` is over, however it ended."""
    ended: asyncio.Future[None] = task.get_loop().create_future()

    def done(_: asyncio.Future[Any]) -> None:
        if not ended.done():
            ended.set_result(None)

    task.add_done_callback(done)
    return ended


def _resolve_after(target: asyncio.Future[None], source: asyncio.Future[None] | None) -> None:
    """Resolve ``target`` once ``source`` resolved (now when None); fail it when ``source`` is
    cancelled or fails: when its I/O ended is then not known (``PagePool.close_after``)."""
    if source is None:
        target.set_result(None)
        return

    def done(_: asyncio.Future[None]) -> None:
        if target.done():
            return
        if source.cancelled() or source.exception() is not None:
            target.set_exception(RuntimeError("the end of stuck disk I/O is not known"))
        else:
            target.set_result(None)

    source.add_done_callback(done)


def _all_ended(futures: Sequence[asyncio.Future[Any]]) -> asyncio.Future[None]:
    """Resolves once every one of ``futures`` (a tier's ``io_ended``...) resolved; fails at once when
    one is cancelled or fails: when its I/O ended is then not known (``PagePool.close_after``)."""
    ended: asyncio.Future[None] = futures[0].get_loop().create_future()
    left = set(futures)

    def done(future: asyncio.Future[Any]) -> None:
        left.discard(future)
        if ended.done():
            return
        if future.cancelled() or future.exception() is not None:
            ended.set_exception(RuntimeError("the end of stuck disk I/O is not known"))
        elif not left:
            ended.set_result(None)

    for future in futures:
        future.add_done_callback(done)
    return ended


def _yield_gil() -> None:
    """Let the engine's threads run: the loop thread shares the GIL with the engine's scheduler,
    and a thread waiting for the GIL otherwise waits out the switch interval (5 ms by default)."""
    time.sleep(0)


class PageFileStore:
    """Page files for one engine identity; pages are given as lists of ``uint8`` CPU tensors.

    Construct from any thread but the store's own (it blocks until the disk tier started: index
    rebuilt, temp files removed). The coroutines run on :attr:`thread`'s loop. ``thread``: a loop
    thread shared with other stores (the caller closes it after closing them); None: one of the
    store's own, closed with it. ``sharing``: whether other processes serve the same directory
    (:class:`Sharing`; they then have the same ``engine``, ``facts`` and ``page_bytes``).
    """

    def __init__(self, config: StoreConfig, engine: str, facts: Mapping[str, object], page_bytes: int,
                 thread: LoopThread | None = None, sharing: Sharing = Sharing.ALONE) -> None:
        if isinstance(page_bytes, bool) or not isinstance(page_bytes, int) or page_bytes <= 0:
            raise ValueError(f"page_bytes must be a positive int, got {page_bytes!r}")
        if not isinstance(sharing, Sharing):
            raise TypeError(f"sharing must be a Sharing, got {sharing!r}")
        self.config = config
        self.sharing = sharing
        self.page_bytes = page_bytes
        self.fingerprint = fingerprint(engine, {**facts, "page_bytes": page_bytes})
        self.directory = config.directory / f"{engine}-{self.fingerprint.hex()}"
        ns = config.namespace.encode("utf-8")
        material = b"aiokv-engine-key-v1" + self.fingerprint + len(ns).to_bytes(8, "little") + ns
        self._seed = xxhash.xxh3_128_digest(material)
        self.layout = raw_layout(page_bytes)
        self._layout_dir = PageFiles(self.directory, self.layout).layout_dir
        self._refreshed = -math.inf  # loop time of the reader's last rescan
        self._checked = -math.inf  # loop time of the reader's last look for a page file it lacks
        self._dir_identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the directory the tier uses
        self.refreshes = 0
        """Rescans of a reader's index (:attr:`Sharing.READER`)."""
        self._tickets = itertools.count(1)
        self._pool: PagePool | None = None
        self._disk: DiskTier | None = None
        self._slots: asyncio.Semaphore | None = None
        self._clearing = asyncio.Lock()
        # Pages of one buffer whose size is the disk layout's (4096-multiple) skip the staging copy.
        self._direct_ok = config.zero_copy and self.layout.page_bytes == page_bytes
        self._regions: list[memoryview] = []  # engine memory registered with the disk tier
        self._registering: set[asyncio.Task[None]] = set()
        self.direct_pages = 0
        """Pages moved straight between the engine's memory and their files (no staging copy)."""
        self.staged_pages = 0
        """Pages moved through a staging page."""
        self.close_timeouts = 0
        """Closes that returned after ``close_timeout`` with disk I/O still stuck in the kernel."""
        self.clear_timeouts = 0
        """Calls of :meth:`clear` that returned False after ``close_timeout`` with the clear still
        running (disk I/O stuck in the kernel): it ends once that I/O did."""
        self._clear_task: asyncio.Task[bool] | None = None  # the clear in progress (clear())
        self._stuck_io: asyncio.Future[None] | None = None  # a close left disk I/O stuck: resolves when it ended
        # A close cut before its tiers closed (the loop's end cancels every task): resolved by the run
        # that closes them (the dying loop's finalizer), once the staging pool may be freed.
        self._cut_close: asyncio.Future[None] | None = None
        # close()'s run on the loop until it ended (wait_closed): it goes on when an interrupt cut its
        # caller short. Not kept after: a death's exception in it holds frames (views of the engine's memory).
        self._closing: concurrent.futures.Future[asyncio.Future[None] | None] | None = None
        self._clear_orphaned = False  # its caller stopped waiting: its outcome is logged, not raised
        self._retired: list[DiskTier] = []  # tiers a rescan replaced whose close did not end in time
        self._rescans: set[asyncio.Task[None]] = set()  # a reader's rescans in flight (close() stops them)
        self._owns_thread = thread is None
        # A reader's staleness checks: one worker for the store's life, started here (off the loop).
        self._check = ReaderCheck(f"aiokv-{engine}-check") if sharing is Sharing.READER else None
        self._closed = False
        self._abandoned = False  # the open's caller is gone: the open closes what it opened (loop only)
        self._open_task: asyncio.Task[Any] | None = None  # the open running on the loop (loop only)
        cleanup = Aside(self._clean_up_start, f"aiokv-{engine}-cleanup")  # made before anything it closes
        owned: list[LoopThread] = []
        try:
            if thread is None:
                open_thread(config, engine, owned)
            self.thread = thread if thread is not None else owned[0]
        except BaseException:  # refused (a pids limit), or interrupted: the check worker, started above, ends
            if owned:
                # Interrupted once it was made: stopped (idle, it holds nothing yet), else it ran for good.
                owned[0].close()
            if self._check is not None:
                self._check.join()  # no job queued yet: it ends at once
            raise
        try:
            self.thread.run(self._open())
        except BaseException:
            # The cleanup runs on a thread of its own (aside.py), handed over by this clause's first call (C
            # code: no signal's handler runs before it), and is waited for. Made on this thread, an interrupt
            # at its retry's back jump (Ctrl-C pressed a third time; or a second one at the entry of the
            # function making it) skipped the rest: the disk tier open for good (threads, ring, lock), the
            # staging pool mapped, the loop thread running, with nobody holding the store.
            try:
                _thread.start_new_thread(cleanup.start, ())
            except RuntimeError:  # no thread may start (a pids limit): made here, exposed as before
                cleanup.run()
            cleanup.wait()  # an interrupt here leaves it running to its end
            raise

    def _clean_up_start(self) -> None:
        """After a start cut short (its open failed, or its caller was interrupted: a KeyboardInterrupt
        from a signal handler), close what it opened and stop the store's own thread; on the thread of
        its own the constructor hands it to. Where its steps fail (or, made on the constructor's thread
        when no other may start, an interrupt lands in them), it makes them again (each may be made twice),
        then raises what cut the first pass short: it skipped the rest, the loop thread left running for
        good, or the disk tier open (its threads, ring and lock) with nobody holding the store, the
        staging pool mapped."""
        cut: BaseException | None = None
        while True:
            try:
                self._clean_up_start_once()
            except BaseException as exc:  # a close's error (or what a signal's handler raises): made again
                cut = exc
                continue
            if cut is not None:
                raise cut
            return

    def _clean_up_start_once(self) -> None:
        if self._owns_thread and self._disk is None:
            # Decided on the loop, where the open runs: looked at here, an open ending before the
            # stop below (this thread losing the GIL there) left the tier open for good under a
            # loop stopped by a close (no finalizer runs), its lock held, the pool mapped.
            with contextlib.suppress(RuntimeError, concurrent.futures.CancelledError):  # it died
                self.thread.run(self._cut_open())
        if self._disk is not None:
            # Opened: this thread was interrupted (a KeyboardInterrupt from a signal handler) once
            # the open had ended. Closed as close() does: stopping the loop left the tier open for
            # good (its threads, ring and lock; no finalizer runs after a close), the pool mapped.
            # Made again, a close() that began hands the close over again if it never reached the loop.
            self.close()
            return
        if not self._owns_thread:
            # Interrupted while the open runs on a shared loop, which goes on running it (the
            # store's own is stopped below, which cancels it): the open closes what it opened. It
            # was left open for good, nobody holding the store (the loop's owner stops the loop
            # once its calls answered: no finalizer runs after a close), the pool mapped.
            with contextlib.suppress(RuntimeError):  # the loop closed or died: nothing runs there
                self.thread.submit(self._abandon_open())
        if self._check is not None:
            self._check.join()
        if self._owns_thread:
            self.thread.close()
            self._wait_thread_ended(None)  # a close() made again does not join

    async def _open(self) -> None:
        self._open_task = asyncio.current_task()
        if self._abandoned:
            return  # its caller is gone before it began: nothing to open, nothing to close
        pages = self.config.pages_in_staging
        pool = await PagePool.open(self.layout, pages * self.layout.page_bytes, register_cuda=False, workers=1)
        try:
            disk = await self._start_disk(pool)
        except BaseException:
            await pool.aclose()
            raise
        self._refreshed = asyncio.get_running_loop().time()
        self._slots = asyncio.Semaphore(pages)
        # If the loop dies, the dying thread closes the tier and the staging pool (nothing else can).
        # Added here with them, on the loop: the open's caller may be interrupted once it ended.
        self.thread.add_finalizer(self._close_dying)
        self._pool, self._disk = pool, disk
        self._open_task = None  # ended: nothing to cut (the done task is not kept for the store's life)
        if self._abandoned:
            await self._close_abandoned()

    async def _cut_open(self) -> None:
        """The open's caller on the store's own loop is gone (interrupted), the open not ended: cut it
        (loop only: it cannot end between this look and the cancel) and wait for its end. Its
        cancellation frees what it opened; an open that ended is closed by the caller, as close()
        does. Waited for: a loop stopped before that end cut the staging pool's release in turn (the
        loop's end cancels every task), its segment left mapped and named until exit."""
        if self._disk is None:
            task = self._open_task
            if not self._abandoned:  # once: cut again (a caller interrupted again), its cleanup was cut too
                self._abandoned = True  # not begun yet: it opens nothing
                if task is not None:
                    task.cancel()
            if task is not None:
                await asyncio.wait({task})

    async def _abandon_open(self) -> None:
        """The open's caller is gone (interrupted): an open that ended is closed now, one still
        running closes at its end (both on the loop: no race with that end)."""
        self._abandoned = True
        if self._disk is not None:
            await self._close_abandoned()

    async def _close_abandoned(self) -> None:
        """Close a store nobody holds (its constructor's caller interrupted); its future answers
        once closed, which the shared loop's owner waits for before it stops the loop."""
        if not self._closed:
            self._closed = True
            await self._close_once(self._close_future())

    async def _start_disk(self, pool: PagePool) -> DiskTier:
        """A started tier over the directory, in the role of :attr:`sharing`."""
        if self.sharing is Sharing.ALONE:
            return await self._new_disk(pool)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.writer_wait_s
        delay = 0.01
        while True:
            if self.sharing is Sharing.WRITER:
                disk = await self._new_disk(pool)
                if disk.read_only is not ReadOnly.LOCKED:
                    return disk
                if loop.time() >= deadline:
                    log.warning("aiokv store: %s stays locked by another process after %.1f s: this writer "
                                "serves it read-only", self.directory, self.config.writer_wait_s)
                    return disk
            else:
                # A shared lock while the tier starts: its own (exclusive) attempt then fails, so
                # it starts read-only, and never removes the writer's temp files or evicts its pages.
                disk = await self._new_disk(pool, guard=True)
                if disk.read_only is not None:
                    return disk
                # It took the lock anyway: the writer let go of it between our two attempts (it
                # was between two tiers). Give it back at once.
                if loop.time() >= deadline:
                    await disk.aclose()
                    raise OSError(f"aiokv store: a reader of {self.directory} kept getting its lock for "
                                  f"{self.config.writer_wait_s} s: is the writer running?")
            await disk.aclose()
            await asyncio.sleep(delay)
            delay = min(2 * delay, 0.2)

    async def _new_disk(self, pool: PagePool, guard: bool = False) -> DiskTier:
        """A started tier over the store's directory, reached only through a descriptor checked here
        (:func:`~aiokv.adapters.storedirs.open_dirs`, in a thread): the tier never looks the
        directory's name up, so a name swapped after the check (a symlink, another directory)
        redirects nothing. ``guard``: the lock file is held shared while the tier starts (a
        reader's). Raises ``UnsafeDirectoryError`` (logged; the tier closed again) when, once the
        tier started, the name no longer leads to the directory checked: someone replaced it
        meanwhile."""
        own_fd, layout_fd, held = await run_in_new_thread(
            functools.partial(open_dirs, self.directory, self._layout_dir, guard), "aiokv-store-dir", close_dirs)
        try:
            try:
                try:
                    disk = DiskTier(
                        DiskConfig(
                            directory=self.directory,
                            capacity_bytes=self.config.capacity_bytes,
                            backend=self.config.backend,
                            direct_io=self.config.direct_io,
                            queue_depth=self.config.queue_depth,
                            # A reader never takes the lock (nor follows: its own rescans do), or it
                            # could become the writer of a directory its writer restarts into.
                            follow_interval_s=0 if self.sharing is Sharing.READER else
                            _DISK_DEFAULTS["follow_interval_s"],
                        ),
                        self.layout,
                        pool,
                    )
                    await disk.start(directory_fd=own_fd)
                finally:
                    if held is not None:
                        os.close(held)
                checked = os.fstat(own_fd)  # a descriptor's fstat never blocks
            finally:
                os.close(own_fd)
            try:
                named = await run_in_new_thread(functools.partial(dir_identity, self.directory), "aiokv-store-dir",
                                                _nothing)
            except BaseException:
                await disk.aclose()
                raise
            if named != (checked.st_dev, checked.st_ino):
                await disk.aclose()
                message = (f"aiokv store: {self.directory} was replaced (renamed, or a link put in its place) while "
                           "the store started: refusing to use it (nothing was written outside the directory checked)")
                log.error("%s", message)
                raise UnsafeDirectoryError(errno.EPERM, message)
        except BaseException:
            if layout_fd is not None:
                os.close(layout_fd)
            raise
        self._dir_identity = named
        if layout_fd is not None:
            # A reader's staleness checks look in the layout directory of the tier it serves now.
            assert self._check is not None  # guard is a reader's
            self._check.adopt(layout_fd)
        return disk

    def key(self, engine_key: bytes) -> PageKey:
        """The page key of the engine's key ``engine_key`` (any bytes)."""
        return xxhash.xxh3_128_digest(self._seed + engine_key)

    # -- on the loop ----------------------------------------------------------------------------

    def contains(self, keys: Sequence[PageKey]) -> list[bool]:
        """Whether a page file is indexed for each key (a read still verifies it); after
        :meth:`close` every key misses (as reads do). Loop only."""
        disk = self._started()[1]
        if self._closed:
            return [False] * len(keys)
        return [disk.contains(key) for key in keys]

    def touch(self, keys: Sequence[PageKey]) -> int:
        """Mark the page files of ``keys`` most recently used (keys without one are skipped); how
        many were. Loop only; no I/O (recency is not kept across restarts: the index rebuilds in
        file-time order)."""
        return self._started()[1].touch(keys)

    def present_prefix(self, keys: Sequence[PageKey]) -> int:
        """How many leading ``keys`` have page files; 0 after :meth:`close`. Loop only."""
        disk = self._started()[1]
        return 0 if self._closed else disk.keys_present_prefix(keys)

    async def fresh_prefix(self, keys: Sequence[PageKey]) -> int:
        """:meth:`present_prefix`; a reader first rescans its directory when the first key missing
        from its index has a file (the writer published it since), if ``reader_refresh_s`` passed.
        A :meth:`close` meanwhile stops the rescan: every key then misses (0)."""
        count = self.present_prefix(keys)
        if count < len(keys) and await self._stale(keys[count : count + 1]):
            await self._refresh()
            count = self.present_prefix(keys)
        return count

    async def fresh_contains(self, keys: Sequence[PageKey]) -> list[bool]:
        """:meth:`contains`; a reader first rescans as :meth:`fresh_prefix` when a missing key has a
        file. A :meth:`close` meanwhile stops the rescan: every key then misses."""
        found = self.contains(keys)
        missing = [key for key, there in zip(keys, found, strict=True) if not there]
        if missing and await self._stale(missing):
            await self._refresh()
            found = self.contains(keys)
        return found

    async def _stale(self, missing: Sequence[PageKey]) -> bool:
        """Whether a reader's index is due a rescan: one of the ``missing`` keys has a file now.
        Looked for at most every ``reader_refresh_s`` (as rescans are made), on the reader's check
        worker (:class:`~aiokv.adapters.storedirs.ReaderCheck`): lookups that keep missing pages
        nobody published cost no system call in between, and the loop never waits on the directory."""
        if self._check is None or self._closed:
            return False  # not a reader, or nothing to rescan any more
        files = self._started()[1].files
        now = asyncio.get_running_loop().time()
        if now - max(self._refreshed, self._checked) < self.config.reader_refresh_s:
            return False
        self._checked = now
        names: list[tuple[str, str]] = []
        for key in missing:
            fan, name = files.rel(key).split("/")
            names.append((fan, name))
        return await self._check.check(names)

    async def _refresh(self) -> None:
        """Rebuild a reader's index: a new tier over the directory replaces the old one, which
        finishes the reads in flight and closes. A rescan that fails keeps the old tier (logged).
        The rescan runs in a task of the store's, which :meth:`close` stops (the caller's task is
        not the store's to cancel); a cancelled caller leaves it running. None after close()."""
        if self._closed:
            return
        task = asyncio.get_running_loop().create_task(self._rescan())
        self._rescans.add(task)
        task.add_done_callback(self._rescans.discard)
        await asyncio.wait({task})

    async def _rescan(self) -> None:
        """:meth:`_refresh`'s work; it never fails (failures are logged: the old tier serves)."""
        try:
            async with self._clearing:
                loop = asyncio.get_running_loop()
                if loop.time() - self._refreshed < self.config.reader_refresh_s:
                    return  # another caller rescanned while this one waited
                self._refreshed = loop.time()
                pool, old = self._started()
                try:
                    disk = await self._start_disk(pool)
                except Exception:
                    log.exception("aiokv store: rescanning %s failed; serving the index it had", self.directory)
                    return
                if self._closed:
                    # close() began while it started (and gave up waiting, or will close the old
                    # tier): nobody else would close this one.
                    await disk.aclose()
                    return
                self._disk = disk
                self.refreshes += 1
                await self._retire(old)
        except Exception:
            log.exception("aiokv store: rescanning %s failed", self.directory)

    async def _retire(self, old: DiskTier) -> None:
        """Close ``old``, a tier the store replaced, waiting ``close_timeout`` at most: its I/O still
        stuck in the kernel then (a hung file system) goes on, and the staging pool it may read or
        write is freed only once that I/O ended (:meth:`_close`)."""
        self._retired.append(old)  # first: a close() cancelling this still finds it
        if await old.close_within(self.config.close_timeout):
            self._retired.remove(old)

    async def store(self, key: PageKey, page: Sequence[torch.Tensor]) -> bool:
        """Write the page made of the ``page`` tensors (1-D ``uint8`` CPU, ``page_bytes`` in all) under
        ``key``. True once stored (or already on disk); False when the disk tier dropped or failed
        the write (counted in its statistics). A page of one tensor is written straight from it
        (``zero_copy``), else copied into a staging page first; either way the caller's memory is
        free again when this returns (also when cancelled). Raises ``ValueError`` for parts that do
        not add up to ``page_bytes``."""
        pool, disk = self._started()
        if disk.contains(key):
            disk.touch([key])  # as the disk tier's own write of a stored key: the page is recent again
            return True
        assert self._slots is not None
        direct = self._direct(page, writable=False)
        async with self._slots:
            _yield_gil()
            if direct is not None:
                try:
                    self.direct_pages += 1
                    return await disk.write_from(key, direct)
                finally:
                    direct.release()
                    _yield_gil()
            self.staged_pages += 1
            handle = self._reserve(pool)
            if handle is None:
                return False
            try:
                self._copy(pool, handle, page, into_staging=True)
            except BaseException:
                pool.table.abort(handle)
                raise
            ready = pool.table.commit(handle, keep=True)
            assert ready is not None
            try:
                return await disk.write(key, ready)
            finally:
                pool.table.release(ready)
                pool.table.discard(ready.key)
                _yield_gil()

    async def load(self, key: PageKey, page: Sequence[torch.Tensor]) -> bool:
        """Read ``key``'s page file into the ``page`` tensors and verify it; True only once verified.
        False for a missing, corrupt (deleted, counted) or unreadable file: the tensors are then
        untouched when the page went through a staging page, and hold undefined bytes when it was
        read in place (``zero_copy``, a page of one tensor): the engine must not use them, as it
        does not use a page whose load failed. Raises ``ValueError`` as :meth:`store`."""
        pool, disk = self._started()
        if not disk.contains(key):
            return False
        assert self._slots is not None
        direct = self._direct(page, writable=True)
        async with self._slots:
            if direct is not None:
                try:
                    self.direct_pages += 1
                    return await disk.read_into(key, direct)
                finally:
                    direct.release()
                    _yield_gil()
            self.staged_pages += 1
            handle = self._reserve(pool)
            if handle is None:
                return False
            try:
                if not await disk.read(key, handle):
                    return False
                if pool.closed:
                    return False  # the store closed while the read was stuck in the kernel: a miss
                self._copy(pool, handle, page, into_staging=False)
                return True
            finally:
                pool.table.abort(handle)
                _yield_gil()

    def statistics(self) -> DiskStatistics:
        """The disk tier's statistics. Loop only."""
        return self._started()[1].statistics()

    def register_memory(self, region: memoryview) -> None:
        """Register the engine's ``region`` (C-contiguous, writable, mapped until :meth:`close`) with
        the disk tier in the background, so that pages inside it move through io_uring fixed
        buffers; until then (or where it cannot be registered: counted in the tier's statistics)
        they move through plain buffers. Loop only; the registration is redone after :meth:`clear`.
        A reader (:attr:`Sharing.READER`) does not register: each rescan replaces its tier, and
        pinning the region again each time would cost more than fixed buffers save."""
        if self.sharing is Sharing.READER:
            return
        self._regions.append(region)
        self._register(region)

    def _register(self, region: memoryview) -> None:
        task = asyncio.get_running_loop().create_task(self._started()[1].register_memory(region))
        self._registering.add(task)
        task.add_done_callback(self._registered)

    async def wait_registered(self) -> None:
        """Wait until the registrations in the background are over (done, refused or failed)."""
        if self._registering:
            await asyncio.wait(set(self._registering))

    @property
    def registered_regions(self) -> int:
        """Engine regions handed to :meth:`register_memory` (those refused are counted in the
        tier's ``memory_unregistered``)."""
        return len(self._regions)

    def _registered(self, task: asyncio.Task[None]) -> None:
        self._registering.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("aiokv store: registering engine memory failed", exc_info=task.exception())

    async def flush(self) -> None:
        """Wait for writes in flight."""
        await self._started()[1].flush()

    async def clear(self) -> bool:
        """Delete every page file of this identity and start over empty. True when cleared.

        The disk tier is closed first (waiting for its I/O in flight), the regular files of ours in
        its directory deleted through descriptors of that directory (never following a link, never
        entering a directory that is not ours, never through a name swapped since the tier started:
        see :func:`~aiokv.adapters.storedirs.clear_tree`) and a fresh tier started there. Calls
        meanwhile see a closing tier: writes are refused and reads miss (never bytes from a
        half-removed file). False, with the tier left as it was, when the directory is read-only
        here or held by another process (its owner alone deletes there); False with the tier
        restarted over what is left when the removal fails part-way (the index is rebuilt from the
        files that remain). A reader (:attr:`Sharing.READER`) only rescans: the writer deletes.

        Bounded by ``close_timeout``: a clear not over by then (disk I/O stuck in the kernel, a
        frozen or hung file system) returns False, counted in ``clear_timeouts``, and goes on in the
        background: the tier stays closed until the stuck I/O ended, then the files are deleted and
        a fresh tier started. A ``clear()`` while one runs waits for that one (bounded alike) and
        returns its outcome; a cancelled ``clear()`` leaves it running; :meth:`close` stops it.
        Raises ``RuntimeError`` after :meth:`close`, and when a :meth:`close` stopped it meanwhile.
        """
        if self._closed:
            raise RuntimeError("page-file store is closed")
        task = self._clear_task
        if task is None or task.done():
            task = self._clear_task = asyncio.get_running_loop().create_task(self._clear())
            self._clear_orphaned = False
            task.add_done_callback(self._cleared)
        done, _ = await asyncio.wait({task}, timeout=self.config.close_timeout)
        if not done:
            self.clear_timeouts += 1
            self._clear_orphaned = True
            log.error("aiokv store: clearing %s is not over after close_timeout (%.1f s): disk I/O stuck in the "
                      "kernel? It goes on in the background; writes are refused and reads miss until it ends",
                      self.directory, self.config.close_timeout)
            return False
        if task.cancelled():  # close() stopped it (nothing else cancels the store's own task)
            raise RuntimeError("page-file store closed while clearing")
        return task.result()

    def _cleared(self, task: asyncio.Task[bool]) -> None:
        """The clear task's outcome, logged when its caller stopped waiting (else clear() returns it)."""
        if task.cancelled():
            return
        exc = task.exception()
        if not self._clear_orphaned:
            return
        if exc is not None:
            log.error("aiokv store: clearing %s failed after close_timeout", self.directory, exc_info=exc)
        else:
            log.warning("aiokv store: clearing %s ended after close_timeout (%s)", self.directory,
                        "cleared" if task.result() else "not cleared")

    async def _clear(self) -> bool:
        """:meth:`clear`'s work, in a task of the store's own (a caller's bound does not cut it)."""
        if self.sharing is Sharing.READER:
            # The writer deletes; a reader forgets what it indexed (and finds what is still there).
            self._refreshed = -math.inf
            await self._refresh()
            return True
        async with self._clearing:  # a reader's rescan waits: two would each start a tier
            pool, disk = self._started()
            if disk.read_only is not None:
                log.warning("aiokv store: not clearing %s: %s", self.directory, disk.read_only.value)
                return False
            await self._stop_registering()
            await disk.aclose()  # shielded: a close() stopping this clear leaves it running (and bounds it)
            try:
                clearing = functools.partial(clear_tree, self.directory, self._dir_identity)
                removed = await run_in_new_thread(clearing, "aiokv-store-clear", _nothing)
            except OSError:
                log.exception("aiokv store: clearing %s failed part-way", self.directory)
                removed = False
            # If this raises, the closed tier stays: writes are refused and reads miss.
            fresh = await self._start_disk(pool)
            if self._closed:  # close() began meanwhile: nobody else would close this tier
                await fresh.aclose()
                return removed
            self._disk = fresh
            for region in self._regions:
                self._register(region)
            return removed

    # -- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait (up to ``close_timeout``) for I/O in flight, stop a :meth:`clear` or a reader's
        rescan in flight, close the disk tier and the staging pool, stop the thread. Disk I/O
        still stuck in the kernel then (a frozen or hung file system) is counted in
        ``close_timeouts``; the staging pool it may read or write is freed, and the store's own
        thread stopped, only once it ended. Afterwards (a shared loop thread still runs) lookups
        and reads miss, writes are refused and :meth:`clear` raises ``RuntimeError``. Idempotent;
        call from any thread but the store's. An interrupt of the calling thread (``KeyboardInterrupt``
        from a signal handler) is raised at once; the close goes on on the loop, and the store's own
        thread is stopped once it ended (a second interrupt landing before the close reached the loop
        leaves it to a later call, which hands it over again). ``RuntimeError`` on the store's loop
        thread unless closed already (it would wait there for good for a close only that thread runs)."""
        if self._closed:
            closing = self._closing
            if closing is not None and not closing.running() and not closing.done():
                # A close() interrupted again in the hand-over its finally made again may have left no
                # close running: made again (the loop runs the close once). It returned at once, the
                # tier open for good.
                with contextlib.suppress(RuntimeError):  # the loop closed or died: the future says so
                    self._hand_over(closing)
            return
        if self.thread.in_loop_thread():
            raise RuntimeError("PageFileStore.close called on its loop thread: it would deadlock")
        # The close's future is the store's, made before the close is marked begun: an interrupt of
        # this thread landing before or in the hand-over to the loop leaves it pending (wait_closed and
        # when_closed wait for it) and the hand-over is made again below (the loop runs the close once;
        # a second interrupt there leaves it to a later close()). Made only there, an interrupt before
        # the hand-over left no close running: the tier open for good and counted as closed (the
        # engine's memory let go under it). The store's own thread is stopped once it ended (its future's
        # callback: arranged however this call is cut short).
        closing = self._close_future()
        deadline = time.monotonic() + self.config.close_timeout
        handed = False
        try:
            try:
                # Marked begun inside the try: an interrupt landing right after it still hands the close
                # over (finally). Marked before the try, one landing in between (the deadline's
                # time.monotonic() call, where a signal's handler runs) left the close never handed over
                # and counted as begun: the tier open for good unless the caller called close() again.
                # One landing before the mark leaves no close begun (the finally does nothing then).
                self._closed = True
                self._hand_over(closing)
                handed = True
                closing.result()
            except (SystemExit, KeyboardInterrupt) as exc:
                if closing.done() and not closing.cancelled() and closing.exception() is exc:
                    raise LoopDied(f"aiokv loop thread died: {exc!r}") from exc  # it ended the loop (as run())
                raise  # this thread's own (a signal's handler): the close goes on, see below
        except LoopDied:
            pass  # the dying thread closed them (finalizer)
        finally:
            if self._closed:
                # The engine's memory is its own again, by this clause's first call (C code: no signal's
                # handler runs before it; see aside.py). Let go in _after_close, an interrupt at its entry
                # (Ctrl-C once, as the close ended) left the store holding views of it for good: vLLM's
                # region exported (never unmapped) by a store nobody closes again.
                self._regions.clear()
                self._after_close(closing, handed, deadline)

    def _after_close(self, closing: concurrent.futures.Future[asyncio.Future[None] | None], handed: bool,
                     deadline: float) -> None:
        """close()'s ending, however its caller was cut short: the hand-over made again if it was not
        made, the reader's check joined, the store's own thread waited for (the engine's memory was let go)."""
        if not handed and not closing.done():
            # Interrupted before or in the hand-over: made again (the loop runs the close once).
            with contextlib.suppress(RuntimeError):  # the loop closed or died: the future says so
                self._hand_over(closing)
        # Its layout directory descriptor closed; a look stuck in the kernel (a hung file
        # system) is not waited for past the bound: it only looks, and ends by itself.
        if self._check is not None and not self._check.join(max(0.0, deadline - time.monotonic())):
            log.error("aiokv store: a staleness check of %s is still stuck in the kernel after close_timeout "
                      "(%.1f s); its thread ends with it", self.directory, self.config.close_timeout)
        if self._owns_thread and closing.done() and _stuck_of(closing) is None:
            # The close ended: its future's callback stopped the store's own thread (on the loop,
            # which stops after it), waited for here. Never stopped from here: this thread
            # interrupted (a KeyboardInterrupt from a signal handler) while the close ran or was
            # handed over stopped the loop under it, the tier left open for good (its threads, ring
            # and lock; no finalizer runs after a close).
            bound = None if self.thread.died is None else max(0.0, deadline - time.monotonic())
            if not self._wait_thread_ended(bound):
                # A death's end waits for the work it cancelled, its I/O stuck in the kernel (a hung
                # file system), then its finalizer closes the tier and frees the pool: it ends by
                # itself. Joined without a bound, close() (vLLM's shutdown) held until that I/O ended.
                log.error("aiokv store: the dying loop thread of %s is still ending after close_timeout "
                          "(%.1f s): disk I/O stuck in the kernel; its finalizer closes the disk tier",
                          self.directory, self.config.close_timeout)

    def _close_future(self) -> concurrent.futures.Future[asyncio.Future[None] | None]:
        """The future of the close to come or running (made once, before the close begins); the store's
        own thread is stopped once it ended."""
        closing = self._closing
        if closing is None:
            closing = concurrent.futures.Future()
            closing.add_done_callback(self._close_ended)
            if self._owns_thread:
                closing.add_done_callback(self._close_thread_when_closed)
            self._closing = closing
        return closing

    def _close_ended(self, _: concurrent.futures.Future[asyncio.Future[None] | None]) -> None:
        self._closing = None

    def _hand_over(self, closing: concurrent.futures.Future[asyncio.Future[None] | None]) -> None:
        """Run the close on the loop, its outcome set on ``closing`` (once, however often handed over).
        Raises (and sets on ``closing``) ``LoopDied`` or ``RuntimeError`` when the loop died or closed."""
        try:
            handed = self.thread.submit(self._close_once(closing))
        except RuntimeError as exc:  # LoopDied too: nothing runs on the loop any more
            _settle_unstarted(closing, exc)
            raise

        def unstarted(future: concurrent.futures.Future[None]) -> None:
            # Never started (the loop ended first): nothing else answers ``closing``.
            if future.cancelled():
                _settle_unstarted(closing, concurrent.futures.CancelledError())
            elif (error := future.exception()) is not None:
                _settle_unstarted(closing, error)

        handed.add_done_callback(unstarted)

    async def _close_once(self, closing: concurrent.futures.Future[asyncio.Future[None] | None]) -> None:
        """:meth:`_close`, its outcome set on ``closing`` (``LoopDied`` when a death's end cut it)."""
        if closing.running() or closing.done():
            return  # handed over again (its caller interrupted in the hand-over): it runs already
        closing.set_running_or_notify_cancel()
        try:
            stuck = await self._close()
            # Kept here, on the loop, for every close (an abandoned open's too, which no close() call
            # waits for): io_stuck and wait_io_settled said nothing was stuck there.
            self._stuck_io = stuck
        except asyncio.CancelledError:
            died = self.thread.died
            if died is None:  # a close of the shared loop thread cut it (its caller's future was cancelled)
                closing.set_exception(concurrent.futures.CancelledError())
            else:
                error = LoopDied(f"aiokv loop thread died: {died!r}")
                error.__cause__ = died
                closing.set_exception(error)
            raise
        except BaseException as exc:
            closing.set_exception(exc)
            raise
        closing.set_result(stuck)

    def wait_closed(self, timeout: float | None) -> bool:
        """After :meth:`close`: wait up to ``timeout`` seconds for its run on the loop to end (one whose
        caller an interrupt cut short goes on there); True once it ended, when the tier no longer uses
        the engine's registered memory (as when ``close()`` returns; after a death of the loop thread,
        once that thread ended: its finalizer closed the tiers). Any thread but the store's."""
        if not self._closed:
            return False  # not begun (its caller interrupted before it began)
        deadline = None if timeout is None else time.monotonic() + timeout
        closing = self._closing
        if closing is not None:
            concurrent.futures.wait((closing,), timeout)
            if not closing.done():
                return False
        if self.thread.died is not None:
            # A death's end cancelled the close (its future failed) before its finalizer closed the
            # tiers, which may still use the engine's memory: over once the dying thread ended.
            return self._wait_thread_ended(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return True  # it ended, or none ran (close() found the loop dead: its finalizer closed)

    def when_closed(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` once :meth:`close`'s run on the loop ended (see :meth:`wait_closed`; a close that
        did not begin yet: once a later one ended): at once when it has, else on the loop thread (``fn``
        must not block; what it raises is logged); after a death of the loop thread, once that thread's
        end is over (its finalizer closed the tiers): by that thread as its last act, or at once."""

        def guarded() -> None:
            try:
                fn()
            except Exception:
                log.exception("aiokv store: a callback after the close of %s failed", self.directory)

        def call(_: object) -> None:
            if self.thread.died is not None:
                # The death's end cut the close (its future failed) before its finalizer closed the
                # tiers, which may still use the engine's memory: called once that end is over, by the
                # dying thread itself (the loop's must not join itself, a caller's must not block). A
                # thread of its own for it was refused where no thread may start (a pids limit), and
                # the callback never ran: vLLM's region held for good.
                self.thread.when_ended(guarded)
            else:
                guarded()

        if self._closing is None and self._closed:
            call(None)  # it ended
        else:
            # Running, or not begun yet (its caller interrupted before it began): once a close ended.
            self._close_future().add_done_callback(call)

    def _wait_thread_ended(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (None: for good) for the loop thread's end; True once ended."""
        if timeout is not None:
            return self.thread.wait_ended(timeout)
        while not self.thread.wait_ended(3600.0):
            pass
        return True

    def _close_thread_when_closed(self, closing: concurrent.futures.Future[asyncio.Future[None] | None]) -> None:
        """Stop the store's own thread once its close ended (after stuck I/O: once that ended and the
        staging pool is freed): the callback of the close's future, on the thread that ended it (mostly
        the loop's, which must not join itself), however the caller of close() was cut short."""
        stuck = _stuck_of(closing)
        if stuck is None:
            self._stop_thread()
        else:
            self._close_thread_after(stuck)

    def _close_thread_after(self, io_ended: asyncio.Future[None]) -> None:
        """Stop the store's own thread once the stuck I/O ended and the staging pool is freed: its
        loop runs the tier's close to that end (a stopped loop would leave the pool mapped)."""
        thread = self.thread

        def stop(_: object) -> None:
            self._stop_thread()

        try:
            thread.submit(self._pool_freed(io_ended)).add_done_callback(stop)
        except RuntimeError:  # LoopDied too: the loop ended meanwhile, nothing runs there any more
            thread.close()

    def _stop_thread(self) -> None:
        """Stop the store's own thread from a callback, mostly on the loop thread (the loop then stops
        after the callback: no thread to start, none to join; an aiokv-store-stop thread for it was
        refused where no thread may start, a pids limit). A dying thread ends by itself."""
        if self.thread.died is None:
            self.thread.close()

    async def _pool_freed(self, io_ended: asyncio.Future[None]) -> None:
        await asyncio.wait({io_ended})
        if self._pool is not None:
            await self._pool.wait_freed()

    @property
    def io_stuck(self) -> bool:
        """True when the store's close (:meth:`close`'s, or that of an open whose caller was interrupted)
        ended with disk I/O still stuck in the kernel (see :meth:`wait_io_settled`)."""
        return self._stuck_io is not None

    async def wait_io_settled(self) -> None:
        """After :meth:`close`: wait until no disk I/O of this store touches memory any more and its
        staging pool is freed (at once unless the close left I/O stuck). The owner of a shared loop
        thread stops it only then: a loop stopped earlier cancels the stuck work, whose close then
        never frees the pool. Loop only."""
        if self._stuck_io is not None:
            await self._pool_freed(self._stuck_io)

    async def _stop_registering(self) -> None:
        """Stop the registrations in the background and wait for them: a cancelled one waits for its
        pinning thread (DiskTier.register_memory), which may still pin pages of the engine's region
        or the staging pool (neither may be let go under it). A pin stuck in the kernel holds the
        close (and a dying loop's finalizer) for as long: warned every ``close_timeout``, never silent."""
        for task in self._registering:
            task.cancel()
        report_s = max(self.config.close_timeout, STUCK_REPORT_MIN_S)
        waited, pending = 0.0, set(self._registering)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=report_s)
            if pending:
                waited += report_s
                log.warning("aiokv store: the close of %s has waited %.0f s for %d registration(s) of memory with "
                            "the disk tier (a pinning thread stuck in the kernel?); it keeps waiting",
                            self.directory, waited, len(pending))

    async def _close_dying(self) -> None:
        """The dying loop thread's finalizer: :meth:`_close`, then, when disk I/O is still stuck in the
        kernel, wait without bound until it ended, the tiers' close (run anew) with it, and the staging
        pool is freed (warned every ``close_timeout``). The dying thread closes its loop after this: left
        pending there, that close and the pool's release never ran (tier open for good, pool mapped;
        review 266). ``close_timeout`` bounds :meth:`close`'s caller, who waits that long at most for
        this thread's end."""
        stuck = await self._close()
        if stuck is None:
            return
        report_s = max(self.config.close_timeout, STUCK_REPORT_MIN_S)
        freed = asyncio.ensure_future(self._pool_freed(stuck))
        waited = 0.0
        while not (await asyncio.wait({freed}, timeout=report_s))[0]:
            waited += report_s
            log.warning("aiokv store: the dying loop thread of %s has waited %.0f s for disk I/O stuck in the kernel "
                        "to end; it closes the disk tier and frees the staging pool then", self.directory, waited)
        freed.result()

    async def _close(self) -> asyncio.Future[None] | None:
        """Close within ``close_timeout``; returns the tier's ``io_ended`` when its I/O is still
        stuck in the kernel (the staging pool is freed once that resolved), else None."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.close_timeout  # one bound for the whole close
        # A clear still running, this tier's and replaced tiers' stuck I/O: the staging pool is freed
        # once all of them ended.
        pending: list[asyncio.Future[Any]] = []
        stuck: asyncio.Future[None] | None = None
        tiers_closed = False
        try:
            if self._check is not None:
                # A lookup waiting on a staleness check stuck in the kernel answers now (a miss):
                # else it held close() another close_timeout and was then cancelled under the
                # engine's thread (concurrent.futures.CancelledError out of batch_exists).
                self._check.stop()
                self._check.abandon()
            # A clear still running (stuck, else clear() would have ended it) and a reader's rescans
            # (in callers' stead): stopped, their tiers closed below.
            stopping = [task for task in (self._clear_task, *self._rescans) if task is not None and not task.done()]
            for task in stopping:
                task.cancel()
            if stopping:
                await asyncio.wait(stopping, timeout=max(0.0, deadline - loop.time()))
            # Starting a fresh tier, its thread stuck in the file system: the pool waits for it.
            pending += [_ended(task) for task in stopping if not task.done()]
            await self._stop_registering()
            # Read after the clear and rescans ended: they may have started a fresh tier meanwhile.
            tiers = [*self._retired, *([self._disk] if self._disk is not None else [])]
            for tier in tiers:  # closed at once when closed already
                if not await tier.close_within(max(0.0, deadline - loop.time())):
                    pending.append(tier.io_ended)
            tiers_closed = True
            if pending:
                self.close_timeouts += 1
                stuck = _all_ended(pending)
                log.error("aiokv store: disk I/O of %s still stuck in the kernel after close_timeout (%.1f s); "
                          "the staging pool stays mapped until it ends", self.directory, self.config.close_timeout)
        finally:
            if self._check is not None:
                self._check.stop()  # also when the loop dies: nobody may join it then
            if self._pool is not None:
                cut = self._cut_close
                if not tiers_closed:
                    # Cut before every tier closed (the loop's end cancels every task: a death, whose
                    # finalizer runs this close again, or a shared loop thread's close): their I/O and
                    # threads may still use the pool, freed once a later run closed them (else mapped
                    # until exit). It was freed at once, under a tier still open.
                    if cut is None or cut.done():
                        cut = self._cut_close = loop.create_future()
                    pending.append(cut)
                elif cut is not None and not cut.done():
                    _resolve_after(cut, stuck)  # this run closed what the cut one left: it frees the pool
                if stuck is not None:
                    self._pool.close_after(stuck)  # the stuck I/O may still read or write its pages
                elif pending:
                    self._pool.close_after(_all_ended(pending))  # cancelled meanwhile: still not freed under it
                else:
                    await self._pool.aclose()
                    await self._pool.wait_freed()  # (at once, unless a cut run's close_after frees it)
        return stuck

    # -- internals ------------------------------------------------------------------------------

    def _started(self) -> tuple[PagePool, DiskTier]:
        if self._pool is None or self._disk is None:
            raise RuntimeError("page-file store is not open")
        return self._pool, self._disk

    def _direct(self, page: Sequence[torch.Tensor], writable: bool) -> memoryview | None:
        """A view of the page's memory when it can move in place: one contiguous ``uint8`` CPU
        tensor of the disk layout's page size (a 4096-multiple); else None (staging copy)."""
        if len(page) != 1:
            return None
        part = page[0]
        if part.numel() != self.page_bytes:
            raise ValueError(f"page parts hold {part.numel()} bytes, pages are {self.page_bytes}")
        if not self._direct_ok or part.dtype != torch.uint8 or part.device.type != "cpu" or not part.is_contiguous():
            return None
        view = part.numpy().data
        if writable and view.readonly:
            view.release()
            return None
        return view

    def _reserve(self, pool: PagePool) -> PageHandle | None:
        # A staging page under a key of its own: the page is only bounce memory, never looked up.
        ticket = next(self._tickets).to_bytes(16, "little")
        (reservation,) = pool.reserve([ticket])
        if reservation.outcome is not ReserveOutcome.RESERVED:
            return None
        return reservation.handle

    def _copy(self, pool: PagePool, handle: PageHandle, page: Sequence[torch.Tensor], into_staging: bool) -> None:
        total = sum(part.numel() for part in page)
        if total != self.page_bytes:
            raise ValueError(f"page parts hold {total} bytes, pages are {self.page_bytes}")
        staging = pool.tensor(handle).reshape(-1)
        offset = 0
        for part in page:
            n = part.numel()
            window = staging[offset : offset + n]
            if into_staging:
                window.copy_(part)
            else:
                part.copy_(window)
            offset += n
