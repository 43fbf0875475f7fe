"""Review 278 of 3ba17b2 (the start lock refuses when the directory's ``flock`` fails): a dead
manager's socket left in the directory (it was killed: nobody listens there) while the lock cannot
be taken. The refused start must not touch it (a socket is probed and unlinked only under the lock:
unlocked, it could be another start's, bound and not yet listening); a directory a refused start
made is left, never removed unlocked. Once the lock can be taken again the next start reuses the
directory, clears the dead socket and listens. The flock failure is simulated (``fcntl.flock``
failing for that directory only, as ``test_adv_rev262_start_lock_fs.py`` does: no file system here
fails a directory's flock); the socket and directory are real."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from loop_probes import until
from tp_helpers import CONFIG

from aiokv import KVLayout
from aiokv.tp.endpoint import SOCKET_NAME, StartLockFailed
from aiokv.tp.group import RankGroup

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
POOL = "/aiokv-rev278-start-lock-test"


@contextlib.contextmanager
def _flock_failing(monkeypatch: pytest.MonkeyPatch, directory: Path, code: int) -> Iterator[None]:
    flock = fcntl.flock

    def failing(fd: int, operation: int) -> None:
        if operation != fcntl.LOCK_UN and os.readlink(f"/proc/self/fd/{fd}") == os.fspath(directory):
            raise OSError(code, os.strerror(code))
        flock(fd, operation)

    with monkeypatch.context() as patch:
        patch.setattr(fcntl, "flock", failing)
        yield


def _dead_socket(path: Path) -> tuple[int, int]:
    """A socket file nobody listens on (its manager killed); returns its identity."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(os.fspath(path))
    sock.close()
    info = os.lstat(path)
    assert stat.S_ISSOCK(info.st_mode)
    return info.st_dev, info.st_ino


@pytest.mark.asyncio
@pytest.mark.parametrize("made", [False, True], ids=["existing", "made_by_the_refused_start"])
async def test_a_refused_start_leaves_a_dead_socket_to_the_next_locked_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, made: bool) -> None:
    directory = tmp_path / "mgr"
    if not made:
        directory.mkdir(mode=0o700)
    refused = RankGroup(LAYOUT, 2, POOL, 4, CONFIG, directory)
    with _flock_failing(monkeypatch, directory, errno.ENOLCK):
        try:
            if made:
                with pytest.raises(StartLockFailed):
                    await refused.start()
                assert os.listdir(directory) == []  # made by it, not removed unlocked
            dead = _dead_socket(directory / SOCKET_NAME)
            with pytest.raises(StartLockFailed):
                await refused.start()
        finally:
            await refused.aclose()
    info = os.lstat(directory / SOCKET_NAME)
    assert (info.st_dev, info.st_ino) == dead  # not probed nor unlinked unlocked
    group = RankGroup(LAYOUT, 2, POOL, 4, CONFIG, directory)
    await group.start()  # the lock taken: the dead socket cleared, ours bound (reached below)
    try:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with client:
            client.connect(os.fspath(group.address))
            await until(lambda: group.statistics().connections == 1)
    finally:
        await group.aclose()
