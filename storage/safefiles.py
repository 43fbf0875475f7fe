"""Opening page files safely: never through a symlink, never blocking on a special file.

Every page file (temporary or final, for reading or writing, on every backend) is opened with
``O_NOFOLLOW | O_NONBLOCK`` and WITHOUT ``O_DIRECT``; :func:`check_page_fd` then requires a regular
file owned by our effective uid (and, to be written, with a single link), and only then
:func:`ready_for_io` clears ``O_NONBLOCK`` and sets ``O_DIRECT``. So:

- a symlink planted under a page file's name fails the open (ELOOP): nothing outside the cache
  is ever read or written through it;
- a FIFO, socket or device never blocks the open (O_NONBLOCK: a FIFO opens at once for reading and
  fails with ENXIO for writing) and is refused before any read or write;
- a hard link to another file is never overwritten.

The open runs without ``O_DIRECT`` because the kernel refuses ``O_DIRECT`` on a FIFO with EINVAL,
which would hide what the file is; ``fcntl(F_SETFL)`` adds it once the file is known to be regular.
``O_NONBLOCK`` must go before the I/O: io_uring answers EAGAIN instead of waiting on a file that has it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import stat

OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
"""Flags every page-file open carries."""

READ_FLAGS = os.O_RDONLY | os.O_NOATIME | OPEN_FLAGS
"""Flags of a page file opened to be read. ``O_NOATIME``: a read io_uring issues inline (in the
loop thread's ``io_uring_enter``) updated the file's access time there, and that update waits for
the file system: for its journal, or for a read of the inode's table block. With the disk hung the
loop thread stayed in the kernel until it answered (a read held at a FUSE-gated loop device: for
good, as the test that would let the gate go ran on that loop). ``O_NOATIME`` needs the file's
owner (or CAP_FOWNER); a file of another owner is refused anyway (:func:`check_page_fd`), by the
open itself (EPERM) where the caller is not privileged: :func:`classify_read_open_error`."""

# What an O_NOFOLLOW|O_NONBLOCK open answers when the name does not hold a regular file: a symlink
# (ELOOP), a FIFO without reader / a socket / a device without driver (ENXIO), a directory (EISDIR).
_PLANTED = {errno.ELOOP: "a symbolic link", errno.ENXIO: "a FIFO, socket or device", errno.EISDIR: "a directory"}


class UnsafeFileError(OSError):
    """A page file's name holds something else: a symlink, a special file, a directory, a file of
    another owner, or (for writing) a file with other hard links. Counted as ``ErrorKind.UNSAFE``."""


class UnsafeDirectoryError(PermissionError):
    """A directory of the tier is not ours, is not a real directory, or others can write into it
    and its mode cannot be fixed: the tier refuses to start."""


def classify_open_error(exc: OSError, name: str) -> OSError:
    """``exc`` from opening a page file, turned into :class:`UnsafeFileError` when it says the name
    holds a symlink, special file or directory."""
    what = _PLANTED.get(exc.errno or 0)
    if what is None:
        return exc
    return UnsafeFileError(exc.errno, f"{name} is {what}, not a page file")


def classify_read_open_error(exc: OSError, dir_fd: int, name: str) -> OSError:
    """``exc`` from opening page file ``name`` (in ``dir_fd``) with :data:`READ_FLAGS`, as
    :func:`classify_open_error`; EPERM, which ``O_NOATIME`` answers for a file of another owner where
    the tier is not privileged, is :class:`UnsafeFileError` when the name holds a file not ours (an
    ``lstat``, only to tell which: nothing is opened or read), as :func:`check_page_fd` says where
    the open works. Before (review 289), counted as EPERM, the file stayed indexed, each read of it
    a fault again."""
    if exc.errno != errno.EPERM:
        return classify_open_error(exc, name)
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return exc
    if st.st_uid != os.geteuid():
        return UnsafeFileError(errno.EPERM, f"{name} belongs to uid {st.st_uid}, not to uid {os.geteuid()}")
    return exc


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return f"of type {stat.S_IFMT(mode):o}"


def check_page_fd(fd: int, name: str, write: bool) -> os.stat_result:
    """Raise :class:`UnsafeFileError` unless ``fd`` is a regular file owned by our effective uid
    (with exactly one link when ``write``). ``fstat`` never blocks on the file's contents."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(errno.EPERM, f"{name} is {_kind(st.st_mode)}, not a page file")
    if st.st_uid != os.geteuid():
        raise UnsafeFileError(errno.EPERM, f"{name} belongs to uid {st.st_uid}, not to uid {os.geteuid()}")
    if write and st.st_nlink != 1:
        raise UnsafeFileError(errno.EMLINK, f"{name} has {st.st_nlink} hard links: not overwriting it")
    return st


def ready_for_io(fd: int, direct: bool, flags: int | None = None) -> None:
    """Clear ``O_NONBLOCK`` and set ``O_DIRECT`` when ``direct``: only on a checked regular file.
    ``flags``: those it was opened with, when known (spares the F_GETFL call on the hot path)."""
    if flags is None:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    wanted = (flags & ~os.O_NONBLOCK) | (os.O_DIRECT if direct else 0)
    if wanted != flags:
        fcntl.fcntl(fd, fcntl.F_SETFL, wanted)


def open_page_file(name: str, flags: int, dir_fd: int, write: bool, direct: bool, mode: int = 0o600) -> int:
    """Open, check and prepare a page file (blocking; the threads backend). ``flags``: the access mode
    plus ``O_CREAT|O_EXCL`` to create. Raises ``OSError`` (:class:`UnsafeFileError` for what is not ours)."""
    try:
        fd = os.open(name, flags | OPEN_FLAGS, mode, dir_fd=dir_fd)
    except OSError as exc:
        if flags & os.O_NOATIME:
            raise classify_read_open_error(exc, dir_fd, name) from None
        raise classify_open_error(exc, name) from None
    try:
        check_page_fd(fd, name, write)
        # The flags it was opened with: no F_GETFL (a syscall, a GIL release, per page file).
        # F_SETFL changes only its own flags (O_NONBLOCK, O_DIRECT, ...): the others passed are ignored.
        ready_for_io(fd, direct, flags | OPEN_FLAGS)
    except BaseException:
        os.close(fd)
        raise
    return fd


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long
_SYS_OPENAT2 = 437  # the same number on every Linux architecture (added in 5.6)
RESOLVE_CACHED = 0x20
"""``openat2`` resolve flag (5.12): fail with EAGAIN unless the lookup needs no I/O."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class CachedOpen:
    """Open an existing page file on the calling thread only when that cannot block: ``openat2``
    with ``RESOLVE_CACHED`` answers EAGAIN unless every name on the way is in the kernel's lookup
    caches. A recycled file (the least recently used one, written by this tier) usually is: the
    overwrite then needs no ring round trip for its open. Not for creating files (O_CREAT needs I/O).

    Where ``openat2`` or ``RESOLVE_CACHED`` is missing (before 5.12, or refused by a seccomp
    filter answering ENOSYS), :meth:`open` answers None from then on."""

    def __init__(self) -> None:
        self.available = True
        self._how = _OpenHow(0, 0, RESOLVE_CACHED)
        self._how_ref = ctypes.byref(self._how)
        self._size = ctypes.sizeof(_OpenHow)
        # The call's result goes into ``_got`` from C (its restype, called with the C int): Python
        # raises a signal's KeyboardInterrupt as a call returns, and a result only on the stack
        # then is dropped: an fd opened but never closed. A function object of its own, as the
        # restype is per object; one thread opens through an instance (the loop's).
        self._got: list[int] = []
        self._syscall = _libc["syscall"]
        self._syscall.restype = self._got.append

    def open(self, dir_fd: int, name: bytes, flags: int) -> int | None:
        """The fd of ``name`` (relative to ``dir_fd``) opened with ``flags``, or None when opening it
        would need I/O (or ``openat2`` is unavailable here). Raises ``OSError`` as ``openat``
        would (a planted name: see :func:`classify_open_error`; EINVAL with ``O_DIRECT`` in
        ``flags``: the file refuses it). A KeyboardInterrupt (a signal) out of here leaves nothing open."""
        if not self.available:
            return None
        self._how.flags = flags
        got = self._got
        try:
            self._syscall(_SYS_OPENAT2, dir_fd, name, self._how_ref, self._size)
            fd = got[0]  # taken out of ``got`` with no call between: the caller has it
            del got[0]
        except BaseException:
            for leftover in got:  # (an interrupt as the call returned)
                if leftover >= 0:
                    os.close(leftover)
            got.clear()
            raise
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err == errno.EAGAIN:
            return None
        if err == errno.EINVAL and flags & os.O_DIRECT:
            # The file refuses O_DIRECT (a FIFO, a device, a directory: the open ran, then failed),
            # which says nothing about openat2 here: the caller opens it again without O_DIRECT (an
            # openat2 without RESOLVE_CACHED answers EINVAL to that too, and is turned off then).
            # Taken for a missing openat2, one planted FIFO turned the loop's opens off for good.
            raise OSError(err, os.strerror(err))
        if err in (errno.ENOSYS, errno.EINVAL, errno.E2BIG):
            # No openat2, or no RESOLVE_CACHED (EINVAL before 5.12): the ring opens every file
            # from now on. (Our callers pass no other flags openat2 could refuse with EINVAL.)
            self.available = False
            return None
        raise OSError(err, os.strerror(err))
