"""`DiskTier`: page files of one layout, with an in-memory index, LRU capacity and write-behind.

The public shell: lifetime, lookups, the write/read/delete calls and their argument checks,
write-behind, statistics. All bookkeeping is plain synchronous code on the owning loop. Each read
or write is a page job (:mod:`.jobs`) moved on by completion callbacks (:mod:`.writepath`,
:mod:`.readpath`, over the shared state and bookkeeping of :mod:`.tierbase`), holding its own
claim on the page:

- ``write`` takes its own pool reference (``retain``) for the job, so a cancelled caller may drop
  its handle at once; the job finishes (publishes or cleans its temp file) and releases it.
  ``write_from`` has no reference to take: a cancelled caller waits until its buffer is free.
- ``read`` (``read_into``) fills the caller's RESERVED page (buffer); a cancelled caller is kept
  until the kernel (or the thread) is done with that memory — otherwise the caller's ``abort``
  would recycle memory that is still being written — and then gets its ``CancelledError``.

Faults (ENOSPC, EIO, permissions, corrupt or planted files) become False/miss results, are counted
by kind and logged once per kind; nothing raises into the caller's loop except caller mistakes.

Spare files (``spare_files``, :mod:`.spares`): a small stock of pre-created, pre-sized files made
on a thread of their own; a new page is written into one and renamed, as a recycled file is,
instead of creating its file in its chain. They hold their room in the budget.

Capacity: the budget in force is ``capacity_bytes`` or less when the file system has less room
(taken at start, on ENOSPC, and again now and then while it limits the tier); ENOSPC evicts least
recently used files and retries. Read-only mode (a read-only file system, a directory we may not
write, or another cache holding the directory's lock) serves and verifies reads, refuses writes
(counted) and never deletes a file.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import itertools
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from aiokv.closing import await_close
from aiokv.keys import KEY_BYTES, PageKey
from aiokv.pagetable import PageHandle
from aiokv.pool import run_in_new_thread

from .backends import HeaderSlots, PageIO, describe_layout_io, open_backend
from .checks import check_buffer, exact_key
from .checksum import Checksums
from .config import DiskBackend, DiskStatistics, ErrorKind, ReadOnly
from .faults import fault_name
from .followpath import FollowPath
from .jobs import wait_uncancelled
from .layoutdir import Prepared, prepare
from .memory import PageBuffer, buffer_address
from .pagefile import PageFiles
from .readpath import ReadPath
from .safefiles import UnsafeDirectoryError
from .spares import SpareStatistics
from .uring import not_started
from .writebehind import WriteBehind
from .writepath import WritePath

log = logging.getLogger(__name__)


_FAULT_NAMES = tuple(fault_name(kind) for kind in ErrorKind)
"""The fault log's kinds of the tier's I/O faults (``DiskStatistics.errors``' keys)."""


class ReadMarks(NamedTuple):
    """A few of the tier's counters, for a caller that classifies a failed read
    (:meth:`DiskTier.read_marks`: cheap, unlike the whole :meth:`DiskTier.statistics`)."""

    evictions: int
    """``DiskStatistics.evictions``."""
    faults: int
    """Faults counted so far: ``corrupt + follow_raced + sum(errors.values())`` of the statistics."""
    reads_evicted: int
    """Reads that found their file gone because the tier itself had taken the page out of its index
    under them (evicted, deleted, replaced): misses, not faults. A file gone while its page is still
    indexed (unlinked by someone else) is not counted here. Tier-wide, and a read that finds its key
    dropped by such an unlinked read (of the same key, or its fan-out directory's) counts here too:
    ``reads_unlinked`` tells them apart over the same window."""
    reads_unlinked: int = 0
    """Reads that found their file gone while their page was still indexed, or in a fan-out
    directory retired under them: removed from outside, a fault for the cache (review 228)."""


class _QueuedKeys:
    """Per key, the write-behind entries queued and not taken by a worker yet, and how many of
    the first of those a delete discarded (review 264). The queue is FIFO and a worker takes an
    entry (``Queue.get``) in the same step as it hands it on (:meth:`DiskTier._write_queued`),
    so the first ``void`` entries of a key a worker takes are those queued before the last
    delete, and an entry queued after it (the key written again) is written. Entries a close
    drops are never taken (the counts no longer matter then); one a signal's interrupt cut at the
    write's very entry stays counted: a later delete then discards one entry too many (a miss,
    never a deleted page served)."""

    def __init__(self) -> None:
        self._queued: dict[PageKey, int] = {}
        self._void: dict[PageKey, int] = {}
        self.voided = 0
        """Entries a delete discarded that a worker took (``DiskStatistics.write_behind_voided``)."""

    def queued(self, key: PageKey) -> None:
        self._queued[key] = self._queued.get(key, 0) + 1

    def deleted(self, key: PageKey) -> None:
        """Every entry of ``key`` queued so far is discarded when taken."""
        count = self._queued.get(key, 0)
        if count:
            self._void[key] = count

    def taken(self, key: PageKey) -> bool:
        """A worker took an entry of ``key``: True when a delete discarded it."""
        left = self._queued.get(key, 0) - 1
        if left > 0:
            self._queued[key] = left
        else:
            self._queued.pop(key, None)
        void = self._void.get(key, 0)
        if not void:
            return False
        if void > 1:
            self._void[key] = void - 1
        else:
            del self._void[key]
        self.voided += 1
        return True


CLOSE_STALL_S = 1.0
"""Seconds without progress (no I/O request of the tier ending, no step of its close ending) after
which :meth:`DiskTier.close_within`, past its own bound, gives the close up as stuck in the kernel.
A healthy request ends in milliseconds, a loaded disk's within a fraction of this; the close's own
work off the kernel (bookkeeping, hashing, joins) takes milliseconds."""

CLOSE_POLL_S = CLOSE_STALL_S / 10
"""How often :meth:`DiskTier.close_within` looks for that progress."""


_STUCK: set[DiskTier] = set()
"""Tiers whose close gave up waiting for I/O stuck in the kernel (:meth:`DiskTier.close_within`),
until that I/O ended."""


class DiskTier(WritePath, ReadPath, FollowPath):
    """Page files under ``config.directory`` for pages of ``pool`` (same layout).

    Construction is cheap; :meth:`start` (or ``async with``) opens the backend and rebuilds the
    index. Close the tier before the pool: registered buffers pin the pool's memory.

    ``faults``: where I/O faults are counted (kinds ``disk_enospc``, ``disk_eio``, ...); the cache
    manager passes its own log so each fault is counted once; None: a log of the tier's own.

    ``spare_files``: how many pre-created, pre-sized spare files to keep for new pages (0: none,
    every new page creates its file). Each holds one page file's room in ``capacity_bytes``; they
    are made only into free room, on a thread of their own, and removed at close (a crash leaves
    them to the next start, which removes them). ``TypeError``/``ValueError`` for a bad count.
    """

    _counted_close_failure: BaseException | None = None
    """The failure of this tier's close counted ``close_failed`` (:meth:`close_failure_counted`)."""

    # -- lifetime -------------------------------------------------------------------------------

    async def start(self, *, directory_fd: int | None = None) -> None:
        """Check the directories, take the directory's lock, open the backend on the running loop,
        rebuild the index, remove leftover temp files.

        ``directory_fd``: a descriptor of ``config.directory`` that the caller opened and checked
        itself (an engine adapter's directory, whose name others may be able to swap): the tier
        starts from its own duplicate of it and never looks the directory's name up, so a name
        replaced after the caller's check (a symlink, another directory) redirects nothing. The
        caller keeps its descriptor (it may close it once this returned). None: the directory is
        created if need be and opened by its path (it may be a symlink: the operator's choice).

        Raises ``TypeError``/``ValueError`` for a ``directory_fd`` that is not an open descriptor
        (nothing started), ``UnsafeDirectoryError`` (an ``OSError``) for a directory that is not
        safely ours, ``OSError`` when a forced backend (or forced O_DIRECT) cannot work here or the
        directory cannot be created; ``RuntimeError`` when started twice (or while a start is in
        flight), and when :meth:`aclose` ran while it started: the close waits for the start, then
        closes what it made. A directory that cannot be written (read-only file system, locked by
        another cache) is no error: the tier starts read-only.
        """
        if self._dir is not None or self._close_task is not None or (
                self._starting is not None and not self._starting.done()):
            raise RuntimeError("disk tier already started")
        owned = [] if directory_fd is None else [_duplicate_directory_fd(directory_fd)]
        # An aclose() from now on waits for this start to end, then closes what it made.
        starting = self._starting = asyncio.get_running_loop().create_future()
        try:
            await self._start(owned)
        finally:
            starting.set_result(None)

    async def _start(self, owned: list[int]) -> None:
        # Its threads start in the thread that prepares the directory: Thread.start waits until the
        # new thread runs, which held the loop for ms on a loaded machine (#11).
        checksums = Checksums(start=False)
        try:
            # The scan stops once the close begins (the close waits for this start).
            prepared = await _prepare_in_thread(functools.partial(
                _start_then_prepare, checksums, self.files, owned, self.config.follow_interval_s > 0,
                self._closing.is_set))
        except BaseException as exc:
            for fd in owned:  # the thread never ran (it takes the descriptor over when it does)
                os.close(fd)
            checksums.close_nowait()
            if isinstance(exc, UnsafeDirectoryError):
                log.error("%s", exc.strerror)
            raise
        try:
            if self._close_task is not None:  # aclose() ran meanwhile: no backend for a closing tier
                raise RuntimeError("the disk tier was closed while it was starting")
            direct = self._choose_direct(prepared.direct)
            slots = HeaderSlots(self.config.queue_depth)
            try:
                self._io = await open_backend(self.config, self.pool, slots, direct)
            except BaseException:
                slots.close()
                raise
        except BaseException:
            prepared.close()
            checksums.close_nowait()
            raise
        self._dir = prepared
        self._slots = slots
        self._checksums = checksums
        checksums.in_next_turn = self._io.call_next_turn  # its inline batch in the ring's submission callback
        checksums.wake_through(self._io.thread_waker(checksums.deliver))  # the threads' results: the ring's wake-up
        for fault, what in prepared.faults:
            self._faults.count(fault, what)
        self._skipped, self._temp_removed = prepared.skipped, prepared.temp_removed
        for _mtime, key in prepared.found:
            self._index.add_found(key)
        self._pending_deletes_found(prepared)
        self._read_only = prepared.read_only
        self._index.set_capacity(prepared.space, after_enospc=False)
        self._space_checked = asyncio.get_running_loop().time()
        if self._close_task is not None:
            # aclose() ran while the backend opened: it waits for this start, then closes the
            # backend, threads and lock assigned above (before, the start went on after the close
            # had ended and kept them open).
            raise RuntimeError("the disk tier was closed while it was starting")
        if self._read_only is None:
            self._remove_files(self._index.evict_to(self._index.capacity))
        else:
            log.warning("disk tier: %s is read-only here (%s): serving its %d pages, refusing writes",
                        self.files.layout_dir, self._read_only.value, len(self._index))
        self._queued_keys = _QueuedKeys()
        self._queue = WriteBehind(self.config.write_behind_depth, self.config.write_behind_workers,
                                  self._write_queued, self._release, lambda: self._faults.unexpected("write-behind"))
        self._accepting = True
        self._start_following(prepared.seed)
        prepared.seed = None  # the looks' now
        if prepared.lock_fd is not None:
            self._start_watching()
        self._refill_spares()
        self._save_deletes_soon()  # the deletes the start carried out (or a damaged record) saved
        log.info("%s: %d pages indexed, %d temp files removed, %d entries unreadable",
                 describe_layout_io(self.layout, self._io), len(self._index), self._temp_removed, self._skipped)

    def _pending_deletes_found(self, prepared: Prepared) -> None:
        """The pending deletes the start's scan left (:func:`~.layoutdir.apply_deletes`: files not
        indexed, not unlinked yet): with the lock, unlinked again as any failed unlink is
        (remembered as deleted meanwhile); without it (another cache writes here, or none may),
        remembered as deletes from before that writer: a file no newer is never indexed by the looks
        nor a take-over. A start that follows and could not read the record remembers none: its
        looks withhold every page until one reads it (:attr:`.layoutdir.FollowSeed.withholding`;
        review 232: every page found was remembered as deleted, and kept out of the index for as
        long as the follower ran, also once the record read again)."""
        if prepared.seed is not None and prepared.seed.withholding and self.config.follow_interval_s:
            return
        self._deletes_kept = dict(prepared.deletes)
        self._deletes_dropped = set(prepared.deletes_done)
        if prepared.deletes_changed:
            self._deletes_version = 1  # unsaved: the lock holder saves it
        for key, when in prepared.deletes.items():
            if prepared.lock_fd is not None:
                self._unlink_again(key)
                self._unlink_failed_remembered(key)
            else:
                self._remember(key, -1 - when)

    def _choose_direct(self, supported: bool | None) -> bool:
        direct = self.config.direct_io
        if direct and supported is False:
            raise OSError(errno.EINVAL, f"{self.config.directory} refuses O_DIRECT (tmpfs?)")
        if direct is not None:
            return direct
        if not supported:
            log.warning("disk tier: %s %s; using buffered I/O", self.config.directory,
                        "refuses O_DIRECT" if supported is False else "has no file to probe O_DIRECT with")
        return bool(supported)

    async def __aenter__(self) -> DiskTier:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Drain (or drop, per ``drain_on_close``) write-behind, wait for in-flight I/O, close the
        backend, release the directory's lock. Idempotent; a cancelled ``aclose`` keeps closing in
        the background; a close whose task a loop-wide cancel ended is run anew by the next call."""
        await await_close(self._begin_close)

    async def close_within(self, seconds: float) -> bool:
        """As :meth:`aclose`, bounded: True when closed. False when the close stalls in the kernel
        (a frozen or hung file system): past ``seconds``, once :data:`CLOSE_STALL_S` went by with no
        I/O request of the tier ending and no step of its close ending (what is left then waits on
        the kernel: a request in flight, or a thread of the tier in a system call). From then on
        pages still queued for write-behind are dropped (counted in ``dropped``), not written; the
        close goes on in the background and :attr:`io_ended` resolves once no I/O or thread of the
        tier touches pool memory any more: free the pool only then. A failure of that close is
        logged and counted ``close_failed`` in the tier's fault log, once.

        ``seconds`` bounds the wait for a stalled close, not a healthy one: a close whose I/O keeps
        ending goes on to its end (its queued pages written, per ``drain_on_close``), however small
        ``seconds`` — 0 included (a caller's own bound used up by other work, review leftover: an
        idle tier was given up, its queue dropped, "stuck" logged). A stalled close returns False
        within ``max(seconds, CLOSE_STALL_S)`` of the call, about (the stall counts from the last
        progress seen, also by an earlier call). Raises ``TypeError``/``ValueError`` for a
        ``seconds`` that is not a finite number >= 0. A cancelled call leaves the close running."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise TypeError(f"seconds must be a number, got {type(seconds).__name__}")
        if not 0 <= seconds < float("inf"):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds}")
        # Through aclose (looked up on the instance): what wraps it wraps this close too.
        closing = asyncio.ensure_future(self.aclose())
        loop = asyncio.get_running_loop()
        bound = loop.time() + seconds
        while True:
            now = loop.time()
            give_up = max(bound, self._stalled_since(now) + CLOSE_STALL_S)
            if now >= give_up:
                break
            # Polled: progress is seen CLOSE_POLL_S late at most (a timer, no hook on the I/O path).
            done, _ = await asyncio.wait({closing}, timeout=min(give_up - now, CLOSE_POLL_S))
            if done:
                closing.result()  # raises what the close raised, as aclose does
                return True
        # Nobody awaits it any more: its end is retrieved there, a failure logged and counted.
        closing.add_done_callback(self._given_up_close_ended)
        self._waiting_close = closing
        if not self._stuck:
            self._stuck = True
            # Held here until the stuck I/O ended: should every other reference go (the loop
            # closed, the close task cancelled), the pool, header slots and ring of a request the
            # kernel still holds must not be collected (unmapped) under it. Kept until exit then.
            _STUCK.add(self)
            if self._queue is not None:
                # Drop what is queued now (the drain in progress would write it behind the stuck
                # writes); counted once the stuck writes end and the queue's workers stop.
                self._drop_queued = asyncio.ensure_future(self._queue.aclose(drain=False))
            log.error("disk tier: I/O still stuck in the kernel at close: nothing ended for %.1f s, %d requests in "
                      "flight (frozen or hung file system?): dropping queued pages; the pool must stay mapped until "
                      "that I/O ends", now - self._stalled_since(now), self._io_slots.in_use)
        return False

    def close_failure_counted(self, exc: BaseException) -> bool:
        """Whether ``exc``, a failure of this tier's close, was counted ``close_failed`` already;
        marks it counted. One failure reaches every waiter of that close: a :meth:`close_within` that
        gave up on it (counted here, :meth:`_given_up_close_ended`) and the caller of a later one
        (the cache's close run anew after a cut, which counts what it raises): counted once between
        them, whichever sees it first."""
        if exc is self._counted_close_failure:
            return True
        self._counted_close_failure = exc
        return False

    def _given_up_close_ended(self, closing: asyncio.Future[None]) -> None:
        """The end of a close :meth:`close_within` gave up waiting for. A failure is logged and
        counted ``close_failed`` in the tier's fault log (the cache's, shared: its ``stats()``),
        once: every call that gave up on the same close sees the same exception. Before (review
        303) it was retrieved and dropped: the caller had counted only ``close_timeout``."""
        if closing.cancelled():
            return  # a loop-wide cancel: the close is run anew by the next call, which sees its end
        exc = closing.exception()
        if exc is None or self.close_failure_counted(exc):
            return
        log.error("disk tier: the close given up as stuck in the kernel failed later: %r", exc, exc_info=exc)
        self._faults.log.record("close_failed", f"disk tier: the close given up as stuck failed later: {exc!r}")

    def _stalled_since(self, now: float) -> float:
        """When the close was last seen making progress (a slot given back: a request ended; a step
        of :meth:`_close` ended), as of ``now``; the first look counts as progress."""
        mark = (self._io_slots.given_back, self._close_steps)
        seen = self._progress_seen
        if seen is None or seen[:2] != mark:
            seen = self._progress_seen = (*mark, now)
        return seen[2]

    @property
    def io_ended(self) -> asyncio.Future[None]:
        """Resolved once the close ended: no kernel request, worker or checksum thread of the tier
        reads or writes pool memory any more (never resolved by a close that was cancelled or
        failed part-way: then that is not known). ``RuntimeError`` before the close began."""
        if self._io_ended is None:
            raise RuntimeError("the disk tier's close has not begun")
        return self._io_ended

    def _begin_close(self) -> asyncio.Task[None]:
        if self._close_task is None:
            self._accepting = False
            self._closing.set()
            self._io_ended = asyncio.get_running_loop().create_future()
        if self._close_task is None or self._close_task.cancelled():
            # Anew when a loop-wide cancel (an application's SIGTERM handler cancelling every
            # task, a loop's shutdown) ended the close's task: every later aclose()/close_within()
            # raised that cancel at once, the lock held and the threads running (review 205).
            # Each step of _close may run again.
            self._close_task = asyncio.create_task(self._close())
        return self._close_task

    async def _write_queued(self, key: PageKey, handle: PageHandle) -> bool:
        """A page the write-behind queue hands on: written, or dropped once the close gave up
        waiting (:meth:`close_within`: the write would only wait behind the stuck ones), or
        discarded: the key was deleted after this page was queued (review 264)."""
        if self._queued_keys.taken(key):  # (first: the queue's get took the entry in this same step)
            return False
        if self._stuck:
            self._dropped += 1
            return False
        ref = self._retain(handle)
        try:
            return await self._write_owned(key, ref)
        except BaseException as exc:
            if not isinstance(exc, Exception | asyncio.CancelledError) and not_started(self._write_owned, exc):
                self._release(ref)  # (a signal's KeyboardInterrupt at the write's entry: never taken)
            raise

    async def _until_idle(self) -> None:
        """Until no operation is active and no page job runs (those of callers that ended too)."""
        while self._jobs or self._active:
            if self._active:
                self._idle = asyncio.get_running_loop().create_future()
                await self._idle
            if self._jobs:
                await asyncio.wait(set(self._jobs))

    async def _close(self) -> None:
        # Each step ended counts as progress (_close_steps) for close_within: a close that gets on
        # is never given up as stuck.
        if self._starting is not None:
            await asyncio.wait({self._starting})  # a start in flight may still be opening the backend
            self._close_steps += 1
        await self._stop_following()  # its look's thread ended before any descriptor is closed
        self._close_steps += 1
        await self._stop_watching()  # so did the lock check's
        self._close_steps += 1
        if self._writable_again is not None:  # no more looks at a read-only file system
            self._writable_again.cancel()
            await asyncio.wait({self._writable_again})
            self._close_steps += 1
        if self._queue is not None:
            self._dropped += await self._queue.aclose(self.config.drain_on_close)
            self._close_steps += 1
        if self._drop_queued is not None:
            if self._drop_queued.cancelled():  # cut by a loop-wide cancel: drop what is left anew
                assert self._queue is not None
                self._drop_queued = asyncio.ensure_future(self._queue.aclose(drain=False))
            self._dropped += await self._drop_queued
            self._drop_queued = None  # counted once, should this close run again
        await self._until_idle()
        self._close_steps += 1
        if self._dir is not None and self._dir.lock_fd is not None:
            # Files whose unlink failed, a last time: a delete the tier could not carry out is
            # remembered only in memory, and a restart would index and serve the page (review 204).
            retries = self._retry_unlinks()
            if retries:
                await asyncio.wait(retries)
                self._close_steps += 1
        await self._close_spares()
        self._close_steps += 1
        if self._io is not None:
            await self._io.aclose()
            self._close_steps += 1
        if self._checksums is not None:
            await self._checksums.aclose()
        if self._slots is not None:
            self._slots.close()
        if self._dir is not None:
            self._dir.close()
        if self._io_ended is not None and not self._io_ended.done():
            self._io_ended.set_result(None)
        _STUCK.discard(self)

    @property
    def read_only(self) -> ReadOnly | None:
        """Why writes are refused (read-only file system, directory locked by another cache...), or None."""
        return self._read_only

    def layout_dir_fd(self) -> int:
        """A duplicate of the descriptor of the layout directory this tier uses (the caller closes
        it), to reach files beside the pages (the rates file) without looking the directory up by
        name again: after the start the name may lead elsewhere (the root renamed away and a link
        put in its place; a root the caller gave as a descriptor), while the tier keeps its own.
        Raises ``RuntimeError`` before the start and after the close."""
        fd = -1 if self._dir is None else self._dir.dir_fd
        if fd < 0:
            raise RuntimeError("the disk tier holds no directory (not started, or closed)")
        return os.dup(fd)

    # -- lookups --------------------------------------------------------------------------------

    def contains(self, key: PageKey) -> bool:
        """Whether a page file for ``key`` is indexed (it may still fail verification on read)."""
        return exact_key(key) in self._index

    def touch(self, keys: Iterable[PageKey]) -> int:
        """Mark the page files of ``keys`` most recently used, in order (the last one most recent);
        keys without an indexed file (absent, or still being written) are skipped. Returns how many
        were touched. No I/O; recency is not kept across restarts (the index rebuilds in file-time
        order). Raises ``TypeError``/``ValueError`` for a key that is not 16 bytes or ``keys`` that
        is not an iterable of keys (a single ``bytes`` key included): nothing is touched then."""
        if isinstance(keys, (bytes, bytearray, memoryview, str)):
            raise TypeError(f"keys must be an iterable of keys, got a single {type(keys).__name__}")
        try:
            wanted = list(keys)
        except TypeError:
            raise TypeError(f"keys must be an iterable of keys, got {type(keys).__name__}") from None
        wanted = [exact_key(key) for key in wanted]  # all checked before any is touched
        index = self._index
        touched = 0
        for key in wanted:
            if key in index:
                index.touch(key)
                touched += 1
        return touched

    def keys_present_prefix(self, keys: Sequence[PageKey]) -> int:
        """How many leading ``keys`` are on disk."""
        count = 0
        for key in keys:
            if not self.contains(key):
                break
            count += 1
        return count

    # -- write ----------------------------------------------------------------------------------

    async def write(self, key: PageKey, handle: PageHandle) -> bool:
        """Store the page of ``handle`` (READY; the caller keeps its reference) under ``key``.

        True when stored (or already stored); False when dropped for capacity, failed (counted by
        kind) or the tier is closing. Raises ``TypeError``/``ValueError`` for a wrong key or a
        stale/reserved handle, ``RuntimeError`` before :meth:`start`.
        """
        if type(key) is not bytes or len(key) != KEY_BYTES:
            key = exact_key(key)  # raises, or a subclass's bytes as exact bytes
        ref = self._retain(handle)
        if not self._accepting:
            self._release(ref)
            return self._refuse()
        try:
            return await self._write_owned(key, ref)
        except BaseException as exc:
            if not isinstance(exc, Exception | asyncio.CancelledError) and not_started(self._write_owned, exc):
                self._release(ref)  # (a signal's KeyboardInterrupt at the write's entry: never taken)
            raise

    async def write_from(self, key: PageKey, buffer: memoryview) -> bool:
        """Store the ``layout.page_bytes`` bytes of ``buffer`` (C-contiguous, e.g. a page of an
        engine's own CPU memory) under ``key``: as :meth:`write`, without a pool page.

        The caller keeps ``buffer`` alive and unchanged until this returns; if cancelled while the
        kernel (or the checksum thread) still reads it, this waits for that before raising
        ``CancelledError``. Raises ``TypeError``/``ValueError`` for a wrong key or buffer (nothing
        changed then), ``RuntimeError`` before :meth:`start`.
        """
        key = exact_key(key)
        self._check_started()
        page = self._external(buffer, writable=False)
        if not self._accepting:
            page.release()
            return self._refuse()
        joined = self._join_write(key, None, page)
        if isinstance(joined, bool):
            page.release()
            return joined
        job, waiter = joined
        try:
            return await waiter
        except asyncio.CancelledError:
            if job.buffer is page:  # our buffer is in the job's hands until it ends
                await job.wait_ended()
            raise
        finally:
            page.release()

    # -- read -----------------------------------------------------------------------------------

    async def read(self, key: PageKey, handle: PageHandle) -> bool:
        """Fill the RESERVED page of ``handle`` with ``key``'s page file.

        True only when header and checksum verified; False is a miss (absent; corrupt — the file
        is deleted and counted; or an I/O fault, counted). On False the page bytes are undefined:
        abort the reservation. Raises ``TypeError``/``ValueError`` for a wrong key or a handle that
        is not a live reservation. If cancelled with I/O in flight it waits for that I/O to finish
        before raising ``CancelledError``, so the caller may abort the page at once.
        """
        if type(key) is not bytes or len(key) != KEY_BYTES:
            key = exact_key(key)
        page = self._check_reserved(handle)
        memory = self.pool.memory
        return await self._read(key, PageBuffer(memory.page_address(page), memory.page_view(page), self._payload_bytes))

    async def read_into(self, key: PageKey, buffer: memoryview) -> bool:
        """Fill ``buffer`` (C-contiguous, writable, ``layout.page_bytes`` bytes: e.g. a page of an
        engine's own CPU memory) with ``key``'s page: as :meth:`read`, without a pool page.

        True only when header and checksum verified; on False the buffer's bytes are undefined. If
        cancelled with I/O in flight it waits until nothing writes into ``buffer`` any more before
        raising ``CancelledError``. Raises ``TypeError``/``ValueError`` for a wrong key or buffer
        (nothing read then), ``RuntimeError`` before :meth:`start`.
        """
        key = exact_key(key)
        self._check_started()
        page = self._external(buffer, writable=True)
        try:
            return await self._read(key, page)
        finally:
            page.release()  # the job ended: nothing touches the buffer any more

    async def read_many(self, keys: Sequence[PageKey], handles: Sequence[PageHandle]) -> list[bool]:
        """:meth:`read` of each ``keys[i]`` into the RESERVED page of ``handles[i]``, as one batch.

        Returns one bool per page, in order: True only when that page verified (False as
        :meth:`read`'s: absent, corrupt — deleted and counted —, or an I/O fault; abort that
        page's reservation). The pages are read concurrently (within ``queue_depth``) and the
        call awaits one future for the batch, resolved when the last page ended: a batch costs
        the loop one wake-up of the caller, not one per page. Raises ``TypeError``/``ValueError``
        before anything changes for sequences of another type (a single key included) or
        length, a key that is not 16 bytes, the same key or the same page twice, or a handle
        that is not a live reservation; ``RuntimeError`` before :meth:`start`. If cancelled it
        waits until no I/O (or checksum thread) touches any of the batch's pages any more before
        raising ``CancelledError``, so the caller may abort all of them at once.
        """
        wanted = _batch_keys(keys, handles, "handles")
        self._check_started()
        ids = [self._check_reserved(handle) for handle in handles]  # all checked before any is read
        if len(set(ids)) != len(ids):
            raise ValueError("handles name the same pool page twice")
        memory = self.pool.memory
        payload = self._payload_bytes
        pages = [PageBuffer(memory.page_address(page), memory.page_view(page), payload) for page in ids]
        return await self._read_batch(wanted, pages)

    async def read_many_into(self, keys: Sequence[PageKey], buffers: Sequence[memoryview]) -> list[bool]:
        """:meth:`read_into` of each ``keys[i]`` into ``buffers[i]``, as one batch: as
        :meth:`read_many`, with callers' buffers (each as :meth:`read_into` takes it; buffers
        that overlap raise ``ValueError``). The caller keeps every buffer alive until this
        returns; a cancelled call returns only once nothing writes into any of them."""
        wanted = _batch_keys(keys, buffers, "buffers")
        self._check_started()
        page_bytes = self.layout.page_bytes
        for buffer in buffers:  # all checked before any state changes (_external counts fallbacks)
            if not isinstance(buffer, memoryview):
                raise TypeError(f"buffer must be a memoryview, got {type(buffer).__name__}")
            check_buffer(buffer, page_bytes, writable=True)
        spans = sorted(_address(buffer) for buffer in buffers)
        if any(b - a < page_bytes for a, b in itertools.pairwise(spans)):
            raise ValueError("buffers overlap: two pages would be read into the same memory")
        pages = [self._external(buffer, writable=True) for buffer in buffers]
        try:
            return await self._read_batch(wanted, pages)
        finally:
            for page in pages:
                page.release()  # every job ended: nothing touches the buffers any more

    # -- delete ---------------------------------------------------------------------------------

    async def delete(self, key: PageKey) -> None:
        """Remove ``key``'s page file (a write in flight for it is discarded when it lands, and a
        write-behind of it queued so far when a worker takes it; one queued later is written). A file
        of the key in a fan-out directory not listed whole (away, being listed, or its listing failed
        part-way) is never served once that directory is listed (:meth:`_remember_delete`)."""
        key = exact_key(key)
        if key in self._writing:
            self._delete_after_write.add(key)
        if self._queue is not None:
            # A write-behind of the key still queued (no worker took it: not in _writing) is
            # discarded when a worker takes it; before (review 264) it was stored after this
            # returned, and served, also after a restart.
            self._queued_keys.deleted(key)
        listing = self._listing.get(key[0])
        if listing is not None:
            listing.add(key)  # a fan-out directory being listed: the file it finds is not indexed
        if self._io is None:
            return
        # Remembered whatever the key's state: indexed or being written (stored again since its
        # directory went away), an old copy of its file may still come back (review 188).
        part_listed = self._remember_delete(key)
        if key in self._index:
            unlink = self._drop(key)
        elif part_listed and key not in self._writing:
            unlink = self._unlink_later(key)  # its name may lie where the listing has not been
        else:
            unlink = None
        if unlink is not None:
            await asyncio.shield(unlink)
            if self._read_only is not None and key not in self._index and key not in self._writing:
                # Read-only since the unlink began: maybe its own EROFS (the file system remounted
                # read-only since the last write), which left the file. Review 203: the delete was
                # remembered nowhere (the tier was writable when it began), the page stayed on disk
                # outside the index once writable again, and after a lost lock the looks served it.
                # Remembered now (read-only: :meth:`_remember_delete` keeps it) and unlinked once
                # writable; a file already gone costs an unlink that finds nothing.
                self._remember_delete(key)
                self._unlink_later(key)

    # -- write-behind ---------------------------------------------------------------------------

    def write_behind_nowait(self, key: PageKey, handle: PageHandle) -> bool:
        """Queue ``handle``'s page for writing and take ownership of that reference (released after
        the write completes or is dropped). False — ownership not taken — when the queue is full,
        the tier is not accepting work, or it is read-only (counted in ``writes_refused``; see
        :attr:`read_only`). Raises ``TypeError``/``ValueError`` for caller mistakes."""
        key = exact_key(key)
        self._check_ready(handle)
        if not self._accepting or self._queue is None:
            return False
        if self._read_only is not None and key not in self._index:
            self._writes_refused += 1
            return False
        if not self._queue.put_nowait(key, handle):
            return False
        self._queued_keys.queued(key)  # (no worker runs before this: they take it in a later step)
        return True

    async def write_behind(self, key: PageKey, handle: PageHandle) -> None:
        """Wait for room in the write-behind queue, then as :meth:`write_behind_nowait` (ownership
        is taken only when this returns; a read-only tier refuses the write when the queue gets to
        it, counted). Raises ``RuntimeError`` when the tier is closed."""
        key = exact_key(key)
        self._check_ready(handle)
        if not self._accepting or self._queue is None:
            raise RuntimeError("disk tier is not accepting writes (not started or closing)")
        await self._queue.put(key, handle)
        self._queued_keys.queued(key)  # (the put returned in the step that queued it: not taken yet)

    async def flush(self) -> None:
        """Wait until every page queued for write-behind, or being written, so far is written or dropped."""
        if self._queue is not None:
            await self._queue.join()
        pending = [job.ended_future() for job in self._writing.values()]
        if pending:
            await asyncio.wait(pending)

    # -- statistics -----------------------------------------------------------------------------

    def statistics(self) -> DiskStatistics:
        """A snapshot of contents, traffic, faults and queues."""
        io = self._io
        slots = self._io_slots
        return DiskStatistics(
            backend=io.kind if io is not None else DiskBackend.AUTO,
            direct_io=io.direct if io is not None else False,
            pages=len(self._index),
            bytes_stored=self._index.stored_bytes,
            capacity_bytes=self.config.capacity_bytes,
            reads=self._reads,
            writes=self._writes,
            bytes_read=self._bytes_read,
            bytes_written=self._bytes_written,
            hits=self._hits,
            misses=self._misses,
            corrupt=self._corrupt,
            dropped=self._dropped,
            errors=self._faults.snapshot(),
            write_behind_queued=self._queue.qsize() if self._queue is not None else 0,
            write_behind_writing=self._queue.writing if self._queue is not None else 0,
            write_behind_voided=self._queued_keys.voided if self._queue is not None else 0,
            write_behind_workers_replaced=self._queue.workers_replaced if self._queue is not None else 0,
            in_flight=slots.in_use,
            reads_in_flight=slots.in_use - slots.writes_in_use,  # every job that is no write is a read
            writes_in_flight=slots.writes_in_use,
            evictions=self._index.evictions,
            recycled=self._recycled,
            temp_files_removed=self._temp_removed,
            effective_capacity_bytes=self._index.capacity,
            read_only=self._read_only,
            writes_refused=self._writes_refused,
            skipped_at_scan=self._skipped,
            buffered_fallbacks=self._buffered_fallbacks,
            memory_unregistered=self._memory_unregistered,
            follow_looks=self._follow_looks,
            followed_in=self._followed_in,
            followed_out=self._followed_out,
            follow_withheld=self._follow_withheld,
            took_over=self._took_over,
            follow_raced=self._follow_raced,
            lock_retaken=self._lock_retaken,
            lock_lost=self._lock_lost,
            listings_failed=self._listings_failed,
        )

    def read_marks(self) -> ReadMarks:
        """:class:`ReadMarks` now: what :meth:`statistics` would say of them, at a fraction of its
        cost (a load takes them around each read group, on the loop)."""
        log = self._faults.log
        faults = self._corrupt + self._follow_raced
        for name in _FAULT_NAMES:
            faults += log[name]
        return ReadMarks(self._index.evictions, faults, self._reads_evicted, self._reads_unlinked)

    def spare_statistics(self) -> SpareStatistics:
        """A snapshot of the spare files (stock, made, taken, faults)."""
        return self._spares.statistics()

    @property
    def checksum_seconds(self) -> float:
        """CPU seconds spent hashing payloads so far (both directions; benchmarks report the share)."""
        return 0.0 if self._checksums is None else self._checksums.cpu_s

    @property
    def backend(self) -> PageIO:
        """The byte mover in use (tests inject faults through ``backend.faults``)."""
        if self._io is None:
            raise RuntimeError("disk tier not started")
        return self._io

    async def wait_registered(self) -> None:
        """Wait until the pool's background io_uring buffer registration (URING_FIXED chosen by
        ``AUTO``) is over, successful or not; at once for other backends. The registration pins the
        pool region by region while I/O goes on; an engine may await this in its set-up so that
        the pinning does not overlap its first requests. Cancelling the call does not stop it."""
        wait = getattr(self._io, "wait_registered", None)
        if wait is not None:
            await wait()

    # -- callers' memory ------------------------------------------------------------------------

    async def register_memory(self, buffer: memoryview) -> None:
        """Register a caller's region (e.g. an engine's shared CPU memory, C-contiguous, writable)
        so that :meth:`write_from`/:meth:`read_into` of pages inside it use io_uring fixed buffers.

        Pinning runs in a thread (~20 ms/GiB of touched memory); the region must stay mapped until
        the tier is closed (the kernel holds its pages pinned; the tier keeps ``buffer``). Where it
        cannot be registered (threads backend, forced ``URING_FIXED``, memlock, table full) pages
        inside it move through plain buffers: counted in ``memory_unregistered``, never an error.
        O_DIRECT does not depend on this: it is used for every caller page whose address is
        4096-aligned (others go buffered, counted in ``buffered_fallbacks``). Pinning goes in
        pieces (8 MiB, several per registration call); a cancelled call, or :meth:`aclose`, stops
        it after the piece in progress
        (a cancelled call waits for that piece before raising ``CancelledError``): pieces pinned
        so far use fixed buffers, the rest plain ones (counted when stopped by ``aclose``). Raises ``TypeError``/
        ``ValueError`` for a buffer that is not a C-contiguous writable memoryview, or is empty.
        """
        if not isinstance(buffer, memoryview):
            raise TypeError(f"buffer must be a memoryview, got {type(buffer).__name__}")
        check_buffer(buffer, None, writable=True)
        self._check_started()
        if self._io is None or not self._accepting:
            raise RuntimeError("disk tier is closing")
        view = buffer.cast("B")
        try:
            registered = await self._io.register_memory(view, buffer_address(view))
        finally:
            # Not kept in this frame: a traceback kept of a cancelled call (a loop's death cancels
            # every task, and on Python 3.12 its gathers keep their tracebacks) would keep the
            # caller's region exported after the close, and ``mmap.close`` would then fail.
            del view, buffer
        if not registered:
            self._memory_unregistered += 1


def _duplicate_directory_fd(fd: int) -> int:
    """The tier's own duplicate of a caller's directory descriptor (checked: a caller mistake raises
    ``TypeError``/``ValueError``)."""
    if isinstance(fd, bool) or not isinstance(fd, int):
        raise TypeError(f"directory_fd must be an int (a file descriptor) or None, got {type(fd).__name__}")
    if fd < 0:
        raise ValueError(f"directory_fd must be an open file descriptor, got {fd}")
    try:
        return os.dup(fd)  # a plain syscall that never blocks: on the loop
    except OSError as exc:
        raise ValueError(f"directory_fd {fd} is not an open file descriptor ({exc.strerror})") from None


def _start_then_prepare(checksums: Checksums, files: PageFiles, owned: list[int], follow: bool,
                        stop: Callable[[], bool]) -> Prepared:
    """In a worker thread: start the checksum threads, then :func:`prepare` the directory (from the
    descriptor in ``owned``, taken over here, or by its path when ``owned`` is empty; ``follow``:
    keep what a locked directory's scan listed; ``stop``: the scan ends once it is True)."""
    root_fd = owned.pop() if owned else None
    try:
        checksums.start_threads()
    except BaseException:
        if root_fd is not None:
            os.close(root_fd)
        raise
    return prepare(files, root_fd, follow, stop)


async def _prepare_in_thread(work: Callable[[], Prepared]) -> Prepared:
    """``work()`` on a new thread, started without the loop waiting for it (``asyncio.to_thread``'s
    first call starts the default executor's thread on the loop, and ``Thread.start`` waits there
    until it runs). If the caller is cancelled meanwhile, this waits for the thread, closes the
    descriptors it returns (a lock left open would keep the directory read-only for everyone else)
    and re-raises; if the loop goes away first, the thread closes them itself."""
    job = run_in_new_thread(work, "aiokv-disk-start", Prepared.close)
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        await wait_uncancelled(job)
        if not job.cancelled() and job.exception() is None:
            job.result().close()
        raise


def _address(buffer: memoryview) -> int:
    """The first byte's address of a checked caller's buffer (its byte view let go at once)."""
    with buffer.cast("B") as view:
        return buffer_address(view)


def _batch_keys(keys: Sequence[PageKey], others: Sequence[object], what: str) -> list[PageKey]:
    """``keys`` checked for a batch read against its ``others`` (handles or buffers): a sequence
    (not a single key) of distinct 16-byte keys as exact bytes, as long as ``others``."""
    if isinstance(keys, (bytes, bytearray, memoryview, str)) or not isinstance(keys, Sequence):
        raise TypeError(f"keys must be a sequence of keys, got {type(keys).__name__}")
    if isinstance(others, (bytes, bytearray, memoryview, str)) or not isinstance(others, Sequence):
        raise TypeError(f"{what} must be a sequence, got {type(others).__name__}")
    if len(keys) != len(others):
        raise ValueError(f"{len(keys)} keys for {len(others)} {what}")
    wanted = [exact_key(key) for key in keys]
    if len(set(wanted)) != len(wanted):
        raise ValueError("the same key twice in one batch")
    return wanted
