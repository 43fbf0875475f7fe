"""Find and reclaim page-pool segments left in shared memory by processes that died.

The implementation behind :mod:`aiokv.segments` (which re-exports it and is the operators' command,
``python -m aiokv.segments``). Kept apart so the pool imports it with the package, never on the
event loop's start path (a first ``PagePool.open`` imported it in its worker thread, holding the
GIL for 1-5 ms), while ``python -m aiokv.segments`` still runs a module ``import aiokv`` did not import.

A pool's segment outlives a creator killed by SIGKILL (or the OOM killer): nothing unlinks it, and
with defaults it holds a quarter of RAM. Every process that has an aiokv segment open holds a shared
``flock`` on it (:mod:`aiokv.shm`); the kernel drops the lock with the process, so "nobody holds the
lock" is the liveness test, and it works across pid namespaces, unlike a pid check. A segment is
reclaimed only when all of these hold:

- its name has this version's form ``/<prefix>-<pid>-<start ticks>-<16 hex>``;
- it is a regular file of this user (never another user's, never a link, FIFO or directory);
- an exclusive ``flock`` succeeds without waiting (no creator, no attached worker);
- it is not empty (an empty one may be between ``shm_open`` and its owner's lock);
- its creator (pid and start time) is not a live process of this pid namespace (belt and braces).

Segments named by older aiokv versions (``/<prefix>-<pid>-<16 hex>``) carry no lock; they are only
listed, and removed by ``clean --legacy`` when their pid is gone and no process maps them.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import functools
import logging
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass

from aiokv.shm import SHM_DIR, SHM_NAME_PREFIX, process_start_ticks

log = logging.getLogger("aiokv.segments")  # the name operators know


class SegmentState(enum.Enum):
    """What a scan found out about one segment."""

    LIVE = "live"
    """Some process holds it (its creator, or a worker attached to it): never touched."""
    DEAD = "dead"
    """Nobody holds it and its creator is gone: reclaimable."""
    CREATING = "creating"
    """Empty and unlocked: being created right now, or its creator died before sizing it (0 bytes)."""
    LEGACY = "legacy"
    """Named by an aiokv without owner locks: its creator's liveness is known from the pid only."""
    FOREIGN = "foreign"
    """Another user's, or not a regular file: never touched."""


@dataclass(frozen=True)
class SegmentInfo:
    """One aiokv segment in shared memory."""

    name: str
    """Shared-memory name (``/aiokv-…``); the file is ``SHM_DIR + name``."""
    size: int
    """Bytes (its file size)."""
    uid: int
    """Owner's user id."""
    pid: int
    """Creator's pid (in the creator's pid namespace)."""
    state: SegmentState
    creator_alive: bool
    """The creator (pid and, for current names, start time) is a live process of this pid namespace."""
    frees: int = 0
    """Memory (bytes) that unlinking this name gives back: the blocks the file holds, not ``size``
    (a creator killed between sizing its segment and preparing it leaves a sparse file: a 1 GiB
    segment holding 1 MiB once made the default budget promise 1 GiB), and 0 while another name
    (a hard link) keeps the file."""


@functools.lru_cache(maxsize=16)
def _patterns(prefix: str) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """Name patterns of this version's and older versions' segments under ``prefix``."""
    p = re.escape(prefix)
    return re.compile(rf"{p}-(\d+)-(\d+)-[0-9a-f]{{16}}"), re.compile(rf"{p}-(\d+)-[0-9a-f]{{16}}")


_patterns(SHM_NAME_PREFIX)  # compiled with the package: the first pool's scan runs beside the loop,
# and compiling a pattern is pure Python holding the GIL (~1-3 ms the first time in a process)


def _parse(filename: str, prefix: str) -> tuple[int, int | None] | None:
    """(creator pid, start ticks) of an aiokv segment's file name; start is None for legacy names."""
    current, legacy = _patterns(prefix)
    m = current.fullmatch(filename)
    if m:
        return int(m[1]), int(m[2])
    m = legacy.fullmatch(filename)
    return (int(m[1]), None) if m else None


def _creator_alive(pid: int, start: int | None) -> bool:
    ticks = process_start_ticks(pid)
    return ticks is not None and (start is None or ticks == start)


@contextlib.contextmanager
def _opened(path: str) -> Iterator[int | None]:
    # O_NOFOLLOW: never follow a planted link; O_NONBLOCK: opening a planted FIFO must not hang.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        yield None  # vanished, a link (ELOOP), or not ours to read
        return
    try:
        yield fd
    finally:
        os.close(fd)  # also drops any lock taken on it


def _locked_exclusive(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


_MAPS_CHUNK = 64 * 1024  # bytes read at a time from a maps file: bounded memory whatever its size


def _file_contains(path: str, needle: bytes) -> bool:
    """True when the file at ``path`` holds ``needle``, read in bounded chunks (a process with many
    mappings has a maps file of megabytes, and a whole-file read held it all at once per process)."""
    keep = len(needle) - 1  # a needle cut by a chunk's end is found with the next chunk
    with open(path, "rb", buffering=0) as f:
        tail = b""
        while chunk := f.read(_MAPS_CHUNK):
            window = tail + chunk
            if needle in window:
                return True
            tail = window[-keep:] if keep else b""
    return False


def _mapped_anywhere(filename: str) -> bool:
    """True when some process (that we may inspect) has ``SHM_DIR/filename`` open or mapped."""
    path = os.path.join(SHM_DIR, filename)
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return True  # cannot tell: assume in use
    needle = path.encode()
    me = str(os.getpid())
    for pid in pids:
        if pid == me:
            continue  # our own descriptor is the one being examined
        try:
            if _file_contains(f"/proc/{pid}/maps", needle):
                return True
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(path):
                        return True
        except OSError:
            continue  # exited meanwhile, or not ours to read (then it cannot hold our 0600 file)
    return False


def _classify(
    filename: str, fd: int, creator: tuple[int, int | None], *, reclaim: bool, legacy: bool
) -> tuple[SegmentInfo, bool]:
    """State of an opened segment; with ``reclaim`` unlink it when allowed. Returns (info, unlinked)."""
    st = os.fstat(fd)
    pid, start = creator
    alive = _creator_alive(pid, start)

    def info(state: SegmentState) -> SegmentInfo:
        frees = st.st_blocks * 512 if st.st_nlink == 1 else 0
        return SegmentInfo("/" + filename, st.st_size, st.st_uid, pid, state, alive, frees)

    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        return info(SegmentState.FOREIGN), False
    if not _locked_exclusive(fd):
        return info(SegmentState.LIVE), False
    # We hold the lock now: no aiokv process can open it meanwhile (attach fails, create never reuses).
    if start is None:
        state = SegmentState.LEGACY
        allowed = legacy and not alive and not _mapped_anywhere(filename)
    elif alive:
        state, allowed = SegmentState.LIVE, False
    elif st.st_size == 0:
        state, allowed = SegmentState.CREATING, legacy
    else:
        state, allowed = SegmentState.DEAD, True
    if not (reclaim and allowed):
        return info(state), False
    path = os.path.join(SHM_DIR, filename)
    try:
        # The name must still be the file we checked and locked.
        same = os.lstat(path)
        if (same.st_dev, same.st_ino) != (st.st_dev, st.st_ino):
            return info(state), False
        os.unlink(path)
    except FileNotFoundError:
        return info(state), False
    return info(state), True


def _candidates(prefix: str) -> list[tuple[str, tuple[int, int | None]]]:
    try:
        names = sorted(os.listdir(SHM_DIR))
    except OSError:
        return []
    return [(n, creator) for n in names if (creator := _parse(n, prefix)) is not None]


def scan(prefix: str = SHM_NAME_PREFIX, *, deadline: float | None = None) -> list[SegmentInfo]:
    """Every segment in shared memory named like an aiokv pool's, with its state. Touches nothing.

    A segment nobody holds is locked for a moment while it is examined (an ``attach`` of it racing
    with the scan fails with ``FileNotFoundError``); a held one is never locked, so live pools and
    their workers are not disturbed. ``deadline`` (``time.monotonic()``): entries not reached by
    then are left out (an open, fstat and lock each, ~45 us: a caller on an event loop's thread
    bounds its stall so, and counts fewer segments).
    """
    found: list[SegmentInfo] = []
    for filename, creator in _candidates(prefix):
        if deadline is not None and time.monotonic() > deadline:
            break
        try:
            with _opened(os.path.join(SHM_DIR, filename)) as fd:
                if fd is not None:
                    found.append(_classify(filename, fd, creator, reclaim=False, legacy=False)[0])
        except OSError as exc:
            log.warning("shared-memory segment %s not examined: %s", filename, exc)
    return found


def reclaimable_bytes(prefix: str = SHM_NAME_PREFIX) -> int:
    """Bytes that :func:`reclaim` would free now: count them as free when sizing a pool (the
    memory the segments hold, :attr:`SegmentInfo.frees`, not their sizes)."""
    return sum(s.frees for s in scan(prefix) if s.state is SegmentState.DEAD)


def reclaim(prefix: str = SHM_NAME_PREFIX, *, legacy: bool = False) -> list[SegmentInfo]:
    """Unlink the DEAD segments (see the module docstring); returns those unlinked. Never raises OSError.

    ``legacy=True`` also removes empty segments of dead creators and LEGACY ones whose pid is gone
    and which no process maps (they cannot say whether a creator in another pid namespace lives).
    Unlinking frees the segment's memory: tens of ms per GiB, so call it off the event loop.
    """
    removed: list[SegmentInfo] = []
    for filename, creator in _candidates(prefix):
        try:
            with _opened(os.path.join(SHM_DIR, filename)) as fd:
                if fd is None:
                    continue
                seg, unlinked = _classify(filename, fd, creator, reclaim=True, legacy=legacy)
        except OSError as exc:  # one odd file must not stop pool creation
            log.warning("shared-memory segment %s left alone: %s", filename, exc)
            continue
        if unlinked:
            removed.append(seg)
            log.warning(
                "reclaimed shared-memory segment %s (%.2f GiB) left by dead process %d",
                seg.name,
                seg.size / 2**30,
                seg.pid,
            )
    return removed
