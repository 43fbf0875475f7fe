"""Which host's manager owns a TP directory: a record beside its socket, for a directory shared
between hosts (NFS, CephFS, a shared FUSE mount).

A Unix-domain socket answers only where it was bound (that host, that mount): from another host a
live manager's socket refuses a connect as a dead one's does, and the directory's ``flock`` excludes
this host's processes only (:mod:`aiokv.tp.endpoint`). A start there once removed a live manager's
socket as a dead one's, and each manager's stop could then remove the directory under the other.

So a starting manager first claims the directory: a record (:data:`OWNER_NAME`: host name, machine
id, boot id, the directory's ``st_dev`` as it sees it, pid, start time, a token) made ``O_CREAT |
O_EXCL``, which the server decides (NFSv3 and later, CephFS, FUSE): of two hosts starting at once,
one makes it and the other is refused. A record found there is judged (:func:`judge`):

- this boot and this mount (boot id and ``st_dev`` equal): the socket's probe decides, as before;
- this host before its last boot (host name and machine id equal, another boot id, started before
  this boot began): its manager is dead for sure;
- anything else (another host, another mount of the directory on this host, a record that cannot
  be read): refused (:class:`OwnedElsewhere`), nothing removed. Only its manager's stop removes it,
  or a person who knows that manager is gone.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

OWNER_NAME = "manager.owner"
_FORMAT = "aiokv-tp-owner/1"
_MAX_BYTES = 4096
"""A record is a few hundred bytes; anything larger is not one."""


class OwnedElsewhere(RuntimeError):
    """The directory is claimed by a manager whose socket cannot be probed from here (another host,
    another mount), or by a record that cannot be read: the start is refused and nothing of it is
    removed."""


@dataclass(frozen=True)
class HostIdentity:
    """This host as a record names it; an empty string where the system does not say."""

    host: str
    machine: str
    """``/etc/machine-id``: the same across reboots, told apart from another host of the same name."""
    boot: str
    """``/proc/sys/kernel/random/boot_id``: a new one at every boot."""
    booted: float | None
    """When this boot began (wall clock, seconds): ``btime`` of ``/proc/stat``."""


def _first_line(*paths: str) -> str:
    for path in paths:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            with open(path, encoding="ascii") as f:
                line = f.readline().strip()
            if line:
                return line
    return ""


def _boot_time() -> float | None:
    with contextlib.suppress(OSError, UnicodeDecodeError, ValueError), open("/proc/stat", encoding="ascii") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    return None


@functools.cache
def this_host() -> HostIdentity:
    """This host's identity (read once: none of it changes while a process runs)."""
    return HostIdentity(
        host=socket.gethostname(),
        machine=_first_line("/etc/machine-id", "/var/lib/dbus/machine-id"),
        boot=_first_line("/proc/sys/kernel/random/boot_id"),
        booted=_boot_time(),
    )


@dataclass(frozen=True)
class OwnerRecord:
    """A manager's claim on its directory, as read from :data:`OWNER_NAME`."""

    host: str
    machine: str
    boot: str
    dev: int
    """``st_dev`` of the directory as the owner saw it: another mount of it has another."""
    pid: int
    started: float
    """Wall clock, seconds."""
    token: str
    """Tells this claim from any other: only the claim's maker removes it (:func:`remove_record`)."""

    def describe(self) -> str:
        at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return f"host {self.host or '?'} (boot id {self.boot or '?'}), pid {self.pid}, started {at}"


def make_record(directory: Path) -> str | None:
    """Claim ``directory``: make its record, ``O_EXCL``; returns the claim's token, or None when a
    record is there already. Raises ``OSError`` where it cannot be made (the start is refused: a
    directory nobody can claim leaves the other hosts' starts unguarded)."""
    me = this_host()
    token = secrets.token_hex(16)
    record = {
        "format": _FORMAT, "host": me.host, "machine": me.machine, "boot": me.boot,
        "dev": os.lstat(directory).st_dev, "pid": os.getpid(), "started": time.time(), "token": token,
    }
    data = json.dumps(record).encode()
    path = directory / OWNER_NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return None
    try:
        # One write: another host reading meanwhile sees the whole record or an empty file, and an
        # empty one refuses its start as another claim would (a claim being made).
        if os.write(fd, data) != len(data):
            raise OSError(f"short write of {path}")
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)
    return token


def read_record(directory: Path) -> OwnerRecord | None:
    """The record in ``directory``; None when there is none. Raises :class:`OwnedElsewhere` for one
    that cannot be read (not a regular file of this user, empty, torn, of another format): a claim
    being made on another host, or left half made; never taken for a dead one's."""
    path = directory / OWNER_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _unreadable(directory, str(exc)) from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise _unreadable(directory, "not a regular file of this user")
        data = os.read(fd, _MAX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        doc = json.loads(data.decode("utf-8"))
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            raise ValueError("not an owner record")
        found = OwnerRecord(str(doc["host"]), str(doc["machine"]), str(doc["boot"]), int(doc["dev"]),
                            int(doc["pid"]), float(doc["started"]), str(doc["token"]))
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise _unreadable(directory, f"{len(data)} bytes, {exc}") from exc
    return found


def _unreadable(directory: Path, why: str) -> OwnedElsewhere:
    return OwnedElsewhere(
        f"{directory} holds an owner record that cannot be read ({why}): a manager on another host may be "
        f"claiming the directory right now; refusing to start. If no manager uses {directory}, remove "
        f"{directory / OWNER_NAME}"
    )


def owned_elsewhere(found: OwnerRecord, directory: Path) -> str | None:
    """Where ``found``'s manager runs when its socket cannot be probed from this process ("another
    host", "this host through another mount of it (...)"); None when it can (this boot, this mount)
    or that manager is dead for sure (this host before its last boot). Raises ``OSError`` where the
    directory cannot be looked at."""
    me = this_host()
    same_machine = found.host == me.host and found.machine == me.machine
    if found.boot == me.boot and (me.boot or same_machine):
        dev = os.lstat(directory).st_dev
        if found.dev == dev:
            return None
        return f"this host through another mount of it (device {found.dev:#x} there, {dev:#x} here)"
    if same_machine and me.boot and found.boot and me.booted is not None and found.started < me.booted:
        return None  # before this host's last boot (a copy of this host named alike started after it)
    return "another host"


def judge(found: OwnerRecord, directory: Path) -> None:
    """Return when this process may judge ``found``'s manager by its socket (this boot, this mount)
    or knows it dead (this host before its last boot); raise :class:`OwnedElsewhere` otherwise."""
    where = owned_elsewhere(found, directory)
    if where is None:
        return
    raise OwnedElsewhere(
        f"{directory} is owned by a manager on {where}: {found.describe()}. Its socket cannot be probed "
        f"from here (it refuses every connection as a dead one would), so it is left alone and this "
        f"start is refused. If that manager is gone, remove {directory / OWNER_NAME}"
    )


def remove_record(directory: Path, token: str) -> None:
    """Remove ``directory``'s record if it is still the claim ``token``. Exact while no start on this
    host runs (under the start lock, exclusive or shared): another host never removes a claim not
    its own, and while one stands none is made."""
    try:
        found = read_record(directory)
    except OwnedElsewhere:
        return
    if found is not None and found.token == token:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(directory / OWNER_NAME)
