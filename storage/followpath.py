"""The loop's side of following a directory another cache holds (see :mod:`.follow`).

A tier that started ``ReadOnly.LOCKED`` with ``follow_interval_s`` > 0 runs one task that sleeps
that long, runs a look on a thread of its own (:func:`aiokv.pool.run_in_new_thread`: the loop never
waits for a thread to start or for the file system) and applies what it found: files gone out of
the index, files new since into it (most recently used), at most :data:`APPLY_PER_TURN` keys per
loop turn. Once a look took the lock, the tier switches to writing: the lock is the tier's,
leftover temporary files are gone (the look removed them), the budget is taken from the file
system, files refused while read-only are unlinked and the index is trimmed to the budget;
``read_only`` becomes None and ``took_over`` counts it. Writes refused before stay refused: nothing
was queued for later. Where the file system is read-only (or the directory not writable for us),
the tier keeps the lock and serves, and the looks go on, each asking whether it may write now; once
it may, the look scans as a take-over does and the tier switches then.

While following, a read refused by header or checksum is not counted at once: the writer may have
recycled the file under it. The next look tells (:func:`.follow.look`): ``follow_raced`` for a file
that changed since it was indexed, ``corrupt`` for one that did not.

While the tier holds the lock, a second task checks every ``follow_interval_s`` (on a thread:
:mod:`.lockwatch`) that ``.lock`` still names the file it holds: removed or replaced, the name is
taken again (``lock_retaken``), or, where another cache holds the new file, the tier stops writing
and follows it (``ReadOnly.LOCKED``, ``lock_lost``) until that cache lets go.

The close sets the look's stop flag and cancels the task, which waits for the look's thread (it
ends after the fan-out directory it is at) and closes what it opened, the lock included, before the
tier's descriptors are closed: no thread or descriptor is left, and no look uses a descriptor
number the close gave back.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from aiokv.keys import KEY_BYTES, PageKey
from aiokv.pool import run_in_new_thread

from .config import ReadOnly
from .follow import FollowState, Look, look
from .jobs import wait_uncancelled
from .layoutdir import FanoutListing, FollowSeed, file_identity, list_fanout
from .lockwatch import FanoutCheck, LockCheck, LockState, check_writer
from .memory import drop_cancel
from .pagefile import TEMP_PREFIX
from .spares import SPARE_PREFIX
from .tierbase import BULK_UNLINK_KEYS, DELETE_TIME_BITS, STORED_SINCE_DELETE, TierBase

log = logging.getLogger("aiokv.storage.disk")

T = TypeVar("T")

APPLY_PER_TURN = 4096
"""Index changes a look's result makes per loop turn (a directory of a million pages changes by at
most this much between two turns)."""

DELETED_KEPT = 65536
"""Keys deleted while their fan-out directory was away that the tier remembers one by one (beyond,
the oldest goes into :data:`FORGOTTEN_BITS`)."""

FORGOTTEN_BITS = 1 << 23
"""Bits (1 MiB, made at the first delete forgotten) of the filter that keeps deletes beyond
:data:`DELETED_KEPT`: a listing unlinks a file of a key the filter may hold (two bits of the key's
hash) that is no newer than the last delete forgotten in its fan-out directory. No growth; a false
positive (about 1 in 4,000 pages listed after 65,536 deletes forgotten, 1 in 22 after a million)
is a miss, never stale data."""

RELIST_DOUBLINGS = 6
"""A fan-out directory whose late listing keeps failing is listed again after 1, 2, 4, ... and at
most 2 ** this periodic checks (a directory that fails for good is not listed at every check)."""


class FollowPath(TierBase):
    """Following a locked directory (see the module docstring); :class:`~.disk.DiskTier` starts it."""

    # The following's own state beside :class:`TierBase`'s: defaults until a start follows.
    _follow_raced = 0
    """Refused reads of files that changed under them while following (``DiskStatistics.follow_raced``)."""
    _follow_held = False
    """This tier took the directory over where it may not write (a read-only file system...): it
    holds the lock and looks every ``follow_interval_s`` whether it may write now."""
    _follow_corrupt_logged = False
    """Whether the first file the looks found corrupt was logged."""
    _follow_withheld = 0
    """Indexed pages this follower stopped serving as a look could not read the writer's
    pending-delete record (``DiskStatistics.follow_withheld``)."""
    _follow_withholding = False
    """The last look applied withheld every page (:attr:`.follow.Look.withheld`)."""
    _record_stamp: tuple[int, int, int, int] | None = None
    """The pending-delete record's identity when the last lock check read it (:mod:`.lockwatch`)."""
    _record_applying: asyncio.Task[None] | None = None
    """The lock check's record being applied (:meth:`_apply_record_check`, in steps)."""
    _record_unknown: list[asyncio.Task[None]] | None = None
    """A take-over could not read the pending-delete record nor replace it (:attr:`.follow.Look.record_unknown`):
    the unlinks it started, which end before this tier replaces it (:meth:`_replace_unknown_record`)."""
    _follow_refused: dict[PageKey, int]
    """Keys whose file a read refused while following (-> reads), for the next look to tell why
    (:meth:`.follow.FollowState.refuse`); made by :meth:`_start_following`."""

    def _start_following(self, seed: FollowSeed | None) -> None:
        """Follow the directory when the start found it locked and following is on."""
        if seed is None or self._read_only is not ReadOnly.LOCKED or not self.config.follow_interval_s:
            return
        self._follow_refused = {}
        self._follow_state = FollowState(seed)
        self._follow_task = asyncio.get_running_loop().create_task(self._follow(self._follow_state))
        self._follow_task.add_done_callback(drop_cancel)

    def _look_soon(self) -> None:
        """The next look now rather than after ``follow_interval_s`` (after the one in progress, if
        any: the next look starts after this call)."""
        self._follow_ticker.soon()

    async def _stop_following(self) -> None:
        """At close: stop the look in progress, wait for its thread, close what it opened."""
        task = self._follow_task
        if task is None:
            return
        assert self._follow_state is not None
        self._follow_state.stop.set()
        await self._stop_task(task, "following")
        self._follow_state.close_ring()  # the looks' io_uring (.follow): no look runs now
        self._count_undecided()

    async def _stop_task(self, task: asyncio.Task[None], what: str) -> None:
        """Cancel ``task`` (the looks or the lock checks) and wait for it: its thread ends first.
        Its cancellation is retrieved as it ends (:func:`drop_cancel`, added at its start)."""
        task.cancel()
        await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:  # (a bug: never expected)
            log.error("disk tier: %s %s ended with %r", what, self.files.layout_dir, task.exception())

    async def _on_thread(self, work: Callable[[], T], name: str, close: Callable[[T], None], what: str,
                         stop: Callable[[], None] | None = None) -> T | None:
        """``work`` (a look or a lock check) on a thread of its own, so the loop never waits for the
        file system. A cancel (the close) calls ``stop`` (the look ends after the directory it is
        at), waits for the thread — it uses the tier's descriptors, never closed under it — and
        closes what it returned. None when it raised: a bug, counted as ``what``; the next one
        tries again."""
        job = run_in_new_thread(work, name, close)
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            if stop is not None:
                stop()
            await wait_uncancelled(job)
            if not job.cancelled() and job.exception() is None:
                close(job.result())
            raise
        except Exception:
            self._faults.unexpected(what)
            return None

    def _count_undecided(self) -> None:
        """Refused reads no look told about (the following ends: at the close, or the tier writes
        now and no writer may change its files): counted ``corrupt``, as a tier that does not
        follow counts them (once a file, as it does)."""
        undecided = self._follow_state.undecided() if self._follow_state is not None else set()
        self._corrupt += len(undecided | self._follow_refused.keys())
        self._follow_refused.clear()
        if self._follow_state is not None:
            self._follow_state.refused.clear()

    # -- reads refused while following ----------------------------------------------------------

    def _telling_refusals(self) -> bool:
        """Whether a refused read is for a look to tell about: while following a writer that may
        recycle or replace a file under the read."""
        return self._accepting and self._read_only is ReadOnly.LOCKED and self._follow_task is not None

    def _reject(self, key: PageKey, generation: int, why: str) -> None:
        """:meth:`TierBase._reject`, except while following: the writer may have recycled the file
        under the read (its overwrite under the old name, before the rename) or replaced it, which
        is no corruption. The file is out of the index and kept (not served) as there; whether it
        is counted ``corrupt`` (unchanged since it was indexed) or ``follow_raced`` (changed) the
        next look tells (:func:`.follow.look`), and indexes again what is under the name now."""
        if not self._telling_refusals():
            super()._reject(key, generation, why)
            return
        refused = self._follow_refused
        refused[key] = refused.get(key, 0) + 1
        self._refused.add(generation)  # a look or the end of following counts it: a late read never
        now = self._index.generation(key)
        if now == generation:
            self._drop(key)
        if not self._corrupt_logged:  # the first refusal, as TierBase logs it
            self._corrupt_logged = True
            fate = ("a newer file of the key replaced it meanwhile" if now is not None and now != generation else
                    f"kept, as the tier is read-only ({ReadOnly.LOCKED.value}), but no longer served; the next look "
                    "tells a file the other cache recycled under the read from a corrupt one")
            log.warning("disk tier: refusing page file %s: %s (%s; further ones counted only)", self.files.path(key),
                        why, fate)

    def _unlink_later(self, key: PageKey, at: tuple[int, str] | None = None) -> asyncio.Task[None] | None:
        """:meth:`TierBase._unlink_later`; while this tier holds the directory but may not write
        there (``_follow_held``), the file is unlinked once it may."""
        if self._follow_held and self._read_only is not None:
            if at is None:
                self._unlink_when_writable.add(key)
            return None
        return super()._unlink_later(key, at)

    async def _follow(self, state: FollowState) -> None:
        interval = self.config.follow_interval_s
        while self._following():
            await self._follow_ticker.wait(interval)
            if not self._following():
                return
            assert self._dir is not None
            self._follow_started += 1
            state.forget(self._follow_forgotten)  # no look runs now: the state is the loop's
            self._follow_forgotten.clear()
            state.refuse(self._follow_refused)
            self._follow_refused.clear()
            # The names of keys deleted here are examined whole: see look's ``whole`` (review 202).
            held_lock = self._dup_held_lock()
            try:
                work = functools.partial(look, state, self._dir.dir_fd, list(self._dir.fanout), self.files.layout_dir,
                                         self._follow_held, frozenset(self._unlink_when_writable), held_lock)
                found = await self._on_thread(work, "aiokv-disk-follow", Look.close, "a look at the directory",
                                              state.stop.set)
            finally:
                if held_lock is not None:
                    os.close(held_lock)  # the look's thread has ended (a cancel waits for it)
            if found is None:
                continue
            self._follow_looks += 1
            try:
                await self._apply_look(found)
            except Exception:  # a bug in applying it: counted; the next look goes on from its state
                self._faults.unexpected("applying a look at the directory")
            finally:
                found.close()  # what the tier did not take (all of it when cancelled: the lock too)

    def _dup_held_lock(self) -> int | None:
        """For a held look (``_follow_held``): a duplicate of the lock's descriptor the tier holds
        now, so that the look may replace a damaged record while ``.lock`` names that file
        (:func:`.follow._lock_still_ours`); the loop may let that descriptor go meanwhile (a lock
        check that took ``.lock`` again), the duplicate stays the look's. Review 229: the look
        asked for the file the take-over had locked, and after a ``lock_retaken`` never replaced
        the record. None (a fault counted where it cannot be made) when not held."""
        prepared = self._dir
        if not self._follow_held or prepared is None or prepared.lock_fd is None:
            return None
        try:
            return os.dup(prepared.lock_fd)
        except OSError as exc:  # EMFILE: a damaged record is left as it is by this look
            self._faults.count(exc, "duplicating the lock's descriptor")
            return None

    def _following(self) -> bool:
        """Whether the looks go on: another cache holds the directory, or this one took it over
        where it may not write yet."""
        return self._accepting and (self._read_only is ReadOnly.LOCKED or
                                    (self._follow_held and self._read_only is not None))

    async def _apply_look(self, found: Look) -> None:
        """Apply a look's result: faults counted, descriptors taken, the index changed in bounded
        steps; with the lock, the switch to writing."""
        prepared = self._dir
        assert prepared is not None
        for fault, what in found.faults:
            self._faults.count(fault, what)
        self._count_told(found)
        self._apply_recorded_deletes(found.deletes)
        fanout = prepared.fanout
        for index, fd in found.retired:
            if fanout[index] == fd:
                fanout[index] = -1  # reads of its keys are counted misses until it is opened again
                prepared.retired.append(fd)  # an operation in flight may still name a file through it
                self._fanouts_away.add(index)
        for index in list(found.opened):
            if fanout[index] < 0:
                fanout[index] = found.opened.pop(index)
        page_index = self._index
        removed = found.removed
        withheld = self._withhold(found)
        # A key deleted here whose name the look found empty (or its directory retired) has no file
        # left to unlink at the take-over: forgotten, so the set holds only names still on disk the
        # looks know (a long-lived follower's grew by one key a delete, for ever). Should the page
        # come back (its directory put back), the delete remembered names it again: _looked_deleted.
        unlink = self._unlink_when_writable
        for start in range(0, len(removed), APPLY_PER_TURN):
            if start:
                await asyncio.sleep(0)
                if not self._following():
                    return
            for key in removed[start : start + APPLY_PER_TURN]:
                unlink.discard(key)
                if key in page_index:
                    page_index.remove(key)
                    self._followed_out += 1
        for start in range(0, len(withheld), APPLY_PER_TURN):
            await asyncio.sleep(0)
            if not self._following():
                return
            for key in withheld[start : start + APPLY_PER_TURN]:
                if key in page_index:
                    page_index.remove(key)
                    self._follow_withheld += 1
        added = [] if found.withheld else found.added  # oldest first: the newest ends most recently used
        left: set[PageKey] = set()  # keys left to this tier's own write in flight
        for start in range(0, len(added), APPLY_PER_TURN):
            await asyncio.sleep(0)
            if not self._following():
                return
            # Asked at each step: the caller may delete a key this look found between two steps (its
            # first delete too), and that page must not be indexed (review 198).
            deletes = bool(self._deleted_away) or self._forgotten is not None
            for key in added[start : start + APPLY_PER_TURN]:
                if key in self._writing:
                    # This tier's own write, in flight when the lock was lost, published: its end
                    # decides (a write deleted meanwhile is discarded then: indexed here, it was
                    # served, review 198); its name examined again at the next look.
                    self._follow_forgotten.add(key)
                    left.add(key)
                elif key not in page_index and not (deletes and self._looked_deleted(key, found.mtimes[key])):
                    page_index.add_found(key)
                    self._followed_in += 1
                    unlink.discard(key)  # a newer page under the name: the one deleted is gone
        # A held look's ``writable`` (it scanned as a take-over does) counts only while the tier
        # still holds the lock: one lost while the look was on its thread (another cache holds
        # ``.lock`` now) made the tier write without it beside that cache (review 203). Its
        # listings are applied as any look's; the looks go on asking for the lock.
        if (found.lock_fd is not None or (found.writable and self._follow_held)) and self._following():
            self._take_lock_over(found, left)
        elif found.lock_not_ours and self._follow_held:
            self._check_lock_soon()  # taken again (the next look takes over) or lost (this tier follows)

    def _withhold(self, found: Look) -> list[PageKey]:
        """A look's :attr:`.follow.Look.withheld`: the keys indexed now, none of which is served
        until a look reads the writer's pending-delete record again (logged when it begins and
        ends)."""
        withheld = found.withheld
        if withheld == self._follow_withholding:
            return list(self._index) if withheld else []
        self._follow_withholding = withheld
        if found.lock_fd is not None or found.writable:
            return []  # a take-over: what it found is applied as any take-over's
        if withheld:
            log.error("disk tier: the pending-delete record %s of the cache that holds the directory cannot be read: "
                      "none of the %d pages indexed is served until it reads again", self.files.layout_dir / ".deletes",
                      len(self._index))
            return list(self._index)
        log.warning("disk tier: the pending-delete record %s reads again: the pages it does not name are served",
                    self.files.layout_dir / ".deletes")
        return []

    def _apply_recorded_deletes(self, deletes: dict[PageKey, int]) -> None:
        """The writer's pending-delete record as a look read it (:mod:`.deletelog`): deletes whose
        unlink failed there, the file maybe still on disk. A page named there that this tier
        indexed from a file changed no later than the delete leaves the index (unlinked once this
        tier writes), and no file of the key no newer is indexed (remembered as a delete from
        before this tier wrote). Review 213: a follower that had indexed the page kept serving it
        (its file never changed), and after the writer's crash its take-over kept it too."""
        if not deletes:
            return
        state = self._follow_state
        for key, when in deletes.items():
            remembered = self._deleted_away.get(key)
            if remembered is None or (remembered < 0 and -1 - remembered < when):
                self._remember(key, -1 - when)
            if key in self._index:
                entries = state.entries[key[0]] if state is not None else None
                identity = entries.get(key) if entries is not None else None
                if identity is None or identity >> 64 <= when:  # its change time: the file deleted
                    self._index.remove(key)
                    self._followed_out += 1
                    self._unlink_when_writable.add(key)

    def _looked_deleted(self, key: PageKey, mtime: int) -> bool:
        """Whether the file of ``key`` a look found (last modified at ``mtime``, ns) is the page of a
        delete this tier remembers (:meth:`_remember_delete`): then it is left out of the index and
        unlinked once this tier may write. Review 194: a page deleted before the lock was lost (or
        while following), its directory put back, was indexed by the looks and served again, also
        after the take-over. No look runs now: its state (the file's identity) is the loop's."""
        if not self._found_deleted(key, mtime):
            return False
        self._unlink_when_writable.add(key)  # (a file of it the writer stores later is indexed: kept)
        return True

    def _found_deleted(self, key: PageKey, mtime: int) -> bool:
        """:meth:`_looked_deleted`'s question alone: whether that file is the page of a delete this
        tier remembers (one by one, or maybe in the filter)."""
        remembered = self._deleted_away.get(key)
        if remembered is None:
            return self._maybe_forgotten(key, mtime)
        state = self._follow_state
        known = state.entries[key[0]] if state is not None else None
        return _deleted_file(remembered, known.get(key, 0) if known is not None else 0, mtime)

    def _count_told(self, found: Look) -> None:
        """Count what a look told of the refused reads (``corrupt`` or ``follow_raced``)."""
        self._follow_raced += found.raced
        if not found.corrupt:
            return
        self._corrupt += len(found.corrupt)  # files: concurrent reads of one were each a refusal
        if not self._follow_corrupt_logged:
            self._follow_corrupt_logged = True
            log.warning("disk tier: page file %s is corrupt: it failed its checks and did not change since it was "
                        "indexed (kept, as the tier is read-only (%s); further ones counted only)",
                        self.files.path(next(iter(found.corrupt))), ReadOnly.LOCKED.value)

    def _take_lock_over(self, found: Look, left: set[PageKey]) -> None:
        """The writer let the directory go and the look took its lock (or this tier held it and
        may write there now): write from now on. Where it may not write yet (a read-only file
        system...), it holds the lock, and the looks go on asking whether it may."""
        assert self._dir is not None and found.space is not None
        if found.lock_fd is not None:
            self._dir.lock_fd, found.lock_fd = found.lock_fd, None
            self._took_over += 1
            self._count_undecided()  # refused since the look began: no writer changes files now
        self._temp_removed += found.temp_removed
        self._read_only = found.read_only
        self._index.set_capacity(found.space, after_enospc=False)
        self._space_checked = asyncio.get_running_loop().time()
        self._start_watching()
        if self._read_only is not None:
            self._follow_held = True
            log.warning("disk tier: %s: took the directory over from the cache that held it, but it is read-only "
                        "here (%s): serving its %d pages, refusing writes; looking again every %g s",
                        self.files.layout_dir, self._read_only.value, len(self._index),
                        self.config.follow_interval_s)
            return
        if self._follow_held:
            self._follow_held = False
            log.warning("disk tier: %s is writable again: this tier writes there now (%d pages indexed, "
                        "%d temporary files removed)", self.files.layout_dir, len(self._index), found.temp_removed)
        else:
            log.warning("disk tier: %s: the cache that held the directory let it go: this tier writes there now "
                        "(%d pages indexed, %d temporary files removed)", self.files.layout_dir, len(self._index),
                        found.temp_removed)
        # Keys whose file a read found gone after this look began (its forget step done): a file now
        # under such a name is one no look examined (ext4 hands the freed inode number to the key's
        # next file, which the look took for the one it knew), else left on disk outside the index
        # and the budget, never evicted. Unlinked, as refused files are.
        gone = self._unlink_when_writable | self._follow_forgotten
        # A key this look's apply left to its write (in flight then: its name examined again at
        # the next look), whose write ended unstored between two of the apply's steps: the page
        # the look found there was never replaced, and is indexed (review 200: refused below and
        # unlinked, the other writer's page lost), unless the caller ever deleted the key.
        kept = [key for key in left if key in gone and key not in self._index and key not in self._writing
                and key not in self._deleted_away and (mtime := found.mtimes.get(key)) is not None
                and not self._found_deleted(key, mtime)]
        gone.difference_update(kept)
        for key in kept:
            self._index.add_found(key)  # most recently used: the caller just asked to store it
        unlisted = set(found.unlisted)
        fanout = self._dir.fanout
        # A deleted key's name in a directory this look could not list (listed again below, or
        # without a descriptor now: listed when opened) may hold a page the other writer stored
        # after the delete (review 198: unlinked here, a page lost): left to that listing, which
        # asks the delete by the file's time (_index_listed).
        refused: list[PageKey] = [key for key in gone if key not in self._index and key not in self._writing and not (
            (key[0] in unlisted or fanout[key[0]] < 0) and self._listing_asks_delete(key))]
        # A write in flight since before the lock was lost: its end decides what its name holds (a
        # file there is unlinked if it ends unstored), as for a key a listing finds being written;
        # but a page this look found there (the other writer's, not one deleted) is indexed if the
        # write ends unstored: it never published over it (review 199: unlinked, a page lost).
        for key in gone:
            if key in self._writing:
                self._listed_under_write.add(key)
                mtime = found.mtimes.get(key)
                if mtime is not None and not self._found_deleted(key, mtime):
                    self._found_under_write.add(key)
        self._unlink_when_writable.clear()
        self._follow_forgotten.clear()
        unlinks = self._remove_files(refused)
        unlinks += self._remove_files(self._index.evict_to(self._index.capacity))
        # Directories the take-over could not list whole: listed again at the periodic checks
        # (review 194: before, at "the next look", which a writer never makes: the files the
        # looks had not seen stayed on disk outside the index and the budget until a restart).
        for index in found.unlisted:
            if (fd := self._dir.fanout[index]) >= 0:  # (else retired: its name's next open lists it)
                self._listing_failed(index, fd)
        if found.record_unknown:
            self._record_unknown = unlinks
            self._spawn(self._replace_unknown_after(unlinks))
        self._refill_spares()

    async def _replace_unknown_after(self, unlinks: list[asyncio.Task[None]]) -> None:
        if unlinks:
            await asyncio.wait(unlinks)
        self._replace_unknown_record()

    def _replace_unknown_record(self) -> None:
        """A take-over could not read the pending-delete record (EIO, damaged) and its look did not
        replace it (:attr:`.follow.Look.record_unknown`: a fan-out directory not listed whole, the
        save failed): replaced now by this tier's record (where it still cannot be read: one that
        reads is merged, as any save does), once the take-over's unlinks ended and every directory
        is listed (:meth:`_all_listed`: a file no listing saw may be a page the record names, which
        it keeps from a start until then). Asked when those unlinks
        end and at each lock check; a failed save is tried again at the next. Review 232: nothing
        replaced it, and the next start took its deletes for unknown: every page stored since was
        lost."""
        unlinks = self._record_unknown
        if (unlinks is None or self._read_only is not None or not self._all_listed()
                or not all(task.done() for task in unlinks)):
            return
        self._record_unknown = None
        self._replace_record_soon()

    def _replace_record_soon(self) -> None:
        """Save this tier's record over the one on disk that could not be read (where it still
        cannot be read when saved: :func:`.deletelog.update_deletes`' replace)."""
        self._deletes_replace = True
        self._deletes_version += 1
        self._save_deletes_soon()

    def _listing_asks_delete(self, key: PageKey) -> bool:
        """Whether a listing of ``key``'s fan-out directory would ask a delete of ``key`` this tier
        remembers (one by one, or maybe in the filter: :meth:`_index_listed`)."""
        if key in self._deleted_away:
            return True
        bits = self._forgotten
        return (bits is not None and key[0] in self._forgotten_before
                and all(bits[bit >> 3] >> (bit & 7) & 1 for bit in _filter_bits(key)))

    # -- the writer's lock: its name checked (:mod:`.lockwatch`) -------------------------------

    def _start_watching(self) -> None:
        """While this tier holds the directory's lock: check every ``follow_interval_s`` (0: never)
        that ``.lock`` still names the file it holds."""
        task = self._watch_task
        if self.config.follow_interval_s and self._accepting and (task is None or task.done()):
            self._layout_stamp = None  # the first check examines every fan-out name
            self._record_stamp = None  # and reads the pending-delete record
            self._watch_task = asyncio.get_running_loop().create_task(self._watch())
            self._watch_task.add_done_callback(drop_cancel)

    def _check_lock_soon(self) -> None:
        """The next check of the lock now rather than after ``follow_interval_s``."""
        self._watch_ticker.soon()

    def _watching(self) -> bool:
        return self._accepting and self._dir is not None and self._dir.lock_fd is not None

    async def _watch(self) -> None:
        while self._watching():
            await self._watch_ticker.wait(self.config.follow_interval_s)
            if not self._watching():
                return
            prepared = self._dir
            assert prepared is not None and prepared.lock_fd is not None
            # ``stop``: the close ends the record's examination (a name at a time) at its next batch.
            stop = threading.Event()
            # A copy of the fan-out descriptors: the loop may retire or open some meanwhile (a
            # retired one stays open until the close, which waits for this check).
            work = functools.partial(check_writer, prepared.dir_fd, prepared.lock_fd, list(prepared.fanout),
                                     self._layout_stamp, self.files.layout_dir, self._record_stamp, stop.is_set)
            opens = self._fanout_opens
            found = await self._on_thread(work, "aiokv-disk-lock", LockCheck.close, "a check of the directory's lock",
                                          stop.set)
            if found is None:
                continue
            if found.fanouts is not None and self._fanout_opens != opens:
                # A fan-out directory opened on the loop after the copy (not examined), maybe just
                # before a move the stamp taken shows: every name examined again at the next check.
                found.fanouts.stamp = None
            try:
                self._apply_lock_check(found)
            except Exception:
                self._faults.unexpected("applying a check of the directory's lock")
            finally:
                found.close()  # a new lock the tier did not take

    async def _stop_watching(self) -> None:
        """At close: stop the checks, wait for the one in progress and close what it took."""
        task = self._watch_task
        if task is not None:
            await self._stop_task(task, "checking the lock of")

    def _apply_lock_check(self, found: LockCheck) -> None:
        """A check's outcome: a fault counted; fan-out directories whose name no longer leads to
        them retired; a new lock taken (the old one let go); a lock held by another cache: this
        tier stops writing and follows it."""
        prepared = self._dir
        assert prepared is not None
        if found.fault is not None:
            self._faults.count(*found.fault)
        if found.fanouts is not None:
            self._apply_fanout_check(found.fanouts)
        if not self._watching():
            return  # closing: the close lets the lock go
        self._relist_due()
        assert prepared.lock_fd is not None
        if found.state is LockState.RETAKEN:
            assert found.fd is not None
            old, prepared.lock_fd, found.fd = prepared.lock_fd, found.fd, None
            os.close(old)  # an unlinked file nobody else can lock through its name
            self._lock_retaken += 1
            if self._follow_held:
                self._look_soon()  # held: a look that found .lock not ours (review 241) takes over now
            log.warning("disk tier: %s was removed or replaced under this cache, which held it: took the file there "
                        "now (still the only cache writing there)", self.files.layout_dir / ".lock")
        elif found.state is LockState.LOST:
            self._lose_lock()
            return
        if found.record is not None:
            self._record_stamp = found.record.stamp
            if found.record.fault is not None:
                self._replace_damaged_record(found.record.fault)
            elif self._record_applying is None or self._record_applying.done():
                self._record_applying = self._spawn(self._apply_record_check(found.record.deletes))
            else:
                self._record_stamp = None  # one is still applied: this one is read again at the next check
        self._replace_unknown_record()
        # Files whose unlink failed: the disk may answer again (review 204). A bounded batch a
        # check: a disk failing for good costs the loop a few tasks an interval, not thousands.
        self._retry_unlinks(BULK_UNLINK_KEYS)

    def _all_listed(self) -> bool:
        """Whether this tier holds the lock and every fan-out directory has a descriptor and none
        waits to be listed (again): no file lies where no listing of this tier saw it, so a
        pending-delete record replaced unread loses no delete a page on disk still needs (as
        :func:`.follow._replace_record` asks)."""
        prepared = self._dir
        return (prepared is not None and prepared.lock_fd is not None and not self._relist and not self._listings
                and all(fd >= 0 for fd in prepared.fanout))

    def _replace_damaged_record(self, fault: OSError) -> None:
        """A lock check could not read the pending-delete record (damaged, EIO): replaced (where it
        still cannot be read when saved) by the one this tier keeps (every delete it names: loaded
        at its start, or named since its take-over), once no fan-out directory waits to be listed
        again (a file there no listing saw may be one it names; :meth:`_all_listed`) nor a
        take-over's record is still to replace (:meth:`_replace_unknown_record`). Review 232: left
        for this tier's next save, which a tier whose retried unlink keeps failing never made; its
        followers withheld every page for as long as it ran, and its next start served none."""
        if (self._deletes_replace or self._read_only is not None or not self._all_listed()
                or self._record_unknown is not None):
            return
        log.warning("disk tier: the pending-delete record %s cannot be read (%s): replaced by the one this cache keeps",
                    self.files.layout_dir / ".deletes", fault.strerror)
        self._replace_record_soon()

    async def _apply_record_check(self, deletes: dict[PageKey, tuple[int, int | None]]) -> None:
        """The pending-delete record as a lock check read it again (:func:`.lockwatch.check_record`):
        a delete another cache saved after this tier read the record (a writer still running after
        its ``.lock`` was replaced, until its own check tells it; review 225: this tier served
        that page, stale KV). As at a start: a page indexed whose file is no newer than the delete
        (or could not be examined) leaves the index and is unlinked (named in the record while the
        unlink fails), and the delete is remembered as one from before this tier (a listing, and
        the looks after a lost lock, leave such a file out). This tier's own deletes and its
        writes in flight (their end publishes a newer file) are left as they are.

        In steps of :data:`APPLY_PER_TURN`, and a delete the filter covers already (forgotten beyond
        :data:`DELETED_KEPT`, no older) is not remembered again. Review 232: one turn remembered
        them all, each pushing another into the filter, and again at every check where the record
        had changed: 200,000 deletes of another cache held the loop 4 to 6 s each time."""
        dropped = 0
        items = list(deletes.items())
        for start in range(0, len(items), APPLY_PER_TURN):
            if start:
                await asyncio.sleep(0)
            if not self._watching():
                return  # the lock lost (the looks read the record) or closing
            for key, (when, mtime) in items[start : start + APPLY_PER_TURN]:
                if key in self._deletes_kept:
                    continue  # this tier's own (its unlink failed): out of the index already
                remembered = self._deleted_away.get(key)
                if (remembered is None and not self._maybe_forgotten(key, when)) or (
                        remembered is not None and remembered < 0 and -1 - remembered < when):
                    self._remember(key, -1 - when)
                if key in self._index and key not in self._writing and (mtime is None or mtime <= when):
                    self._drop(key)
                    dropped += 1
        if dropped:
            log.warning("disk tier: %s names %d pages indexed here that another cache deleted after this one read "
                        "it (its .lock was replaced under it while it wrote): no longer served, unlinked",
                        self.files.layout_dir / ".deletes", dropped)

    def _apply_fanout_check(self, found: FanoutCheck) -> None:
        """Retire each fan-out descriptor the check found no longer named (moved away whole,
        removed, replaced), as an ENOENT of a write does (:meth:`_retire_fanout`) — unless the
        loop retired it meanwhile. Writes of its keys go under the name from then on: nothing
        lands in a directory moved out of the cache after this check."""
        for fault in found.faults:
            self._faults.count(*fault)
        self._layout_stamp = found.stamp
        prepared = self._dir
        assert prepared is not None
        if not self._watching():
            return  # closing: nothing written any more
        for index, fd, why in found.gone:
            if prepared.fanout[index] == fd:
                self._retire_fanout(index, why)
        for index in found.back:
            if prepared.fanout[index] < 0:
                # Put back (moved back, restored) or made again: opened now, checked, and listed
                # (its page files indexed and counted) rather than at the next operation in it.
                try:
                    self._open_fanout(index)
                except OSError as exc:
                    self._faults.count(exc, f"opening {self.files.layout_dir / f'{index:02x}'}")

    # -- fan-out directories opened late: listed as a start lists them -------------------------

    def _open_fanout(self, index: int) -> int:
        """:meth:`TierBase._open_fanout`; with the lock, the directory opened late (put back:
        moved back, restored; or unreadable at start) is listed and its files indexed as a
        start's scan would (a follower's looks list what they open)."""
        fd = super()._open_fanout(index)
        if self._dir is not None and self._dir.lock_fd is not None:
            self._list_opened(index, fd)
        return fd

    def _list_opened(self, index: int, fd: int) -> None:
        """Fan-out directory ``index`` was opened late as ``fd`` by the writer: one put back in
        place of a retired one (moved back, a backup restored) or unreadable at start may hold page
        files. Listed on a thread (never on the loop: it may be large) as a start lists one; then
        :meth:`_index_listed`."""
        self._listing.setdefault(index, set())  # shared with a listing of a descriptor retired since
        self._listings[index] = self._listings.get(index, 0) + 1
        self._spawn(self._index_opened(index, fd))

    async def _index_opened(self, index: int, fd: int) -> None:
        faults: list[tuple[OSError, str]] = []
        files = self.files
        remove = self._read_only is None
        # Temporary and spare files of this tier may be its writes in flight (a directory moved
        # back holds those issued before the move); any other is a leftover, removed as at start.
        work = functools.partial(_list_in_order, fd, index, files.layout_dir / f"{index:02x}", remove, faults,
                                 lambda name: files.own_temp(name) or self._spares.named(name), self._closing.is_set)
        try:
            listed = await self._on_thread(work, "aiokv-disk-list", _nothing, "listing a fan-out directory")
            for fault, what in faults:
                self._faults.count(fault, what)
            if listed is None:
                self._listing_failed(index, fd)  # it raised (counted): listed again later
            else:
                self._index_listed(index, fd, *listed)
        finally:
            left = self._listings.pop(index) - 1
            if left:
                self._listings[index] = left
            else:
                del self._listing[index]

    def _index_listed(self, index: int, fd: int, listing: FanoutListing, order: list[PageKey]) -> None:
        """Index the page files a listing of a fan-out directory opened late found (``order``:
        their keys, oldest first), as the least recently used, within the budget: those beyond the
        free room (the oldest) are never indexed, counted as evicted and unlinked on a thread
        (:meth:`_unlink_listed`). Skipped: keys indexed, being written or moved meanwhile, and all
        of it when the descriptor was retired again or the tier no longer writes; a file of a key
        unlinked or deleted while the listing ran is unlinked (it may have been listed before its
        unlink)."""
        prepared = self._dir
        assert prepared is not None
        self._temp_removed += listing.temp_removed
        before = self._relist.get(index)
        if before is None or before[0] != fd:
            # Not a listing again after a failure: one that keeps failing would count the same
            # directory and entries at each (review 194; ``listings_failed`` counts the failures).
            self._skipped += listing.skipped + (not listing.complete and not listing.stopped)
        if not self._accepting or listing.stopped or prepared.fanout[index] != fd or prepared.lock_fd is None:
            return
        if listing.complete and listing.examined:
            self._relist.pop(index, None)
        else:
            # What it listed is indexed below; the rest (after an EIO, an ENOMEM, an entry that
            # could not be examined) is listed again at a later check, else it stayed on disk
            # outside the index and the budget until a restart.
            self._listing_failed(index, fd)
        gone = self._listing.get(index, set())
        page_index, writing, moving = self._index, self._writing, self._moving
        fresh = [key for key in order if key not in page_index and key not in writing and key not in moving]
        deleted = self._deleted_away
        if deleted:
            # Deleted by the caller while the directory was away: a file of the key is the one
            # deleted (served, it would be a page the caller invalidated), whatever its time (a copy
            # restored without its times or with new ones, a wall clock stepped back), unless it is
            # the very file this tier stored since the delete, moved back with its directory.
            entries, found = listing.entries, listing.found
            gone = gone | {key for key in fresh
                           if key in deleted and _deleted_file(deleted[key], entries[key], found[key])}
        if self._forgotten_before.get(index) is not None:
            # Deletes beyond DELETED_KEPT (review 193: such a page came back, stale).
            found = listing.found
            gone = gone | {key for key in fresh if key not in deleted and self._maybe_forgotten(key, found[key])}
        indexed = [key for key in fresh if key not in gone]
        excess: list[PageKey] = []
        if self._read_only is None:
            # Indexed as the least recently used, the oldest would be evicted at once: one unlink
            # task each held the loop for seconds (50,000 files put back: 3.4 s in one turn).
            cut = max(0, len(indexed) - max(0, page_index.capacity - page_index.used) // page_index.file_bytes)
            excess, indexed = indexed[:cut], indexed[cut:]
            page_index.evictions += cut
        page_index.add_least_recent(indexed)
        for key in fresh:
            if key in gone:
                self._unlink_later(key)
        # This tier's own temporary and spare names no write, stock or batch holds: copies (a
        # backup restored) or leftovers of writes ended meanwhile; removed as others' are.
        stale = self._not_in_flight(fd, listing.kept)
        self._temp_removed += len(stale)
        if excess or stale:
            self._unlink_listed(fd, excess, stale)
        # A key being written keeps its state: its file here is replaced if the write stores it,
        # else unlinked when the write ends (:meth:`.writepath.WritePath._end_write`).
        self._listed_under_write.update(key for key in listing.found if key in writing and key not in page_index)
        if self._read_only is None:
            self._remove_files(page_index.evict_to(page_index.capacity))
        if indexed:
            log.warning("disk tier: %s, opened again, holds %d page files not indexed: indexed as the least recently "
                        "used", self.files.layout_dir / f"{index:02x}", len(indexed))

    def _remember_delete(self, key: PageKey) -> bool:
        """:meth:`~.disk.DiskTier.delete` of ``key``, while this tier holds the lock: where a file of
        the key may lie that no listing indexed (its fan-out directory without a descriptor: moved
        away and retired, replaced, unreadable at start; one retired before, whose copy may come
        back; one being listed, or whose late listing failed part-way), the delete is remembered
        with its time (at most :data:`DELETED_KEPT` keys), and the listing of that directory
        unlinks a file of the key rather than index it (once the key is stored again, any file but
        that store's: :data:`STORED_SINCE_DELETE`). Whatever the
        key's state: indexed or being written (stored again after its directory went away), the
        old copy is still the one deleted. True when the directory open now is listed only in part
        (being listed, or listed again later): the caller unlinks the name now too. While following,
        every delete is remembered as "a file no newer than it" (the writer keeps the file: a look
        at the directory put back would index it again, :meth:`_looked_deleted`); with the lock but
        read-only, every delete too (the file stays: the lock may be lost before it is unlinked)."""
        prepared = self._dir
        if prepared is None:
            return False
        if prepared.lock_fd is None:
            # A follower unlinks nothing (the writer's listings are its own), but its looks list a
            # directory put back again and would index the file it deleted (review 194): a file
            # no newer than the delete is the page deleted (the writer may store the key again).
            if self._read_only is ReadOnly.LOCKED and self._follow_task is not None:
                self._remember(key, -1 - time.time_ns())
            return False
        index = key[0]
        fd = prepared.fanout[index]
        part_listed = fd >= 0 and (index in self._relist or index in self._listings)
        # Read-only with the lock (an EROFS answer, a take-over held on a read-only file system):
        # the file stays until the tier may unlink it. Should the lock be lost first, the looks
        # (seeded from the index) find it as new, and only a delete remembered keeps it out
        # (review 203: indexed and served after the loss, and left on disk by the take-over).
        if fd >= 0 and not part_listed and index not in self._fanouts_away and self._read_only is None:
            return False  # listed whole, never away, unlinked now: no file of the key outside the index
        self._remember(key, time.time_ns())  # file times come from the same clock, at most as late
        return part_listed

    def _unlink_failed_remembered(self, key: PageKey) -> None:
        """:meth:`TierBase._unlink_failed_remembered`: with the lock, remembered as a delete (its
        time now): a listing of its directory (moved away and back, listed again after a failure)
        unlinks that file rather than index it, and after a lost lock the looks (seeded from the
        index) leave it out and the take-over unlinks it. Review 204: a write deleted in flight whose
        unlink at its end failed was remembered nowhere, and the looks served it after a loss."""
        prepared = self._dir
        if prepared is not None and prepared.lock_fd is not None:
            self._remember(key, time.time_ns())

    def _found_still_kept(self, key: PageKey) -> bool:
        """:meth:`TierBase._found_still_kept`: the take-over asked the file it found against the
        deletes, but another file may lie under the name since (a copy of the page deleted restored
        there, review 200: indexed blind, served). For a key whose delete is remembered, the file
        there now is asked again (one ``stat`` on the loop, of such keys only); where that fails,
        not kept (a miss at worst)."""
        if key not in self._deleted_away and self._forgotten is None:
            return True
        prepared = self._dir
        fd = -1 if prepared is None else prepared.fanout[key[0]]
        if fd < 0:
            return False
        try:
            st = os.stat(key.hex(), dir_fd=fd, follow_symlinks=False)
        except OSError:
            return False
        remembered = self._deleted_away.get(key)
        if remembered is None:
            return not self._maybe_forgotten(key, st.st_mtime_ns)
        return not _deleted_file(remembered, file_identity(st.st_ino, st), st.st_mtime_ns)

    def _write_discarded(self, key: PageKey) -> None:
        """:meth:`TierBase._write_discarded`: while following (the lock lost with the write in
        flight), the file stays until this tier may write, and the delete (remembered as "a file no
        newer than it", or not at all when it came before the loss) did not name it: its data may
        have landed after the delete, and the looks indexed and served it (review 198). Remembered
        again now, after the file was published: no newer than this. So too after a take-over where
        this tier may not write yet (``_follow_held``, a read-only file system): the file is left
        until it may, and the take-over's scan then found it newer than the delete (or no delete
        remembered, the lock held at it) and indexed it (review 199: served, stale KV)."""
        if self._dir is not None and self._follow_task is not None and self._following():
            self._remember(key, -1 - time.time_ns())

    def _remember(self, key: PageKey, remembered: int) -> None:
        """Remember the delete of ``key`` as ``remembered`` (:data:`STORED_SINCE_DELETE`), the oldest
        beyond :data:`DELETED_KEPT` forgotten into the filter."""
        deleted = self._deleted_away
        deleted.pop(key, None)  # most recent last: the oldest is forgotten first
        deleted[key] = remembered
        if len(deleted) > DELETED_KEPT:
            oldest = next(iter(deleted))
            self._forget_delete(oldest, deleted.pop(oldest))

    def _forget_delete(self, key: PageKey, remembered: int) -> None:
        """A delete beyond :data:`DELETED_KEPT`, remembered as ``remembered``: into the filter
        (:data:`FORGOTTEN_BITS`), its time a bound for its fan-out directory."""
        when = -1 - remembered if remembered < 0 else remembered & DELETE_TIME_BITS
        bits = self._forgotten
        if bits is None:
            bits = self._forgotten = bytearray(FORGOTTEN_BITS // 8)
        for bit in _filter_bits(key):
            bits[bit >> 3] |= 1 << (bit & 7)
        index = key[0]
        self._forgotten_before[index] = max(self._forgotten_before.get(index, when), when)

    def _maybe_forgotten(self, key: PageKey, mtime: int) -> bool:
        """Whether a file of ``key`` last modified at ``mtime`` (ns) may be the page of a delete
        forgotten beyond :data:`DELETED_KEPT` (:meth:`_forget_delete`)."""
        bits = self._forgotten
        before = self._forgotten_before.get(key[0])
        return (bits is not None and before is not None and mtime <= before
                and all(bits[bit >> 3] >> (bit & 7) & 1 for bit in _filter_bits(key)))

    def _listing_failed(self, index: int, fd: int) -> None:
        """The late listing of fan-out directory ``index`` (descriptor ``fd``, still in use) failed
        part-way: counted, and listed again by :meth:`_relist_due` after 1, 2, 4, ... periodic
        checks (at most ``2 ** RELIST_DOUBLINGS``)."""
        prepared = self._dir
        if not self._accepting or prepared is None or prepared.fanout[index] != fd or prepared.lock_fd is None:
            return  # closing, retired meanwhile (a new open lists it), or no longer writing
        self._listings_failed += 1
        before = self._relist.get(index)
        failures = before[1] + 1 if before is not None and before[0] == fd else 1
        self._relist[index] = (fd, failures, (1 << min(failures - 1, RELIST_DOUBLINGS)) - 1)

    def _relist_due(self) -> None:
        """At the writer's periodic check: list again the fan-out directories whose late listing
        failed and whose wait is over (:meth:`_listing_failed`)."""
        prepared = self._dir
        assert prepared is not None
        for index, (fd, failures, wait) in list(self._relist.items()):
            if prepared.fanout[index] != fd:
                del self._relist[index]  # retired since: the name's next open lists it
            elif index in self._listings:
                continue  # a listing in flight
            elif wait:
                self._relist[index] = (fd, failures, wait - 1)
            else:
                self._list_opened(index, fd)

    def _not_in_flight(self, fd: int, names: list[str]) -> list[str]:
        """Of this tier's temporary and spare ``names`` in fan-out directory ``fd``, those no write
        in flight (its key's), stock, write or batch of spares (any, while one is made) holds. One
        the backend was handed meanwhile and that is removed is no fault: the write goes into a
        new file (a spare), or its rename misses and it is tried once more (a temporary file)."""
        spares = self._spares
        held = {spare.name for spare in [*spares._stock, *self._spare_of.values()] if spare.dir_fd == fd}
        stale = []
        for name in names:
            if name.startswith(SPARE_PREFIX):
                if self._refill is None and name not in held:
                    stale.append(name)
                continue
            try:
                key = bytes.fromhex(name[len(TEMP_PREFIX):len(TEMP_PREFIX) + 2 * KEY_BYTES])
            except ValueError:
                key = b""
            if key not in self._writing:
                stale.append(name)
        return stale

    def _unlink_listed(self, fd: int, keys: list[PageKey], names: list[str]) -> None:
        """Unlink the files of ``keys`` (never indexed) and ``names`` in fan-out directory ``fd`` on
        a thread, in one task: a new write of one of the keys waits for it, as for any unlink."""
        self._unlink_in_thread([(fd, name) for name in [*(bytes.hex(key) for key in keys), *names]], keys)

    def _lose_lock(self) -> None:
        """``.lock`` was replaced and another cache holds the file there now: it writes and evicts
        by its budget. This tier stops (refuses writes, unlinks nothing: ``ReadOnly.LOCKED``) and
        follows it, as a tier that started read-only does, taking over once it lets go."""
        prepared = self._dir
        assert prepared is not None and prepared.lock_fd is not None
        os.close(prepared.lock_fd)
        prepared.lock_fd = None
        self._lock_lost += 1
        self._relist.clear()  # the looks list what they need: a take-over scans every directory
        self._record_unknown = None  # (its next take-over's look replaces it, or tells it cannot)
        self._deletes_replace = False
        # The other writer's stores are unknown here: a file of a key this tier deleted that is
        # newer than the delete may be one of them (a page to serve once this tier takes over:
        # unlinked before, review 193); one no newer is still the page deleted.
        # So is a file other than the one this tier stored since (the other writer may have
        # deleted and stored the key again).
        deleted = self._deleted_away
        for key, when in deleted.items():
            if when >= 0:
                deleted[key] = -1 - (when & DELETE_TIME_BITS if when >= STORED_SINCE_DELETE else when)
        # Files whose unlink failed (review 204) are remembered deletes (converted above): the
        # take-over unlinks a file no newer than the failure; the name may hold the other writer's
        # newer page by then.
        self._unlink_failed.clear()
        # What a take-over found under names left to this tier's writes is the directory as it was
        # then: the new writer may remove or replace those pages. Forgotten, so a write ending
        # unstored indexes nothing blind; the looks (and the next take-over) ask the name afresh
        # (review 202: the page removed since, the key was indexed with no file under its name).
        self._found_under_write.clear()
        # Spare files are this tier's own (in nobody's index): unlinked while it still may.
        self._remove_spares(self._spares.drain())
        self._read_only = ReadOnly.LOCKED
        self._follow_held = False  # a look still in progress asks for the lock again, not for writing
        log.warning("disk tier: %s was replaced under this cache, and another cache holds the new one: it writes "
                    "there now; this cache stops writing and evicting and follows it (%d pages indexed)",
                    self.files.layout_dir / ".lock", len(self._index))
        task = self._follow_task
        if task is None or task.done():
            self._start_following(self._seed_from_index(prepared.fanout))

    def _seed_from_index(self, fanout: list[int]) -> FollowSeed:
        """The first look's knowledge for a tier that wrote until now: every indexed key under an
        identity no file has (inode 0), so the look examines each name once and reports the keys
        whose files are gone (the new writer evicted them). An empty seed only ever added keys:
        the evicted ones stayed indexed."""
        seed = FollowSeed()
        for index, fd in enumerate(fanout):
            if fd >= 0:
                seed.entries[index] = {}  # listed at the first look (no stamp), as a start's are
        for key in self._index:
            known = seed.entries[key[0]]  # a key's fan-out directory is its first byte
            if known is not None:
                known[key] = 0
        return seed


def _nothing(_: object) -> None:
    """A listing has nothing to close."""


def _filter_bits(key: PageKey) -> tuple[int, int]:
    """The two bits of :data:`FORGOTTEN_BITS` that stand for ``key`` (keys are not always uniform
    hashes: hashed again)."""
    mixed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return mixed % FORGOTTEN_BITS, (mixed >> 32) % FORGOTTEN_BITS


def _deleted_file(remembered: int, identity: int, mtime: int) -> bool:
    """Whether a file of a key whose delete was remembered as ``remembered`` (see
    :data:`STORED_SINCE_DELETE`), listed as ``identity`` (:func:`~.layoutdir.file_identity`), last
    modified at ``mtime`` (ns), is the page deleted: any file but the one this tier stored since;
    for a delete from before another writer held the lock (negative: ``-1 -`` its time), any file
    no newer than the delete."""
    if remembered < 0:
        return -1 - remembered >= mtime
    return (remembered - STORED_SINCE_DELETE) >> 64 != identity


def _list_in_order(fd: int, index: int, shown: Path, remove: bool, faults: list[tuple[OSError, str]],
                   keep: Callable[[str], bool], stop: Callable[[], bool]) -> tuple[FanoutListing, list[PageKey]]:
    """:func:`~.layoutdir.list_fanout` of a fan-out directory opened late, and the keys it found,
    oldest first (sorted here, not on the loop); ``stop`` (the close) ends it at its next batch of
    entries. Blocking."""
    listing = list_fanout(fd, index, shown, remove, None, faults, keep, stop)
    if listing.stopped:
        return listing, []  # the tier is closing: nothing of it indexed
    return listing, [key for _mtime, key in sorted((mtime, key) for key, mtime in listing.found.items())]
