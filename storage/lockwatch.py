"""The writer's check of its lock's name, run on a thread every ``DiskConfig.follow_interval_s``.

The writer holds a ``flock`` on the inode ``<layout dir>/.lock`` named when it took it. Once that
name is unlinked or replaced (an operator's ``rm``, a cleanup script, ``mv``), the lock protects
nothing: a cache starting there, or a follower's look, opens the file under the name now, locks it
and writes too. :func:`check_lock` asks whether the name still leads to the held file; if not, it
takes the name again as a start does (opened, created if gone, checked as a page file, non-blocking
``flock``, the name verified to lead to the file locked):

- taken: the tier holds the new file and lets the old one go: still the only writer;
- held by another cache: that cache writes now (it started, or took over, on the new file): the
  tier stops writing and follows it (:mod:`.followpath`);
- a symlink, FIFO or another non-regular file planted there: refused as at start (never followed or
  locked); nobody can lock through it, so the tier goes on writing and checks again next time.

Gone and not ours to make again now (a read-only file system, a directory we may not write:
EROFS, EACCES, EPERM) is no fault, as for a follower making it (:mod:`.follow`): nobody can make
and lock a file there either, so the tier goes on writing and checks again next time (once the file
system is writable, that check makes and takes the file). Any other file system fault (EIO) is
recorded and changes nothing: checked again next time.

The same check looks at the fan-out directories (:func:`check_fanouts`): the tier writes through a
descriptor of each, which a directory moved away whole (``mv 3a /elsewhere``, or to another name
inside) still leads to: writes through it would land outside the cache; and a directory removed
with its files (``rm -rf 3a``) fails no write of a key still indexed (found stored, nothing
written). One ``fstat`` of the layout directory per check; only when its stamp changed since the
last check (or was too recent to tell a change by) is each name checked against its descriptor
(:func:`~.layoutdir.fanout_gone`, the follower's check), and the tier retires those that no longer
lead to it; a name without a descriptor (retired, or just found replaced) that leads to a directory
again (moved back, a backup restored) is opened, and so listed, by the loop.

And it reads the pending-delete record (:mod:`.deletelog`) again when it changed since the last
check (:func:`check_record`: one ``stat`` when it did not): a writer still running after its
``.lock`` was replaced may save a delete there after this tier's start or take-over read it (its
unlink failed: the file still there), until its own next check tells it that it lost the lock
(review 225). Nothing it does can make this tier read that save: a save checked against the lock
name before it may still land after another cache took the new ``.lock`` and read the record, and
one checked after it tells only the old writer. So the lock holder reads the record again, and a
page it indexed from a file no newer than such a delete leaves its index
(:meth:`~.followpath.FollowPath._apply_record_check`): served for at most one check interval after
that save.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aiokv.keys import PageKey

from .deletelog import DELETES_NAME, TRANSIENT_ERRNOS, load_deletes
from .layoutdir import LOCK_NAME, STOP_EVERY, DirStamp, dir_stamp, fanout_gone, lock_named
from .safefiles import OPEN_FLAGS, check_page_fd, classify_open_error

RecordStamp = tuple[int, int, int, int]
"""The pending-delete record's ``(st_dev, st_ino, st_ctime_ns, st_size)``: it is replaced by a
rename (another inode) at every save."""

_NOT_OURS_TO_MAKE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
"""What creating ``.lock`` answers where it is gone and may not be made again now (a read-only file
system, a directory we may not write)."""


class LockState(enum.Enum):
    """What a check found of the lock's name."""

    HELD = "held"
    """The name leads to the file the tier holds."""
    RETAKEN = "retaken"
    """Gone or replaced, and the tier took the file under it now (:attr:`LockCheck.fd`)."""
    LOST = "lost"
    """Replaced, and another cache holds the file under it now: that cache writes."""
    UNKNOWN = "unknown"
    """Could not be told or taken (the fault recorded): as before, checked again next time."""


@dataclass
class LockCheck:
    """One check's outcome, for the loop to apply (:meth:`close` what it does not take over)."""

    state: LockState
    fd: int | None = None
    """:attr:`LockState.RETAKEN`: the new lock, held."""
    fault: tuple[OSError, str] | None = None
    fanouts: FanoutCheck | None = None
    """The fan-out directories' check made with it (:func:`check_writer`)."""
    record: RecordCheck | None = None
    """The pending-delete record read again (:func:`check_record`), or None: unchanged, or not read."""

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@dataclass
class FanoutCheck:
    """What a check found of the fan-out names, for the loop to apply."""

    stamp: DirStamp | None
    """The layout directory's stamp, taken before the names were examined, for the next check
    (None: examine them all again then: too recent to tell a later change by, or a fault)."""
    gone: list[tuple[int, int, OSError]] = field(default_factory=list)
    """``(index, descriptor, why)`` of each fan-out descriptor whose name no longer leads to it:
    removed (``FileNotFoundError``) or moved or replaced (``UnsafeFileError``)."""
    back: list[int] = field(default_factory=list)
    """Fan-out names without a descriptor held (retired, unreadable at start), or just found
    replaced, that lead to a directory now (put back, restored, made again): the loop opens them,
    checked, which lists them (:meth:`~.followpath.FollowPath._list_opened`)."""
    faults: list[tuple[OSError, str]] = field(default_factory=list)


@dataclass
class RecordCheck:
    """The pending-delete record as a check read it again."""

    stamp: RecordStamp | None
    """Its identity when read (None: there is none), for the next check."""
    deletes: dict[PageKey, tuple[int, int | None]] = field(default_factory=dict)
    """Key -> (time of the delete, ns; the modification time of the file under the key's name
    now, or None: no page file there, or it could not be examined)."""
    fault: OSError | None = None
    """It could not be read (damaged, EIO; ``stamp`` then the last check's, so it is read again
    at the next): the lock holder replaces it with the record it keeps
    (:meth:`~.followpath.FollowPath._replace_damaged_record`)."""


def check_writer(dir_fd: int, lock_fd: int, fanout: Sequence[int], stamp: DirStamp | None,
                 shown: Path, record: RecordStamp | None = None, stop: Callable[[], bool] | None = None) -> LockCheck:
    """The writer's periodic check: the lock (:func:`check_lock`), the fan-out names
    (:func:`check_fanouts`) and the pending-delete record if it changed since ``record`` (the last
    check's :attr:`RecordCheck.stamp`; :func:`check_record`, which asks ``stop``: the close).
    Blocking: run on a thread. Faults are reported, never raised."""
    found = check_lock(dir_fd, lock_fd, shown)
    try:
        found.fanouts = check_fanouts(dir_fd, fanout, stamp, shown)
        if found.state is not LockState.LOST:  # (lost: this tier follows, and its looks read it)
            found.record = check_record(dir_fd, fanout, record, stop)
    except BaseException:
        found.close()
        raise
    return found


def check_record(dir_fd: int, fanout: Sequence[int], seen: RecordStamp | None,
                 stop: Callable[[], bool] | None = None) -> RecordCheck | None:
    """The pending-delete record in the layout directory ``dir_fd``, when its identity differs from
    ``seen`` (else None: one ``stat``), with the modification time of the file under each key's
    name in the fan-out directories ``fanout`` (-1: none held). One that cannot be read (EIO,
    damaged) is reported by :attr:`RecordCheck.fault`, uncounted (the start and the looks count
    such a record); None for a passing fault (out of descriptors or memory): tried again at the
    next check. Review 232: a damaged record was left for the tier's next save, which a writer
    whose retried unlink keeps failing never made, and its followers withheld every page (174d014)
    for as long as it ran. ``stop`` is asked every :data:`~.layoutdir.STOP_EVERY` keys: True (the
    tier closes) ends the check there, None returned (nothing applied), so a close waits for one
    batch of names, not for a whole record. Blocking: run on a thread."""
    try:
        st = os.stat(DELETES_NAME, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None if seen is None else RecordCheck(None)
    except OSError:
        return None
    now: RecordStamp = (st.st_dev, st.st_ino, st.st_ctime_ns, st.st_size)
    if now == seen:
        return None
    try:
        records = load_deletes(dir_fd)  # replaced since the stat: read again at the next check
    except OSError as exc:
        return None if exc.errno in TRANSIENT_ERRNOS else RecordCheck(seen, fault=exc)
    found = RecordCheck(now)
    euid = os.geteuid()
    for count, (key, when) in enumerate(records.items()):
        if stop is not None and not count % STOP_EVERY and stop():
            # The tier closes: read again at the next check, if any. Review 241: a record of many
            # keys (up to MAX_RECORDS, a million: 3 s of stats on a warm local ext4, far longer on
            # a slow one) held the close until every name was examined.
            return None
        fd = fanout[key[0]]  # a key's fan-out directory is its first byte
        mtime: int | None = None
        if fd >= 0:
            try:
                named = os.stat(key.hex(), dir_fd=fd, follow_symlinks=False)
                if stat.S_ISREG(named.st_mode) and named.st_uid == euid:
                    mtime = named.st_mtime_ns
            except OSError:
                pass  # none there, or not to be examined: nothing of it served (a miss at worst)
        found.deletes[key] = (when, mtime)
    return found


def check_fanouts(dir_fd: int, fanout: Sequence[int], stamp: DirStamp | None, shown: Path) -> FanoutCheck:
    """Whether the fan-out descriptors ``fanout`` (-1: none held) still lead to the directories
    named ``00``..``ff`` in the layout directory ``dir_fd`` (shown as ``shown``): one ``fstat``,
    and a ``stat`` of each name only when the layout directory's stamp differs from ``stamp`` (the
    last check's) or that was None. Renaming, removing or making a fan-out directory changes the
    layout directory's times; a stamp is kept only once it is :data:`~.layoutdir.SETTLE_NS` old,
    so a change within a coarse clock's tick of it is still told. Blocking: run on a thread.
    Faults are reported, never raised."""
    try:
        st = os.fstat(dir_fd)
    except OSError as exc:
        return FanoutCheck(None, faults=[(exc, "examining the layout directory")])
    now = dir_stamp(st)  # before the names: a change while they are examined shows next time
    if stamp is not None and stamp == (st.st_mtime_ns, st.st_ctime_ns):
        return FanoutCheck(now)
    found = FanoutCheck(now)
    for index, fd in enumerate(fanout):
        name = f"{index:02x}"
        try:
            if fd >= 0:
                why = fanout_gone(dir_fd, index, fd, shown)
                if why is None:
                    continue
                found.gone.append((index, fd, why))
            if stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                found.back.append(index)
        except FileNotFoundError:
            continue  # none there: made (checked) when an operation first needs it
        except OSError as exc:
            found.faults.append((exc, f"examining {shown / name}"))
            found.stamp = None  # this one examined again at the next check
    return found


def check_lock(dir_fd: int, lock_fd: int, shown: Path) -> LockCheck:
    """Whether ``.lock`` in the layout directory ``dir_fd`` (shown as ``shown``) still names the file
    locked as ``lock_fd``; if not, the name taken again. Blocking: run on a thread. Faults are
    reported, never raised."""
    try:
        if lock_named(lock_fd, dir_fd):
            return LockCheck(LockState.HELD)
    except OSError as exc:
        return LockCheck(LockState.UNKNOWN, fault=(exc, "examining the lock file"))
    name = shown / LOCK_NAME
    try:
        # Created if gone (as a start does); a follower makes it only to take it at its next look.
        fd = os.open(LOCK_NAME, os.O_RDONLY | os.O_CREAT | OPEN_FLAGS, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in _NOT_OURS_TO_MAKE:
            # Not a fault (before, one was counted at every check, for as long as it lasted): no
            # cache of ours can make the file and lock it to write beside this one meanwhile.
            return LockCheck(LockState.UNKNOWN)
        return LockCheck(LockState.UNKNOWN, fault=(classify_open_error(exc, str(name)), "taking the lock again"))
    try:
        check_page_fd(fd, str(name), write=False)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not lock_named(fd, dir_fd):  # replaced again meanwhile: the next check tells
            os.close(fd)
            return LockCheck(LockState.UNKNOWN)
    except BlockingIOError:
        os.close(fd)
        return LockCheck(LockState.LOST)
    except OSError as exc:  # UnsafeFileError (a planted file) among them
        os.close(fd)
        return LockCheck(LockState.UNKNOWN, fault=(exc, "taking the lock again"))
    except BaseException:
        os.close(fd)
        raise
    return LockCheck(LockState.RETAKEN, fd)
