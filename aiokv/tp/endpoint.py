"""Where a manager listens: a socket in a private (0700, ours) directory.

Only processes of the same user can reach a socket in such a directory; the manager also checks
each peer's uid (``SO_PEERCRED``). The path is stable for a given directory, so a restarted manager
listens where its workers reconnect. A socket file left by a dead manager is removed; one that a
live manager still answers on is an error.

Managers starting in one directory take turns (:func:`start_lock`, an exclusive ``flock`` of the
directory held from the probe of the old socket until the new one listens): a socket that is bound
but not yet listening refuses a connection as a dead one does, and a second manager probing it then
removed it and bound its own, leaving the first listening where nobody could reach it (both believed
they owned the group). A stopping manager removes its socket's name before it closes the socket, the
only time that name is known to be its own (review 249). A directory the manager made goes as it
stops only under that lock, and a child forked while a start holds the lock closes its copy
(review 252). A stop holds the lock shared, a start exclusive: a start that meets a stop's lock
(:class:`ManagerStopping`) tries again in a moment, one that meets another start's is refused
(review 262).

The lock is the directory's own ``flock``, never an emulated one: NFS, CIFS and FUSE emulate a
regular file's ``flock`` with POSIX locks (an exclusive one refused on a descriptor opened for
reading: ``EBADF``), but give directories no ``flock`` of their own, so the kernel locks them itself,
among this host's processes: the reach of a Unix-domain socket. A directory whose ``flock`` fails
nevertheless refuses the start (:class:`StartLockFailed`): unlocked, two managers starting there
could both believe they listen (review 249).

That lock, and the probe of a socket, reach this host only: on a directory shared between hosts a
live manager's socket refuses another host's connect as a dead one's does. A start therefore claims
the directory first (:func:`claim_directory`, a record made ``O_EXCL``: :mod:`aiokv.tp.owner`) and
judges a socket by its probe only where the record says this host (this boot, this mount) made it;
another host's claim refuses the start, nothing of it removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import socket
import stat
import struct
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from . import owner

SOCKET_NAME = "manager.sock"
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes, NUL included


@dataclass(frozen=True)
class Endpoint:
    """A private directory and the socket path inside it; ``created`` when this process made the directory."""

    directory: Path
    created: bool

    @property
    def socket_path(self) -> Path:
        """The Unix-domain socket the manager listens on."""
        return self.directory / SOCKET_NAME


def _make_or_find(path: Path) -> tuple[os.stat_result, bool]:
    """``(os.lstat(path), whether this call made it)``: ``path`` made 0700, or found there.

    A directory ``mkdir`` found (``EEXIST``) but gone by the ``lstat`` (removed meanwhile by the
    stopping manager that made it) is made anew: that ``FileNotFoundError`` failed the start, a
    false refusal of an engine restarting its manager right after a stop (review 262)."""
    for _ in range(_START_TRIES):
        try:
            os.mkdir(path, 0o700)
            created = True
        except FileExistsError:
            created = False
        with contextlib.suppress(FileNotFoundError):
            return os.lstat(path), created
    raise RuntimeError(f"{path} was removed {_START_TRIES} times as this manager started there")


def private_directory(directory: str | os.PathLike[str] | None) -> Endpoint:
    """Create ``directory`` 0700 (a fresh temporary one for None), or check an existing one is private.

    Raises ``PermissionError`` for a directory that is a symlink, not ours, or open to others, and
    ``ValueError`` when the socket path inside would be too long for a Unix-domain address.
    """
    if directory is None:
        endpoint = Endpoint(Path(tempfile.mkdtemp(prefix="aiokv-tp-")), True)  # mkdtemp makes it 0700
    else:
        path = Path(directory)
        info, created = _make_or_find(path)
        if not stat.S_ISDIR(info.st_mode):
            raise PermissionError(f"{path} is not a directory (a symlink or a file): refusing to listen there")
        if info.st_uid != os.getuid():
            raise PermissionError(f"{path} belongs to uid {info.st_uid}, not to this user")
        if stat.S_IMODE(info.st_mode) & 0o077:
            if not created:
                raise PermissionError(
                    f"{path} has mode {stat.S_IMODE(info.st_mode):o}: the manager's directory must be 0700"
                )
            os.chmod(path, 0o700)  # mkdir's mode is masked by umask only downwards; be explicit anyway
        endpoint = Endpoint(path, created)
    raw = os.fsencode(endpoint.socket_path)
    if len(raw) > _SUN_PATH_MAX:
        if endpoint.created:
            os.rmdir(endpoint.directory)
        raise ValueError(
            f"socket path {endpoint.socket_path} is {len(raw)} bytes; Unix-domain addresses hold "
            f"{_SUN_PATH_MAX}: choose a shorter directory"
        )
    return endpoint


_START_TRIES = 8
"""Times a start makes its directory anew when it was removed under it (by a stopping manager that
made it) before giving up."""

STOP_WAIT_S = 1.0
"""Seconds a start waits, in all, for stopping managers holding its directory's lock (each holds it
for a few system calls: the removal of its directory) before it is refused."""

STOP_RETRY_FIRST_S = 0.001
"""The first pause of a start that met a stop's lock; each next one doubles, up to a tenth of
:data:`STOP_WAIT_S`."""


class ManagerStopping(RuntimeError):
    """The directory's lock is held by a manager stopping there (removing the directory it made), not
    by a start: a start may try again in a moment (:data:`STOP_WAIT_S`)."""


class StartLockFailed(RuntimeError):
    """The directory's start lock cannot be taken at all (its ``flock`` fails, ``__cause__``): the
    start is refused rather than run unlocked. Choose a directory on another file system."""


# Reentrant: a signal handler that forks (a SIGCHLD handler respawning a worker by multiprocessing's
# fork) may run in the thread holding it, inside _open_directory; a plain lock's acquire before that
# fork then waited for that thread for good, a hang of the whole process (review 255).
_fork_guard = threading.RLock()
_held_locks: set[int] = set()
"""Descriptors of this process's start locks while held: a child forked meanwhile closes its copies."""


def _after_fork_in_child() -> None:
    global _fork_guard
    # A new guard: the forking thread, the only one here, may hold the old one more than once (a
    # fork in a signal handler inside the guard); a with block it returns to ends on the old one.
    _fork_guard = threading.RLock()
    # A flock belongs to the open file description, which a forked child's copy of the descriptor
    # shares: a child forked while a start held the lock (a worker forked by another thread,
    # multiprocessing's fork; O_CLOEXEC acts only at an exec) held it for its whole life, and every
    # later start there, the manager's restart included, was refused (review 252). Closing the copy
    # drops the child's reference only (LOCK_UN would end the parent's lock).
    for fd in _held_locks:
        with contextlib.suppress(OSError):
            os.close(fd)
    _held_locks.clear()


def _before_fork() -> None:
    _fork_guard.acquire()  # the guard in force (a child has a new one): not bound at registration


def _after_fork_in_parent() -> None:
    _fork_guard.release()


# The guard keeps a fork out of the moment a descriptor is open but not yet listed.
os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


def _open_directory(directory: Path) -> int:
    """Open ``directory`` for its start lock; listed in ``_held_locks`` before a fork can copy it."""
    with _fork_guard:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        _held_locks.add(fd)
    return fd


def _close_directory(fd: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)  # ends the lock for any copy a fork made meanwhile, too
    with _fork_guard:
        _held_locks.discard(fd)
        os.close(fd)


def _lock_directory(fd: int, starting: bool = True) -> bool:
    """Take the flock of ``fd`` without waiting, exclusive for a start, shared for a stop (not
    ``starting``): False while another holds it. Raises ``OSError`` where it cannot be taken at all
    (a start ran unlocked there, and review 249's race was open again)."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if starting else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _held_by_stops(fd: int) -> bool:
    """Whether the lock a start was refused is held shared only (by stopping managers): a shared
    lock is granted then, and ends with ``fd``'s release. A start holds it exclusive."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _still_at(directory: Path, fd: int) -> bool:
    """Whether ``directory`` still names the directory open as ``fd``."""
    try:
        return socket_identity(os.lstat(directory)) == socket_identity(os.fstat(fd))
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def start_lock(directory: str | os.PathLike[str] | None) -> Iterator[Endpoint]:
    """Make or check the private directory (:func:`private_directory`) and hold its exclusive start
    lock (its own ``flock``) for the block, which gets the :class:`Endpoint`.

    Raises ``RuntimeError`` at once while another manager holds it (it is starting there right now:
    it will listen, or fail), :class:`ManagerStopping` while stopping managers hold it (removing the
    directory: try again in a moment), :class:`StartLockFailed` where the lock cannot be taken at all
    (the block never runs unlocked).
    The lock ends with the descriptor, so a start that died holding it holds nothing; a child forked
    meanwhile closes its copy. A directory removed before it was locked (a stopping manager that
    made it, see :func:`remove_endpoint`) is made anew: the lock of a directory no longer at the
    path kept no other start from the one there."""
    for _ in range(_START_TRIES):
        endpoint = private_directory(directory)
        try:
            fd = _open_directory(endpoint.directory)
        except FileNotFoundError:
            continue
        try:
            try:
                locked = _lock_directory(fd)
            except OSError as exc:
                raise StartLockFailed(
                    f"cannot lock {endpoint.directory} ({exc}): refusing to start unlocked, where two managers "
                    "starting at once could both believe they listen; choose a directory on another file system"
                ) from exc
            if not locked:
                # A stop holds it for its directory's removal, a few system calls: refused as a
                # start, an engine restarting its manager right after a stop failed (review 262).
                if _held_by_stops(fd):
                    raise ManagerStopping(f"a manager is stopping in {endpoint.directory}")
                # Not removed, even if this start made it: the other start probes and binds there.
                # A manager of before review 262 holds it exclusive as it stops, too: see design.md.
                raise RuntimeError(f"another manager is starting in {endpoint.directory} (or one of an "
                                   "older aiokv is stopping there)")
            if _still_at(endpoint.directory, fd):
                yield endpoint
                return
        finally:
            _close_directory(fd)
    raise RuntimeError(f"{directory} was removed {_START_TRIES} times as this manager started there")


def socket_identity(info: os.stat_result) -> tuple[int, int]:
    """``(st_dev, st_ino)``: which file a path named when it was looked at."""
    return info.st_dev, info.st_ino


def clear_stale_socket(path: Path) -> None:
    """Remove a socket file nobody listens on; raise when a live listener answers or it is not ours.

    Call it under :func:`start_lock`: a socket bound but not yet listening answers as a dead one."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"{path} exists and is not a socket of this user: refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(os.fspath(path))
    except (ConnectionRefusedError, FileNotFoundError):
        unlink_socket(path, socket_identity(info))  # a dead manager's socket, if still the one probed
        return
    except BlockingIOError:
        pass  # a live listener with a full backlog
    finally:
        probe.close()
    raise RuntimeError(f"another manager is listening on {path}")


def claim_directory(endpoint: Endpoint) -> str:
    """Claim the directory for this manager (:mod:`aiokv.tp.owner`) and clear a dead manager's
    socket there; returns the claim's token (:func:`release_claim`). Call it under
    :func:`start_lock`, before the bind: the claim is what keeps out another host's start, which
    this host's lock does not reach.

    A record found is judged first: another host's (or another mount's, or one that cannot be read)
    refuses the start (:class:`~aiokv.tp.owner.OwnedElsewhere`), nothing removed; this host's is
    cleared with its socket when that socket does not answer (:func:`clear_stale_socket`), or left
    when it does (``RuntimeError``). With no record, the socket of a manager of before the records
    is probed as it always was. Raises :class:`ManagerStopping` when the directory was removed
    meanwhile (its maker stopping on another host, which this host's lock does not hold back)."""
    for _ in range(_START_TRIES):
        try:
            token = owner.make_record(endpoint.directory)
        except OSError as exc:
            # Removed since it was locked: by the manager that made it, stopping on another host
            # (this host's stops wait for the lock). Tried again in a moment, made anew.
            if exc.errno not in (errno.ENOENT, errno.ESTALE):
                raise
            raise ManagerStopping(f"{endpoint.directory} was removed as this manager started there") from exc
        if token is not None:
            try:
                clear_stale_socket(endpoint.socket_path)
            except BaseException:
                owner.remove_record(endpoint.directory, token)
                raise
            return token
        found = owner.read_record(endpoint.directory)
        if found is None:
            continue  # removed meanwhile (its manager stopped): claim again
        owner.judge(found, endpoint.directory)
        clear_stale_socket(endpoint.socket_path)  # raises while its manager listens
        owner.remove_record(endpoint.directory, found.token)  # dead: its claim goes with its socket
    raise RuntimeError(f"{endpoint.directory} was claimed and released {_START_TRIES} times as this manager started")


def release_claim(endpoint: Endpoint, token: str) -> None:
    """Remove a stopping manager's claim (:func:`claim_directory`), after its socket's name: not
    under :func:`start_lock` (which holds it exclusive).

    Taken shared, the lock keeps out this host's starts, which may judge the claim of a socket gone
    dead, remove it and make their own (this one's unlink then removed theirs); other hosts never
    remove a claim not theirs. Held by a start, the claim is left to it: it finds the socket gone
    and clears the claim itself (or, killed first, leaves it to the next start here). Where the lock
    cannot be taken at all, no start runs on this host: removed unlocked."""
    try:
        fd = _open_directory(endpoint.directory)
    except OSError:
        return  # gone, with the claim
    try:
        try:
            if not _lock_directory(fd, starting=False):
                return
        except OSError:
            pass
        owner.remove_record(endpoint.directory, token)
    finally:
        _close_directory(fd)


def unlink_socket(path: Path, identity: tuple[int, int] | None) -> None:
    """Unlink ``path`` if it still names the file ``identity`` (:func:`socket_identity`); None: nothing.

    Exact only while that file cannot be freed (its socket open, or under :func:`start_lock` for a
    dead one): a freed inode's number is given to the next file made (ext4 does so at once)."""
    if identity is None:
        return
    try:
        if socket_identity(os.lstat(path)) == identity:
            os.unlink(path)
    except FileNotFoundError:
        pass


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process on the other end of a connected Unix-domain socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def transport_peer(transport: asyncio.BaseTransport) -> tuple[int, int]:
    """:func:`peer_credentials` of a transport's socket; ``(0, this user)`` for a transport without
    one (tests' fakes)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0, os.getuid()
    return peer_credentials(cast(socket.socket, sock))


def trusted_peer(uid: int) -> bool:
    """The rule both ends apply before anything is sent: the peer is this user or root."""
    return uid in (os.getuid(), 0)


def remove_endpoint(endpoint: Endpoint) -> None:
    """Remove a directory we created, unless a manager is starting there. The socket's name is not
    touched: its owner unlinks it with its listener (:func:`unlink_socket`).

    The directory goes under its start lock: removed while another manager started there (probed,
    about to bind), that one's bind failed ``FileNotFoundError`` (review 252). Held by a start, the
    directory is left to it, for good (a start that did not make it leaves it as it stops): harmless,
    the next start reuses it. A start that opened it before the removal makes it anew. The lock is
    taken shared: a start meeting it knows a stop holds it, and waits (review 262); stops need no
    turns among themselves, only the manager that made a directory removing it. A directory whose
    lock cannot be taken at all is left too, never removed unlocked."""
    if not endpoint.created:
        return
    try:
        fd = _open_directory(endpoint.directory)
    except OSError:
        return  # gone already, or no longer a directory: nothing of ours to remove
    try:
        if _lock_directory(fd, starting=False) and _still_at(endpoint.directory, fd):
            os.rmdir(endpoint.directory)
    except OSError:
        pass  # not empty (someone else put something there), or not lockable: leave it
    finally:
        _close_directory(fd)
