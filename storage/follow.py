"""Following a layout directory that another cache holds: the looks, run on a thread.

A tier that started read-only because another cache holds the directory's lock
(``ReadOnly.LOCKED``) looks at the directory every ``DiskConfig.follow_interval_s``
(:mod:`.followpath` on the loop; :func:`look` here, on a thread of its own). Page files are
immutable and named by their content's key, so what the writer stored since is safe to serve:
reads verify header and checksum as always.

A look is cheap when little changed: a fan-out directory is listed again only when its
modification or change time differs from the stamp taken before its last listing (or that stamp
was too recent to tell: :data:`~.layoutdir.SETTLE_NS`), and an entry whose name and inode number
the last listing saw is not examined again (but the names of keys the tier deleted while following:
:func:`look`'s ``whole``). The listing is the start-up scan's
(:func:`~.layoutdir.list_fanout`: names, types, owner; temporary and spare files never indexed).
What the look finds is reported (:class:`Look`) and the loop applies it: files new since (or
replaced: another inode under the name) are added, files gone are dropped. A directory whose
listing failed (EIO, EACCES...) reports nothing this time, is recorded, and is listed again at the
next look (an entry that could not be examined fails its directory's listing the same way).

A read refused by header or checksum while following is told apart by the next look: the
file's identity as listed (inode number and change time, :func:`~.layoutdir.file_identity`) against
the file under the name now. Changed (the writer recycled, replaced or removed it under the read):
no corruption, and a page file there now is indexed again. Unchanged: corrupt only when that
identity was recorded at least :data:`~.layoutdir.SETTLE_NS` after the file's change time (then
any later change shows a later change time); a corrupt file is examined again only when its
directory is listed again, indexed again once its identity changed (the writer stored the key
anew, under the same inode number too). An identity recorded earlier (or when, unknown) cannot tell
a change and its undoing within one tick of a coarse clock (the writer recycling the file away
under the read and back): it is recorded again, and the key indexed again, so that its next
refusal decides (a corrupt file is read twice, not once).

Each look first tries the directory's lock (non-blocking ``flock`` on ``.lock``, opened without
following a link and checked as a page file is). Once the writer let it go (its ``aclose``, or its
death: the kernel drops the lock with the process), the look holds it and scans every fan-out
directory as a start does under the lock (missing fan-out directories created, leftover temporary
and spare files of a dead writer removed, free space taken); the loop then switches the tier to
writing. A look that cannot finish that scan (a fan-out directory that is not safely ours) lets the
lock go again and reports the fault. With the lock the writer's pending-delete record
(:mod:`.deletelog`) is final, and read then; one that cannot be read (EIO, damaged, a passing
fault that outlasts the start's tries) names unknown deletes: as at a start, no page found there
is served (:func:`_deletes_unknown`: the take-over unlinks them all), rather than a page the
writer deleted (review 222). A look without the lock that cannot read it withholds every page as
well (:attr:`Look.withheld`: none served or indexed) until a look reads it again (review 231). A
``.lock`` gone is made again (not locked then): its writer, still running, takes it at its next
check; else the next look takes it.

Nothing is named through a path: fan-out directories are listed through the descriptors the tier
holds; one that is opened late (absent or unreadable at start) is opened by
:func:`~.layoutdir.open_private_subdir` (no symlink, ours, 0700). When the layout directory changed,
each fan-out name is checked to still lead to the directory its descriptor is: one replaced (a
symlink, a file, another directory) or removed is retired (its pages dropped; the tier stops using
the descriptor, which stays open until the close), so nothing is ever written outside the cache
through it.

The 256 ``fstat``s of a look go to the kernel as one batch (:mod:`.statxring`: ``statx`` on each
descriptor through one ``io_uring_enter``) on a ring the looks keep (:attr:`FollowState.ring`,
made by the first look, closed by the look that takes the directory over and at the tier's
close). Each system call releases the GIL, and beside threads running Python taking it back waits
up to the switch interval: one wait a look rather than 256. So are the names the look examines
whole (:func:`look`'s ``whole``: ``statx`` by name, after the listings, 256 a batch; review 203).
Where io_uring or its STATX op is refused (an old kernel, a seccomp filter, another architecture)
the looks ``fstat`` each directory (and ``stat`` each name), as they do the directories a look
opens late; what a look finds is the same either way.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from aiokv.keys import PageKey

from .config import ReadOnly
from .deletelog import DELETES_NAME, DELETES_TEMP, Planted, load_deletes_retrying, remove_temp, save_deletes
from .layoutdir import (
    FANOUT,
    LOCK_NAME,
    SETTLE_NS,
    STOP_EVERY,
    DirStamp,
    FollowSeed,
    FreeSpace,
    dir_stamp,
    fanout_gone,
    file_identity,
    free_space,
    list_fanout,
    lock_named,
    open_private_subdir,
)
from .safefiles import OPEN_FLAGS, UnsafeDirectoryError, UnsafeFileError, check_page_fd, classify_open_error

if TYPE_CHECKING:
    from .statxring import StatxRefused, StatxRing

log = logging.getLogger("aiokv.storage.disk")

BATCHED_STATX = True
"""The looks examine the fan-out directories in one io_uring batch (see above); False: one
``fstat`` each, as before (A/B runs: ``tools/bench_follow_look.py --stat``). Read at each look."""

Stats = dict[int, os.stat_result | OSError]
"""A batch's results by descriptor: what ``os.fstat`` returned, or raised."""


class FollowState:
    """What the looks know of the directory. Owned by the look in progress (one at a time, on its
    thread); the loop only creates it and sets :attr:`stop`."""

    def __init__(self, seed: FollowSeed) -> None:
        self.entries: list[dict[PageKey, int] | None] = seed.entries
        self.stamps: list[DirStamp | None] = seed.stamps
        self.layout_stamp = seed.layout_stamp
        self.retry: set[int] = {index for index, known in enumerate(seed.entries) if known is None}
        """Fan-out directories without a descriptor whose last open or listing failed (at first:
        every one the start could not list): tried again at every look (until found absent)."""
        self.refused: dict[PageKey, int] = {}
        """Keys whose file a read refused (header, checksum, size) since the looks last told why,
        with how many reads: the next look tells a file that changed under the reads (the writer
        recycled, replaced or removed it) from one that is corrupt (:func:`_tell_refused`)."""
        self.corrupt: dict[int, set[PageKey]] = {}
        """Per fan-out directory, keys whose refused file had not changed since it was indexed:
        examined again (one ``stat`` each) only when a look lists their directory again, and
        indexed again once their file's identity changed (the writer stored the key anew, maybe
        under the same inode number)."""
        self.vouched: dict[int, dict[PageKey, int]] = {}
        """Per fan-out directory, refused keys indexed again with the identity their file had when
        a look recorded it at least :data:`~.layoutdir.SETTLE_NS` after its change time (any change
        since shows a later change time): their next refusal, the identity unchanged, is
        ``corrupt``. Only keys refused once (the entries stay one int per key); dropped once the
        key is refused again, or its directory's listing finds another identity."""
        self.whole: dict[int, list[PageKey]] = {}
        """Per fan-out directory, the keys whose names the look in progress examines whole when it
        lists that directory (:func:`look`'s ``whole``), not by inode number alone."""
        self.whole_due: list[tuple[int, int, PageKey, int]] = []
        """``(index, descriptor, key, identity listed)`` of those names the look's listings found
        as known: examined together once the listings are done (:func:`_examine_whole`)."""
        self.stop = threading.Event()
        """Set by the tier's close: the look in progress ends after the directory it is at."""
        self.ring: StatxRing | None = None
        """The looks' io_uring for their ``statx`` batches: made by the first look that batches,
        closed by :meth:`close_ring` (no look runs then)."""
        self.statx_refused: StatxRefused | None = None
        """Why the looks ``fstat`` each directory (io_uring or STATX refused here), or None."""
        self.deletes_unreadable = False
        """The last look could not read the pending-delete record: the same fault is not counted
        again at every look (a damaged record stays until its writer replaces it)."""
        self.withholding = seed.withholding
        """A look without the lock (or the start) could not read the record since one last did: its deletes are
        unknown, so the tier serves none of the pages the looks know (:attr:`Look.withheld`). The
        look that reads it again lists every directory whole and reports every file as found
        anew (:func:`_find_all_anew`): indexed again unless the record (or a delete the tier
        remembers) names it."""

    def close_ring(self) -> None:
        """Close the looks' ring (idempotent): by the look that took the directory over, and at the
        tier's close once no look runs. A later look makes another."""
        ring, self.ring = self.ring, None
        if ring is not None:
            ring.close()

    def forget(self, keys: set[PageKey]) -> None:
        """Between two looks (on the loop): the next look examines ``keys``' names again, as new,
        whatever inode it knew there (the tier found their files gone: a file made since under the
        same inode number is another file)."""
        for key in keys:
            known = self.entries[key[0]]  # a key's fan-out directory is its first byte
            if known is not None and known.pop(key, None) is not None:
                self.stamps[key[0]] = None
            vouched = self.vouched.get(key[0])
            if vouched is not None:
                vouched.pop(key, None)

    def refuse(self, refused: dict[PageKey, int]) -> None:
        """Between two looks (on the loop): reads refused ``refused``'s files (key -> reads); the
        next look tells why (:attr:`refused`)."""
        mine = self.refused
        for key, reads in refused.items():
            mine[key] = mine.get(key, 0) + reads

    def undecided(self) -> set[PageKey]:
        """Keys of refused reads no look could tell about yet (their directory could not be listed)."""
        return set(self.refused)


@dataclass
class Look:
    """What one look found, for the loop to apply (:meth:`close` what it does not take over)."""

    added: list[PageKey] = field(default_factory=list)
    """Keys of page files new since the last look (or under a new inode), oldest first."""
    mtimes: dict[PageKey, int] = field(default_factory=dict)
    """The last modification time (ns) of each file of :attr:`added` (the loop leaves out one a
    remembered delete names: :meth:`~.followpath.FollowPath._apply_look`)."""
    removed: list[PageKey] = field(default_factory=list)
    """Keys whose files are gone."""
    opened: dict[int, int] = field(default_factory=dict)
    """Fan-out directories the look opened (index -> checked descriptor): the tier's from now on."""
    retired: list[tuple[int, int]] = field(default_factory=list)
    """``(index, descriptor)`` of fan-out directories whose name no longer leads to them."""
    faults: list[tuple[OSError, str]] = field(default_factory=list)
    lock_fd: int | None = None
    """The directory's lock, when the look took it: the tier writes from now on."""
    space: FreeSpace | None = None
    """With the lock: the file system's room."""
    read_only: ReadOnly | None = None
    """With the lock: why the tier still may not write (a read-only file system...), or None."""
    temp_removed: int = 0
    raced: int = 0
    """Refused reads of files that changed since they were indexed (recycled, replaced, removed
    under the read): no corruption; a file now under the name is in :attr:`added`."""
    corrupt: dict[PageKey, int] = field(default_factory=dict)
    """Refused reads (per key) of files unchanged since they were indexed: corrupt."""
    writable: bool = False
    """A look of a tier holding the lock on a directory it could not write (``held``): it may
    now, and the look scanned it as a take-over does (the tier writes from now on)."""
    lock_not_ours: bool = False
    """A held look that may write now, where ``.lock`` does not name the lock the tier holds
    (removed, or replaced: another cache may write there): no take-over; the loop asks its lock
    check now, which takes ``.lock`` again or finds it lost."""
    deletes: dict[PageKey, int] = field(default_factory=dict)
    """The writer's pending-delete record as this look read it (:mod:`.deletelog`): key -> time of
    a delete whose unlink failed (the file maybe still there). Empty when unreadable (a fault),
    but for a look that takes the directory over: then every key the looks know a file of, with
    the time of the look (:func:`_deletes_unknown`), or, once it unlinked them and replaced the
    record, those whose file is still there (:func:`_replace_record`)."""
    withheld: bool = False
    """A look without the lock that could not read the record (EIO, damaged: its deletes unknown):
    as at a start, none of the pages the tier indexed is served, and none is indexed, until a look
    reads it again (:attr:`FollowState.withholding`). Review 231: such looks went on indexing and
    serving, a page the writer deleted (its unlink failed, named only in the record) included."""
    unlisted: list[int] = field(default_factory=list)
    """A take-over's fan-out directories (with a descriptor) whose listing failed: the tier that
    writes from now on looks no more, and lists them again at its periodic checks."""
    record_unknown: bool = False
    """A look that takes the directory over (or may write there now) could not read the record
    (:func:`_deletes_unknown`) and did not replace it (:func:`_replace_record`: a directory not
    listed whole, the save failed): the tier replaces it once it may
    (:meth:`~.followpath.FollowPath._replace_unknown_record`)."""

    def close(self) -> None:
        """Close the descriptors the tier did not take (all of them for a look nobody applies)."""
        for fd in self.opened.values():
            os.close(fd)
        self.opened = {}
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # lets the lock go
            self.lock_fd = None


def look(state: FollowState, dir_fd: int, fanout: list[int], shown: Path, held: bool = False,
         whole: frozenset[PageKey] = frozenset(), held_lock: int | None = None) -> Look:
    """One look at the layout directory ``dir_fd`` (shown as ``shown``) whose fan-out descriptors
    are ``fanout`` (a copy of the tier's; -1: none). ``held``: the tier holds the lock already (it
    took the directory over where it may not write: a read-only file system...): the look only
    asks whether it may write now, and then scans as a take-over does. ``whole``: keys whose names
    are examined whole (one ``stat`` each: inode number and change time) whenever their directory
    is listed, not taken for the file known by inode number alone (the tier's deletes while it
    follows: the writer may store such a key anew under the freed inode number, ext4 hands it to
    the next file made, and the look took that page for the one deleted: never indexed, unlinked
    at the take-over, review 202). ``held_lock``: with ``held``, a duplicate of the descriptor of
    the lock the tier holds now (the caller's, closed by it after the look; None: not at hand):
    the look takes the directory over (scans as a take-over, reports ``writable``), replaces a
    damaged record or removes its temporary file only while ``.lock`` names that file
    (:func:`_lock_still_ours`). Blocking: run on a thread. Faults are reported in
    :attr:`Look.faults`, never raised."""
    result = Look()
    found: dict[PageKey, int] = {}  # key -> mtime (ns): nothing the cyclic GC tracks
    indexed = _indexed(state)
    state.whole = {}
    state.whole_due = []
    for key in whole:
        state.whole.setdefault(key[0], []).append(key)  # a key's fan-out directory is its first byte
    try:
        if not held:
            result.lock_fd = _try_lock(dir_fd, shown, result.faults)
        # Before the listings: a delete recorded after this read is read by the next look. With the
        # lock (taken now, or held) the record is final (only its holder writes it): read after
        # taking it, a delete the writer recorded just before it let the lock go is read too.
        unreadable = _read_deletes(state, result, dir_fd, shown)
        if unreadable is None and state.withholding:
            _find_all_anew(state)  # the record reads again: every page found serves again (unless named)
        if held:
            # Scanned as a take-over (temporary files removed, fan-out directories made, then the
            # tier writes) only while ``.lock`` names the lock the tier holds, asked before the
            # scan: review 241, once ``.lock`` was replaced and another cache took the new one, the
            # scan unlinked that writer's temporary file under its page write in flight and the
            # tier wrote beside it until its lock check. Not ours: the lock check, asked now,
            # tells (taken again, or lost: then it follows); asked again after the scan for the record.
            if _may_write(result, dir_fd) and result.read_only is None:
                if not _lock_still_ours(held_lock, result, dir_fd, shown):
                    result.lock_not_ours = True
                else:
                    result.writable = _take_over(state, result, found, dir_fd, fanout, shown)
                    if result.writable and _lock_still_ours(held_lock, result, dir_fd, shown):
                        _remove_record_temp(result, dir_fd, shown)
        elif result.lock_fd is None:
            _follow(state, result, found, dir_fd, fanout, shown)
        elif not (_may_write(result, dir_fd) and _take_over(state, result, found, dir_fd, fanout, shown)):
            os.close(result.lock_fd)
            result.lock_fd = None
        elif result.read_only is None:
            _remove_record_temp(result, dir_fd, shown)
        if unreadable is not None and not held and result.lock_fd is None:
            # Asked once the look knows whether the tier takes over: one that took the lock but not
            # the directory (a fan-out name not safely ours) let it go, and follows on (review 232:
            # it applied its scan with no deletes known, and the page the writer deleted was served).
            state.withholding = result.withheld = True
        if not state.stop.is_set():
            _examine_whole(state, result, found, shown)
            _tell_refused(state, result, found, indexed, fanout, shown)
        if unreadable is not None and (result.lock_fd is not None or result.writable):
            _deletes_unknown(state, result, found, unreadable, shown)
            result.record_unknown = True  # (until _replace_record saves one)
            # A held look that may write now replaces it too (review 227: the damaged record stayed
            # after a take-over on a read-only file system, and every later start lost the pages
            # stored since), while the tier's lock is still the one it took.
            if result.read_only is None and not state.stop.is_set() and (
                    result.lock_fd is not None or _lock_still_ours(held_lock, result, dir_fd, shown)):
                _replace_record(state, result, found, dir_fd, fanout, shown)
        result.added = sorted(found, key=found.__getitem__)  # oldest first, here rather than on the loop
        result.mtimes = found
        if result.lock_fd is not None or result.writable:
            state.close_ring()  # the tier writes from now on (a later look, if any, makes another)
    except BaseException:
        result.close()
        raise
    return result


def _read_deletes(state: FollowState, result: Look, dir_fd: int, shown: Path) -> OSError | None:
    """The writer's pending-delete record into :attr:`Look.deletes`; the fault when it cannot be
    read (recorded once until a look reads it again). A passing fault is tried again first, as a
    start does (:func:`~.deletelog.load_deletes_retrying`): by a look that holds the lock (the
    record is final then), and by one that does not, which serves no page while it cannot read it
    (:attr:`Look.withheld`: one EMFILE would withhold them all until the next look)."""
    what = f"reading {shown / DELETES_NAME}"

    def retrying(exc: OSError) -> None:
        if not state.deletes_unreadable:
            result.faults.append((exc, f"{what} (tried again)"))

    try:
        result.deletes = load_deletes_retrying(dir_fd, retrying)
    except OSError as exc:
        if not state.deletes_unreadable:
            result.faults.append((exc, what))
        state.deletes_unreadable = True
        return exc
    state.deletes_unreadable = False
    return None


def _find_all_anew(state: FollowState) -> None:
    """The record reads again after looks that withheld every page (:attr:`Look.withheld`): every
    directory the looks listed is listed whole again with nothing known, so this look reports each
    file there as found (the tier indexes those the record and its remembered deletes do not
    name)."""
    state.withholding = False
    for index, entries in enumerate(state.entries):
        if entries is not None:
            state.entries[index] = {}
            state.stamps[index] = None


def _deletes_unknown(state: FollowState, result: Look, found: dict[PageKey, int], fault: OSError,
                     shown: Path) -> None:
    """A look that takes the directory over (or may write there now) where the record cannot be
    read: its deletes are unknown, so, as at a start, no page on disk is served. Every key the looks
    know a file of counts as deleted now (:attr:`Look.deletes`): the loop drops it from the index,
    indexes none of them, and its take-over unlinks them. Review 222: the look took over with no
    deletes at all, and kept serving a page the writer had deleted (its unlink failed: the file
    still there, named in the record) for good. The fault is recorded (once for this look: counted
    again when an earlier look counted it, the take-over's loss is another) and logged."""
    what = f"reading {shown / DELETES_NAME} (the directory taken over: no page found there is served)"
    result.faults = [(exc, what if exc is fault else told) for exc, told in result.faults]
    if not any(exc is fault for exc, _told in result.faults):
        result.faults.append((fault, what))
    now = time.time_ns()  # after the listings: every file they found is no newer
    keys: set[PageKey] = set(found)
    for entries in state.entries:
        if entries:
            keys.update(entries)
    result.deletes = dict.fromkeys(keys, now)
    log.error("disk tier: the pending-delete record %s cannot be read (%s) as this tier takes the directory "
              "over: none of the %d pages there is served (unlinked once it may write)", shown / DELETES_NAME,
              fault.strerror, len(keys))


def _lock_still_ours(held_lock: int | None, result: Look, dir_fd: int, shown: Path) -> bool:
    """A held look (the tier took the lock at an earlier look, where it could not write): whether
    ``.lock`` still names the file the tier holds locked now (``held_lock``, a duplicate of its
    descriptor: the file stays open, so its inode number cannot go to another file meanwhile), so
    that no other cache writes here now (one that took a ``.lock`` put in its place would; the
    tier's lock check tells it later). False, a fault recorded where the names cannot be examined,
    when unknown (no descriptor at hand). Review 229 (of 4b00f54): the file the take-over's look
    had locked was asked for, and once the tier's lock check had taken ``.lock`` again (removed
    from outside, then made again) no held look ever replaced the damaged record: every later
    start served none of the pages stored since."""
    if held_lock is None:
        return False
    try:
        return lock_named(held_lock, dir_fd)
    except OSError as exc:
        result.faults.append((exc, f"examining {shown / LOCK_NAME}"))
        return False


def _remove_record_temp(result: Look, dir_fd: int, shown: Path) -> None:
    """A take-over that may write removes the record's temporary file a crash of its writer left
    while saving it, as a start under the lock does (:func:`~.layoutdir.apply_deletes`, review
    218). Review 225: the take-over left it there (up to the record's size) until this tier's
    first save of the record. Looked up first: an unlink waits for a frozen file system even when
    the name is not there (the write access is taken before the lookup), and the take-over look
    is otherwise only reads (a look held 30 s behind ``fsfreeze`` for a file that did not exist)."""
    try:
        os.stat(DELETES_TEMP, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    except OSError:
        pass  # the unlink below says what is wrong
    moved: Planted = []  # a directory planted there cleared (review 296: it failed at each take-over)
    try:
        if remove_temp(dir_fd, moved) and not moved:
            result.temp_removed += 1  # a file: a planted directory is counted as a fault
    except OSError as exc:
        result.faults.append((exc, f"removing {shown / DELETES_TEMP}"))
    result.faults += [(fault, f"removing {shown / DELETES_TEMP}") for fault in moved]


def _replace_record(state: FollowState, result: Look, found: dict[PageKey, int], dir_fd: int, fanout: list[int],
                    shown: Path) -> None:
    """A take-over that could not read the record (:func:`_deletes_unknown`), holding the lock
    this look took (or a held look's, :func:`_lock_still_ours`), and writable: as a start does
    (:func:`~.layoutdir.apply_deletes`), the pages it does not serve are unlinked now, on this
    thread, and the record replaced by one naming those whose unlink failed (or whose file changed
    since the listing), all with the time of the look; a name that holds no page of ours (a
    symlink, a directory, another user's file) is left alone and not named, as a start does.
    Review 225: the take-over left the damaged record on disk, and every later start over
    the directory took its deletes for unknown again: none of the pages the new writer stored was
    served, all unlinked (the cache lost at each restart, until a failed unlink saved a record).
    Only where every fan-out directory was listed whole: a file no listing saw may be a page
    deleted, which only the damaged record still keeps from a start (the record stays then). In
    that order: a crash before the save leaves the damaged record (no page served at the next
    start), after it one naming every file still there. An unlink's fault is not recorded here: the
    loop's take-over unlinks these keys again (the file stays: counted there, and named in the
    record by the tier). A save's fault is recorded (the record stays as it was).

    Saved, the look reports the keys unlinked as gone (:attr:`Look.removed`, applied in bounded
    steps) and only those left named as deletes: each key of :attr:`Look.deletes` is remembered
    on the loop in one step, and beyond ``DELETED_KEPT`` (65,536) that held the engine's loop for
    seconds (140,000 pages: 1.2 s; a million: 40 s) where nothing is left to remember."""
    if result.unlisted or any(fd < 0 and index not in result.opened for index, fd in enumerate(fanout)):
        return
    kept: dict[PageKey, int] = {}
    euid = os.geteuid()
    for index, entries in enumerate(state.entries):
        if not entries:
            continue
        fd = result.opened.get(index, fanout[index])
        for count, (key, identity) in enumerate(entries.items()):
            if count % STOP_EVERY == 0 and state.stop.is_set():
                # The tier closes: the record stays (what is left on disk is served by no start).
                # Asked within a directory too (review 227: a directory of many pages held the
                # close until all were unlinked).
                return
            name = bytes.hex(key)
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != euid:
                    # No page of ours (a symlink, a directory, another user's file under a page's
                    # name): a start leaves it, and names it in no record (review 227: unlinked
                    # here, or, a directory, named in the record saved for good).
                    continue
                if file_identity(st.st_ino, st) != identity:  # another file since the listing: left named
                    kept[key] = result.deletes[key]
                    continue
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass
            except OSError:
                kept[key] = result.deletes[key]
    try:
        result.faults += [(exc, f"replacing {shown / DELETES_NAME} (taken over)") for exc in save_deletes(dir_fd, kept)]
    except OSError as exc:
        result.faults.append((exc, f"saving {shown / DELETES_NAME} (taken over)"))
        return
    state.deletes_unreadable = False
    result.record_unknown = False
    result.removed += [key for key in result.deletes if key not in kept]
    result.deletes = kept
    for key in [key for key in found if key not in kept]:
        del found[key]  # unlinked; one still there stays found: the loop leaves it out and unlinks it


def _try_lock(dir_fd: int, shown: Path, faults: list[tuple[OSError, str]]) -> int | None:
    """The directory's lock if nobody holds it now, else None. Never blocks. A ``.lock`` gone is
    made again, not taken: the writer, should it live, takes it at its next check
    (:mod:`.lockwatch`); a writer that closed or died since cannot, and the next look takes it."""
    name = shown / LOCK_NAME
    try:
        fd = os.open(LOCK_NAME, os.O_RDONLY | OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        _make_lock(dir_fd, name, faults)
        return None
    except OSError as exc:
        faults.append((classify_open_error(exc, str(name)), "opening the lock file"))
        return None
    try:
        check_page_fd(fd, str(name), write=False)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # The name must still lead to the file locked: a lock on a file unlinked (or replaced)
        # meanwhile would make a second writer beside the one holding the new one.
        if not lock_named(fd, dir_fd):
            os.close(fd)
            return None
    except BlockingIOError:
        os.close(fd)  # the writer holds it
        return None
    except OSError as exc:
        os.close(fd)
        if not isinstance(exc, FileNotFoundError):
            faults.append((exc, "taking the lock"))
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _make_lock(dir_fd: int, name: Path, faults: list[tuple[OSError, str]]) -> None:
    """``.lock`` was removed (``rm``, a cleanup script) and its writer closed or died before its
    check made it again: without the file no follower would ever take the directory over."""
    try:
        os.close(os.open(LOCK_NAME, os.O_RDONLY | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o600, dir_fd=dir_fd))
    except OSError as exc:
        # Made meanwhile (by the writer's check, a start), or not ours to make (a read-only file
        # system, a directory not writable for us, the directory itself gone): nothing to take.
        if exc.errno not in (errno.EEXIST, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT):
            faults.append((classify_open_error(exc, str(name)), "making the lock file again"))


def _follow(state: FollowState, result: Look, found: dict[PageKey, int], dir_fd: int, fanout: list[int],
            shown: Path) -> None:
    """A look without the lock: the fan-out directories that changed, listed again."""
    layout_changed = _layout_changed(state, result, dir_fd)
    if layout_changed:
        _check_names(state, result, dir_fd, fanout, shown)
    retired = {index for index, _fd in result.retired}  # what is at their names now: at a later look
    stats = _stat_batch(state, fanout)
    for index in range(FANOUT):
        if state.stop.is_set():
            return
        fd = fanout[index]
        if fd >= 0:
            _relist(state, result, found, index, fd, shown, remove_temps=False, always=False, stats=stats)
        elif index not in retired and (layout_changed or index in state.retry):
            fd = _open_late(state, result, dir_fd, index, shown, create=False)
            if fd >= 0 and not _relist(state, result, found, index, fd, shown, remove_temps=False, always=True):
                _drop_late(state, result, index)


def _may_write(result: Look, dir_fd: int) -> bool:
    """With the lock held: the file system's room and why the tier may not write there
    (:attr:`Look.read_only`, as a start decides it). False (recorded) when statvfs failed."""
    try:
        result.space = space = free_space(dir_fd)
    except OSError as exc:
        result.faults.append((exc, "statvfs"))
        return False
    if space.read_only:
        result.read_only = ReadOnly.FILE_SYSTEM
    elif not os.access(".", os.W_OK | os.X_OK, dir_fd=dir_fd, effective_ids=True):
        result.read_only = ReadOnly.NOT_WRITABLE
    return True


def _take_over(state: FollowState, result: Look, found: dict[PageKey, int], dir_fd: int, fanout: list[int],
               shown: Path) -> bool:
    """With the lock held (:func:`_may_write` asked): every fan-out directory scanned as a start
    under the lock does. False (the lock to be let go, the fault recorded) when one is not safely
    ours."""
    _layout_changed(state, result, dir_fd)
    _check_names(state, result, dir_fd, fanout, shown)
    writable = result.read_only is None
    stats = _stat_batch(state, fanout)
    for index in range(FANOUT):
        if state.stop.is_set():
            return False
        fd = fanout[index]
        if fd >= 0:
            if not _relist(state, result, found, index, fd, shown, remove_temps=writable, always=True, stats=stats):
                result.unlisted.append(index)  # (nothing of it reported: its files are unknown)
            continue
        fd = _open_late(state, result, dir_fd, index, shown, create=writable)
        if fd == -2:
            return False  # not safely ours: a start would refuse the directory
        if fd >= 0 and not _relist(state, result, found, index, fd, shown, remove_temps=writable, always=True):
            _drop_late(state, result, index)
    return True


def _layout_changed(state: FollowState, result: Look, dir_fd: int) -> bool:
    """Whether the layout directory changed since the last look (fan-out directories made,
    renamed, removed); its new stamp is kept."""
    try:
        st = os.fstat(dir_fd)
    except OSError as exc:
        result.faults.append((exc, "examining the layout directory"))
        return False
    before, state.layout_stamp = state.layout_stamp, dir_stamp(st)
    return before is None or before != (st.st_mtime_ns, st.st_ctime_ns)


def _check_names(state: FollowState, result: Look, dir_fd: int, fanout: list[int], shown: Path) -> None:
    """Retire each fan-out descriptor whose name no longer leads to its directory."""
    for index, fd in enumerate(fanout):
        if fd < 0 or index in result.opened:
            continue
        try:
            why = fanout_gone(dir_fd, index, fd, shown)  # removed (its pages with it) or replaced
        except OSError as exc:
            result.faults.append((exc, f"examining {shown / f'{index:02x}'}"))
            continue
        if why is None:
            continue
        result.faults.append((why, "following the directory"))
        _retire(state, result, index, fd)
        fanout[index] = -1


def _retire(state: FollowState, result: Look, index: int, fd: int) -> None:
    known = state.entries[index]
    if known:
        result.removed += known
    state.entries[index] = None
    state.stamps[index] = None
    state.vouched.pop(index, None)
    result.retired.append((index, fd))
    # What is at the name now is opened at the next look (until found absent), whether or not the
    # layout directory changes again (review 194: a look that came over SETTLE_NS after the change
    # recorded its stamp, and no later look opened the name: its pages were never followed again).
    state.retry.add(index)


def _open_late(state: FollowState, result: Look, dir_fd: int, index: int, shown: Path, create: bool) -> int:
    """Fan-out directory ``index`` opened (checked) for the tier: its descriptor, -1 when it is
    absent or cannot be opened now (recorded; tried again at the next look), -2 when it is not
    safely ours (recorded)."""
    name = f"{index:02x}"
    try:
        fd = open_private_subdir(dir_fd, name, shown / name, create=create)
    except UnsafeDirectoryError as exc:
        result.faults.append((UnsafeFileError(exc.errno, exc.strerror), f"opening {shown / name}"))
        state.retry.discard(index)  # tried again once the layout directory changes
        return -2
    except FileNotFoundError:
        state.retry.discard(index)
        return -1
    except OSError as exc:
        result.faults.append((exc, f"opening {shown / name}"))
        state.retry.add(index)
        return -1
    state.retry.discard(index)
    result.opened[index] = fd
    state.entries[index] = None  # listed whole, whatever a retired descriptor listed
    state.stamps[index] = None
    return fd


def _drop_late(state: FollowState, result: Look, index: int) -> None:
    """A fan-out directory opened by this look that could not be listed: closed again, and opened
    anew at the next look (what made it unreadable may be gone by then: a mount over it, say)."""
    os.close(result.opened.pop(index))
    state.retry.add(index)


def _stat_batch(state: FollowState, fanout: list[int]) -> Stats | None:
    """``os.fstat`` of each descriptor of ``fanout`` (-1: none) in one io_uring batch
    (:data:`BATCHED_STATX`), or None: each to be ``fstat``ed (refused here: recorded in
    :attr:`FollowState.statx_refused`, for good; or the ring could not be made now)."""
    fds = [fd for fd in fanout if fd >= 0]
    if not fds:
        return None
    got = _batched(state, lambda ring: ring.stat_fds(fds))
    return None if got is None else dict(zip(fds, got, strict=True))


def _batched(state: FollowState, batch: Callable[[StatxRing], list[os.stat_result | OSError]]
             ) -> list[os.stat_result | OSError] | None:
    """``batch`` on the looks' ring (made now if there is none), or None: each to be examined
    alone (:data:`BATCHED_STATX` off; refused here: recorded in :attr:`FollowState.statx_refused`,
    for good; or the ring could not be made now)."""
    if not BATCHED_STATX or state.statx_refused is not None:
        return None
    from .statxring import StatxRefused, open_ring  # the io_uring module loads when first used

    ring = state.ring
    try:
        if ring is None or ring.closed:  # closed: a batch ended by an exception (see statxring)
            state.ring = None  # (a closed ring is no ring: its setup's faults are the new one's)
            try:
                ring = open_ring(FANOUT)
            except OSError:
                return None  # no ring now (EMFILE...): fstat this time, a ring at the next look (ENOMEM: refused)
            state.ring = ring
        return batch(ring)
    except StatxRefused as exc:
        state.statx_refused = exc
    except OSError as exc:
        state.statx_refused = StatxRefused(exc.errno or 0, f"io_uring_enter failed ({exc})")  # never expected
    state.close_ring()
    return None


def _examine_whole(state: FollowState, result: Look, found: dict[PageKey, int], shown: Path) -> None:
    """After the listings: each name of :attr:`FollowState.whole_due` examined whole (inode number
    and change time, :func:`_examine`), all in ``statx`` batches on the looks' ring (one GIL wait
    per batch: one ``stat`` each waited for the GIL after each, up to the switch interval beside a
    busy loop, review 203), else one ``stat`` each. A key whose name is empty now (or holds no page
    file of ours) is reported gone."""
    due, state.whole_due = state.whole_due, []
    if not due:
        return
    targets = [(fd, bytes.hex(key)) for _index, fd, key, _before in due]
    stats: list[os.stat_result | OSError] | list[None] = _batched(state, lambda ring: ring.stat_at(targets)) or (
        [None] * len(due))
    for (index, fd, key, before), examined in zip(due, stats, strict=True):
        entries = state.entries[index]
        if entries is None or entries.get(key) != before or key in found:
            continue  # examined since (a corrupt file's recheck), or its directory dropped
        _examine(state, result, found, index, key, before, fd, shown / f"{index:02x}", examined)
        if key not in entries:
            result.removed.append(key)  # gone since the listing (or not a page file of ours)


def _relist(state: FollowState, result: Look, found: dict[PageKey, int], index: int, fd: int, shown: Path,
            remove_temps: bool, always: bool, stats: Stats | None = None) -> bool:
    """List fan-out directory ``index`` again if it changed (``always``: in any case) and report
    what is new and what is gone (``stats``: its descriptor examined already, see
    :func:`_stat_batch`). False when the listing failed: nothing reported, the fault recorded, and
    the directory listed again next time."""
    name = shown / f"{index:02x}"
    try:
        examined = stats.get(fd) if stats is not None else None
        if isinstance(examined, OSError):
            raise examined
        st = examined if examined is not None else os.fstat(fd)
    except OSError as exc:
        result.faults.append((exc, f"examining {name}"))
        return False
    if not st.st_nlink:  # removed (its files with it): listing it fails with ENOENT
        result.faults.append((FileNotFoundError(errno.ENOENT, f"{name} was removed"), "following the directory"))
        if index not in result.opened:
            _retire(state, result, index, fd)
        return False
    stamp = (st.st_mtime_ns, st.st_ctime_ns)
    if not always and state.stamps[index] == stamp:
        return True
    known = state.entries[index]
    listing = list_fanout(fd, index, name, remove_temps, known or {}, result.faults, None, state.stop.is_set)
    result.temp_removed += listing.temp_removed
    if not listing.complete or not listing.examined:
        state.stamps[index] = None  # nothing from it this time: listed again at the next look
        return False
    found.update(listing.found)
    entries = listing.entries
    if known:
        result.removed += [key for key in known if key not in entries]
    state.entries[index] = entries
    state.stamps[index] = dir_stamp(st)
    for key in state.whole.get(index, ()):
        before = entries.get(key)
        if before is not None and key not in listing.found:  # taken for the file known by its inode
            state.whole_due.append((index, fd, key, before))
    if index in state.corrupt:
        _recheck_corrupt(state, result, found, index, fd, name)
    vouched = state.vouched.get(index)
    if vouched is not None:
        for key in [key for key, identity in vouched.items() if entries.get(key) != identity]:
            del vouched[key]  # another file under the name now (or none): what was vouched is moot
        if not vouched:
            del state.vouched[index]
    return True


def _recheck_corrupt(state: FollowState, result: Look, found: dict[PageKey, int], index: int, fd: int,
                     shown: Path) -> None:
    """After a listing of fan-out directory ``index``: a corrupt file's key is indexed again once
    the file under its name is another (the writer stored the key anew: under the same inode
    number too, as ext4 hands a freed one to the next file made), and forgotten once its name is
    gone."""
    corrupt = state.corrupt[index]
    entries = state.entries[index]
    assert entries is not None
    for key in list(corrupt):
        before = entries.get(key)
        if before is None or key in found:  # gone, or another inode: the listing reported it
            corrupt.discard(key)
        elif _examine(state, result, found, index, key, before, fd, shown) is not False:
            corrupt.discard(key)  # another file now (or none), or not examined: as a new one
    if not corrupt:
        del state.corrupt[index]


def _indexed(state: FollowState) -> dict[PageKey, int | None]:
    """Before a look's listings: the identity each refused key's file had when it was indexed (None:
    not known, the read found its file gone meanwhile, or its directory was never listed whole)."""
    indexed: dict[PageKey, int | None] = {}
    for key in state.refused:
        entries = state.entries[key[0]]
        indexed[key] = entries.get(key) if entries is not None else None
    return indexed


def _tell_refused(state: FollowState, result: Look, found: dict[PageKey, int], indexed: dict[PageKey, int | None],
                  fanout: list[int], shown: Path) -> None:
    """For each key a read refused since the last look (after the listings; ``indexed``: its
    file's identity before them): its file changed since it was indexed — recycled, replaced or
    removed under the read: counted :attr:`Look.raced`, and the file under its name now (if
    any) indexed again — or it did not. Unchanged, and that identity was recorded at least
    :data:`~.layoutdir.SETTLE_NS` after the file's change time (:attr:`FollowState.vouched`):
    corrupt (:attr:`Look.corrupt`, kept in :attr:`FollowState.corrupt`). Unchanged, but recorded
    earlier (or when, unknown: a listing's): the file may have changed and changed back within
    one tick of a coarse clock under the read, so the identity is recorded again (vouched for
    now) and the key indexed again (in :attr:`Look.added`), the read counted neither way: its
    next refusal decides. A key whose directory could not be listed, or whose file changed less
    than that before, waits for a later look (one ``stat`` a look, no read)."""
    for key, reads in list(state.refused.items()):
        index = key[0]
        entries, fd = state.entries[index], fanout[index]
        if fd >= 0 and entries is None:
            continue  # its directory could not be listed: at a later look
        del state.refused[key]
        vouched = state.vouched.get(index, {})
        before = indexed.get(key)
        if fd < 0 or entries is None or before is None or entries.get(key) != before:
            # Its directory is gone, or its file was not the one indexed (or this look's listing
            # found another there, or none, and reported it).
            result.raced += reads
            vouched.pop(key, None)
        else:
            _tell_unchanged(state, result, found, key, reads, before, vouched, fd, shown)
        if not vouched:
            state.vouched.pop(index, None)


def _tell_unchanged(state: FollowState, result: Look, found: dict[PageKey, int], key: PageKey, reads: int,
                    before: int, vouched: dict[PageKey, int], fd: int, shown: Path) -> None:
    """:func:`_tell_refused` for a key whose file the listings found as indexed (identity
    ``before``; ``vouched``: its directory's :attr:`FollowState.vouched`, maybe a new dict)."""
    index = key[0]
    now = time.time_ns()  # before the stat: a change after it shows a later change time
    changed = _examine(state, result, found, index, key, before, fd, shown / f"{index:02x}")
    if changed is None or (not changed and now - (before >> 64) < SETTLE_NS):
        # Not examined (recorded), or changed too lately to tell: a write within one tick of a
        # coarse clock leaves the change time as it was, and the writer renames a recycled file
        # away at once. At a later look.
        state.refused[key] = reads
    elif changed:
        result.raced += reads
        vouched.pop(key, None)
    elif vouched.pop(key, None) == before:
        result.corrupt[key] = reads
        state.corrupt.setdefault(index, set()).add(key)
    else:
        # The same identity, recorded now at least SETTLE_NS after its change time: any change
        # from now on shows. Indexed again (ordered by its change time: mtime is not at hand).
        vouched[key] = before
        state.vouched[index] = vouched
        found[key] = before >> 64


def _examine(state: FollowState, result: Look, found: dict[PageKey, int], index: int, key: PageKey, before: int,
             fd: int, shown: Path, examined: os.stat_result | OSError | None = None) -> bool | None:
    """Whether the file under ``key``'s name in fan-out directory ``index`` (descriptor ``fd``) is
    another than the one of identity ``before``: True (what the looks know updated: a page file of
    ours is put in ``found``, to be indexed again; anything else, and a file made there later, is
    examined by the next listing as new), False, or None when it cannot be examined (recorded).
    ``examined``: what a batch's ``statx`` of the name gave (None: ``stat`` it now)."""
    name = bytes.hex(key)
    try:
        if isinstance(examined, OSError):
            raise examined
        st = examined if examined is not None else os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        result.faults.append((exc, f"examining {shown / name}"))
        return None
    entries = state.entries[index]
    assert entries is not None
    if st is not None:
        now = file_identity(st.st_ino, st)
        if now == before:
            return False
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            entries[key] = now
            found[key] = st.st_mtime_ns
            return True
    entries.pop(key, None)
    state.stamps[index] = None  # listed again at the next look, whatever its times
    return True
