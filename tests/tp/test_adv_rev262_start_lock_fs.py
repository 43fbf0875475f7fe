"""Review 262 leftover: the manager's start lock on a file system that emulates ``flock`` with POSIX
locks, and where the lock cannot be taken at all.

NFS (and CIFS, and FUSE file systems asking for it) turn a file's ``flock`` into a POSIX lock, which a
descriptor opened for reading cannot take exclusive (``EBADF``): the start lock, an exclusive
``flock`` of the directory opened ``O_RDONLY``, was feared to fail so, and a start then ran unlocked
with a warning (review 249's race: two managers starting at once both believing they listen).

On a real such file system (``fuse_lockfs.py``: FUSE with ``FUSE_FLOCK_LOCKS``, answering lock
requests as NFSv4 does, ``EBADF`` included) the directory's lock holds: the kernel gives directories
no emulated ``flock`` (FUSE's, NFS's and CIFS's directory file operations have none) and locks them
itself, among this host's processes. Starts there take turns, a start waits for a stop, as on a
local file system. These pass before and after the fix.

Where the lock cannot be taken at all (a file system that fails a directory's ``flock``) the start
is now refused (``StartLockFailed``) and a stop leaves the directory; both ran unlocked before. No
file system at hand here fails a directory's ``flock``: that fault is simulated, ``fcntl.flock``
failing for the manager's directory only.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lock_scenarios import STARTING, STOPPING, go_on, reap, spawn
from loop_probes import until, waiting_in
from tp_helpers import CONFIG

from aiokv import KVLayout
from aiokv.tp import endpoint as endpoint_module
from aiokv.tp.endpoint import SOCKET_NAME, StartLockFailed
from aiokv.tp.group import RankGroup

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
POOL = "/aiokv-start-lock-fs-test"
_MNT_DETACH = 2


def _group(directory: Path) -> RankGroup:
    return RankGroup(LAYOUT, 2, POOL, 4, CONFIG, directory)


async def _reachable(group: RankGroup) -> None:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with client:
        client.connect(os.fspath(group.address))
        await until(lambda: group.statistics().connections == 1)


def _lock_requests(mount: Path) -> list[str]:
    """The lock requests that reached the file system so far (its ``lock NODE TYPE -> ERRNO`` lines)."""
    return (mount.parent / "lockfs.log").read_text().splitlines()


@pytest.fixture
def lockfs(tmp_path: Path) -> Iterator[Path]:
    """``fuse_lockfs.py`` mounted at ``<tmp>/mnt`` (its log beside it); unmounted after the test.
    Skips where it cannot be."""
    if os.geteuid() != 0:
        pytest.skip("mounting a FUSE file system needs root")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse here")
    mount = tmp_path / "mnt"
    mount.mkdir()
    with open(tmp_path / "lockfs.log", "w") as log:
        server = subprocess.Popen(
            [sys.executable, os.fspath(Path(__file__).with_name("fuse_lockfs.py")), os.fspath(mount)],
            stdout=subprocess.PIPE, stderr=log, text=True,
        )
    try:
        assert server.stdout is not None
        line = server.stdout.readline().strip()
        if line != "ready":
            pytest.skip(f"FUSE mount not possible here: {line or server.wait()}")
        try:
            yield mount
        finally:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            if libc.umount2(os.fsencode(mount), 0) != 0:
                libc.umount2(os.fsencode(mount), _MNT_DETACH)  # busy: detached, the server ends when unused
    finally:
        if server.stdout is not None:
            server.stdout.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_the_file_system_emulates_flock_with_posix_locks(lockfs: Path) -> None:
    # What review 262 feared, on a regular file of this file system: exclusive refused EBADF opened
    # for reading, taken opened for writing, and then held against another descriptor.
    path = lockfs / "probe"
    os.mknod(path, 0o600 | 0o100000)
    reading = os.open(path, os.O_RDONLY)
    writing = os.open(path, os.O_RDWR)
    other = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(OSError, match="Bad file descriptor") as refused:
            fcntl.flock(reading, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert refused.value.errno == errno.EBADF
        fcntl.flock(writing, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        for fd in (reading, writing, other):
            os.close(fd)
    os.unlink(path)
    assert len(_lock_requests(lockfs)) == 3  # each reached the file system, as NFS's reach the server


@pytest.mark.asyncio
async def test_starts_there_take_turns(lockfs: Path) -> None:
    directory = lockfs / "mgr"
    starting = await spawn(STARTING, directory)  # holds the lock, as a start between probe and listen
    try:
        refused = _group(directory)
        try:
            with pytest.raises(RuntimeError, match="another manager is starting"):
                await refused.start()
        finally:
            await refused.aclose()
    finally:
        await reap(starting)  # killed there: its lock ends with it
    group = _group(directory)
    await group.start()
    try:
        assert group.address == directory / SOCKET_NAME
        await _reachable(group)
    finally:
        await group.aclose()
    assert os.listdir(directory) == []  # made by the killed start, left by this one (not its maker)
    assert _lock_requests(lockfs) == []  # the kernel locked the directory itself: no emulation


@pytest.mark.asyncio
async def test_a_start_there_waits_for_a_stop(lockfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(endpoint_module, "STOP_WAIT_S", 30.0)  # bounded; long for a loaded host
    directory = lockfs / "mgr"
    directory.mkdir(mode=0o700)  # made by the stopping manager: its stop removes it
    stopping = await spawn(STOPPING, directory)  # holds the lock shared, at its rmdir
    group = _group(directory)
    start = asyncio.ensure_future(group.start())
    try:
        await until(lambda: start.done() or waiting_in(start, "sleep"))
        assert not start.done(), start.exception()
        assert await go_on(stopping) == b"removed\n"
        await start
        await _reachable(group)
    finally:
        await reap(stopping)
        await asyncio.wait([start])
        await group.aclose()
    assert not directory.exists()  # made anew by this start, removed by its stop


@contextlib.contextmanager
def _flock_failing(monkeypatch: pytest.MonkeyPatch, directory: Path, code: int) -> Iterator[None]:
    """``fcntl.flock`` of ``directory``'s descriptors fails ``code`` (simulated: no file system here
    fails a directory's flock); every other flock, and an unlock, runs for real."""
    flock = fcntl.flock

    def failing(fd: int, operation: int) -> None:
        if operation != fcntl.LOCK_UN and os.readlink(f"/proc/self/fd/{fd}") == os.fspath(directory):
            raise OSError(code, os.strerror(code))
        flock(fd, operation)

    with monkeypatch.context() as patch:
        patch.setattr(fcntl, "flock", failing)
        yield


@pytest.mark.asyncio
@pytest.mark.parametrize("code", [errno.EBADF, errno.ENOLCK], ids=["EBADF", "ENOLCK"])
async def test_a_directory_that_cannot_be_locked_refuses_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    directory = tmp_path / "mgr"
    directory.mkdir(mode=0o700)
    group = _group(directory)
    with _flock_failing(monkeypatch, directory, code):
        try:
            # Before: started unlocked, with a warning.
            with pytest.raises(StartLockFailed, match="refusing to start unlocked") as refused:
                await group.start()
            assert isinstance(refused.value.__cause__, OSError) and refused.value.__cause__.errno == code
        finally:
            await group.aclose()
    assert os.listdir(directory) == []  # nothing bound


@pytest.mark.asyncio
async def test_a_stop_that_cannot_lock_leaves_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "mgr"
    group = _group(directory)
    await group.start()  # made the directory: its stop removes it, under the lock only
    with _flock_failing(monkeypatch, directory, errno.ENOLCK):
        await group.aclose()
    # Before: removed unlocked, under any start there. Left, the next start reuses it.
    assert directory.exists() and os.listdir(directory) == []
    again = _group(directory)
    await again.start()
    try:
        await _reachable(again)
    finally:
        await again.aclose()
