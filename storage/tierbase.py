"""`TierBase`: the disk tier's state and the bookkeeping its read and write jobs share.

Plain synchronous code on the owning loop (a few coroutines await a thread or an unlink): where a
key's file is (directory descriptor and name; a fan-out directory removed, moved or replaced
retired and opened again), the jobs' accounting (I/O slots, the count :meth:`DiskTier.aclose`
waits on), the budget in force against the file system's free space, the index with the unlinks
that follow it, and the stock of spare files (:mod:`.spares`) that new pages are written into. The
caller checks and page references are its base's (:mod:`.tieredge`). The job state machines
build on it (:mod:`.writepath`, :mod:`.readpath`); :class:`~.disk.DiskTier` is the public shell.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from aiokv.faults import FaultLog
from aiokv.keys import PageKey
from aiokv.layout import KVLayout
from aiokv.pool import PagePool, run_in_new_thread

from .backends import HeaderSlots, PageIO
from .checksum import Checksums
from .config import DiskConfig, ReadOnly
from .deletelog import update_deletes
from .faults import DiskFaults
from .follow import FollowState
from .index import PageIndex
from .jobs import IOSlots, Job, WriteJob, wait_uncancelled
from .layoutdir import DirStamp, FreeSpace, Prepared, fanout_gone, free_space, open_private_subdir
from .pagefile import PageFiles, file_bytes
from .safefiles import UnsafeDirectoryError, UnsafeFileError
from .spares import Made, Spare, SpareStock, make_spares
from .ticker import Ticker
from .tieredge import TierEdge
from .writebehind import WriteBehind

log = logging.getLogger("aiokv.storage.disk")  # one logger for the tier, whichever file logs
T = TypeVar("T")


BULK_UNLINK_KEYS = 64
"""Files evicted at once from which one thread unlinks them all rather than a loop task each: a
start over a lowered budget (20,000 files over one of 100) held the loop 0.73 s making and running
a task per file."""

UNLINK_RETRY_KEPT = 65536
"""Files whose unlink failed (not EROFS) kept to unlink again (``TierBase._unlink_failed``: 16-byte
keys, a few MiB at most); beyond, the oldest is forgotten (left on disk outside the index)."""

STORED_SINCE_DELETE = 1 << 192
"""A remembered delete (:data:`~.followpath.DELETED_KEPT`) at or above this: the tier stored the key
again, and the value less this is that store's file (:func:`~.layoutdir.file_identity`: inode
number and change time) above 64 bits, the time of the delete (ns) below them. A listing takes
only that file, moved with its directory, for the key's page; any other file of the key (the old
one, a copy of it with new times) is the one deleted. Below it: the time of the delete, and every
file of the key is the one deleted, whatever its time (a copy with fresh times, a wall clock
stepped back)."""

DELETE_TIME_BITS = (1 << 64) - 1
"""The time of the delete in a remembered delete at or above :data:`STORED_SINCE_DELETE`."""


class TierBase(TierEdge):
    """The state of a :class:`~.disk.DiskTier` (constructed through it) and the internals its
    read and write paths share. Not used on its own."""

    def __init__(self, config: DiskConfig, layout: KVLayout, pool: PagePool, faults: FaultLog | None = None,
                 *, spare_files: int = 0) -> None:
        if not isinstance(config, DiskConfig):
            raise TypeError(f"config must be a DiskConfig, got {type(config).__name__}")
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if not isinstance(pool, PagePool):
            raise TypeError(f"pool must be a PagePool, got {type(pool).__name__}")
        if pool.layout != layout:
            raise ValueError(f"pool layout ({pool.layout.describe()}) differs from {layout.describe()}")
        if faults is not None and not isinstance(faults, FaultLog):
            raise TypeError(f"faults must be a FaultLog or None, got {type(faults).__name__}")
        if isinstance(spare_files, bool) or not isinstance(spare_files, int):
            raise TypeError(f"spare_files must be an int, got {type(spare_files).__name__}")
        if spare_files < 0:
            raise ValueError(f"spare_files must be >= 0, got {spare_files}")
        self.config = config
        self.layout = layout
        self.pool = pool
        self.files = PageFiles(config.directory, layout)
        self._file_bytes = file_bytes(layout)
        self._io: PageIO | None = None
        self._slots: HeaderSlots | None = None
        self._io_slots = IOSlots(config.queue_depth, self._in_next_turn)
        self._payload_bytes = layout.payload_bytes
        self._active = 0  # page jobs driven by callbacks, not yet ended
        self._idle: asyncio.Future[None] | None = None
        self._checksums: Checksums | None = None
        self._index = PageIndex(self._file_bytes, config.capacity_bytes, config.min_free_bytes)
        self._writing: dict[PageKey, WriteJob] = {}
        self._delete_after_write: set[PageKey] = set()
        # Renames/unlinks in flight on a key's final path: a new write of the key waits for them.
        self._moving: dict[PageKey, asyncio.Future[Any]] = {}
        self._recycled = 0
        self._jobs: set[asyncio.Task[Any]] = set()
        self._queue: WriteBehind | None = None
        self._accepting = False
        self._close_task: asyncio.Task[None] | None = None
        # Set as the close begins: listings on threads (the start's, a fan-out directory's opened
        # late) end at their next batch of entries rather than after the whole directory.
        self._closing = threading.Event()
        self._starting: asyncio.Future[None] | None = None  # DiskTier.start in flight, or ended
        self._io_ended: asyncio.Future[None] | None = None  # see DiskTier.io_ended
        self._stuck = False  # DiskTier.close_within gave up waiting: queued pages are dropped
        self._close_steps = 0  # steps of DiskTier._close ended: progress DiskTier.close_within watches
        self._progress_seen: tuple[int, int, float] | None = None  # see DiskTier._stalled_since
        self._drop_queued: asyncio.Future[int] | None = None  # that drop, ending with the queue
        self._waiting_close: asyncio.Future[None] | None = None  # the aclose it stopped waiting for
        self._faults = DiskFaults(faults)
        self._corrupt_logged = False
        self._refused: set[int] = set()
        """Generations of page files a read refused (counted ``corrupt`` once each) while reads may
        still be in flight: a concurrent read of the same file refusing it later counts nothing, one
        that finds it taken out of the index by a delete, an eviction or a newer file counts it.
        Emptied whenever no page job is active."""
        self._reads = self._writes = self._bytes_read = self._bytes_written = 0
        self._hits = self._misses = self._corrupt = self._dropped = 0
        self._temp_removed = self._skipped = self._writes_refused = 0
        self._buffered_fallbacks = self._memory_unregistered = 0
        self._dir: Prepared | None = None
        self._read_only: ReadOnly | None = None
        # While read-only after an EROFS answer: the look at the file system every
        # ``free_space_recheck_s``, and the files that mode left behind (unlinked once writable).
        self._writable_again: asyncio.Task[None] | None = None
        self._unlink_when_writable: set[PageKey] = set()
        # Keys whose unlink failed with a fault other than EROFS (EIO from a failing disk, EACCES,
        # EBUSY): the file is still there, outside the index (remembered as deleted too). Review
        # 204: named nowhere before, it stayed on disk for good and a restart served it. Unlinked
        # again at each lock check, once writable again and at the close (the oldest first forgotten
        # beyond UNLINK_RETRY_KEPT); a key stored again since is not (a newer page under the name).
        self._unlink_failed: dict[PageKey, None] = {}
        # The same deletes (any unlink that failed, EROFS included) as saved in the pending-delete
        # record (:mod:`.deletelog`): key -> time of the delete (ns). Kept only in memory, a process
        # killed before the retry succeeded left the file, and the next start served it. A key
        # leaves once its file is gone (or replaced by a newer page); ``_deletes_dropped`` are
        # those left since the last save. One save at a time (``_deletes_saving``), by the lock
        # holder while writable; versions tell which changes are on disk.
        self._deletes_kept: dict[PageKey, int] = {}
        self._deletes_dropped: set[PageKey] = set()
        self._deletes_version = self._deletes_saved = 0
        self._deletes_saving: asyncio.Task[None] | None = None
        # Keys whose unlink ``_retry_unlinks`` is starting (set only around that call): a retry's
        # failure leaves the key's record entry as it is (review 218: each rewrote the record).
        self._retrying: set[PageKey] = set()
        self._deletes_save_failed = False  # counted once until a save succeeds (retried every check)
        # The next save replaces the record on disk where it cannot be read, EIO too (``update_deletes``'
        # replace): set where a take-over or a lock check could not read it (:mod:`.followpath`).
        self._deletes_replace = False
        self._spares_when_writable: list[Spare] = []
        self._space_checked = 0.0
        # Files out of ``used`` (evicted, deleted, spares removed) whose unlink has not landed yet:
        # their blocks are still taken (a write that needs them waits, :mod:`.writepath`).
        self._unfreed_files = 0
        # A first try waited for its unlinks because the estimate said the file system nearly full
        # since the last look (:meth:`.WritePath._short_of_room`): the looks go on, as while the file
        # system limits the tier below its budget. Review 253: a tier at its budget (a start over a
        # full disk, an ENOSPC while other writes held the room) never looked again, and waited for
        # its unlinks for good once others freed the disk.
        self._short_seen = False
        # While another cache holds the directory: the looks that follow it (:mod:`.followpath`).
        self._follow_state: FollowState | None = None
        self._follow_task: asyncio.Task[None] | None = None
        self._follow_looks = self._followed_in = self._followed_out = self._took_over = 0
        self._follow_started = 0  # looks started (tests wait for one started after a change)
        self._follow_ticker = Ticker()  # the pause before the next look
        # While this tier holds the lock: the check of its name every follow_interval_s (:mod:`.lockwatch`).
        self._watch_task: asyncio.Task[None] | None = None
        self._watch_ticker = Ticker()
        self._lock_retaken = self._lock_lost = 0
        # The layout directory's stamp at the last check of the fan-out names (None: check them all),
        # and the fan-out directories opened on the loop so far (:meth:`_open_fanout`).
        self._layout_stamp: DirStamp | None = None
        self._fanout_opens = 0
        # Fan-out directories opened late being listed (:meth:`_list_opened`) -> the keys there
        # whose file was unlinked or deleted meanwhile (never indexed from that listing).
        self._listing: dict[int, set[PageKey]] = {}
        self._listings: dict[int, int] = {}  # listings in flight per fan-out directory
        # Fan-out directories whose late listing failed part-way -> (descriptor, failures, periodic
        # checks to let pass before the next listing): listed again until one completes.
        self._relist: dict[int, tuple[int, int, int]] = {}
        self._listings_failed = 0
        # Keys the caller deleted while a file of theirs may lie where no listing indexed it (see
        # FollowPath._remember_delete) -> the time of the delete (ns), or STORED_SINCE_DELETE plus
        # the identity of the file this tier stored since (and the time): a file of theirs that
        # comes back with the directory is unlinked, not indexed, unless it is that file (moved
        # with its directory); -1 less the time of a delete from before another writer held the
        # lock: a file no newer.
        self._deleted_away: dict[PageKey, int] = {}
        # Deletes beyond DELETED_KEPT (FollowPath._forget_delete): a filter of bits (made at the
        # first) and, per fan-out directory, the time of the last one forgotten there.
        self._forgotten: bytearray | None = None
        self._forgotten_before: dict[int, int] = {}
        # Fan-out directories that had a descriptor retired (moved away, replaced): a copy of one may
        # come back whenever, so a delete of a key there is remembered whatever the key's state then.
        self._fanouts_away: set[int] = set()
        # Keys such a listing found a file of while a write of theirs was in flight (left to it):
        # a write that ends unstored unlinks that file (else on disk, outside the index and budget).
        self._listed_under_write: set[PageKey] = set()
        # Of those, keys a take-over's scan found a page under (not a page deleted) while this
        # tier's own write of theirs was in flight since before the lock was lost: a write that
        # ends unstored (and not deleted) never published over it, and indexes it rather than
        # unlinking it (review 199: the other writer's page was lost).
        self._found_under_write: set[PageKey] = set()
        # Keys whose file a read found gone while following: the next look examines their names
        # again (:meth:`.follow.FollowState.forget`).
        self._follow_forgotten: set[PageKey] = set()
        # Spare files: the stock, the batch being made, the spare each write holds until its slot.
        self._spares = SpareStock(spare_files, config.free_space_recheck_s)
        self._refill: asyncio.Future[Made] | None = None
        self._spare_of: dict[WriteJob, Spare] = {}
        self._spare_fault_logged = False

    # -- file names and fan-out directories ------------------------------------------------------

    def _where(self, key: PageKey) -> tuple[int, str]:
        """The descriptor of ``key``'s fan-out directory and the page file's name in it. A fan-out
        directory that could not be opened at start is opened now, with the same checks; raises
        ``OSError`` (``UnsafeFileError`` for a symlink or a directory not safely ours) when it
        cannot be, which the callers count as a fault of that read or write. (Names were once
        resolved through the layout directory then, ``xx/<key>``: ``O_NOFOLLOW`` guards only the
        last component, so a symlink planted at ``xx`` led outside the cache.)"""
        assert self._dir is not None
        fanout = self._dir.fanout[key[0]]
        if fanout < 0:
            fanout = self._open_fanout(key[0])
        return fanout, bytes.hex(key)  # PageFiles.name, inline (bytes.hex: see there)

    def _open_fanout(self, index: int) -> int:
        """Open fan-out directory ``index`` late (blocking, on the loop: a rare path after a fault),
        made again (0700) when the tier writes: one removed under it (:meth:`_fanout_gone`)."""
        assert self._dir is not None
        name = f"{index:02x}"
        try:
            fd = open_private_subdir(self._dir.dir_fd, name, self.files.layout_dir / name,
                                     create=self._read_only is None)
        except UnsafeDirectoryError as exc:
            raise UnsafeFileError(exc.errno, str(exc)) from None
        self._dir.fanout[index] = fd  # closed with the others (Prepared.close)
        self._fanout_opens += 1
        return fd

    def _fanout_gone(self, index: int) -> bool:
        """After an ENOENT of a write or a read in fan-out directory ``index``: whether the
        descriptor the tier holds leads to a directory removed (an operator's ``find -empty
        -delete``, ``rm -rf``, a cleanup script) or no longer under its name; if so it is retired
        (:meth:`_retire_fanout`). Blocking calls on the loop, only after such a fault: the happy
        path pays nothing. (The writer's periodic check asks the same on its thread:
        :mod:`.lockwatch`.)"""
        prepared = self._dir
        assert prepared is not None
        fd = prepared.fanout[index]
        if fd < 0:
            return False
        try:
            why = fanout_gone(prepared.dir_fd, index, fd, self.files.layout_dir)
        except OSError as exc:
            self._faults.count(exc, "examining a fan-out directory")
            return False
        if why is None:
            return False
        self._retire_fanout(index, why)
        return True

    def _retire_fanout(self, index: int, why: OSError) -> None:
        """The descriptor of fan-out directory ``index`` no longer leads to the directory under its
        name (``why``): retired as a follower retires one (:func:`~.follow._check_names`): kept
        open until the close (an operation in flight may still name a file through it), its keys
        out of the index (their files went with it, or are out of reach of the name), its spares
        out of stock; the next :meth:`_where` opens the name again with the start's checks (made
        again when the tier writes; a symlink or a file there refused, ``UNSAFE``)."""
        prepared = self._dir
        assert prepared is not None
        fd = prepared.fanout[index]
        assert fd >= 0
        prepared.fanout[index] = -1  # before anything that calls: never used again
        prepared.retired.append(fd)
        self._fanouts_away.add(index)
        dropped = [key for key in self._index if key[0] == index]  # a key's fan-out is its first byte
        for key in dropped:
            self._index.remove(key)
        # A page a take-over found under a key's name, left to this tier's write in flight: that
        # name now leads elsewhere (a copy put back may hold the page deleted): no longer indexed
        # if the write ends unstored, but left to the listing of the name's next directory
        # (review 200: indexed blind, the deleted page was served).
        self._found_under_write.difference_update([key for key in self._found_under_write if key[0] == index])
        self._remove_spares(self._spares.drop_in(fd))
        log.warning("disk tier: %s was removed, moved or replaced under this cache (%s): %d pages indexed there "
                    "are gone; opening the name again", self.files.layout_dir / f"{index:02x}", why.strerror,
                    len(dropped))

    def _temp(self, key: PageKey) -> str:
        """A fresh temporary name beside ``key``'s final one, in :meth:`_where`'s directory (called
        after it: the fan-out directory is open)."""
        assert self._dir is not None and self._dir.fanout[key[0]] >= 0
        return self.files.temp_name(key)

    # -- jobs -----------------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """``coro`` in a task the close waits for."""
        task = asyncio.create_task(coro)
        try:
            self._jobs.add(task)
            task.add_done_callback(self._jobs.discard)
        except BaseException:
            # (a signal's KeyboardInterrupt as a call returned): never left in ``_jobs`` for ever
            # (the close would wait on it again every turn); a second discard does nothing.
            task.add_done_callback(self._jobs.discard)
            raise
        return task

    def _in_next_turn(self, fn: Callable[[], None]) -> None:
        """``fn()`` early in the loop's next turn: through the backend (the ring runs it in the
        submission callback that a page's start scheduled anyway), or a loop callback before start."""
        io = self._io
        if io is None:
            asyncio.get_running_loop().call_soon(fn)
        else:
            io.call_next_turn(fn)

    def _return_slot(self, job: Job) -> None:
        """Give ``job``'s I/O slot back if it still holds it (idempotent: every path may call it)."""
        self._io_slots.give_back(job)

    def _job_started(self) -> None:
        self._active += 1

    def _job_ended(self, job: Job) -> None:
        """``job`` ended: the tier's count of jobs down once (``ended`` set with it, no call between:
        a signal's exception comes at calls), then those waiting for it woken. Idempotent: a job's
        guard ends it again after an interrupt, which only wakes what is left."""
        if not job.ended:
            job.ended = True
            self._active -= 1
        job.wake()
        if not self._active:
            self._refused.clear()  # no read of a refused file left in flight
            if self._idle is not None and not self._idle.done():
                self._idle.set_result(None)

    def _count_interrupt(self, what: str) -> None:
        """A job ended by an interrupt (a signal's KeyboardInterrupt left it between steps): a fault."""
        self._faults.count(InterruptedError(errno.EINTR, "interrupted by a signal"), what)

    # -- free space -----------------------------------------------------------------------------

    def _space_recheck_due(self) -> bool:
        return ((self._index.capacity < self._index.budget or self._short_seen) and
                asyncio.get_running_loop().time() - self._space_checked >= self.config.free_space_recheck_s)

    async def _recheck_space(self) -> None:
        # While the file system limits the tier below its budget, or once a first try waited for
        # its unlinks on the estimate since the last look (``_short_seen``), look again now and
        # then: others may have freed space.
        if self._index.capacity >= self._index.budget and not self._short_seen:
            return
        if asyncio.get_running_loop().time() - self._space_checked >= self.config.free_space_recheck_s:
            await self._refresh_space(after_enospc=False)

    async def _refresh_space(self, after_enospc: bool) -> None:
        assert self._dir is not None
        self._space_checked = asyncio.get_running_loop().time()
        self._short_seen = False
        stored, spares_made = self._writes, self._spares.made
        try:
            # A thread of its own: ``asyncio.to_thread``'s first call starts the default executor's
            # thread from the loop, which waits there until it runs.
            space = await run_in_new_thread(functools.partial(free_space, self._dir.dir_fd), "aiokv-statvfs",
                                            _nothing)
        except OSError as exc:
            self._faults.count(exc, "statvfs")
            return
        if space.read_only:
            self._enter_read_only(ReadOnly.FILE_SYSTEM)
        # Never below ``used``: spares keep their room (their blocks are allocated already), and
        # the next writes take them first. The writes stored while the look ran may have taken
        # their blocks after it: pending too (each, whatever its file: a rare case, counted high);
        # so may the spares of a batch that landed while it ran.
        landed = self._writes - stored + self._spares.made - spares_made
        self._index.set_capacity(space, after_enospc, self._new_files_pending() + landed)

    def _new_files_pending(self) -> int:
        """New files whose room is in ``used`` but whose blocks may not be taken yet, so that a
        look at the free space now counts them free: writes in flight holding room for a new file
        (no victim to overwrite), and the spares of the batch being made. Review 261: the estimate
        of the free room (:meth:`.WritePath._short_of_room`) counted the writes twice, and a first
        try that evicted went at once where its unlink's blocks were needed (an ENOSPC, a page
        evicted for the retry); the spares being made were left out the same way. Counted at a
        look only (no cost per write); a spare's write counts too, and so does every spare of the
        batch (some may be allocated already: the estimate errs low, which costs a wait for an
        unlink)."""
        writes = sum(1 for job in self._writing.values() if job.holds_room and job.victim is None)
        return writes + self._spares.making

    def _enter_read_only(self, reason: ReadOnly) -> None:
        """Refuse writes from now on. For a read-only file system (an EROFS answer, or statvfs),
        look again every ``free_space_recheck_s`` and write again once it is writable (remounted
        read-write), as a full disk is rechecked. (A read-only mode found at start stays: the
        directory's lock and fan-out directories may be missing.)"""
        if self._read_only is not None:
            return
        self._read_only = reason
        log.warning("disk tier: %s became read-only (%s): serving its %d pages, refusing writes",
                    self.files.layout_dir, reason.value, len(self._index))
        if (reason is ReadOnly.FILE_SYSTEM and self._accepting and self._dir is not None
                and self._dir.lock_fd is not None and self._writable_again is None):
            self._writable_again = asyncio.get_running_loop().create_task(self._wait_writable())

    async def _wait_writable(self) -> None:
        """While read-only for the file system: a ``fstatvfs`` (on a thread of its own: it blocks
        on a hung NFS) every ``free_space_recheck_s``; writes resume once ``ST_RDONLY`` is gone.
        Ends with the tier's close (cancelled) or when writes resume."""
        assert self._dir is not None
        dir_fd = self._dir.dir_fd
        try:
            while self._read_only is ReadOnly.FILE_SYSTEM and self._accepting:
                await asyncio.sleep(self.config.free_space_recheck_s)
                if not self._accepting:
                    return
                self._space_checked = asyncio.get_running_loop().time()
                try:
                    space = await run_in_new_thread(functools.partial(free_space, dir_fd), "aiokv-statvfs",
                                                    _nothing)
                except OSError as exc:
                    self._faults.count(exc, "statvfs")
                    continue
                # Still FILE_SYSTEM: a lock found lost meanwhile made it LOCKED (:mod:`.followpath`).
                if not space.read_only and self._accepting and self._read_only is ReadOnly.FILE_SYSTEM:
                    self._leave_read_only(space)
        finally:
            self._writable_again = None

    def _leave_read_only(self, space: FreeSpace) -> None:
        """The file system is writable again: take writes, remove what read-only mode left behind."""
        self._read_only = None
        log.warning("disk tier: %s is writable again: writing pages again", self.files.layout_dir)
        self._index.set_capacity(space, after_enospc=False, pending=self._new_files_pending())
        keys = [key for key in self._unlink_when_writable if key not in self._index and key not in self._writing]
        self._unlink_when_writable.clear()
        self._remove_files(keys)
        self._retry_unlinks(BULK_UNLINK_KEYS)
        spares, self._spares_when_writable = self._spares_when_writable, []
        for spare in spares:
            self._unlink_spare(spare)
        self._remove_files(self._index.evict_to(self._index.capacity))
        self._refill_spares()

    # -- index and files ------------------------------------------------------------------------

    def _forget(self, key: PageKey, generation: int) -> None:
        """``key``'s file of ``generation`` was gone when read: out of the index. While following
        another cache, the next look examines the name again whatever inode it knew there: that
        cache may have stored the key anew under the same inode number (ext4 reuses a freed one at
        once), which the look would take for the file it knew and never index again."""
        if (self._index.forget(key, generation) and self._read_only is ReadOnly.LOCKED
                and self._follow_task is not None):
            self._follow_forgotten.add(key)

    def _reject(self, key: PageKey, generation: int, why: str) -> None:
        """A page file that failed verification: counted, out of the index, deleted unless the tier
        is read-only (another cache may own it, or nothing may be deleted here). The first one is
        logged, saying which of these happened. Counted once a file (its generation): concurrent
        reads of one damaged file counted each (review 167); a file a read refused after a delete,
        an eviction or a newer file took it out of the index counted nothing (review 172)."""
        now = self._index.generation(key)
        if generation not in self._refused:
            # Also when out of the index already by another path (deleted, evicted, replaced under
            # the read): before, such a refused file counted nothing (only the read that dropped it).
            self._refused.add(generation)
            self._corrupt += 1
        if now == generation:
            self._drop(key)
        if not self._corrupt_logged:
            self._corrupt_logged = True
            if now is None:
                fate = "already out of the index"
            elif now != generation:
                fate = "a newer file of the key replaced it meanwhile"
            elif self._read_only is not None:
                fate = f"kept, as the tier is read-only ({self._read_only.value}), but no longer served"
            else:
                fate = "deleted"
            log.warning("disk tier: refusing page file %s: %s (%s; further ones counted only)",
                        self.files.path(key), why, fate)

    def _drop(self, key: PageKey) -> asyncio.Task[None] | None:
        """Out of the index, and its file unlinked — unless read-only: then the file stays."""
        self._index.remove(key)
        return self._unlink_later(key)

    def _found_still_kept(self, key: PageKey) -> bool:
        """Whether the page a take-over found under ``key``'s name (left to a write that ended
        unstored: ``_found_under_write``) may be indexed now (:class:`~.followpath.FollowPath` asks
        the file there now against the deletes it remembers)."""
        return True

    def _write_discarded(self, key: PageKey) -> None:
        """A write of ``key`` deleted while in flight landed, its file published, and is discarded
        (unlinked): nothing more here (:class:`~.followpath.FollowPath` remembers it while it
        follows another writer and may not unlink yet)."""

    def _unlink_later(self, key: PageKey, at: tuple[int, str] | None = None) -> asyncio.Task[None] | None:
        """Unlink ``key``'s file (out of the index already) in a task a new write of the key waits
        for; ``at``: in that directory descriptor and name (a retired fan-out directory's) rather
        than under the key's name now. Read-only: nothing (unlinked once writable, but ``at``)."""
        listing = self._listing.get(key[0])
        if listing is not None:
            listing.add(key)  # a listing in flight may have seen the file: not indexed from it
        if self._read_only is not None:
            if at is not None:
                return None
            # Unlinked if the file system becomes writable, or once this tier takes the directory
            # over from the cache that holds it (:mod:`.followpath`).
            if self._writable_again is not None or (
                    self._read_only is ReadOnly.LOCKED and self._follow_task is not None):
                self._unlink_when_writable.add(key)
            return None
        previous = self._moving.get(key)
        # A retry of a delete already named in the record (its fault counted, its time kept): its
        # failure changes nothing there. Anything else failing is a new delete (a key stored again
        # since, deleted again: counted, and named with the time now, which its newer file needs).
        retry = at is None and key in self._retrying

        async def unlink() -> None:
            durable = False
            try:
                if previous is not None:
                    await asyncio.wait({previous})
                assert self._io is not None
                await self._io.unlink(*(at or self._where(key)))
                if at is None:
                    self._delete_done(key)
            except FileNotFoundError:
                if at is None:
                    self._delete_done(key)
            except OSError as exc:
                named = retry and key in self._deletes_kept
                if not named:  # (a retry's failure was counted at its delete's: one fault a delete)
                    self._faults.count(exc, "unlink")
                if at is None:
                    # The file stays, out of the index: remembered as deleted (no listing or look
                    # indexes it) and unlinked again later. Review 204: named nowhere before (a
                    # write deleted in flight, discarded at its end; an eviction), a restart served it.
                    self._unlink_failed_remembered(key)
                    if not named:
                        self._delete_pending(key)
                if exc.errno == errno.EROFS:
                    self._enter_read_only(ReadOnly.FILE_SYSTEM)
                    if at is None:
                        self._unlink_later(key)  # read-only now: named for the unlink once writable
                elif at is None:
                    self._unlink_again(key)
                    durable = True
            finally:
                if self._moving.get(key) is task:
                    del self._moving[key]
            if durable:
                # On disk before the delete returns: a crash from now on still never serves it
                # (a new write of the key does not wait for this).
                await self._deletes_durable()

        task = self._spawn(unlink())
        self._moving[key] = task
        # Also once the task ended: one a signal's KeyboardInterrupt ended at its start never ran
        # its ``finally`` (a new write of the key would wait on it for ever).
        task.add_done_callback(functools.partial(self._unlink_ended, key))
        # Every file unlinked here is out of ``used`` (or never in it): its blocks taken until the
        # unlink lands. Review 261: only evictions' were counted, so a delete's (``delete``, a
        # refused file, a write discarded) or a failed recycle's victim's unlink in flight left the
        # estimate too hopeful by its file.
        self._count_unfreed(task, 1)
        return task

    def _unlink_again(self, key: PageKey) -> None:
        """``key``'s unlink failed (not EROFS): its file is unlinked again later (``_unlink_failed``)."""
        failed = self._unlink_failed
        failed.pop(key, None)  # most recent last: the oldest is forgotten first
        failed[key] = None
        if len(failed) > UNLINK_RETRY_KEPT:
            del failed[next(iter(failed))]

    def _unlink_failed_remembered(self, key: PageKey) -> None:
        """``key``'s unlink failed (EROFS included), its file still there: nothing more here
        (:class:`~.followpath.FollowPath` remembers it as deleted, so no listing or look indexes it)."""

    def _retry_unlinks(self, most: int | None = None) -> list[asyncio.Task[None]]:
        """Unlink again the files whose unlink failed (the ``most`` oldest; None: all), but keys
        indexed or being written since (a newer page under the name: the one deleted is gone).
        Writable only; a fault again names the key again (counted once a delete, at its first
        failure). A save of the pending-delete record that failed or waited is tried again."""
        failed = self._unlink_failed
        if self._read_only is not None:
            return []
        if not failed:
            saving = self._save_deletes_soon()
            return [] if saving is None else [saving]
        taken = list(itertools.islice(failed, most))
        for key in taken:
            del failed[key]
        keys = []
        for key in taken:
            if key in self._index:
                self._delete_done(key)  # a newer page renamed over the one deleted
            elif key not in self._writing:
                keys.append(key)
        retrying = self._retrying
        retrying.update(keys)
        try:
            tasks = [task for key in keys if (task := self._unlink_later(key)) is not None]
        finally:
            retrying.difference_update(keys)
        saving = self._save_deletes_soon()
        if saving is not None:
            tasks.append(saving)
        return tasks

    # -- the pending-delete record (:mod:`.deletelog`) --------------------------------------------

    def _delete_pending(self, key: PageKey) -> None:
        """``key``'s unlink failed: named in the record (saved by :meth:`_deletes_durable` or the
        next retry), with the time now: a file of the key no newer is the page deleted."""
        self._deletes_kept[key] = time.time_ns()
        self._deletes_dropped.discard(key)
        self._deletes_version += 1

    def _delete_done(self, key: PageKey) -> None:
        """``key``'s file is gone (or a newer page replaced it): out of the record, saved soon."""
        if self._deletes_kept.pop(key, None) is not None:
            self._deletes_dropped.add(key)
            self._deletes_version += 1
            self._save_deletes_soon()

    def _save_deletes_soon(self) -> asyncio.Task[None] | None:
        """The save of the record in flight, or one started now if changes are unsaved and the tier
        may write (the lock held, writable); None when nothing is saved."""
        if self._deletes_saving is not None:
            return self._deletes_saving
        prepared = self._dir
        if (self._deletes_saved >= self._deletes_version or prepared is None or prepared.lock_fd is None
                or self._read_only is not None or self._io is None):
            return None
        self._deletes_saving = self._spawn(self._save_deletes(prepared.dir_fd))
        return self._deletes_saving

    async def _save_deletes(self, dir_fd: int) -> None:
        """Save the record as it is now on a thread of its own (fsyncs block); a fault is counted
        (EROFS: read-only) and the changes stay unsaved, tried again at the next retry."""
        try:
            version = self._deletes_version
            kept, dropped, replace = dict(self._deletes_kept), set(self._deletes_dropped), self._deletes_replace
            job = run_in_new_thread(functools.partial(update_deletes, dir_fd, kept, dropped, replace),
                                    "aiokv-disk-deletes", _nothing)
            try:
                planted = await asyncio.shield(job)
            except asyncio.CancelledError:
                await wait_uncancelled(job)  # (the thread uses the tier's directory descriptor)
                raise
            except OSError as exc:
                if not self._deletes_save_failed:
                    self._deletes_save_failed = True
                    self._faults.count(exc, "saving the pending-delete record")
                if exc.errno == errno.EROFS:
                    self._enter_read_only(ReadOnly.FILE_SYSTEM)
                return
            for fault in planted:  # a directory planted in the record's way, moved (review 289)
                self._faults.count(fault, "replacing the pending-delete record")
                log.warning("disk tier: replacing the pending-delete record in %s: %s", self.files.layout_dir, fault)
            self._deletes_saved = max(self._deletes_saved, version)
            self._deletes_save_failed = False
            if replace:
                self._deletes_replace = False
            self._deletes_dropped.difference_update(dropped)
        finally:
            self._deletes_saving = None
        # Saved: changes made meanwhile (a retried unlink that succeeded) are saved now, not at the
        # next retry (the close waits for that save too: a job of the tier's before this one ends).
        self._save_deletes_soon()

    async def _deletes_durable(self) -> None:
        """Until the record on disk holds every change made before this call, or a save failed
        (counted) or may not run (read-only, the lock lost): then the delete stays in memory."""
        want = self._deletes_version
        for _ in range(2):  # the save in flight may predate the change: the second one holds it
            if self._deletes_saved >= want:
                return
            saving = self._save_deletes_soon()
            if saving is None:
                return
            await asyncio.wait({saving})

    def _unlink_ended(self, key: PageKey, task: asyncio.Task[None]) -> None:
        if self._moving.get(key) is task:
            del self._moving[key]

    def _remove_files(self, keys: list[PageKey]) -> list[asyncio.Task[None]]:
        """Unlink the files of keys evicted from the index (nothing when read-only). Many at once
        (a start over a lowered budget) go to one thread, as :data:`BULK_UNLINK_KEYS` says."""
        fanout = self._dir.fanout if self._dir is not None else None
        if len(keys) < BULK_UNLINK_KEYS or self._read_only is not None or fanout is None:
            # (each unlink counted in ``_unfreed_files`` by ``_unlink_later``)
            return [task for key in keys if (task := self._unlink_later(key)) is not None]
        # Keys with an unlink or move in flight wait for it, and a fan-out directory without a
        # descriptor is opened first: those one by one, as always.
        one_by_one = [key for key in keys if key in self._moving or fanout[key[0]] < 0]
        if one_by_one:
            alone = set(one_by_one)
            keys = [key for key in keys if key not in alone]
        tasks = [task for key in one_by_one if (task := self._unlink_later(key)) is not None]
        if keys:
            bulk = self._unlink_in_thread([(fanout[key[0]], self.files.name(key)) for key in keys], keys)
            self._count_unfreed(bulk, len(keys))
            tasks.append(bulk)
        return tasks

    def _count_unfreed(self, task: asyncio.Task[None], files: int) -> None:
        """``files`` files out of ``used`` (evicted, deleted, a spare removed) unlinked by ``task``:
        in ``_unfreed_files`` until it ends (done or failed: a failed unlink is not retried for
        room). The callback first: an interrupt between the two leaves the count low, a write no
        more careful than before this count."""
        task.add_done_callback(functools.partial(self._unfreed_landed, files))
        self._unfreed_files += files

    def _unfreed_landed(self, files: int, _: asyncio.Task[None]) -> None:
        # No call here (a signal's exception comes at calls; one at the entry drops the loop's
        # handle, as for any callback). Review 253: a KeyboardInterrupt as ``max()`` returned dropped
        # the decrement, and the count stayed high for good (first tries waiting for their unlinks
        # where the room did not need it).
        left = self._unfreed_files - files
        self._unfreed_files = left if left > 0 else 0

    def _unlink_in_thread(self, names: list[tuple[int, str]], keys: list[PageKey]) -> asyncio.Task[None]:
        """Unlink ``names`` (directory descriptor, name) on a thread of its own, in one task; the
        files of ``keys`` among them: a new write of one waits for it, as for any unlink, and a
        listing in flight does not index it. Faults counted once a kind; the close waits."""
        job = run_in_new_thread(functools.partial(unlink_all, names), "aiokv-disk-unlink", _nothing)
        moving, listings = self._moving, self._listing
        for key in keys:
            moving[key] = job
            listing = listings.get(key[0])
            if listing is not None:
                listing.add(key)  # a listing in flight may have seen the file: not indexed from it
        job.add_done_callback(functools.partial(_forget_moving, moving, keys))
        return self._spawn(self._unlinked_in_thread(job))

    async def _unlinked_in_thread(self, job: asyncio.Future[list[OSError]]) -> None:
        try:
            faults = await asyncio.shield(job)
        except asyncio.CancelledError:
            await wait_uncancelled(job)  # (the close: the thread uses the tier's descriptors)
            raise
        for fault in faults:
            self._faults.count(fault, "unlink")
            if fault.errno == errno.EROFS:
                self._enter_read_only(ReadOnly.FILE_SYSTEM)

    # -- spare files ----------------------------------------------------------------------------

    def _refill_spares(self) -> None:
        """Start a batch of spare files if the stock is short, room is free and none is in flight
        (plain code: the files are made on a thread of their own)."""
        spares = self._spares
        if not spares.target or not self._accepting or self._read_only is not None or self._dir is None:
            return
        want = spares.wanted(asyncio.get_running_loop().time())
        if not want:
            return
        dirs = [fd for fd in self._dir.fanout if fd >= 0]
        count = self._index.reserve_spares(want) if dirs else 0
        if not count:
            return
        batch = spares.plan(dirs, count)
        # A thread of its own (run_in_new_thread): creating files blocks, and the loop must not
        # wait in Thread.start either (#11).
        self._refill = run_in_new_thread(functools.partial(make_spares, batch, self._file_bytes),
                                         "aiokv-disk-spares", _orphan_spares)
        self._refill.add_done_callback(functools.partial(self._spares_made, len(batch)))

    def _spares_made(self, planned: int, refill: asyncio.Future[Made]) -> None:
        """A batch landed: its spares go into stock, the room of those not made goes back."""
        if self._refill is refill:
            self._refill = None
        now = asyncio.get_running_loop().time()
        try:
            made = refill.result()
        except Exception:  # a bug in the batch (or no thread left): nothing made
            self._faults.unexpected("spare files")  # counted here: not again as the batch's fault
            made, counted = Made([], OSError(errno.EIO, "spare batch failed")), True
        else:
            counted = False
        self._spares.landed(made, now)
        self._index.release_spares(planned - len(made.spares))
        if self._dir is not None and self._dir.retired:
            # A fan-out directory retired while the batch ran (moved out of the cache, removed):
            # its spares never serve (a page written into a file outside the cache): unlinked.
            for fd in {spare.dir_fd for spare in made.spares} & set(self._dir.retired):
                self._remove_spares(self._spares.drop_in(fd))
        error = made.error
        if error is not None:
            # The fault below the tier counted by kind, once per batch (a batch stops at its first
            # fault). Before (review 306) only SpareStatistics.failed knew of it: an EIO of a shut
            # down ext4 was in no error count the cache reports.
            if not counted:
                self._faults.count(error, "spare files")
            if not self._spare_fault_logged:
                self._spare_fault_logged = True
                log.warning("disk tier: cannot make spare files in %s (%s): new pages create their own files "
                            "(further faults counted only)", self.files.layout_dir, error)
            if error.errno == errno.EROFS:
                self._enter_read_only(ReadOnly.FILE_SYSTEM)
        if not self._accepting or self._read_only is not None:
            return  # closing (the close removes the stock once the writes are done), or read-only
        self._refill_spares()

    def _take_spare(self, job: WriteJob) -> bool:
        """Give ``job`` a spare file and its room (True), or nothing (False)."""
        spare = self._spares.take()
        if spare is None:
            return False
        # One block without a call (where a signal's exception comes): the spare passes to the job
        # with its room, or stays the stock's (PageIndex.spare_taken, inline).
        self._index.spares -= 1
        self._spare_of[job] = spare
        job.holds_room = True
        self._refill_spares()
        return True

    def _remove_spares(self, spares: list[Spare]) -> None:
        """Spares out of stock: their room goes back, their files are unlinked (not when read-only:
        the next start removes them)."""
        if not spares:
            return
        self._index.release_spares(len(spares))
        for spare in spares:
            self._unlink_spare(spare)

    def _unlink_spare(self, spare: Spare) -> asyncio.Task[None] | None:
        """Unlink a spare's file that no stock or write holds any more (its room is not counted);
        the unlink's task (it never raises), or None where none started."""
        if self._io is None:
            return None
        if self._read_only is not None:
            if self._writable_again is not None:
                self._spares_when_writable.append(spare)
            return None

        async def unlink() -> None:
            assert self._io is not None
            try:
                await self._io.unlink(spare.dir_fd, spare.name)
                self._spares.removed += 1
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._faults.count(exc, "unlink")
                if exc.errno == errno.EROFS:
                    self._enter_read_only(ReadOnly.FILE_SYSTEM)

        task = self._spawn(unlink())
        self._count_unfreed(task, 1)  # its room is out of ``used`` (or a write's, which makes a new file)
        return task

    async def _close_spares(self) -> None:
        """At close, once no write is left: wait for the batch in flight, then remove the stock."""
        while (refill := self._refill) is not None:
            # Until its callback (_spares_made) ran, not only until its future is done: one done
            # with that callback still queued would put its spares into stock after the drain
            # below, left on disk (a thread ending in the turn the close's last wait did).
            # Callbacks run in the order added: this one after _spares_made.
            landed = asyncio.get_running_loop().create_future()
            refill.add_done_callback(functools.partial(_set_landed, landed))
            await wait_uncancelled(landed)
        self._remove_spares(self._spares.drain())
        while self._jobs:
            await asyncio.wait(set(self._jobs))


def _set_landed(landed: asyncio.Future[None], _: asyncio.Future[Made]) -> None:
    """A batch's callback (:meth:`TierBase._spares_made`) ran: the close may drain the stock."""
    if not landed.done():
        landed.set_result(None)


def _orphan_spares(_: Made) -> None:
    """Spares made after their tier's loop closed: left for the next start to remove."""


def _nothing(_: object) -> None:
    """Nothing to close for a caller that is gone."""


def unlink_all(names: list[tuple[int, str]]) -> list[OSError]:
    """Unlink each (directory descriptor, name) of ``names`` (never following a symlink); the
    faults met but ENOENT (each kind once: the rest would be the same). Blocking."""
    faults: dict[int | None, OSError] = {}
    for fd, name in names:
        try:
            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            faults.setdefault(exc.errno, exc)
    return list(faults.values())


def _forget_moving(moving: dict[PageKey, asyncio.Future[Any]], keys: list[PageKey],
                   job: asyncio.Future[list[OSError]]) -> None:
    for key in keys:
        if moving.get(key) is job:
            del moving[key]
