"""Review 246: a rank group's ``start()`` that failed once it listened (registering the listener with
the loop refused) leaves nothing behind, and a second ``start()`` never removes another manager's
socket.

The failed start closed its listener and removed its socket file, but kept that file's inode number
in ``_inode``. A second ``start()`` that failed before it bound (another manager now listening at the
path: ``RuntimeError``) then removed the socket at the path whenever its inode had that number, and
ext4 gives a file made right after an unlink the inode just freed: the live manager's socket was
unlinked under it (its workers could no longer connect).

The sockets and the file system are real; the loop's ``add_reader`` is refused as ``epoll_ctl``
refuses past ``fs.epoll.max_user_watches`` (``ENOSPC``), a limit of the whole host not to be lowered
here.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from tp_helpers import CONFIG

from aiokv import KVLayout
from aiokv.tp.endpoint import SOCKET_NAME
from aiokv.tp.group import RankGroup

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)


def _fds_on(path: Path) -> list[str]:
    """This process's descriptors of sockets bound at ``path`` (by /proc/self/fd and /proc/net/unix)."""
    inodes = set()
    with open("/proc/net/unix") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[7] == os.fspath(path):
                inodes.add(f"socket:[{fields[6]}]")
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") in inodes:
                found.append(name)
        except OSError:
            pass  # closed meanwhile (the listing's own descriptor)
    return found


@pytest.mark.asyncio
async def test_a_start_retried_after_a_failed_one_leaves_another_managers_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "mgr"
    directory.mkdir(mode=0o700)
    path = directory / SOCKET_NAME
    group = RankGroup(LAYOUT, 2, "/aiokv-failed-start-test", 4, CONFIG, directory)
    loop = asyncio.get_running_loop()

    bound: list[int] = []

    def refuse(fd: int, callback: Any, *args: Any) -> None:
        bound.append(os.lstat(path).st_ino)  # the failed start's socket file
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(loop, "add_reader", refuse)
    with pytest.raises(OSError, match="No space left"):
        await group.start()
    monkeypatch.undo()
    assert not path.exists(), "the failed start left its socket file"
    assert _fds_on(path) == [], "the failed start left its listener open"
    # Another manager listens at the path now.
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        other.bind(os.fspath(path))
        other.listen()
        assert len(bound) == 1
        if os.lstat(path).st_ino != bound[0]:
            pytest.skip("the file system gave the new socket another inode (ext4 reuses it at once)")
        with pytest.raises(RuntimeError, match="another manager"):
            await group.start()
        assert path.exists(), "the second start removed the other manager's socket"
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with client:
            client.connect(os.fspath(path))  # the other manager is still reachable
        await group.aclose()
        assert path.exists(), "the close removed the other manager's socket"
    finally:
        other.close()
    assert _fds_on(path) == []


@pytest.mark.asyncio
async def test_a_start_retried_after_a_failed_one_listens_and_its_close_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "mgr"
    path = directory / SOCKET_NAME
    group = RankGroup(LAYOUT, 2, "/aiokv-failed-start-test", 4, CONFIG, directory)
    loop = asyncio.get_running_loop()

    def refuse(fd: int, callback: Any, *args: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(loop, "add_reader", refuse)
    with pytest.raises(OSError, match="No space left"):
        await group.start()
    monkeypatch.undo()
    assert not directory.exists(), "the failed start left the directory it made"
    await group.start()
    try:
        assert group.address == path and len(_fds_on(path)) == 1
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with client:
            client.connect(os.fspath(path))
    finally:
        await group.aclose()
    assert not path.exists() and not directory.exists()
    assert _fds_on(path) == []
