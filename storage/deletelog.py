"""The pending-delete record: deletes whose unlink failed, kept on disk so a restart honours them.

A delete whose unlink failed (EIO from a failing disk, EACCES, EBUSY) leaves the page file on disk
outside the index; the tier unlinks it again later (``TierBase._unlink_failed``). Kept only in
memory, a process killed before that retry succeeded left the file, and the next start's scan
indexed and served the page its caller had deleted. So the lock holder keeps such keys in
``.deletes`` in the layout directory, each with the time of the delete (ns, the clock file times
come from): a start does not index a file of a key named there that is no newer than that time,
unlinks it when it holds the lock, and forgets the key once its file is gone (or newer: stored
again since). A file stored within one granule of the file clock after the delete counts as the
page deleted: a miss, never stale data.

The record is replaced whole and atomically (written to ``.deletes.new``, fsynced, renamed over
``.deletes``, the directory fsynced): a crash leaves the old record or the new one, never a torn
one; an empty record is unlinked. Only the lock holder writes it (one process), one save at a
time (the tier's). A record that cannot be read or fails its check is no record to trust: see
:func:`load_deletes`' callers. Blocking functions: run on a thread.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import os
import stat
import struct
import threading
import time
from collections.abc import Callable

from aiokv.keys import KEY_BYTES, PageKey

from .safefiles import UnsafeFileError

DELETES_NAME = ".deletes"
DELETES_TEMP = ".deletes.new"
MAGIC = b"AIOKVDL1"
_COUNT = struct.Struct("<Q")
_RECORD = struct.Struct(f"<{KEY_BYTES}sQ")  # key, time of the delete (ns)
_DIGEST_BYTES = 16
MAX_RECORDS = 1 << 20
"""More keys than the tier ever keeps (``UNLINK_RETRY_KEPT``): a larger count is a damaged record."""


class DeletesCorrupt(OSError):
    """``.deletes`` is not a record this code wrote (planted, damaged): its deletes are unknown."""

    def __init__(self, why: str) -> None:
        super().__init__(errno.EBADMSG, f"{DELETES_NAME}: {why}")


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest()


def encode(records: dict[PageKey, int]) -> bytes:
    body = MAGIC + _COUNT.pack(len(records)) + b"".join(_RECORD.pack(key, when) for key, when in records.items())
    return body + _digest(body)


def decode(data: bytes) -> dict[PageKey, int]:
    """The records of ``data``; raises :class:`DeletesCorrupt` for anything else."""
    head = len(MAGIC) + _COUNT.size
    if len(data) < head + _DIGEST_BYTES or not data.startswith(MAGIC):
        raise DeletesCorrupt("not a pending-delete record")
    (count,) = _COUNT.unpack_from(data, len(MAGIC))
    if count > MAX_RECORDS or len(data) != head + count * _RECORD.size + _DIGEST_BYTES:
        raise DeletesCorrupt("wrong length")
    if _digest(data[:-_DIGEST_BYTES]) != data[-_DIGEST_BYTES:]:
        raise DeletesCorrupt("checksum mismatch")
    return {key: when for key, when in _RECORD.iter_unpack(data[head:-_DIGEST_BYTES])}


def load_deletes(dir_fd: int) -> dict[PageKey, int]:
    """The record in the layout directory ``dir_fd`` ({} when there is none). Opened without
    following a symlink and without blocking on a FIFO; anything but a regular file of ours with one
    link raises :class:`DeletesCorrupt`, as does a damaged record; a read fault raises ``OSError``."""
    try:
        fd = os.open(DELETES_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DeletesCorrupt("a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            raise DeletesCorrupt("not a regular file of ours")
        limit = len(MAGIC) + _COUNT.size + MAX_RECORDS * _RECORD.size + _DIGEST_BYTES
        if st.st_size > limit:
            raise DeletesCorrupt("too large")
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        return decode(b"".join(chunks))
    finally:
        os.close(fd)


TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EINTR, errno.EAGAIN})
"""Read faults that say nothing about the record (short of descriptors or memory, interrupted):
the read is tried again (:func:`load_deletes_retrying`)."""
RETRY_DELAYS_S = (0.01, 0.04, 0.16)
"""Back-off before each further try: 0.21 s in all at most, on the start's thread."""


def load_deletes_retrying(dir_fd: int, retrying: Callable[[OSError], None]) -> dict[PageKey, int]:
    """:func:`load_deletes`, tried again after a short back-off (:data:`RETRY_DELAYS_S`) when it
    fails with a passing fault (:data:`TRANSIENT_ERRNOS`; ``retrying`` is told each): such a fault
    at a start once took every page on disk for deleted (review 220). Raises as
    :func:`load_deletes` once the tries are spent, at once for any other fault. Blocking."""
    for delay in RETRY_DELAYS_S:
        try:
            return load_deletes(dir_fd)
        except DeletesCorrupt:
            raise
        except OSError as exc:
            if exc.errno not in TRANSIENT_ERRNOS:
                raise
            retrying(exc)
        time.sleep(delay)
    return load_deletes(dir_fd)


PLANTED_PREFIX = ".deletes.planted-"
"""A directory planted at the record's names, not empty, is renamed aside to this prefix and the
time (ns), in the layout directory: its content is left as it is, for whoever planted it (the
newest :data:`PLANTED_KEPT` of them)."""
PLANTED_KEPT = 4
"""Names set aside kept at most: at each directory renamed aside, the older ones beyond this are
removed where that is safe (:func:`_drop_aside`). Review 296: nothing removed them, and whoever
could write into the cache directory made the tier gather them for ever."""
ASIDE_EMPTIED_MAX = 1024
"""Entries of one directory set aside removed at most: a larger one is left (and counted)."""
ASIDE_LEFT_REMEMBERED = 4096
"""Names set aside left by a trim remembered at most (:data:`_aside_left`); past it a name left is
not remembered (tried, and counted, at each trim), those remembered stay. Before, a full set was
cleared: with more names left in the directories than this, each trim forgot what the one before
remembered and tried (and counted) them all again, at every trim."""

_aside_left: set[tuple[int, int, int, str]] = set()
"""(device, inode of the directory, inode as listed, name) of the names set aside that a trim of
this process could not remove safely: later trims do not try them again, nor count them again.
Review 306: each was tried at every trim (a directory of over 1,024 entries scanned, one of a
non-empty directory emptied anew) and the left ones counted each time, so every plant cost more
than the one before. A name, not only the inode: a directory set aside later that reuses a removed
one's inode has a name of its own (the time it was set aside). One the directory no longer lists
(removed by someone) is forgotten at its next trim (before, it kept its room in the set). A new process
tries each once more. Trims run on threads: :data:`_aside_lock`."""
_aside_lock = threading.Lock()

Planted = list[OSError]
"""Directories planted in the record's way that a save moved: each an EISDIR (the fault to count)
naming the planted name and saying what was done; and the names set aside that could not be
removed (:func:`_trim_aside`)."""


def _clear_planted(dir_fd: int, name: str, moved: Planted) -> None:
    """``name`` met EISDIR: a directory (the tier makes none there; a rename or unlink cannot
    replace one). Removed when empty (``rmdir`` removes nothing else), else renamed aside to a
    :data:`PLANTED_PREFIX` name in ``dir_fd`` — names only: nothing in it is followed, read or
    removed, nothing outside the directory touched — and the older names set aside beyond
    :data:`PLANTED_KEPT` removed (:func:`_trim_aside`). Raises ``OSError`` when neither works
    (the name is something else by now: the save fails and is tried again later)."""
    try:
        os.rmdir(name, dir_fd=dir_fd)
        done = "removed (empty)"
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        aside = f"{PLANTED_PREFIX}{_aside_stamp(dir_fd)}"
        os.rename(name, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        done = f"renamed aside to {aside} (not empty: its content left as it is)"
        moved.append(IsADirectoryError(errno.EISDIR, f"a directory planted there, {done}", name))
        _trim_aside(dir_fd, moved, keep=aside)
        return
    moved.append(IsADirectoryError(errno.EISDIR, f"a directory planted there, {done}", name))


def _aside_time(name: str) -> int:
    """The time in a name set aside; -1 (the oldest) for a name this code did not make. ASCII
    digits only: ``isdigit`` also takes ``²`` or ``①``, which ``int`` refuses (review 299: a name
    planted so made every start and save raise ``ValueError``)."""
    suffix = name[len(PLANTED_PREFIX):]
    return int(suffix) if suffix.isascii() and suffix.isdigit() else -1


def _list_aside(dir_fd: int) -> tuple[int, list[tuple[str, int]]]:
    """The device of ``dir_fd`` and its names set aside, each with its inode as listed."""
    # A descriptor of its own for the listing: ``dir_fd``'s file offset stays the tier's.
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        dev = os.fstat(fd).st_dev
        with os.scandir(fd) as scan:
            return dev, [(entry.name, entry.inode()) for entry in scan if entry.name.startswith(PLANTED_PREFIX)]
    finally:
        os.close(fd)


def _aside_stamp(dir_fd: int) -> int:
    """The time for a name set aside now: the wall clock's (ns), or one past the newest name set
    aside already where that is not below it (the clock stepped back, a name planted from the
    future): the name just set aside is always the newest, never the first trimmed (review 300)."""
    now = time.time_ns()
    try:
        _dev, aside = _list_aside(dir_fd)
    except OSError:
        return now  # the trim lists again (and counts what it meets); it keeps this name anyway
    return max([now, *(_aside_time(name) + 1 for name, _ino in aside)])


def _trim_aside(dir_fd: int, moved: Planted, keep: str | None = None) -> None:
    """Remove the names set aside beyond the newest :data:`PLANTED_KEPT` (:func:`_drop_aside`),
    ``keep`` (the one just set aside) counted among them whatever its time (a name of the same or
    a later time planted meanwhile). Those that cannot be removed safely are left as they are and
    counted, one fault for all those a trim newly left, and remembered (:data:`_aside_left`, up to
    :data:`ASIDE_LEFT_REMEMBERED`): no later trim of the process tries or counts them again. A fault
    here fails nothing (the record's save goes on), it is counted too."""
    try:
        dev, aside = _list_aside(dir_fd)
        where = os.fstat(dir_fd).st_ino
    except OSError as exc:
        moved.append(exc)
        return
    listed = {(dev, where, ino, name) for name, ino in aside}
    with _aside_lock:  # what this directory no longer lists is forgotten (its room freed)
        _aside_left.difference_update([k for k in _aside_left if k[:2] == (dev, where) and k not in listed])
    aside.sort(key=lambda entry: (entry[0] == keep, _aside_time(entry[0]), entry[0]), reverse=True)
    left = []
    for name, listed_ino in aside[PLANTED_KEPT:]:
        known = (dev, where, listed_ino, name)
        if known in _aside_left:
            continue  # left (and counted) by an earlier trim of this process: not tried again
        try:
            if not _drop_aside(dir_fd, name, listed_ino, dev):
                left.append(name)
                with _aside_lock:
                    if len(_aside_left) < ASIDE_LEFT_REMEMBERED:  # past it: tried again next time
                        _aside_left.add(known)
        except FileNotFoundError:
            pass
        except OSError as exc:
            moved.append(exc)
    if left:
        moved.append(UnsafeFileError(
            errno.ENOTEMPTY, f"{len(left)} directories set aside beyond the {PLANTED_KEPT} kept cannot be removed "
            f"safely (a directory within not empty, too many entries, a mount): left as they are", left[0]))


def _drop_aside(dir_fd: int, name: str, listed_ino: int, dev: int) -> bool:
    """Remove the name set aside ``name`` of ``dir_fd`` (listed with inode ``listed_ino``, on the
    device ``dev`` of ``dir_fd``) without following anything or leaving the cache directory: a
    non-directory is unlinked (the name: a symlink's target, a hard link's file stay as they are);
    a directory is emptied one level down — each entry that is no directory unlinked, each empty
    directory removed — and removed. False, nothing more done, where that does not empty it (a
    directory within not empty, more than :data:`ASIDE_EMPTIED_MAX` entries), or where ``name``
    is a mount point (its inode not the one listed, or another device: what is mounted there is
    not the cache's). Raises ``OSError``."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return True
    if st.st_ino != listed_ino or st.st_dev != dev:
        return False
    try:
        os.rmdir(name, dir_fd=dir_fd)
        return True
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            return False  # replaced (or mounted over) since the look: left
        with os.scandir(fd) as scan:
            entries = list(itertools.islice(scan, ASIDE_EMPTIED_MAX + 1))
        if len(entries) > ASIDE_EMPTIED_MAX:
            return False
        for entry in entries:
            # By name in the directory opened: nothing is followed (unlink and rmdir take the
            # name); a name that changed kind meanwhile fails (EISDIR, ENOTDIR), as does a mount
            # point (EBUSY) or a directory not empty: it stays.
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    os.rmdir(entry.name, dir_fd=fd)
                else:
                    os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        return False
    return True


def _unlink_record_name(dir_fd: int, name: str, moved: Planted) -> bool:
    """Unlink ``name`` (never followed: unlink takes the name), a planted directory cleared
    (:func:`_clear_planted`); False when there was none."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    except IsADirectoryError:
        _clear_planted(dir_fd, name, moved)
    return True


def remove_temp(dir_fd: int, moved: Planted) -> bool:
    """Remove the record's temporary file a crash of its writer left (the lock holder, at a start or
    a take-over); a directory planted there cleared as a save does (:func:`_clear_planted`, added
    to ``moved``). Review 296: each start and take-over failed on it (EISDIR), counted and logged
    each time, until a save of the record happened to clear it. True when a name was removed;
    raises ``OSError``."""
    return _unlink_record_name(dir_fd, DELETES_TEMP, moved)


def save_deletes(dir_fd: int, records: dict[PageKey, int]) -> Planted:
    """Replace the record in ``dir_fd`` with ``records`` atomically (unlinked when empty), durable
    when this returns. A directory planted at ``.deletes`` or ``.deletes.new`` (no rename or unlink
    replaces one: before, review 289, the record was never replaced, and every later start served
    no page it found) is removed when empty, else renamed aside (:func:`_clear_planted`); returns
    those, for the caller to count. Raises ``OSError`` (EROFS, ENOSPC, EIO...): then the old record
    stands."""
    moved: Planted = []
    _unlink_record_name(dir_fd, DELETES_TEMP, moved)  # a crash's leftover
    if not records:
        if _unlink_record_name(dir_fd, DELETES_NAME, moved):
            os.fsync(dir_fd)
        return moved
    fd = os.open(DELETES_TEMP, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=dir_fd)
    try:
        try:
            data = memoryview(encode(records))
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.rename(DELETES_TEMP, DELETES_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except IsADirectoryError:
            _clear_planted(dir_fd, DELETES_NAME, moved)
            os.rename(DELETES_TEMP, DELETES_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(DELETES_TEMP, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    os.fsync(dir_fd)
    return moved


def update_deletes(dir_fd: int, kept: dict[PageKey, int], dropped: set[PageKey], replace: bool = False) -> Planted:
    """The record on disk less ``dropped``, with ``kept`` (newer times win), saved
    (:func:`save_deletes`). Merged rather than replaced: a tier that took the directory over keeps
    what the cache before it recorded. A damaged record is replaced by ``kept`` (its start-time
    handling is :func:`~.layoutdir.apply_deletes`'), and with ``replace`` so is one that cannot be
    read (EIO: the tier took its deletes for unknown); a passing fault (:data:`TRANSIENT_ERRNOS`)
    raises, as any read fault without ``replace`` (the save is tried again later). One that reads
    is merged even so: a cache that holds the directory now (the tier not told yet) keeps its own.
    Returns the planted directories the save moved (:func:`save_deletes`)."""
    try:
        on_disk = load_deletes(dir_fd)
    except DeletesCorrupt:
        on_disk = {}
    except OSError as exc:
        if not replace or exc.errno in TRANSIENT_ERRNOS:
            raise
        on_disk = {}
    merged = {key: when for key, when in on_disk.items() if key not in dropped}
    merged.update(kept)
    if merged != on_disk or not merged:
        return save_deletes(dir_fd, merged)
    return []
