"""The layout directory at start: safe directories, the lock, what this process may do, what is there.

:func:`prepare` runs once per :meth:`DiskTier.start`, in a worker thread (it blocks on the file
system). In order:

1. The root (``DiskConfig.directory``, created 0700; it may be a symlink: the operator chose it;
   or a descriptor of it that the caller already opened and checked, e.g. an engine adapter's
   directory: then its name is never looked up again), the layout directory and the 256 fan-out
   directories (``O_NOFOLLOW``: a symlink there is refused) must be directories owned by our
   effective uid. Group/other permission bits are
   removed (0700); a directory of another owner, or one others can write whose mode cannot be
   fixed, raises :class:`UnsafeDirectoryError` and the tier does not start.
2. ``<layout dir>/.lock`` is taken with a non-blocking ``flock``: one cache writes and evicts in a
   directory at a time, so its byte budget holds however many processes share the directory. A
   second cache finds it locked and runs read-only, serving what is there. Once locked, the name
   must still lead to the file locked (else it was replaced meanwhile: opened again, up to
   :data:`LOCK_TRIES` times); the writer checks that name from then on (:mod:`.lockwatch`).
3. Read-only also when the file system is mounted read-only or the directory is not writable.
4. O_DIRECT is probed by opening an existing file (the lock file, else a page file) — creating a
   probe file is the last resort, so a full or read-only file system can still be probed.
5. Every fan-out directory is scanned through its own descriptor; one that cannot be opened or
   read (EIO) is skipped and counted, as is a file that cannot be examined. Leftover temporary
   files and spare files (:mod:`.spares`; a crash leaves them, maybe torn) are removed only by the
   lock holder (for anyone else they may be writes in flight), and counted as temporary files.
6. The pending-delete record (:mod:`.deletelog`) is honoured (:func:`apply_deletes`): pages
   deleted whose unlink failed before a crash are not indexed, and the lock holder unlinks them
   (and the record's temporary file a crash left).

:func:`list_fanout` is that scan of one fan-out directory; the looks of a tier that follows a
directory another cache holds (:mod:`.follow`) list through it too, and a start that finds the
directory locked keeps what it listed (:class:`FollowSeed`) for them.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiokv.keys import KEY_BYTES, PageKey

from .config import ReadOnly
from .deletelog import DELETES_NAME, DELETES_TEMP, Planted, load_deletes_retrying, remove_temp
from .pagefile import TEMP_PREFIX, PageFiles
from .safefiles import OPEN_FLAGS, UnsafeDirectoryError, UnsafeFileError, check_page_fd
from .spares import SPARE_PREFIX

log = logging.getLogger("aiokv.storage.disk")

LOCK_NAME = ".lock"
FANOUT = 256
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
SETTLE_NS = 1_000_000_000
"""A directory changed less than this before a listing is listed again at the next look, changed or
not: file systems stamp changes with a coarse clock, so an entry made just after the listing may
leave the directory's times as the listing saw them."""

DirStamp = tuple[int, int]
"""A directory's ``(st_mtime_ns, st_ctime_ns)``: an entry made, renamed or removed changes it."""

STOP_EVERY = 64
"""Entries a listing goes through between two looks at its stop flag (:func:`list_fanout`): a close
ends the listing of a directory of 100,000 files after these, not after the whole directory."""

INODE_BITS = (1 << 64) - 1
"""The inode number's part of a :func:`file_identity`."""


def file_identity(inode: int, st: os.stat_result) -> int:
    """The file ``st`` (its inode number ``inode``) as one int: its change time (ns) above its inode
    number. A file made under a freed inode number, a write, a rename or a link count change give
    another value (up to the file system's clock: two changes within one tick of a coarse clock may
    look alike). One int, not a tuple: nothing the cyclic GC tracks, for every entry of a followed
    directory."""
    return st.st_ctime_ns << 64 | inode


def dir_stamp(st: os.stat_result) -> DirStamp | None:
    """``st``'s stamp, or None when it is too recent to tell later changes by (:data:`SETTLE_NS`)."""
    stamp = (st.st_mtime_ns, st.st_ctime_ns)
    return stamp if time.time_ns() - max(stamp) >= SETTLE_NS else None


@dataclass
class FollowSeed:
    """What a start that found the directory locked listed, for the looks that follow it: per
    fan-out directory the :func:`file_identity` of every key-named entry as examined (None: not
    listed whole) and its stamp taken before the listing (None: list it again); the layout
    directory's stamp."""

    entries: list[dict[PageKey, int] | None] = field(default_factory=lambda: [None] * FANOUT)
    stamps: list[DirStamp | None] = field(default_factory=lambda: [None] * FANOUT)
    layout_stamp: DirStamp | None = None
    withholding: bool = False
    """The start could not read the pending-delete record: the looks withhold every page until one
    reads it (:attr:`.follow.FollowState.withholding`), rather than the pages found be remembered
    as deleted for good (review 232)."""


@dataclass
class FanoutListing:
    """One listing of a fan-out directory (:func:`list_fanout`)."""

    entries: dict[PageKey, int] = field(default_factory=dict)
    """:func:`file_identity` of every key-named entry listed (page files, and what was refused):
    as examined now, or as ``known`` had it for an entry under the same inode number."""
    found: dict[PageKey, int] = field(default_factory=dict)
    """Key -> mtime (ns) of the page files among them that ``known`` did not name (all without
    it). A dict of bytes and ints: nothing the cyclic GC tracks (a list of 60,000 tuples made
    one full collection of the process's objects, a 15 ms stall of the loop)."""
    complete: bool = True
    """False when the listing failed part-way (its fault is recorded): ``entries`` is a part."""
    examined: bool = True
    """False when an entry could not be examined (EACCES, EIO: recorded): it is not in ``entries``."""
    stopped: bool = False
    """True when its stop flag ended it part-way (``complete`` False, nothing recorded): the tier
    is closing, or the start was cancelled."""
    temp_removed: int = 0
    skipped: int = 0
    kept: list[str] = field(default_factory=list)
    """Temporary and spare names ``keep`` spared (see :func:`list_fanout`)."""


@dataclass(frozen=True)
class FreeSpace:
    """What the file system still has for us."""

    bytes: int
    """Bytes available to unprivileged users (the root reserve is left alone)."""
    files: int | None
    """Inodes available, or None where the file system has no inode limit (btrfs reports 0)."""
    read_only: bool


def free_space(dir_fd: int) -> FreeSpace:
    """``fstatvfs`` of the directory ``dir_fd`` (blocking, cheap on local file systems)."""
    st = os.fstatvfs(dir_fd)
    files = st.f_favail if st.f_files > 0 else None
    return FreeSpace(st.f_bavail * st.f_frsize, files, bool(st.f_flag & os.ST_RDONLY))


@dataclass
class Prepared:
    """The outcome of :func:`prepare`; the tier owns ``dir_fd`` and ``lock_fd`` until :meth:`close`."""

    dir_fd: int
    """The layout directory: every page file is opened, renamed and unlinked relative to it."""
    lock_fd: int | None
    """The held ``flock`` (None when another cache holds it or it could not be taken)."""
    read_only: ReadOnly | None
    direct: bool | None
    """Whether O_DIRECT opens work here; None when nothing could be probed."""
    space: FreeSpace
    found: list[tuple[int, PageKey]] = field(default_factory=list)
    """``(mtime ns, key)`` of every page file, oldest first."""
    temp_removed: int = 0
    skipped: int = 0
    """Fan-out directories and files that could not be examined."""
    faults: list[tuple[OSError, str]] = field(default_factory=list)
    """Faults met, with what was being done: the tier counts them."""
    fanout: list[int] = field(default_factory=lambda: [-1] * FANOUT)
    """Checked descriptors of the fan-out directories (-1: absent or unreadable at start): page
    files are opened, renamed and unlinked relative to them, so no operation walks a path (after a
    cache drop every walk through the fan-out directory was a lookup of its own)."""
    seed: FollowSeed | None = None
    """Kept when asked for and the directory was locked: what the follow looks start from."""
    retired: list[int] = field(default_factory=list)
    """Fan-out descriptors no longer used (their name leads elsewhere now, or the directory is
    gone), kept open until the close: an operation in flight may still name a file through one."""
    stopped: bool = False
    """The scan was stopped part-way (:func:`prepare`'s ``stop``): what it holds is a part, never
    served (the tier is closing)."""
    deletes: dict[PageKey, int] = field(default_factory=dict)
    """Pending deletes (:mod:`.deletelog`) still to carry out: key -> time of the delete (ns). Their
    files (no newer than that) are not in ``found``; the tier unlinks them when it may."""
    deletes_changed: bool = False
    """``deletes`` differs from the record on disk (deletes carried out, a damaged record): the
    lock holder saves it."""
    deletes_done: set[PageKey] = field(default_factory=set)
    """Keys of the record whose delete the start carried out (or found stored again since)."""

    def close(self) -> None:
        for fd in (*self.fanout, *self.retired, self.lock_fd, self.dir_fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.fanout = [-1] * FANOUT
        self.retired = []
        self.lock_fd = None
        self.dir_fd = -1


def prepare(files: PageFiles, root_fd: int | None = None, follow: bool = False,
            stop: Callable[[], bool] | None = None) -> Prepared:
    """Check (and create) the directories, take the lock, probe, scan. Blocking: run in a thread.

    ``root_fd``: a descriptor of ``files.root`` that the caller opened and checked (then the root
    is never opened by its path: a name swapped meanwhile cannot redirect anything); ``prepare``
    takes it over and closes it. None: the root is created (0700) and opened by its path.
    ``follow``: when another cache holds the directory, keep what the scan listed
    (:attr:`Prepared.seed`) for the looks that follow it. ``stop``: asked between fan-out
    directories and every :data:`STOP_EVERY` entries; once True the scan ends there
    (:attr:`Prepared.stopped`: a part, for the caller to close, not to serve).

    Raises :class:`UnsafeDirectoryError` for a directory that is not safely ours, ``OSError`` when
    the layout directory neither exists nor can be created."""
    if root_fd is None:
        files.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        root_fd = os.open(files.root, _DIR_FLAGS)
    try:
        check_private_dir(root_fd, files.root)
        dir_fd = open_private_subdir(root_fd, files.layout_dir.name, files.layout_dir, create=True)
    finally:
        os.close(root_fd)
    try:
        return _prepare_layout(dir_fd, files.layout_dir, follow, stop)
    except BaseException:
        os.close(dir_fd)
        raise


def _prepare_layout(dir_fd: int, shown: Path, follow: bool, stop: Callable[[], bool] | None) -> Prepared:
    faults: list[tuple[OSError, str]] = []
    lock_fd, read_only = _take_lock(dir_fd, shown, faults)
    try:
        space = free_space(dir_fd)
        if read_only is None and space.read_only:
            read_only = ReadOnly.FILE_SYSTEM
        if read_only is None and not os.access(".", os.W_OK | os.X_OK, dir_fd=dir_fd, effective_ids=True):
            read_only = ReadOnly.NOT_WRITABLE
        state = Prepared(dir_fd, lock_fd, read_only, None, space, faults=faults)
        if follow and read_only is ReadOnly.LOCKED:
            state.seed = FollowSeed(layout_stamp=dir_stamp(os.fstat(dir_fd)))
    except BaseException:
        if lock_fd is not None:
            os.close(lock_fd)
        raise
    try:
        for i in range(FANOUT):
            if (stop is not None and stop()) or not _scan_fanout(state, i, shown, stop):
                state.stopped = True
                return state  # closing: neither sorted nor probed
        apply_deletes(state, shown)
        state.found.sort()
        state.direct = _probe_direct(state)
        return state
    except BaseException:
        for fd in (*state.fanout, lock_fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        raise


def apply_deletes(state: Prepared, shown: Path) -> None:
    """Honour the pending-delete record (:mod:`.deletelog`) before anything is served: a file the
    scan found of a key named there, no newer than its delete, leaves ``found``, and is unlinked
    when this start holds the lock (the key forgotten once its file is gone; kept in
    ``state.deletes`` while the unlink fails or cannot be tried). A key the scan did not find stays
    named (its fan-out directory may be unreadable now): the tier's first retry finds it gone. A
    record that cannot be read or is damaged names unknown deletes: every page found counts as
    deleted (a miss for all rather than stale data; the lock holder unlinks them and saves a
    record of what is left). A passing read fault (out of descriptors or memory:
    :data:`~.deletelog.TRANSIENT_ERRNOS`) is first tried again for a fraction of a second
    (:func:`~.deletelog.load_deletes_retrying`), each try counted. Blocking: the start's thread."""
    writer = state.read_only is None and state.lock_fd is not None
    if writer:
        # A crash while the record was saved left its temporary file (review 218: it lay there
        # until a later save): removed by the lock holder only, as any crash's temporary file.
        # A directory planted there is cleared (review 296: the unlink failed at each start,
        # counted and logged each time, until a save happened to clear it).
        moved: Planted = []
        try:
            if remove_temp(state.dir_fd, moved) and not moved:
                state.temp_removed += 1  # a file: a planted directory is counted as a fault
        except OSError as exc:
            state.faults.append((exc, f"removing {shown / DELETES_TEMP}"))
        state.faults += [(fault, f"removing {shown / DELETES_TEMP}") for fault in moved]
    def retrying(exc: OSError) -> None:
        # Short of descriptors or memory says nothing about the record: tried again, not taken
        # for a damaged record (that unlinked every page on disk; review 220).
        state.faults.append((exc, f"reading {shown / DELETES_NAME} (tried again)"))
        log.warning("disk tier: reading the pending-delete record %s failed (%s): trying again",
                    shown / DELETES_NAME, exc.strerror)

    try:
        records = load_deletes_retrying(state.dir_fd, retrying)
    except OSError as exc:
        state.faults.append((exc, f"reading {shown / DELETES_NAME}"))
        log.error("disk tier: the pending-delete record %s cannot be trusted (%s): no page found there is served",
                  shown / DELETES_NAME, exc.strerror)
        now = time.time_ns()
        records = {key: now for _mtime, key in state.found}
        state.deletes_changed = True
        if state.seed is not None and state.lock_fd is None:
            # A start that follows: nothing found is served (no deletes named below are
            # remembered, :meth:`~.disk.DiskTier._pending_deletes_found`); its looks withhold
            # until one reads the record, which then indexes what it does not name.
            state.seed.withholding = True
    if not records:
        return
    kept: dict[PageKey, int] = {}
    found: list[tuple[int, PageKey]] = []
    seen: set[PageKey] = set()
    for mtime, key in state.found:
        seen.add(key)
        when = records.get(key)
        if when is None or mtime > when:
            found.append((mtime, key))  # no delete, or stored again since
            continue
        fd = state.fanout[key[0]]
        if not writer or fd < 0:
            kept[key] = when
            continue
        try:
            os.unlink(key.hex(), dir_fd=fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            state.faults.append((exc, f"unlinking {shown / f'{key[0]:02x}' / key.hex()} (a pending delete)"))
            kept[key] = when
    for key, when in records.items():
        if key not in seen:
            kept[key] = when
    state.found = found
    state.deletes = kept
    state.deletes_done = set(records).difference(kept)
    state.deletes_changed = state.deletes_changed or kept != records


def check_private_dir(fd: int, shown: Path) -> None:
    """Check that the directory ``fd`` (shown as ``shown`` in messages) is ours and nobody else's:
    group/other bits are removed (logged). Raises :class:`UnsafeDirectoryError` for what is not a
    directory, belongs to another uid, or can be written by others and cannot be made 0700."""
    st = os.fstat(fd)
    euid = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectoryError(errno.ENOTDIR, f"disk tier: {shown} is not a directory")
    if st.st_uid != euid:
        raise UnsafeDirectoryError(
            errno.EPERM, f"disk tier: {shown} belongs to uid {st.st_uid}, not to this process (uid {euid}): "
            "refusing to use it; choose another directory or give it to this user")
    mode = stat.S_IMODE(st.st_mode)
    if not mode & 0o077:
        return
    try:
        os.fchmod(fd, mode & 0o700)
    except OSError as exc:
        if mode & 0o022:
            raise UnsafeDirectoryError(
                errno.EPERM, f"disk tier: others can write into {shown} (mode {mode:o}) and it cannot be made "
                f"0700 ({exc.strerror}): refusing to use it") from None
        log.warning("disk tier: %s is readable by others (mode %o) and cannot be made 0700: %s", shown, mode, exc)
        return
    log.warning("disk tier: %s had mode %o; changed to %o (nobody else may use the cache directory)",
                shown, mode, mode & 0o700)


def open_private_subdir(parent_fd: int, name: str, shown: Path, create: bool) -> int:
    """A descriptor of the directory ``name`` under ``parent_fd`` (created 0700 when ``create``),
    opened without following a symlink (``O_NOFOLLOW``) and checked by :func:`check_private_dir`.
    The caller owns it. Blocking. Raises :class:`UnsafeDirectoryError` for a symlink or file at
    ``name`` or a directory that is not safely ours; ``OSError`` when it is absent (and could not be
    created: the creation's error) or cannot be opened."""
    made: OSError | None = None
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            pass
        except OSError as exc:  # read-only, no inode left...: use it if it is there
            made = exc
    try:
        fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeDirectoryError(
                exc.errno, f"disk tier: {shown} is not a directory (a symlink or a file): refusing to use it") from None
        if exc.errno == errno.ENOENT and made is not None:
            raise made from None
        raise
    try:
        check_private_dir(fd, shown)
    except BaseException:
        os.close(fd)
        raise
    return fd


LOCK_TRIES = 3
"""Times a start opens ``.lock`` again when the name led to another file once its ``flock`` was
taken (replaced meanwhile); then it starts read-only, the fault recorded."""


def _take_lock(dir_fd: int, shown: Path, faults: list[tuple[OSError, str]]) -> tuple[int | None, ReadOnly | None]:
    lock_name = shown / LOCK_NAME
    for _ in range(LOCK_TRIES):
        try:
            # Read-only: flock needs no write access, and a file open for writing would make a later
            # ``mount -o remount,ro`` fail with EBUSY. An existing file opens on a read-only mount too.
            fd = os.open(LOCK_NAME, os.O_RDONLY | os.O_CREAT | OPEN_FLAGS, 0o600, dir_fd=dir_fd)
        except OSError as exc:
            _refuse_planted(exc, lock_name)
            if exc.errno != errno.EROFS:
                faults.append((exc, f"creating {lock_name}"))
            return None, ReadOnly.FILE_SYSTEM if exc.errno == errno.EROFS else ReadOnly.NOT_WRITABLE
        try:
            check_page_fd(fd, str(lock_name), write=False)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # The file locked may no longer be the lock (replaced between the open and the flock,
            # its holder gone): another cache may hold the file the name leads to now.
            if lock_named(fd, dir_fd):
                return fd, None
        except BlockingIOError:
            os.close(fd)
            return None, ReadOnly.LOCKED
        except UnsafeFileError as exc:
            os.close(fd)
            raise UnsafeDirectoryError(exc.errno, f"disk tier: {exc.strerror}: refusing to use {shown}") from None
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # the name leads elsewhere now: that file is the lock
    faults.append((OSError(errno.EAGAIN, f"{lock_name} was replaced {LOCK_TRIES} times while locking it"),
                   "taking the lock"))
    return None, ReadOnly.LOCKED


def lock_named(fd: int, dir_fd: int) -> bool:
    """Whether ``.lock`` in the directory ``dir_fd`` still names the file open as ``fd`` (the name
    not followed). Raises ``OSError`` when either cannot be examined (not for a name gone: False)."""
    held = os.fstat(fd)
    try:
        named = os.stat(LOCK_NAME, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


def fanout_gone(dir_fd: int, index: int, fd: int, shown: Path) -> OSError | None:
    """Why the descriptor ``fd`` of fan-out directory ``index`` (in the layout directory ``dir_fd``,
    shown as ``shown``) no longer serves: removed (``FileNotFoundError``: its files with it) or its
    name replaced (``UnsafeFileError``: a symlink, a file, another directory); None while the name
    still leads to it. A follower's look and the writer's write that met ENOENT ask this. Raises
    ``OSError`` when either cannot be examined."""
    name = f"{index:02x}"
    held = os.fstat(fd)
    try:
        named = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError as exc:
        return exc
    if (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino) and held.st_nlink:
        return None
    return UnsafeFileError(errno.EPERM, f"{shown / name} was replaced (no longer the directory listed)")


def _refuse_planted(exc: OSError, name: Path) -> None:
    if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
        raise UnsafeDirectoryError(exc.errno, f"disk tier: {name} is not a regular file: refusing to use "
                                   f"{name.parent}") from None


def _scan_fanout(state: Prepared, index: int, layout_dir: Path, stop: Callable[[], bool] | None) -> bool:
    """Index one fan-out directory and keep its descriptor; what cannot be read is skipped and
    recorded, never fatal. False when ``stop`` ended the listing (nothing of it kept)."""
    name = f"{index:02x}"
    shown = layout_dir / name
    try:
        fd = open_private_subdir(state.dir_fd, name, shown, create=state.read_only is None)
    except UnsafeDirectoryError:
        raise
    except FileNotFoundError:
        return True  # never created (a read-only start): nothing there
    except OSError as exc:
        state.skipped += 1
        state.faults.append((exc, f"opening {shown}"))
        return True
    seed = state.seed
    try:
        stamp = dir_stamp(os.fstat(fd)) if seed is not None else None  # before the listing
        listing = list_fanout(fd, index, shown, state.read_only is None, None, state.faults, None, stop)
    except BaseException:
        os.close(fd)
        raise
    if listing.stopped:
        os.close(fd)
        return False
    state.found += [(mtime, key) for key, mtime in listing.found.items()]
    state.temp_removed += listing.temp_removed
    state.skipped += listing.skipped
    if not listing.complete:
        state.skipped += 1
        os.close(fd)  # unreadable: opened again (checked) when an operation needs it (DiskTier._where)
        return True
    if seed is not None:
        seed.entries[index], seed.stamps[index] = listing.entries, stamp
    state.fanout[index] = fd
    return True


def list_fanout(fd: int, index: int, shown: Path, remove_temps: bool, known: dict[PageKey, int] | None,
                faults: list[tuple[OSError, str]], keep: Callable[[str], bool] | None = None,
                stop: Callable[[], bool] | None = None) -> FanoutListing:
    """List the fan-out directory ``fd`` (number ``index``, shown as ``shown``): page files are
    regular files of ours named by a key whose first byte is ``index`` (a key named in another
    directory, moved there with its directory, is never read there: not indexed); anything else
    with a key name is skipped and recorded as UNSAFE, a file that cannot be examined is skipped
    and recorded; names that are no key's are never indexed.
    ``remove_temps`` (the lock holder only): temporary and spare files are unlinked, but for those
    ``keep`` names (this tier's own, maybe in flight, in a directory listed while it writes: listed
    in ``kept``). ``known``: the
    identities a previous listing found (see :attr:`FanoutListing.entries`): an entry with the
    same name and inode number is neither examined again nor reported in ``found``. A failure part-way
    (getdents: EIO) is recorded and ends the listing (``complete`` False). ``stop`` is asked every
    :data:`STOP_EVERY` entries: True ends the listing there (``stopped``; nothing recorded), so a
    close waits for one batch of a large or slow directory, not for all of it. Blocking."""
    listing = FanoutListing()
    entries, found = listing.entries, listing.found
    euid = os.geteuid()
    try:
        with os.scandir(fd) as scan:
            for count, entry in enumerate(scan, 1):  # getdents may fail midway: the entries listed so far stay
                if stop is not None and not count % STOP_EVERY and stop():
                    listing.complete = False
                    listing.stopped = True
                    break
                name = entry.name
                if name.startswith((TEMP_PREFIX, SPARE_PREFIX)):
                    if remove_temps:
                        if keep is not None and keep(name):
                            listing.kept.append(name)
                        else:
                            listing.temp_removed += _remove_temp(fd, name, shown, faults)
                    continue
                if len(name) != 2 * KEY_BYTES:
                    continue
                try:
                    key = bytes.fromhex(name)
                except ValueError:
                    continue
                # fromhex also takes upper case and spaced pairs ("64AB..", "64 00 .."): not the
                # name of a key (``key.hex()``). Indexed, such a file took the budget's room and
                # was "evicted" under a name it does not have, so it stayed for good (review 264).
                if len(key) != KEY_BYTES or key.hex() != name or key[0] != index:
                    continue
                inode = entry.inode()
                if known is not None:
                    before = known.get(key)
                    if before is not None and before & INODE_BITS == inode:
                        entries[key] = before  # the same file as before: nothing new
                        continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    listing.skipped += 1
                    listing.examined = False
                    faults.append((exc, f"examining {shown / name}"))
                    continue
                entries[key] = file_identity(inode, st)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != euid:
                    listing.skipped += 1
                    faults.append((UnsafeFileError(errno.EPERM, f"{shown / name} is not our regular file"),
                                   "scanning"))
                    continue
                found[key] = st.st_mtime_ns
    except OSError as exc:
        listing.complete = False
        faults.append((exc, f"reading {shown}"))
    return listing


def _remove_temp(fd: int, name: str, shown: Path, faults: list[tuple[OSError, str]]) -> int:
    """Unlink a leftover temporary or spare file: 1 when removed."""
    try:
        os.unlink(name, dir_fd=fd)
        return 1
    except FileNotFoundError:
        pass
    except OSError as exc:
        faults.append((exc, f"removing {shown / name}"))
    return 0


def _probe_direct(state: Prepared) -> bool | None:
    """Whether O_DIRECT opens work here (tmpfs before Linux 6.6 answers EINVAL), without creating a
    file when one exists; None when nothing could be probed.

    Each name is opened in the descriptor of its own directory (a page file in the fan-out
    directory the scan opened), never by a path of two names: a fan-out directory swapped for a
    symlink since the scan would lead such an open outside the cache (``O_NOFOLLOW`` guards the
    last name only). Reached in a read-only start without the lock file.

    Opened without ``O_DIRECT``, then set with ``F_SETFL`` once the file is known to be regular
    (:mod:`.safefiles`' rule): the kernel refuses ``O_DIRECT`` on a FIFO or a directory with
    ``EINVAL`` too, so a FIFO or directory planted under the name since the scan read as a file
    system refusing ``O_DIRECT`` (review 278: a start configured ``direct_io=True`` refused)."""
    places = [(state.dir_fd, LOCK_NAME)]
    page = next((key for _mtime, key in state.found if state.fanout[key[0]] >= 0), None)
    if page is not None:
        places.append((state.fanout[page[0]], page.hex()))
    for dir_fd, name in places:
        try:
            fd = os.open(name, os.O_RDONLY | OPEN_FLAGS, dir_fd=dir_fd)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue  # (a FIFO's F_SETFL takes O_DIRECT: its packet mode)
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return False
            continue
        finally:
            os.close(fd)
        return True
    if state.read_only is not None:
        return None
    probe = f"{TEMP_PREFIX}probe-{os.urandom(6).hex()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT | OPEN_FLAGS, 0o600,
                     dir_fd=state.dir_fd)
    except OSError as exc:
        return False if exc.errno == errno.EINVAL else None
    os.close(fd)
    os.unlink(probe, dir_fd=state.dir_fd)
    return True
