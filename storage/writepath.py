"""The write path of the disk tier: a page job moved on by completion callbacks.

A write hashes its payload first (holding no I/O slot or room meanwhile), then claims room (a
spare file and its room, or room evicting or recycling least recently used files), takes an I/O
slot and publishes: a spare file or a recycled one (overwritten under its own name, renamed), or a
new file (temporary name, renamed). Only the rare waits — a rename or unlink of the key in flight,
a due free-space check, an ENOSPC retry — take a coroutine. Every path ends the job exactly once
(:meth:`WritePath._end_write`).

A KeyboardInterrupt (a signal) raised in a step of the job ends it as a counted fault
(:meth:`WritePath._write_settle`) unless the step had handed it on — a completion it waits for
(:attr:`~.jobs.Job.step`: the checksum, the backend, a refill or its retry task) or the slot queue —
and the interrupt goes on.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import os

from aiokv.keys import PageKey
from aiokv.pagetable import PageHandle

from .config import ReadOnly
from .jobs import Job, WriteJob
from .layoutdir import file_identity
from .memory import PageBuffer
from .pagefile import pack_header
from .safefiles import UnsafeFileError
from .spares import Made, Spare
from .tierbase import DELETE_TIME_BITS, STORED_SINCE_DELETE, TierBase
from .uring import not_started

_NO_NEW_FILE = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT})
"""Faults of a recycle's victim that fail the write rather than send it to a new file: read-only
(the tier switches), or the file system full (evict and retry, bounded)."""


class WritePath(TierBase):
    """Writes of the disk tier (see the module docstring); :class:`~.disk.DiskTier` calls them."""

    async def _write_owned(self, key: PageKey, ref: PageHandle) -> bool:
        # Takes ownership of ``ref``: released by the job (or by _join_write when nothing is to do).
        try:
            joined = self._join_write(key, ref, None)
        except BaseException as exc:
            if not isinstance(exc, Exception) and not_started(self._join_write, exc):
                self._release(ref)  # (a signal's KeyboardInterrupt before the write took it)
            raise
        if isinstance(joined, bool):
            return joined
        # The caller's own future: cancelling it leaves the job (and other writers of the key) alone.
        return await joined[1]

    def _join_write(self, key: PageKey, ref: PageHandle | None,
                    page: PageBuffer | None) -> bool | tuple[WriteJob, asyncio.Future[bool]]:
        """Start a write of ``key`` from ``ref`` or ``page``, or join the one in flight; the job and
        this caller's future, or the answer when there is nothing to write. ``ref`` is taken from
        the call's start: the job's, or released here (also after an interrupt)."""
        owned = ref
        job: WriteJob | None = None
        created = False
        try:
            if key in self._index:
                self._index.touch(key)
                if ref is not None:
                    self._release(ref)
                    owned = None  # (released: an inline return, no call before this)
                return True
            if self._read_only is not None:
                self._writes_refused += 1
                if ref is not None:
                    self._release(ref)
                    owned = None
                return False
            waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            job = self._writing.get(key)
            if job is None:
                job = WriteJob(key, ref, page)
                job.waiters.append(waiter)  # before the start: a write dropped for room ends right there
                # Registered, counted and given the reference in one block without a call (a
                # signal's exception comes at calls).
                self._writing[key] = job
                self._active += 1  # _job_started, inline
                owned = None
                created = True
                self._start_write(job)
            else:
                job.waiters.append(waiter)
                if ref is not None:
                    self._release(ref)
                    owned = None
            return job, waiter
        except BaseException as exc:
            if not isinstance(exc, Exception):
                if owned is not None:
                    self._release(owned)
                elif created and job is not None and not_started(self._start_write, exc):
                    self._write_settle(job)
            raise

    def _start_write(self, job: WriteJob) -> None:
        """Hash the payload first (holding no I/O slot or room meanwhile), then claim room, take a
        slot and publish, all moved on by completion callbacks. Only the rare waits — a rename or
        unlink of the key in flight, a due free-space check, an ENOSPC retry — take a coroutine."""
        assert self._checksums is not None
        start = self._checksums.start
        step = -1  # the hash's hand-off (none yet)
        try:
            job.page = self._source(job)
            payload = job.page.payload
            step = job.step = job.handoffs = job.handoffs + 1
            start(payload, functools.partial(self._write_hashed, job, step), writing=True)
        except Exception:
            job.step = 0
            self._write_bug(job)
        except BaseException as exc:
            if job.step == step and not_started(start, exc):
                job.step = 0
            self._write_rescue(job)
            raise

    def _write_hashed(self, job: WriteJob, step: int, checksum: int | BaseException) -> None:
        if job.step != step:
            return  # delivered again after an interrupt (its deliverer could not tell): it ran
        job.step = 0
        try:
            if isinstance(checksum, BaseException):
                if isinstance(checksum, OSError):  # the hash was interrupted before it started
                    self._faults.count(checksum, "write")
                    self._end_write(job, False)
                    return
                raise checksum
            job.checksum = checksum
            if job.key in self._moving or self._space_recheck_due():
                self._spawn_write_later(job, refresh=False)
            else:
                self._claim(job)
        except Exception:
            self._write_bug(job)
        except BaseException:
            self._write_rescue(job)
            raise

    async def _write_later(self, job: WriteJob, refresh: bool) -> None:
        """Look at the free space again (``refresh``: the file system just said it is full), wait
        for a rename or unlink of the key in flight, then go on by callbacks."""
        job.step = 0  # the task has the job (at its start: an interrupt before, and _write_later_done ends it)
        try:
            if refresh:
                await self._refresh_space(after_enospc=True)
            else:
                await self._recheck_space()
            # An old rename or unlink must not remove the new file; one may follow another (a
            # failed recycle unlinks its victim's name once the recycle is done): wait for all.
            while (moving := self._moving.get(job.key)) is not None:
                await asyncio.wait({moving})
            self._claim(job)
        except Exception:
            self._write_bug(job)
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):  # (a signal's KeyboardInterrupt)
                self._write_rescue(job)
            raise

    def _spawn_write_later(self, job: WriteJob, refresh: bool) -> None:
        """:meth:`_write_later` in a task of its own, which has the job (a hand-off until it starts)."""
        coro = self._write_later(job, refresh)
        step = job.handoffs + 1
        done = functools.partial(self._write_later_done, job, step)
        job.step = job.handoffs = step  # after the partial's call, where an interrupt may come
        task: asyncio.Task[None] | None = None
        try:
            task = self._spawn(coro)
            task.add_done_callback(done)
        except BaseException as exc:
            if not isinstance(exc, Exception):  # (a signal's KeyboardInterrupt)
                if task is not None:
                    task.add_done_callback(done)  # maybe twice: it ends the job once
                elif not_started(self._spawn, exc):
                    job.step = 0  # never spawned: the caller's guard ends the job
                    coro.close()
            raise

    def _write_later_done(self, job: WriteJob, step: int, task: asyncio.Task[None]) -> None:
        # Cancelled (its loop is going away; maybe before its first step) or a BaseException: the
        # job holds no room or slot while it awaits (both are taken in ``_claim``, which never
        # awaits), so it ends unstored unless the task handed it on before (an interrupt in
        # ``_claim``, which settles or hands it on itself); its callers and ``aclose`` wait for that end.
        try:
            if job.ended or not (task.cancelled() or task.exception() is not None):
                return
            if job.step == step:
                job.step = 0  # it never started
            if not job.step and not self._io_slots.waits(job):
                self._end_write(job, False)
        except BaseException:
            # (a signal's KeyboardInterrupt) looked at again in the next turn (idempotent)
            asyncio.get_running_loop().call_soon(self._write_later_done, job, step, task)
            raise

    def _claim(self, job: WriteJob) -> None:
        """Room for the file (a spare file, or evicting least recently used files, or recycling
        one), then a slot."""
        try:
            if self._read_only is not None:  # became read-only meanwhile
                self._writes_refused += 1
                self._end_write(job, False)
                return
            if self._take_spare(job):
                self._io_slots.take(job, self._write_slot)
                return
            index, refill = self._index, self._refill
            if refill is not None and index.used + index.file_bytes > index.capacity:
                # The only free room is held by spares being made: take one of them when they land
                # rather than evict a page (they are made into free room, never at a page's cost).
                step = job.handoffs + 1
                done = functools.partial(self._claim_after_refill, job, step)
                job.step = job.handoffs = step  # no call before the callback's: an interrupt after it finds it added
                refill.add_done_callback(done)
                return
            claim = self._index.claim(self.config.recycle_files)
            if claim is None:
                self._dropped += 1
                self._end_write(job, False)
                return
            job.holds_room = True
            job.victim, evicted = claim
            if job.victim is not None:
                # Out of the index from now on: a new write of the victim's key must wait until the
                # recycle left the name (it may wait for a slot first), not publish a file it overwrites.
                job.moved = asyncio.get_running_loop().create_future()
                self._moving[job.victim] = job.moved
            unlinks = self._remove_files(evicted)
            if unlinks and (job.attempt or (job.victim is None and self._short_of_room())):
                # The write needs the room they free (they never raise): a retry after ENOSPC, or a
                # new file on a file system the tier knows nearly full (a recycle overwrites its
                # victim's blocks). Else it goes at once: a budget-bounded tier on a roomy file
                # system never waits for its unlinks.
                freed = asyncio.gather(*unlinks, return_exceptions=True)
                step = job.handoffs + 1
                done = functools.partial(self._claim_after_unlinks, job, step)
                job.step = job.handoffs = step
                freed.add_done_callback(done)
            else:
                self._io_slots.take(job, self._write_slot)
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self._write_rescue(job)
            raise

    def _short_of_room(self) -> bool:
        """Whether the file system, as far as the tier knows, would keep less than one file's bytes
        free once this claim's file is written (in ``used`` already) if no unlink in flight of a
        file out of ``used`` had landed (an eviction's, a delete's, a failed recycle's victim's),
        and the tier's new files in flight at the last look took their blocks
        (:meth:`~.index.PageIndex.free_bytes`). Then such an unlink landing after the new file took
        its blocks would cost it an ENOSPC and a second eviction (a page lost), and the room it
        frees would stay unused until the next free-space check. One file of margin: the estimate
        counts file sizes, not blocks and metadata."""
        index = self._index
        size = index.file_bytes
        if index.free_bytes() - self._unfreed_files * size >= size:
            return False
        self._short_seen = True  # the free space looked at again when due (others may have freed some)
        return True

    def _claim_after_unlinks(self, job: WriteJob, step: int, _: asyncio.Future[list[object]]) -> None:
        if job.step != step:
            return
        job.step = 0
        try:
            self._io_slots.take(job, self._write_slot)
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self._write_rescue(job)
            raise

    def _claim_after_refill(self, job: WriteJob, step: int, _: asyncio.Future[Made]) -> None:
        # After the batch's own callback put its spares into stock (callbacks run in order).
        if job.step != step:
            return
        job.step = 0
        try:
            if job.key in self._moving:
                self._spawn_write_later(job, refresh=False)
            else:
                self._claim(job)
        except Exception:
            self._write_bug(job)
        except BaseException:
            self._write_rescue(job)
            raise

    def _write_slot(self, job: Job, slot: int) -> None:
        start: object = None
        step = -1  # the write's hand-off (none yet)
        # The backend's start is a plain call (no *args): Python checks for signals as a call it
        # does not inline returns, and an interrupt after the write was handed over must not look
        # like one before it (not_started below).
        try:
            assert isinstance(job, WriteJob)
            io = self._io
            assert job.page is not None and self._slots is not None and io is not None
            pack_header(self._slots.views[slot], self.layout, job.key, job.checksum)
            spare = self._spare_of.get(job)
            try:
                dir_fd, final = self._where(job.key)
                victim_at = None if job.victim is None or spare is not None else self._where(job.victim)
                job.dir_fd = dir_fd
            except OSError as exc:
                # A fan-out directory (the page's or its victim's) that cannot be opened (safely)
                # now: a counted fault of this write, as a read counts it (ENOENT: deleted; a
                # symlink planted there: UNSAFE), not a bug's traceback per write.
                self._write_failed(job, exc)
                return
            sync = self.config.sync_writes
            if spare is not None:
                # As a recycled file: overwritten under its own name, then renamed to ``final``.
                start = recycle = io.start_recycle
                step = job.step = job.handoffs = job.handoffs + 1
                done = functools.partial(self._spare_done, job, step, spare)
                recycle(spare.dir_fd, spare.name, dir_fd, final, slot, job.page, sync, done)
                del self._spare_of[job]  # the backend's now (it removes the name on a fault)
                return
            if job.victim is None:
                temp = self._temp(job.key)
                start = publish = io.start_publish
                step = job.step = job.handoffs = job.handoffs + 1
                written = functools.partial(self._written, job, step)
                publish(dir_fd, temp, final, slot, job.page, sync, written)
                return
            # The victim's file is overwritten under its name, then renamed to ``final``: a new
            # write of the victim's key waits (on ``job.moved``, set by ``_claim``) until it left the name.
            assert victim_at is not None
            victim_dir, victim = victim_at
            start = recycle = io.start_recycle
            step = job.step = job.handoffs = job.handoffs + 1
            done = functools.partial(self._recycled_done, job, step)
            recycle(victim_dir, victim, dir_fd, final, slot, job.page, sync, done)
        except Exception:
            assert isinstance(job, WriteJob)
            job.step = 0
            self._write_failed(job, None)  # frees the victim's name (its file unlinked: never taken)
        except BaseException as exc:
            if not isinstance(job, WriteJob):
                raise
            if job.step == step and not not_started(start, exc):  # type: ignore[arg-type]
                self._spare_of.pop(job, None)  # the backend has the write (and a spare's name)
            else:
                job.step = 0
                self._write_settle(job)
            raise

    def _victim_moved(self, job: WriteJob, unlink: bool = False) -> None:
        """The victim's name is free for a new write of its key (idempotent: every exit calls it).
        ``unlink``: the recycle ended without taking the file over, so it is removed first (out of
        the index already); the unlink registers before ``moved`` resolves, so a writer woken by it
        waits for the unlink too. ``moved`` is forgotten last: a run cut short by an interrupt is
        run again whole (a second unlink of the name finds nothing, or waits for the first)."""
        moved = job.moved
        if moved is None:
            return
        victim = job.victim
        assert victim is not None
        listing = self._listing.get(victim[0])
        if listing is not None:
            listing.add(victim)  # a listing in flight may have seen its file under the old name
        try:
            if unlink:
                self._unlink_later(victim)
        finally:
            if not moved.done():
                moved.set_result(None)
            if self._moving.get(victim) is moved:
                del self._moving[victim]
            job.moved = None

    def _recycled_done(self, job: WriteJob, step: int, error: BaseException | None, taken: bool) -> None:
        """The victim's file was taken over (``taken``) and written, or not taken: gone (a new file
        instead), not ours (counted, unlinked, a new file instead) or a fault of its open (EACCES,
        EIO: the same; EROFS, ENOSPC fail the write). Taken but gone by the rename (unlinked
        behind the tier after the open): a new file instead, nothing counted."""
        if job.step != step:
            return  # delivered again after an interrupt (its deliverer could not tell): it ran
        job.step = 0
        try:
            victim = job.victim
            assert victim is not None and self._io is not None and job.page is not None
            # ENOENT after the take-over is the rename's (writes, fsync and close never answer
            # it): the victim's name was unlinked under the overwrite, which wrote an orphaned
            # inode (the backend closed it). Not this write's fault: its page goes into a new file,
            # as when the open finds no file. (Its new fan-out directory removed answers ENOENT
            # too: the new file's create then fails, counted.)
            gone = isinstance(error, FileNotFoundError)
            # An unlink of the victim's name registers in ``_moving`` before ``moved`` resolves: a
            # writer of the victim's key woken by it then finds the unlink and waits for it too.
            unlink = None
            if taken and not gone:
                self._recycled += 1
            elif isinstance(error, UnsafeFileError):
                self._faults.count(error, "recycle")
                unlink = self._unlink_later(victim)  # a planted name: removed (unlink never follows it)
            elif (error is not None and (taken or not gone)
                  and not (isinstance(error, OSError) and error.errno == errno.EROFS)):
                # Out of the index already: do not orphan its file. (Taken and ENOENT: the name
                # unlinked, or the new name's directory removed, the victim's file left holding the
                # page: unlinked, ENOENT ignored.)
                unlink = self._unlink_later(victim)
            self._victim_moved(job)
            if error is None or (taken and not gone):
                self._publish_done(job, error)
                return
            if not isinstance(error, OSError) or error.errno in _NO_NEW_FILE:
                self._write_failed(job, error)
                return
            if not isinstance(error, (UnsafeFileError, FileNotFoundError)):
                # The victim's open failed (EACCES: made 0000 under the tier; EIO): counted, the
                # victim unlinked above, and the page goes into a new file (before: the write failed).
                self._faults.count(error, "recycle")
            job.victim = None
            self._new_file_instead(job, unlink)  # still holding the slot: a new file in its place
        except Exception:
            self._write_bug(job)
        except BaseException:
            self._write_rescue(job)
            raise

    def _spare_done(self, job: WriteJob, step: int, spare: Spare, error: BaseException | None,
                    taken: bool) -> None:
        """The spare was taken over (``taken``) and written, or not taken: then the job writes a
        new file in its place (still holding its slot and the spare's room); a name that still
        holds something is unlinked (never followed), a fault counted."""
        if job.step != step:
            return  # delivered again after an interrupt (its deliverer could not tell): it ran
        job.step = 0
        try:
            # Taken but ENOENT: the spare's name was unlinked under the overwrite (see
            # _recycled_done): not taken after all, a new file instead, nothing counted.
            if taken and not isinstance(error, FileNotFoundError):
                self._spares.taken += 1
                self._publish_done(job, error)
                return
            self._spares.not_taken += 1
            if isinstance(error, OSError) and error.errno == errno.EROFS:
                self._write_failed(job, error)  # counted; read-only from now on
                return
            if not isinstance(error, OSError):
                raise AssertionError(f"spare not taken without a fault: {error!r}")
            unlink = None
            if not isinstance(error, FileNotFoundError):
                self._faults.count(error, "spare")
                unlink = self._unlink_spare(spare)
            elif taken:
                # The rename's ENOENT: the spare's name unlinked, or the page's directory removed
                # (then the spare still holds the page under its name): unlinked, ENOENT ignored.
                unlink = self._unlink_spare(spare)
            self._new_file_instead(job, unlink)
        except Exception:
            self._write_bug(job)
        except BaseException:
            self._write_rescue(job)
            raise

    def _new_file_instead(self, job: WriteJob, unlink: asyncio.Task[None] | None) -> None:
        """``job``, holding its slot and room, writes a new file in place of the file it could not
        take over (a recycle's victim, a spare), whose unlink is ``unlink`` (counted in
        ``_unfreed_files``; None: none). The new file needs the blocks that unlink frees: where
        the file system is nearly full (:meth:`_short_of_room`) it waits for the unlink, its slot
        given back meanwhile (taken again after), as a first try that evicts. Review 261: it went
        at once, and the unlink landing after the new file took its blocks cost an ENOSPC and a
        page evicted for the retry."""
        if unlink is None or not self._short_of_room():
            self._write_slot(job, job.slot)
            return
        self._io_slots.give_back(job)
        freed = asyncio.gather(unlink, return_exceptions=True)
        step = job.handoffs + 1
        done = functools.partial(self._claim_after_unlinks, job, step)
        job.step = job.handoffs = step
        freed.add_done_callback(done)

    def _written(self, job: WriteJob, step: int, error: BaseException | None) -> None:
        """A new file published (``error`` None) or not: the backend's completion."""
        if job.step != step:
            return  # delivered again after an interrupt (its deliverer could not tell): it ran
        job.step = 0
        try:
            if isinstance(error, FileNotFoundError) and not job.remade:
                # The create or the rename in the page's fan-out directory: removed under the tier
                # (a cleanup's ``find -empty -delete``) and every later write of its keys failed.
                # Its descriptor is retired if so, and the write tried once more (bounded), still
                # holding its slot and room: into the directory opened (made) again, or refused
                # there (a symlink or a file in its place: UNSAFE), counted then.
                job.remade = True
                self._fanout_gone(job.key[0])
                self._write_slot(job, job.slot)
                return
            self._publish_done(job, error)
        except Exception:
            self._write_bug(job)
        except BaseException:
            self._write_rescue(job)
            raise

    def _publish_done(self, job: WriteJob, error: BaseException | None) -> None:
        self._io_slots.give_back(job)
        if error is not None:
            self._write_failed(job, error)
            return
        try:
            prepared = self._dir
            assert prepared is not None
            if prepared.fanout[job.key[0]] != job.dir_fd:
                # Its fan-out directory was retired while the backend wrote (moved out of the cache
                # or replaced: the writer's check): the file is in that directory, not under the
                # name. Not indexed (before: indexed until its first read missed), and removed from
                # there (nothing left outside the cache); not a fault of the write.
                self._unlink_later(job.key, (job.dir_fd, self.files.name(job.key)))
                self._end_write(job, False)
                return
            self._end_write(job, True)
        except Exception:  # never left unended: its caller and close() wait for the end
            self._write_bug(job)

    def _write_failed(self, job: WriteJob, error: BaseException | None) -> None:
        """A write that held room failed: the room goes back; ENOSPC tries again (bounded)."""
        self._io_slots.give_back(job)
        self._give_room_back(job)
        try:
            self._victim_moved(job, True)  # a retry may pick another victim: this one's name is free
        except Exception:
            error = None  # a bug: ended below
        if not isinstance(error, OSError):
            self._write_bug(job)
            return
        if self._count_write_fault(error) and job.attempt < self.config.enospc_retries:
            job.attempt += 1
            self._spawn_write_later(job, refresh=True)
        else:
            self._end_write(job, False)

    def _give_room_back(self, job: WriteJob) -> None:
        """The room ``job`` claimed goes back, if it still holds it, and a spare it took but never
        handed to the backend is removed. Idempotent, and each part is undone after it is done
        (no call between): run again after an interrupt, it finishes what is left."""
        spare = self._spare_of.get(job)
        if spare is not None:
            self._unlink_spare(spare)
            del self._spare_of[job]
        if job.holds_room:
            self._index.give_back()
            job.holds_room = False

    def _write_bug(self, job: WriteJob) -> None:
        """An unexpected failure (a bug): counted and logged; the job ends, its room and slot given
        back (it may still wait for a slot: it leaves the queue) and its victim's name freed (else
        a new write of that key, and ``aclose``, would wait for it forever)."""
        self._io_slots.leave(job)
        self._io_slots.give_back(job)
        self._give_room_back(job)
        self._faults.unexpected("write")
        try:
            self._victim_moved(job, True)  # resolves ``moved`` even if the unlink fails
        except Exception:
            self._faults.unexpected("write")
        if not job.ended:
            self._end_write(job, False)

    def _write_rescue(self, job: WriteJob) -> None:
        """After an interrupt (a signal's KeyboardInterrupt) in one of ``job``'s steps: ended now
        unless something still has it — a completion it waits for (``step``) or the slot queue
        (a slot it holds was given back or handed on by the step that had it)."""
        if not job.step and not self._io_slots.waits(job):
            self._write_settle(job)

    def _write_settle(self, job: WriteJob) -> None:
        """End ``job`` after an interrupt left it between steps: its slot and room go back, its
        victim's name is freed, it ends unstored as a counted fault; an end the interrupt cut short
        only finishes what is left. Idempotent."""
        job.step = 0
        self._io_slots.give_back(job)
        if not job.ended:
            self._count_interrupt("write")
        self._end_write(job, False)

    def _count_write_fault(self, exc: OSError) -> bool:
        """Count a write's fault; True when it is the file system saying it is full."""
        self._faults.count(exc, "write")
        if exc.errno == errno.EROFS:
            self._enter_read_only(ReadOnly.FILE_SYSTEM)
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)

    def _stored_since_delete(self, key: PageKey) -> None:
        """``key``, whose delete is remembered, was stored (its file published under its name):
        remember that file (:data:`STORED_SINCE_DELETE`), the only one of the key a later listing
        takes for its page. Not by time: a copy of the deleted page made after the delete (``cp``
        without ``-p``) is newer than it. One ``stat`` on the loop, of a name just published (in
        the lookup caches), for such keys only; where it fails, every file of the key stays the one
        deleted (a miss at worst)."""
        prepared = self._dir
        fd = -1 if prepared is None or prepared.lock_fd is None else prepared.fanout[key[0]]
        if fd < 0:
            # (No lock: a write in flight when it was lost ended now. The delete stays "a file no
            # newer than it" (:meth:`~.followpath.FollowPath._lose_lock`): the other writer may store
            # the key again, and its file must not count as the page deleted, review 194.)
            return
        try:
            st = os.stat(key.hex(), dir_fd=fd, follow_symlinks=False)
        except OSError:
            return
        deleted = self._deleted_away
        when = deleted[key]
        when = -1 - when if when < 0 else when & DELETE_TIME_BITS  # ... if stored since already
        deleted[key] = STORED_SINCE_DELETE + (file_identity(st.st_ino, st) << 64 | when)

    def _end_write(self, job: WriteJob, stored: bool) -> None:
        """``job`` ends, stored or not: its reference released, its room the file's or given back,
        its callers told, the tier's count of jobs down. Run again after an interrupt (with
        ``stored`` False), it finishes what is left: each part is marked done with no call after
        it (a signal's exception comes at calls), and a file already indexed stays."""
        key = job.key
        ref = job.ref
        if ref is not None:
            self._release(ref)
            job.ref = None
        if self._writing.get(key) is job:
            del self._writing[key]
        if stored and key in self._delete_after_write:
            stored = False
            self._unlink_later(key)
            self._write_discarded(key)
        adopt = False
        if key in self._listed_under_write:
            self._listed_under_write.discard(key)
            if not stored and key not in self._index:
                if (key in self._found_under_write and key not in self._delete_after_write
                        and self._found_still_kept(key)):
                    # A page a take-over's scan found (not one deleted) that this write, unstored,
                    # never replaced: indexed below (review 199: unlinked, a page lost).
                    adopt = True
                else:
                    self._unlink_later(key)  # the file a listing left to this write (02f53ee)
        self._found_under_write.discard(key)
        if stored and job.holds_room:
            self._index.add(key)
            job.holds_room = False  # the file's now
            if key in self._deleted_away:
                self._stored_since_delete(key)
            self._writes += 1
            self._bytes_written += self._file_bytes
        self._give_room_back(job)
        if adopt and key not in self._index:
            self._index.add_least_recent([key])
            if self._read_only is None:
                self._remove_files(self._index.evict_to(self._index.capacity))
        self._delete_after_write.discard(key)
        for waiter in job.waiters:
            if not waiter.done():
                waiter.set_result(stored)
        self._job_ended(job)
        self._victim_moved(job, True)  # (freed earlier on every path: never left pending)
