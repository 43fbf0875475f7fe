"""Review 249: two managers starting in one directory at once, and a manager stopping while another
starts there.

A manager's start probed the socket file at its path (``clear_stale_socket``), then bound and
listened. A socket bound but not yet listening refuses a connection as a dead one does: a second
manager probing it then removed it and bound its own, and the first listened on a file nobody could
reach. Both starts succeeded and both managers believed they owned the group (the ranks reached only
the second). Starts now take the directory's ``flock`` from the probe until they listen; one that
finds it held raises ``RuntimeError``.

A stopping manager closed its listener, then (a few loop turns later, after its links ended)
unlinked the socket file if its inode number was still the one it bound. Between the two, a manager
starting there found a dead socket, removed it and bound its own, which ext4 gives the inode just
freed: the stopping manager then unlinked the new manager's live socket. (The window was loop turns
wide when the manager had links: their sockets, which hold the file too, closed a turn before the
unlink.) The name now goes before the listener closes, while its inode cannot be freed.

The sockets, locks and file system are real; the first start is held between its bind and its
listen on a thread of its own (a wrapper of ``socket.listen`` waiting for an event); the second
manager of the close case starts, on a thread of its own, as the first's close calls
``remove_endpoint`` (a wrapper).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from loop_probes import until, until_thread
from tp_helpers import CONFIG

from aiokv import KVLayout
from aiokv.tp import group as group_module
from aiokv.tp.endpoint import SOCKET_NAME
from aiokv.tp.group import RankGroup

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
POOL = "/aiokv-start-race-test"


def _group(directory: Path) -> RankGroup:
    return RankGroup(LAYOUT, 2, POOL, 4, CONFIG, directory)


def _private(tmp_path: Path) -> Path:
    directory = tmp_path / "mgr"
    directory.mkdir(mode=0o700)
    return directory


def _connect(path: Path) -> socket.socket:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(os.fspath(path))
    except BaseException:
        client.close()
        raise
    return client


@pytest.fixture
def other_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running on a thread of its own (the first manager's), stopped after the test."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="rev249-manager-a", daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


@pytest.mark.asyncio
async def test_a_start_between_anothers_bind_and_listen_is_refused_and_the_first_is_reachable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other_loop: asyncio.AbstractEventLoop
) -> None:
    directory = _private(tmp_path)
    path = directory / SOCKET_NAME
    bound = threading.Event()
    release = threading.Event()
    listen = socket.socket.listen

    def held_listen(self: socket.socket, *args: Any) -> None:
        if threading.current_thread().name == "rev249-manager-a":
            bound.set()  # bound at the path, not listening yet
            assert release.wait(30), "the test never let the first start listen"
        listen(self, *args)

    monkeypatch.setattr(socket.socket, "listen", held_listen)

    async def make_first() -> RankGroup:
        return _group(directory)

    first = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(make_first(), other_loop))
    first_start = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(first.start(), other_loop))
    second = _group(directory)
    try:
        try:
            await until_thread(bound.is_set, "the first start's bind")
            bound_id = os.lstat(path).st_ino
            with pytest.raises(RuntimeError, match="another manager is starting"):
                await second.start()
        finally:
            release.set()  # the first start listens now
            await asyncio.wait([first_start])
            await second.aclose()  # nothing to do unless it started
        assert first_start.exception() is None
        assert os.lstat(path).st_ino == bound_id, "the refused start replaced the first manager's socket"
        with _connect(path):
            # The first manager accepts what connects at the path (its ranks reach it).
            seen = asyncio.run_coroutine_threadsafe(until(lambda: first.statistics().connections == 1), other_loop)
            await asyncio.wrap_future(seen)
        third = _group(directory)
        try:
            with pytest.raises(RuntimeError, match="another manager is listening"):
                await third.start()  # the start lock is free again: the probe answers
        finally:
            await third.aclose()
    finally:
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(first.aclose(), other_loop))
    assert not path.exists()


@pytest.mark.asyncio
async def test_a_start_during_anothers_close_keeps_its_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other_loop: asyncio.AbstractEventLoop
) -> None:
    directory = _private(tmp_path)
    path = directory / SOCKET_NAME
    first = _group(directory)
    await first.start()
    first_id = os.lstat(path).st_ino

    async def make_second() -> RankGroup:
        return _group(directory)

    second = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(make_second(), other_loop))
    remove_endpoint = group_module.remove_endpoint
    second_ids: list[int] = []

    def start_second_first(*args: Any) -> None:
        # The first manager's close has closed its listener and its links (their sockets held the
        # file too) and is about to remove its endpoint: a second manager starts there now, on its
        # own thread (with links open this step came loop turns after the listener closed).
        asyncio.run_coroutine_threadsafe(second.start(), other_loop).result(30)
        second_ids.append(os.lstat(path).st_ino)
        remove_endpoint(*args)

    monkeypatch.setattr(group_module, "remove_endpoint", start_second_first)
    try:
        await first.aclose()
        monkeypatch.undo()
        assert len(second_ids) == 1
        if second_ids[0] != first_id:
            pytest.skip("the file system gave the new socket another inode (ext4 reuses it at once)")
        assert path.exists(), "the first manager's close removed the second manager's socket"
        with _connect(path):
            seen = asyncio.run_coroutine_threadsafe(until(lambda: second.statistics().connections == 1), other_loop)
            await asyncio.wrap_future(seen)
    finally:
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(second.aclose(), other_loop))
    assert not path.exists()


@pytest.mark.asyncio
async def test_a_dead_managers_socket_is_replaced_and_others_are_left(tmp_path: Path) -> None:
    directory = _private(tmp_path)
    path = directory / SOCKET_NAME
    # A manager that died: its socket file stays, nobody listens on it.
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(os.fspath(path))
    dead.listen()
    dead.close()
    group = _group(directory)
    await group.start()
    try:
        assert group.statistics().address == os.fspath(path)
        with _connect(path):
            await until(lambda: group.statistics().connections == 1)
    finally:
        await group.aclose()
    assert not path.exists()

    # A live listener (another manager): refused, its socket left in place.
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with live:
        live.bind(os.fspath(path))
        live.listen()
        live_id = os.lstat(path).st_ino
        with pytest.raises(RuntimeError, match="another manager is listening"):
            await _group(directory).start()
        assert os.lstat(path).st_ino == live_id
        _connect(path).close()
    os.unlink(path)

    # A dead socket of another user: not ours to remove.
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(os.fspath(path))
    dead.close()
    os.chown(path, 65534, 65534)
    if os.lstat(path).st_uid == os.getuid():
        pytest.skip("cannot give the socket file to another user here")
    with pytest.raises(PermissionError, match="not a socket of this user"):
        await _group(directory).start()
    assert os.lstat(path).st_uid == 65534


@pytest.mark.asyncio
async def test_the_start_lock_of_another_process_refuses_until_it_ends(tmp_path: Path) -> None:
    directory = _private(tmp_path)
    path = directory / SOCKET_NAME
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c",
        "import fcntl, os, sys\n"
        f"fd = os.open({os.fspath(directory)!r}, os.O_RDONLY | os.O_DIRECTORY)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        assert await holder.stdout.readline() == b"held\n"
        refused = _group(directory)
        try:
            with pytest.raises(RuntimeError, match="another manager is starting"):
                await refused.start()
        finally:
            await refused.aclose()
        assert not path.exists()
        holder.kill()  # a start that died holding the lock holds nothing
        await holder.wait()
        group = _group(directory)
        await group.start()
        try:
            with _connect(path):
                await until(lambda: group.statistics().connections == 1)
        finally:
            await group.aclose()
    finally:
        if holder.returncode is None:
            holder.kill()
            await holder.wait()
