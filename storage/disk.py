"""`DiskTier`: page files of one layout, with an in-memory index, LRU capacity and write-behind.

All bookkeeping is plain synchronous code on the owning loop. Each read or write is a page job
(:mod:`.jobs`) moved on by completion callbacks, holding its own claim on the page:

- ``write`` takes its own pool reference (``retain``) for the job, so a cancelled caller may drop
  its handle at once; the job finishes (publishes or cleans its temp file) and releases it.
  ``write_from`` has no reference to take: a cancelled caller waits until its buffer is free.
- ``read`` (``read_into``) fills the caller's RESERVED page (buffer); a cancelled caller is kept
  until the kernel (or the thread) is done with that memory — otherwise the caller's ``abort``
  would recycle memory that is still being written — and then gets its ``CancelledError``.

Faults (ENOSPC, EIO, permissions, corrupt or planted files) become False/miss results, are counted
by kind and logged once per kind; nothing raises into the caller's loop except caller mistakes.

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
import logging
import os
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

from aiokv.faults import FaultLog
from aiokv.keys import PageKey
from aiokv.layout import KVLayout
from aiokv.pagetable import PageHandle, StaleHandleError
from aiokv.pool import PagePool, run_in_new_thread

from .backends import HeaderSlots, PageIO, describe_layout_io, open_backend
from .checks import check_buffer, check_key, check_ready, check_reserved
from .checksum import Checksums
from .config import DiskBackend, DiskConfig, DiskStatistics, ReadOnly
from .faults import DiskFaults
from .index import PageIndex
from .jobs import IOSlots, Job, ReadJob, WriteJob, wait_uncancelled
from .layoutdir import Prepared, free_space, prepare
from .memory import PageBuffer, buffer_address
from .pagefile import (
    PageFiles,
    PageHeader,
    file_bytes,
    pack_header,
    parse_header,
)
from .safefiles import UnsafeDirectoryError, UnsafeFileError
from .writebehind import WriteBehind

log = logging.getLogger(__name__)
T = TypeVar("T")


class DiskTier:
    """Page files under ``config.directory`` for pages of ``pool`` (same layout).

    Construction is cheap; :meth:`start` (or ``async with``) opens the backend and rebuilds the
    index. Close the tier before the pool: registered buffers pin the pool's memory.

    ``faults``: where I/O faults are counted (kinds ``disk_enospc``, ``disk_eio``, ...); the cache
    manager passes its own log so each fault is counted once; None: a log of the tier's own.
    """

    def __init__(self, config: DiskConfig, layout: KVLayout, pool: PagePool, faults: FaultLog | None = None) -> None:
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
        self.config = config
        self.layout = layout
        self.pool = pool
        self.files = PageFiles(config.directory, layout)
        self._file_bytes = file_bytes(layout)
        self._io: PageIO | None = None
        self._slots: HeaderSlots | None = None
        self._io_slots = IOSlots(config.queue_depth)
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
        self._faults = DiskFaults(faults)
        self._corrupt_logged = False
        self._reads = self._writes = self._bytes_read = self._bytes_written = 0
        self._hits = self._misses = self._corrupt = self._dropped = 0
        self._temp_removed = self._skipped = self._writes_refused = 0
        self._buffered_fallbacks = self._memory_unregistered = 0
        self._dir: Prepared | None = None
        self._read_only: ReadOnly | None = None
        self._space_checked = 0.0

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
        directory cannot be created; ``RuntimeError`` when started twice. A directory that cannot be
        written (read-only file system, locked by another cache) is no error: the tier starts
        read-only.
        """
        if self._dir is not None or self._close_task is not None:
            raise RuntimeError("disk tier already started")
        owned = [] if directory_fd is None else [_duplicate_directory_fd(directory_fd)]
        # Its threads start in the thread that prepares the directory: Thread.start waits until the
        # new thread runs, which held the loop for ms on a loaded machine (#11).
        checksums = Checksums(start=False)
        try:
            prepared = await _prepare_in_thread(functools.partial(_start_then_prepare, checksums, self.files, owned))
        except BaseException as exc:
            for fd in owned:  # the thread never ran (it takes the descriptor over when it does)
                os.close(fd)
            checksums.close_nowait()
            if isinstance(exc, UnsafeDirectoryError):
                log.error("%s", exc.strerror)
            raise
        try:
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
        for fault, what in prepared.faults:
            self._faults.count(fault, what)
        self._skipped, self._temp_removed = prepared.skipped, prepared.temp_removed
        for _mtime, key in prepared.found:
            self._index.add_found(key)
        self._read_only = prepared.read_only
        self._index.set_capacity(prepared.space, after_enospc=False)
        self._space_checked = asyncio.get_running_loop().time()
        if self._read_only is None:
            self._remove_files(self._index.evict_to(self._index.capacity))
        else:
            log.warning("disk tier: %s is read-only here (%s): serving its %d pages, refusing writes",
                        self.files.layout_dir, self._read_only.value, len(self._index))
        self._queue = WriteBehind(self.config.write_behind_depth, self.config.write_behind_workers,
                                  lambda key, handle: self._write_owned(key, self._retain(handle)),
                                  self._release, lambda: self._faults.unexpected("write-behind"))
        self._accepting = True
        log.info("%s: %d pages indexed, %d temp files removed, %d entries unreadable",
                 describe_layout_io(self.layout, self._io), len(self._index), self._temp_removed, self._skipped)

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
        the background."""
        if self._close_task is None:
            self._accepting = False
            self._close_task = asyncio.create_task(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        if self._queue is not None:
            self._dropped += await self._queue.aclose(self.config.drain_on_close)
        while self._jobs or self._active:
            if self._active:
                self._idle = asyncio.get_running_loop().create_future()
                await self._idle
            if self._jobs:
                await asyncio.wait(set(self._jobs))
        if self._io is not None:
            await self._io.aclose()
        if self._checksums is not None:
            await self._checksums.aclose()
        if self._slots is not None:
            self._slots.close()
        if self._dir is not None:
            self._dir.close()

    @property
    def read_only(self) -> ReadOnly | None:
        """Why writes are refused (read-only file system, directory locked by another cache...), or None."""
        return self._read_only

    # -- lookups --------------------------------------------------------------------------------

    def contains(self, key: PageKey) -> bool:
        """Whether a page file for ``key`` is indexed (it may still fail verification on read)."""
        check_key(key)
        return key in self._index

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
        for key in wanted:
            check_key(key)
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
        check_key(key)
        ref = self._retain(handle)
        if not self._accepting:
            self._release(ref)
            return self._refuse()
        return await self._write_owned(key, ref)

    async def _write_owned(self, key: PageKey, ref: PageHandle) -> bool:
        # Takes ownership of ``ref``: released by the job (or right here when nothing is to do).
        joined = self._join_write(key, ref, None)
        if isinstance(joined, bool):
            self._release(ref)
            return joined
        # The caller's own future: cancelling it leaves the job (and other writers of the key) alone.
        return await joined[1]

    async def write_from(self, key: PageKey, buffer: memoryview) -> bool:
        """Store the ``layout.page_bytes`` bytes of ``buffer`` (C-contiguous, e.g. a page of an
        engine's own CPU memory) under ``key``: as :meth:`write`, without a pool page.

        The caller keeps ``buffer`` alive and unchanged until this returns; if cancelled while the
        kernel (or the checksum thread) still reads it, this waits for that before raising
        ``CancelledError``. Raises ``TypeError``/``ValueError`` for a wrong key or buffer (nothing
        changed then), ``RuntimeError`` before :meth:`start`.
        """
        check_key(key)
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

    def _join_write(self, key: PageKey, ref: PageHandle | None,
                    page: PageBuffer | None) -> bool | tuple[WriteJob, asyncio.Future[bool]]:
        """Start a write of ``key`` from ``ref`` (taken by the job) or ``page``, or join the one in
        flight; the job and this caller's future, or the answer when there is nothing to write
        (``ref`` is then still the caller's)."""
        if key in self._index:
            self._index.touch(key)
            return True
        if self._read_only is not None:
            self._writes_refused += 1
            return False
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        job = self._writing.get(key)
        if job is None:
            job = self._writing[key] = WriteJob(key, ref, page)
            job.waiters.append(waiter)  # before the start: a write dropped for room ends right there
            self._job_started()
            self._start_write(job)
        else:
            if ref is not None:
                self._release(ref)
            job.waiters.append(waiter)
        return job, waiter

    def _start_write(self, job: WriteJob) -> None:
        """Hash the payload first (holding no I/O slot or room meanwhile), then claim room, take a
        slot and publish, all moved on by completion callbacks. Only the rare waits — a rename or
        unlink of the key in flight, a due free-space check, an ENOSPC retry — take a coroutine."""
        assert self._checksums is not None
        try:
            job.page = self._source(job)
            self._checksums.start(job.page.payload, functools.partial(self._write_hashed, job), writing=True)
        except Exception:
            self._write_bug(job)

    def _write_hashed(self, job: WriteJob, checksum: int | BaseException) -> None:
        try:
            if isinstance(checksum, BaseException):
                raise checksum
            job.checksum = checksum
            if job.key in self._moving or self._space_recheck_due():
                self._spawn_write_later(job, refresh=False)
            else:
                self._claim(job)
        except Exception:
            self._write_bug(job)

    async def _write_later(self, job: WriteJob, refresh: bool) -> None:
        """Look at the free space again (``refresh``: the file system just said it is full), wait
        for a rename or unlink of the key in flight, then go on by callbacks."""
        try:
            if refresh:
                await self._refresh_space(after_enospc=True)
            else:
                await self._recheck_space()
            moving = self._moving.get(job.key)
            if moving is not None:
                await asyncio.wait({moving})  # an old unlink must not remove the new file
            self._claim(job)
        except Exception:
            self._write_bug(job)

    def _spawn_write_later(self, job: WriteJob, refresh: bool) -> None:
        task = self._spawn(self._write_later(job, refresh))
        task.add_done_callback(functools.partial(self._write_later_done, job))

    def _write_later_done(self, job: WriteJob, task: asyncio.Task[None]) -> None:
        # Cancelled (its loop is going away; maybe before its first step) or a BaseException: the
        # job holds no room or slot while it awaits (both are taken in ``_claim``, which never
        # awaits), so it ends unstored; its callers and ``aclose`` wait for that end.
        if not job.ended and (task.cancelled() or task.exception() is not None):
            self._end_write(job, False)

    def _claim(self, job: WriteJob) -> None:
        """Room for the file (evicting least recently used files, or recycling one), then a slot."""
        if self._read_only is not None:  # became read-only meanwhile
            self._writes_refused += 1
            self._end_write(job, False)
            return
        claim = self._index.claim(self.config.recycle_files)
        if claim is None:
            self._dropped += 1
            self._end_write(job, False)
            return
        job.holds_room = True
        job.victim, evicted = claim
        unlinks = self._remove_files(evicted)
        if job.attempt and unlinks:
            # A retry after ENOSPC needs the space they free (they never raise).
            freed = asyncio.gather(*unlinks, return_exceptions=True)
            freed.add_done_callback(lambda _: self._io_slots.take(job, self._write_slot))
        else:
            self._io_slots.take(job, self._write_slot)

    def _write_slot(self, job: Job, slot: int) -> None:
        assert isinstance(job, WriteJob) and self._slots is not None and self._io is not None
        try:
            assert job.page is not None
            pack_header(self._slots.views[slot], self.layout, job.key, job.checksum)
            dir_fd, final = self._where(job.key)
            if job.victim is None:
                self._io.start_publish(dir_fd, self._temp(job.key), final, slot, job.page, self.config.sync_writes,
                                       functools.partial(self._written, job))
                return
            # The victim's file is overwritten under its name, then renamed to ``final``: a new
            # write of the victim's key waits until it left the name.
            job.moved = asyncio.get_running_loop().create_future()
            self._moving[job.victim] = job.moved
            self._io.start_recycle(*self._where(job.victim), dir_fd, final, slot, job.page,
                                   self.config.sync_writes, functools.partial(self._recycled_done, job))
        except Exception:
            self._victim_moved(job)
            self._write_failed(job, None)

    def _victim_moved(self, job: WriteJob) -> None:
        moved = job.moved
        if moved is None:
            return
        job.moved = None
        moved.set_result(None)
        assert job.victim is not None
        if self._moving.get(job.victim) is moved:
            del self._moving[job.victim]

    def _recycled_done(self, job: WriteJob, error: BaseException | None, taken: bool) -> None:
        """The victim's file was taken over (``taken``) and written, or not taken: gone (a new file
        instead), not ours (counted, unlinked, a new file instead) or a fault."""
        try:
            victim = job.victim
            assert victim is not None and self._io is not None and job.page is not None
            self._victim_moved(job)
            if taken:
                self._recycled += 1
            if error is None or taken:
                self._written(job, error)
                return
            if isinstance(error, UnsafeFileError):
                self._faults.count(error, "recycle")
                self._unlink_later(victim)  # a planted name: removed (unlink never follows it)
            elif not isinstance(error, FileNotFoundError):
                if not (isinstance(error, OSError) and error.errno == errno.EROFS):
                    self._unlink_later(victim)  # out of the index already: do not orphan its file
                self._write_failed(job, error)
                return
            job.victim = None
            self._write_slot(job, job.slot)  # still holding the slot: a new file in its place
        except Exception:
            self._write_bug(job)

    def _written(self, job: WriteJob, error: BaseException | None) -> None:
        self._return_slot(job)
        if error is not None:
            self._write_failed(job, error)
            return
        try:
            self._end_write(job, True)
        except Exception:  # never left unended: its caller and close() wait for the end
            self._write_bug(job)

    def _write_failed(self, job: WriteJob, error: BaseException | None) -> None:
        """A write that held room failed: the room goes back; ENOSPC tries again (bounded)."""
        self._return_slot(job)
        self._give_room_back(job)
        if not isinstance(error, OSError):
            self._write_bug(job)
            return
        if self._count_write_fault(error) and job.attempt < self.config.enospc_retries:
            job.attempt += 1
            self._spawn_write_later(job, refresh=True)
        else:
            self._end_write(job, False)

    def _give_room_back(self, job: WriteJob) -> None:
        """The room ``job`` claimed goes back, if it still holds it (idempotent)."""
        if job.holds_room:
            job.holds_room = False
            self._index.give_back()

    def _write_bug(self, job: WriteJob) -> None:
        """An unexpected failure (a bug): counted and logged; the job ends, its room and slot given
        back (it may still wait for a slot: it leaves the queue)."""
        self._io_slots.leave(job)
        self._return_slot(job)
        self._give_room_back(job)
        self._faults.unexpected("write")
        if not job.ended:
            self._end_write(job, False)

    def _count_write_fault(self, exc: OSError) -> bool:
        """Count a write's fault; True when it is the file system saying it is full."""
        self._faults.count(exc, "write")
        if exc.errno == errno.EROFS:
            self._enter_read_only(ReadOnly.FILE_SYSTEM)
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)

    def _end_write(self, job: WriteJob, stored: bool) -> None:
        key = job.key
        if job.ref is not None:
            self._release(job.ref)
        self._writing.pop(key, None)
        if stored and key in self._delete_after_write:
            stored = False
            self._unlink_later(key)
        if stored:
            job.holds_room = False  # the file's now
            self._index.add(key)
            self._writes += 1
            self._bytes_written += self._file_bytes
        self._give_room_back(job)
        self._delete_after_write.discard(key)
        for waiter in job.waiters:
            if not waiter.done():
                waiter.set_result(stored)
        self._job_ended(job)

    def _where(self, key: PageKey) -> tuple[int, str]:
        """The directory descriptor and name of ``key``'s page file: its fan-out directory's, or the
        layout directory's (with the fan-out prefix) where that could not be opened at start."""
        assert self._dir is not None
        fanout = self._dir.fanout[key[0]]
        if fanout >= 0:
            return fanout, self.files.name(key)
        return self._dir.dir_fd, self.files.rel(key)

    def _temp(self, key: PageKey) -> str:
        """A fresh temporary name beside ``key``'s final one, relative to :meth:`_where`'s directory:
        start-up removes leftover temporaries only inside fan-out directories."""
        assert self._dir is not None
        return self.files.temp_name(key) if self._dir.fanout[key[0]] >= 0 else self.files.temp_rel(key)

    # -- read -----------------------------------------------------------------------------------

    async def read(self, key: PageKey, handle: PageHandle) -> bool:
        """Fill the RESERVED page of ``handle`` with ``key``'s page file.

        True only when header and checksum verified; False is a miss (absent; corrupt — the file
        is deleted and counted; or an I/O fault, counted). On False the page bytes are undefined:
        abort the reservation. Raises ``TypeError``/``ValueError`` for a wrong key or a handle that
        is not a live reservation. If cancelled with I/O in flight it waits for that I/O to finish
        before raising ``CancelledError``, so the caller may abort the page at once.
        """
        check_key(key)
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
        check_key(key)
        self._check_started()
        page = self._external(buffer, writable=True)
        try:
            return await self._read(key, page)
        finally:
            page.release()  # the job ended: nothing touches the buffer any more

    async def _read(self, key: PageKey, page: PageBuffer) -> bool:
        generation = self._index.generation(key)
        if generation is None or not self._accepting:
            self._misses += 1
            return False
        self._index.touch(key)
        job = ReadJob(key, page, generation, asyncio.get_running_loop().create_future())
        self._job_started()
        self._io_slots.take(job, self._read_slot)
        try:
            return await job.result
        except asyncio.CancelledError:
            if not self._cancel_waiting(job):
                await job.wait_ended()  # the kernel (or a thread) may still write into the page
            raise

    def _read_slot(self, job: Job, slot: int) -> None:
        assert isinstance(job, ReadJob) and self._io is not None
        self._reads += 1
        self._index.readers[job.key] += 1
        try:
            self._io.start_load(*self._where(job.key), slot, job.page, functools.partial(self._read_loaded, job))
        except Exception:
            self._read_unreader(job.key)
            self._return_slot(job)
            self._faults.unexpected("read")
            self._end_read(job, False)

    def _read_unreader(self, key: PageKey) -> None:
        readers = self._index.readers
        readers[key] -= 1
        if not readers[key]:
            del readers[key]

    def _read_loaded(self, job: ReadJob, got: int | BaseException) -> None:
        assert self._slots is not None and self._checksums is not None
        key, generation = job.key, job.generation
        self._read_unreader(key)
        try:
            if isinstance(got, BaseException):
                self._return_slot(job)
                self._read_fault(job, got)
                return
            if got != self._file_bytes:
                self._return_slot(job)
                self._reject(key, generation, f"truncated ({got} of {self._file_bytes} bytes)")
                self._end_read(job, False)
                return
            header = parse_header(self._slots.views[job.slot], self.layout, key)
            self._return_slot(job)  # the header is parsed: the slot may go on before the payload hash
            if not isinstance(header, PageHeader):
                self._reject(key, generation, header.value)
                self._end_read(job, False)
                return
            job.checksum = header.checksum
            self._checksums.start(job.page.payload, functools.partial(self._read_hashed, job))
        except Exception:  # the slot back and the job ended on every path: later I/O must not hang
            self._return_slot(job)
            self._faults.unexpected("read")
            if not job.ended:
                self._end_read(job, False)

    def _read_fault(self, job: ReadJob, exc: BaseException) -> None:
        if isinstance(exc, FileNotFoundError):
            self._forget(job.key, job.generation)  # removed behind our back
        elif isinstance(exc, UnsafeFileError):  # planted: nothing was read through it
            self._faults.count(exc, "read")
            if self._index.generation(job.key) == job.generation:
                self._drop(job.key)
        elif isinstance(exc, OSError):
            self._faults.count(exc, "read")
        else:
            self._faults.unexpected("read")
        self._end_read(job, False)

    def _read_hashed(self, job: ReadJob, checksum: int | BaseException) -> None:
        try:
            if isinstance(checksum, BaseException):
                self._faults.unexpected("read")
                self._end_read(job, False)
            elif checksum != job.checksum:
                self._reject(job.key, job.generation, "payload checksum mismatch")
                self._end_read(job, False)
            else:
                self._bytes_read += self._file_bytes
                self._end_read(job, True)
        except Exception:  # never left unended: its caller and close() wait for the end
            self._faults.unexpected("read")
            if not job.ended:
                self._end_read(job, False)

    def _end_read(self, job: ReadJob, ok: bool) -> None:
        if ok:
            self._hits += 1
        else:
            self._misses += 1
        if not job.result.done():
            job.result.set_result(ok)
        self._job_ended(job)

    def _cancel_waiting(self, job: ReadJob) -> bool:
        """A cancelled read still waiting for a slot ends at once (nothing was read); True then."""
        if job.ended or not self._io_slots.leave(job):
            return job.ended
        self._misses += 1
        self._job_ended(job)
        return True

    # -- delete ---------------------------------------------------------------------------------

    async def delete(self, key: PageKey) -> None:
        """Remove ``key``'s page file (a write in flight for it is discarded when it lands)."""
        check_key(key)
        if key in self._writing:
            self._delete_after_write.add(key)
        if key in self._index and self._io is not None:
            unlink = self._drop(key)
            if unlink is not None:
                await asyncio.shield(unlink)

    # -- write-behind ---------------------------------------------------------------------------

    def write_behind_nowait(self, key: PageKey, handle: PageHandle) -> bool:
        """Queue ``handle``'s page for writing and take ownership of that reference (released after
        the write completes or is dropped). False — ownership not taken — when the queue is full,
        the tier is not accepting work, or it is read-only (counted in ``writes_refused``; see
        :attr:`read_only`). Raises ``TypeError``/``ValueError`` for caller mistakes."""
        check_key(key)
        self._check_ready(handle)
        if not self._accepting or self._queue is None:
            return False
        if self._read_only is not None and key not in self._index:
            self._writes_refused += 1
            return False
        return self._queue.put_nowait(key, handle)

    async def write_behind(self, key: PageKey, handle: PageHandle) -> None:
        """Wait for room in the write-behind queue, then as :meth:`write_behind_nowait` (ownership
        is taken only when this returns; a read-only tier refuses the write when the queue gets to
        it, counted). Raises ``RuntimeError`` when the tier is closed."""
        check_key(key)
        self._check_ready(handle)
        if not self._accepting or self._queue is None:
            raise RuntimeError("disk tier is not accepting writes (not started or closing)")
        await self._queue.put(key, handle)

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
        return DiskStatistics(
            backend=io.kind if io is not None else DiskBackend.AUTO,
            direct_io=io.direct if io is not None else False,
            pages=len(self._index),
            bytes_stored=self._index.used,
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
            in_flight=self._io_slots.in_use,
            evictions=self._index.evictions,
            recycled=self._recycled,
            temp_files_removed=self._temp_removed,
            effective_capacity_bytes=self._index.capacity,
            read_only=self._read_only,
            writes_refused=self._writes_refused,
            skipped_at_scan=self._skipped,
            buffered_fallbacks=self._buffered_fallbacks,
            memory_unregistered=self._memory_unregistered,
        )

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

    # -- callers' memory -----------------------------------------------------------------------

    async def register_memory(self, buffer: memoryview) -> None:
        """Register a caller's region (e.g. an engine's shared CPU memory, C-contiguous, writable)
        so that :meth:`write_from`/:meth:`read_into` of pages inside it use io_uring fixed buffers.

        Pinning runs in a thread (~20 ms/GiB of touched memory); the region must stay mapped until
        the tier is closed (the kernel holds its pages pinned; the tier keeps ``buffer``). Where it
        cannot be registered (threads backend, forced ``URING_FIXED``, memlock, table full) pages
        inside it move through plain buffers: counted in ``memory_unregistered``, never an error.
        O_DIRECT does not depend on this: it is used for every caller page whose address is
        4096-aligned (others go buffered, counted in ``buffered_fallbacks``). Pinning goes in
        pieces (64 MiB); a cancelled call, or :meth:`aclose`, stops it after the piece in progress
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
        if not await self._io.register_memory(view, buffer_address(view)):
            self._memory_unregistered += 1

    def _external(self, buffer: memoryview, writable: bool) -> PageBuffer:
        """A caller's page buffer, checked (``TypeError``/``ValueError`` before any state change)."""
        if not isinstance(buffer, memoryview):
            raise TypeError(f"buffer must be a memoryview, got {type(buffer).__name__}")
        check_buffer(buffer, self.layout.page_bytes, writable)
        view = buffer.cast("B")
        page = PageBuffer(buffer_address(view), view, self._payload_bytes)
        if not page.aligned and self._io is not None and self._io.direct:
            self._buffered_fallbacks += 1  # O_DIRECT needs aligned memory: this one goes buffered
        return page

    def _source(self, job: WriteJob) -> PageBuffer:
        """Where ``job``'s bytes are: the caller's buffer, or its pool page (checked: still live)."""
        if job.buffer is not None:
            return job.buffer
        assert job.ref is not None
        page = self.pool.table.check(job.ref)
        return PageBuffer(self.pool.memory.page_address(page), self.pool.memory.page_view(page), self._payload_bytes)

    # -- internals ------------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.create_task(coro)
        self._jobs.add(task)
        task.add_done_callback(self._jobs.discard)
        return task

    def _return_slot(self, job: Job) -> None:
        """Give ``job``'s I/O slot back if it still holds it (idempotent: every path may call it)."""
        self._io_slots.give_back(job)

    def _job_started(self) -> None:
        self._active += 1

    def _job_ended(self, job: Job) -> None:
        job.end()
        self._active -= 1
        if not self._active and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def _remove_files(self, keys: list[PageKey]) -> list[asyncio.Task[None]]:
        """Unlink the files of keys evicted from the index (nothing when read-only)."""
        return [task for key in keys if (task := self._unlink_later(key)) is not None]

    # -- free space -----------------------------------------------------------------------------

    def _space_recheck_due(self) -> bool:
        return (self._index.capacity < self._index.budget and
                asyncio.get_running_loop().time() - self._space_checked >= self.config.free_space_recheck_s)

    async def _recheck_space(self) -> None:
        # While the file system limits the tier below its budget, look again now and then: others
        # may have freed space.
        if self._index.capacity >= self._index.budget:
            return
        if asyncio.get_running_loop().time() - self._space_checked >= self.config.free_space_recheck_s:
            await self._refresh_space(after_enospc=False)

    async def _refresh_space(self, after_enospc: bool) -> None:
        assert self._dir is not None
        self._space_checked = asyncio.get_running_loop().time()
        try:
            space = await asyncio.to_thread(free_space, self._dir.dir_fd)
        except OSError as exc:
            self._faults.count(exc, "statvfs")
            return
        if space.read_only:
            self._enter_read_only(ReadOnly.FILE_SYSTEM)
        self._index.set_capacity(space, after_enospc)

    def _enter_read_only(self, reason: ReadOnly) -> None:
        if self._read_only is None:
            self._read_only = reason
            log.warning("disk tier: %s became read-only (%s): serving its %d pages, refusing writes",
                        self.files.layout_dir, reason.value, len(self._index))

    # -- index ----------------------------------------------------------------------------------

    def _forget(self, key: PageKey, generation: int) -> None:
        self._index.forget(key, generation)

    def _reject(self, key: PageKey, generation: int, why: str) -> None:
        """A page file that failed verification: counted, out of the index, deleted unless the tier
        is read-only (another cache may own it, or nothing may be deleted here). The first one is
        logged, saying which of these happened."""
        self._corrupt += 1
        now = self._index.generation(key)
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

    def _unlink_later(self, key: PageKey) -> asyncio.Task[None] | None:
        if self._read_only is not None:
            return None
        previous = self._moving.get(key)

        async def unlink() -> None:
            try:
                if previous is not None:
                    await asyncio.wait({previous})
                assert self._io is not None
                await self._io.unlink(*self._where(key))
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._faults.count(exc, "unlink")
                if exc.errno == errno.EROFS:
                    self._enter_read_only(ReadOnly.FILE_SYSTEM)
            finally:
                if self._moving.get(key) is task:
                    del self._moving[key]

        task = self._spawn(unlink())
        self._moving[key] = task
        return task

    def _refuse(self) -> bool:
        self._dropped += 1
        return False

    def _check_started(self) -> None:
        if self._io is None and self._close_task is None:
            raise RuntimeError("disk tier not started: call start() or use async with")

    def _check_ready(self, handle: PageHandle) -> int:
        self._check_started()
        return check_ready(self.pool, handle)

    def _check_reserved(self, handle: PageHandle) -> int:
        self._check_started()
        return check_reserved(self.pool, handle)

    def _retain(self, handle: PageHandle) -> PageHandle:
        self._check_ready(handle)
        return self.pool.table.retain(handle)

    def _release(self, handle: PageHandle) -> None:
        try:
            self.pool.table.release(handle)
        except StaleHandleError:
            log.exception("disk tier: page reference already released")


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


def _start_then_prepare(checksums: Checksums, files: PageFiles, owned: list[int]) -> Prepared:
    """In a worker thread: start the checksum threads, then :func:`prepare` the directory (from the
    descriptor in ``owned``, taken over here, or by its path when ``owned`` is empty)."""
    root_fd = owned.pop() if owned else None
    try:
        checksums.start_threads()
    except BaseException:
        if root_fd is not None:
            os.close(root_fd)
        raise
    return prepare(files, root_fd)


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
