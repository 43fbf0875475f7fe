"""Many ``stat``s in one system call: a small io_uring of ``IORING_OP_STATX`` for one thread at a time.

A look at a followed directory (:mod:`.follow`) examines each of the 256 fan-out directories. One
``os.fstat`` each is 256 system calls, and each releases the GIL: beside threads that run Python,
taking it back waits up to the switch interval (5 ms) each time. Here the ``statx`` of every
descriptor goes into one submission, submitted and waited for in one ``io_uring_enter``
(``IORING_ENTER_GETEVENTS``, ``min_complete`` the whole batch): about one GIL wait a batch.

The values are those ``fstat`` gives (``statx`` with ``AT_EMPTY_PATH`` on the descriptor, default
sync, the basic fields: the same ``getattr`` of the inode), returned as ``os.stat_result``; a
descriptor whose ``statx`` failed gets the ``OSError`` ``fstat`` would raise (its errno).

Refusal: io_uring setup refused (EPERM under a seccomp filter or ``io_uring_disabled``, ENOSYS,
EINVAL: old kernels), or ``IORING_OP_STATX`` unknown to the kernel (EINVAL in its completion, before
5.6): :class:`StatxRefused`, and the caller examines its descriptors with ``os.fstat`` (for good,
after setup or the op was refused). Such an errno in a completion is the op's refusal only while
the ring has never given a result and the plain call gives one for that target; else it is that
file's own outcome (a FUSE file system answering EPERM or EINVAL for one name), returned as its
``OSError`` like any other (review 213: one such file closed the ring for good, and the looks
went back to one ``fstat`` each). The kernel reads
SQEs in ``io_uring_enter`` on the calling thread, and CQ head and tail are aligned 32-bit stores
(x86-64 TSO, as :mod:`.uring`): elsewhere :func:`open_ring` refuses.

The kernel writes each result into this ring's buffers from its io-wq workers: every batch waits
for all its completions before it returns, also when it raises (a signal handler's exception on
the main thread: the rest is waited for, then it goes on), and a ring whose wait failed part-way
(a bug: never expected) keeps its buffers alive for the life of the process rather than free them
under the kernel. So a ring may be dropped without :meth:`StatxRing.close`: its descriptor and maps
(:class:`.uring.RingMaps`, shared with the engine's ring) are released when it is collected.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from collections.abc import Sequence

from . import uring

IORING_ENTER_GETEVENTS = 1
AT_EMPTY_PATH = 0x1000
AT_SYMLINK_NOFOLLOW = 0x100
STATX_BASIC_STATS = 0x7FF
STATX_SIZE = 256
"""Bytes of a ``struct statx``."""

# struct statx: mask, (blksize, attributes), nlink, uid, gid, mode, (spare), ino, size, (blocks,
# attributes_mask, atime: sec, nsec; btime), ctime, mtime, (rdev), dev major, minor.
_STATX = struct.Struct("<I4x8xIIIH2xQQ16xqI4x16xqI4xqI4x8xII")

REFUSED_ERRNOS = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS, errno.EPERM})
"""Errors of io_uring setup, or of a STATX completion, that mean: not here (use ``os.fstat``)."""

_ABANDONED: list[object] = []
"""Buffers of rings whose wait failed with requests maybe in flight: never freed (see above)."""

NS = 1_000_000_000


class StatxRefused(Exception):
    """io_uring or its STATX op is refused here: examine with ``os.fstat`` (``errno``: the refusal's)."""

    def __init__(self, err: int, what: str) -> None:
        super().__init__(f"{what}: {os.strerror(err)}")
        self.errno = err


def open_ring(entries: int) -> StatxRing:
    """A ring for batches of up to ``entries`` (more go in several submissions). Raises
    :class:`StatxRefused` where io_uring is refused, or the memory ordering this module assumes
    is not the machine's."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise StatxRefused(errno.EOPNOTSUPP, f"io_uring statx batches on {platform.machine()}")
    try:
        return StatxRing(entries)
    except OSError as exc:
        # ENOMEM: the locked-memory limit the ring counts against (older kernels), lasting: refused.
        if exc.errno in REFUSED_ERRNOS or exc.errno == errno.ENOMEM:
            raise StatxRefused(exc.errno or errno.EINVAL, "io_uring setup") from exc
        raise


class StatxRing:
    """One io_uring for ``statx`` batches, used by one thread at a time; :meth:`close` it (or drop
    it: its descriptor and maps go when it is collected)."""

    def __init__(self, entries: int) -> None:
        params = uring._Params()
        params.flags = uring.IORING_SETUP_CLAMP
        # Its descriptor and maps, released by close() or, dropped unclosed, by its finalizer: the
        # ring is dropped between batches only (each waits for its own), or abandoned.
        self._rings = uring.RingMaps(entries, params)
        self._fd = self._rings.fd
        try:
            self.entries = self._rings.sq_entries
            self._bufs = ctypes.create_string_buffer(STATX_SIZE * self.entries)
            self._bufs_addr = ctypes.addressof(self._bufs)
            self._empty = ctypes.create_string_buffer(b"")
            self._empty_addr = ctypes.addressof(self._empty)
        except BaseException:  # (no memory for the buffers): nothing was submitted
            self.close()
            raise
        self.batches = 0
        """Batches waited for (one ``io_uring_enter`` each, more only after a signal)."""
        self.worked = False
        """A completion gave a result: the op works here, and an errno is its file's outcome."""

    def close(self) -> None:
        """Unmap and close the ring (idempotent). No batch is in flight: each waits for its own."""
        self._fd = -1
        self._rings.close()

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def stat_fds(self, fds: Sequence[int]) -> list[os.stat_result | OSError]:
        """``os.fstat`` of each of ``fds``, in as few system calls as the ring's size allows: a
        result or the error ``fstat`` would have raised, in order. Raises :class:`StatxRefused`
        (the ring closed: use ``os.fstat`` from now on)."""
        return self._batches([(fd, self._empty_addr) for fd in fds], AT_EMPTY_PATH, None)

    def stat_names(self, dir_fd: int, names: Sequence[str]) -> list[os.stat_result | OSError]:
        """``os.stat(name, dir_fd=dir_fd, follow_symlinks=False)`` of each of ``names``, batched as
        :meth:`stat_fds`."""
        return self.stat_at([(dir_fd, name) for name in names])

    def stat_at(self, targets: Sequence[tuple[int, str]]) -> list[os.stat_result | OSError]:
        """``os.stat(name, dir_fd=dir_fd, follow_symlinks=False)`` of each ``(dir_fd, name)``
        (names in several directories), batched as :meth:`stat_fds`."""
        paths = [ctypes.create_string_buffer(os.fsencode(name)) for _dir_fd, name in targets]
        return self._batches([(dir_fd, ctypes.addressof(path)) for (dir_fd, _name), path in zip(targets, paths,
                                                                                                strict=True)],
                             AT_SYMLINK_NOFOLLOW, paths)

    def _batches(self, targets: list[tuple[int, int]], flags: int, keep: object) -> list[os.stat_result | OSError]:
        """``keep``: what the paths' addresses point into (kept alive with the buffers should a
        wait fail): for names, their buffers in the order of ``targets``."""
        if self._fd < 0:
            raise StatxRefused(errno.EBADF, "the statx ring was closed")
        results: list[os.stat_result | OSError] = []
        for start in range(0, len(targets), self.entries):
            results += self._batch(targets[start : start + self.entries], flags, keep, start)
        return results

    def _plain_errno(self, target: tuple[int, int], keep: object, index: int) -> int:
        """What the plain call answers for ``target`` (number ``index`` of the call's): 0 for a
        result, else its errno (``fstat`` of a descriptor, ``stat`` of a name, not following it)."""
        fd, path = target
        try:
            if path == self._empty_addr:
                os.fstat(fd)
            else:
                assert isinstance(keep, list)
                os.stat(os.fsdecode(keep[index].value), dir_fd=fd, follow_symlinks=False)
        except OSError as exc:
            return exc.errno or errno.EIO
        return 0

    def _batch(self, targets: list[tuple[int, int]], flags: int, keep: object,
               first: int) -> list[os.stat_result | OSError]:
        count = len(targets)
        rings = self._rings  # (no view of it kept: see uring.RingMaps)
        sqes, tail, mask = rings.sqes, rings.sq_tail.value, rings.sq_mask
        for i, (fd, path) in enumerate(targets):
            uring._SQE.pack_into(sqes, ((tail + i) & mask) * 64, uring.OP_STATX, 0, 0, fd,
                                 self._bufs_addr + i * STATX_SIZE, path, STATX_BASIC_STATS, flags, i, 0, 0, 0, 0, 0)
        res = [0] * count
        head = rings.cq_head.value  # every earlier completion was reaped: this batch's come after it
        try:
            rings.sq_tail.value = tail + count  # after the SQEs: the kernel reads them in io_uring_enter
            done = 0
            while done < count:
                to_submit = (rings.sq_tail.value - rings.sq_head.value) & 0xFFFFFFFF
                try:
                    _enter(self._fd, to_submit, count - done)
                except InterruptedError:
                    pass  # a signal: what completed is drained, the rest waited for again
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EBUSY):
                        raise
                done += self._drain(res)
        except BaseException:
            self._settle(tail, head, keep)
            raise
        self.batches += 1
        out: list[os.stat_result | OSError] = []
        refused = -1
        for i, result in enumerate(res):
            if result < 0:
                if -result in REFUSED_ERRNOS and refused < 0:
                    refused = i
                out.append(OSError(-result, os.strerror(-result)))
            else:
                self.worked = True
                out.append(_stat_result(self._bufs, i * STATX_SIZE))
        if refused >= 0 and not self.worked:
            # Never a result on this ring: the op itself may be refused (every completion EINVAL
            # before 5.6), or this file answers so. The plain call tells: the same errno there is
            # the file's; a result there is the op's refusal (os.fstat from now on).
            err = -res[refused]
            if self._plain_errno(targets[refused], keep, first + refused) != err:
                self.close()
                raise StatxRefused(err, "io_uring statx")
        return out

    def _settle(self, tail: int, head: int, keep: object) -> None:
        """After an exception in the batch whose SQEs start at SQ ``tail`` and completions at CQ
        ``head`` (a signal handler's on the main thread, a failed wait): wait for what it submitted,
        so that no buffer is written after it returns and no completion lands in the next batch.
        Should that fail too, the buffers stay alive for good and the ring is closed."""
        rings = self._rings
        try:
            published = (rings.sq_tail.value - tail) & 0xFFFFFFFF  # 0 if raised before the store
            while True:
                cq_tail = rings.cq_tail.value
                rings.cq_head.value = cq_tail  # this batch's: its results are not wanted
                reaped = (cq_tail - head) & 0xFFFFFFFF
                if reaped >= published:
                    return
                to_submit = (rings.sq_tail.value - rings.sq_head.value) & 0xFFFFFFFF
                try:
                    _enter(self._fd, to_submit, published - reaped)
                except InterruptedError:
                    pass
        except BaseException:
            _ABANDONED.append((self._bufs, self._empty, keep))
            self.close()
            raise

    def _drain(self, res: list[int]) -> int:
        rings = self._rings
        head, tail = rings.cq_head.value, rings.cq_tail.value
        taken = 0
        while head != tail:
            user_data, result, _flags = uring._CQE.unpack_from(rings.cq, rings.cqes_off + (head & rings.cq_mask) * 16)
            res[user_data] = result
            head = (head + 1) & 0xFFFFFFFF
            taken += 1
        rings.cq_head.value = head  # after reading the CQEs: the kernel may reuse their slots then
        return taken


def _enter(fd: int, to_submit: int, min_complete: int) -> int:
    """``io_uring_enter`` submitting ``to_submit`` SQEs and waiting for ``min_complete`` CQEs (the
    kernel skips the wait when it took fewer SQEs than asked: nothing waits for what was not
    submitted)."""
    return uring._check(uring._libc.syscall(uring.SYS_IO_URING_ENTER, fd, ctypes.c_uint(to_submit),
                                            ctypes.c_uint(min_complete), ctypes.c_uint(IORING_ENTER_GETEVENTS),
                                            None, 0))


def _stat_result(buf: ctypes.Array[ctypes.c_char], offset: int) -> os.stat_result:
    """The ``struct statx`` at ``offset`` of ``buf`` as ``os.fstat`` reports it."""
    (_mask, nlink, uid, gid, mode, ino, size, a_sec, a_nsec, c_sec, c_nsec, m_sec, m_nsec, dev_major,
     dev_minor) = _STATX.unpack_from(buf, offset)
    atime, mtime, ctime = a_sec * NS + a_nsec, m_sec * NS + m_nsec, c_sec * NS + c_nsec
    return os.stat_result((mode, ino, os.makedev(dev_major, dev_minor), nlink, uid, gid, size, a_sec, m_sec, c_sec,
                           a_sec + a_nsec * 1e-9, m_sec + m_nsec * 1e-9,
                           c_sec + c_nsec * 1e-9, atime, mtime, ctime))
