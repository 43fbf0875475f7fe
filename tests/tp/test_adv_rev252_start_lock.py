"""Review 252: the directory start lock of review 249 (``endpoint.start_lock``) and what else touches
that directory.

A child forked while a start held the lock (a worker forked by another thread, multiprocessing's
``fork``) inherited the locked descriptor: ``flock`` belongs to the open file description, so the
child held the lock for its whole life (``O_CLOEXEC`` closes it only at an exec) and every later
start there, a manager's restart included, was refused "another manager is starting".

A manager that made its directory removes it as it stops, and a start refused by the lock did the
same: either could remove the directory under a manager starting there (it had probed and was about
to bind, or had opened the directory and was about to lock it), whose bind then failed
``FileNotFoundError``, or whose lock protected a directory no longer at the path.

Real processes, sockets, locks and file system; each start is held at a point of its own on a
thread of its own by a wrapper of the real call (bind, flock, the stale-socket probe).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fcntl
import os
import socket
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from loop_probes import until, until_thread
from tp_helpers import CONFIG

from aiokv import KVLayout
from aiokv.tp import endpoint as endpoint_module
from aiokv.tp import group as group_module
from aiokv.tp.endpoint import SOCKET_NAME
from aiokv.tp.group import RankGroup

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
POOL = "/aiokv-start-lock-test"
OTHER = "rev252-manager-b"
REFUSED = "rev252-refused"


def _group(directory: Path) -> RankGroup:
    return RankGroup(LAYOUT, 2, POOL, 4, CONFIG, directory)


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
    """An event loop running on a thread of its own (the other manager's), stopped after the test."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=OTHER, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def _on(loop: asyncio.AbstractEventLoop, coroutine: Any) -> asyncio.Future[Any]:
    return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, loop))


async def _make(directory: Path) -> RankGroup:
    return _group(directory)


def _hold(held: threading.Event, release: threading.Event, thread: str = OTHER) -> None:
    if threading.current_thread().name.startswith(thread):
        held.set()
        assert release.wait(30), "the test never let the held start go on"


async def _reachable(group: RankGroup, loop: asyncio.AbstractEventLoop | None = None) -> None:
    with _connect(group.address):
        if loop is None:
            await until(lambda: group.statistics().connections == 1)
        else:
            await _on(loop, until(lambda: group.statistics().connections == 1))


@pytest.mark.asyncio
async def test_a_child_forked_while_a_start_holds_the_lock_does_not_keep_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other_loop: asyncio.AbstractEventLoop
) -> None:
    directory = tmp_path / "mgr"
    directory.mkdir(mode=0o700)  # the user's: it stays after a stop (one made by the manager goes)
    bound, release = threading.Event(), threading.Event()
    listen = socket.socket.listen

    def held_listen(self: socket.socket, *args: Any) -> None:
        _hold(bound, release)  # the start lock is held now
        listen(self, *args)

    monkeypatch.setattr(socket.socket, "listen", held_listen)
    first = await _on(other_loop, _make(directory))
    first_start = _on(other_loop, first.start())
    reader, writer = os.pipe()
    try:
        await until_thread(bound.is_set, "the first start's bind")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads running
            pid = os.fork()
        if pid == 0:  # a long-lived child (a worker): it lives until the test closes the pipe
            try:
                os.close(writer)
                os.read(reader, 1)
            finally:
                os._exit(0)
        release.set()
        await first_start
        await _on(other_loop, first.aclose())
        monkeypatch.undo()
        # The manager restarts while the child lives: it was refused "another manager is starting".
        second = _group(directory)
        await second.start()
        try:
            await _reachable(second)
        finally:
            await second.aclose()
    finally:
        release.set()
        os.close(writer)
        os.close(reader)
        if pid:
            await asyncio.to_thread(os.waitpid, pid, 0)


@pytest.mark.asyncio
async def test_a_stop_does_not_remove_the_directory_of_a_start_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other_loop: asyncio.AbstractEventLoop
) -> None:
    directory = tmp_path / "mgr"  # made by the first manager: its stop removes it
    first = _group(directory)
    await first.start()
    probed, release = threading.Event(), threading.Event()
    clear = endpoint_module.clear_stale_socket

    def held_clear(path: Path) -> None:
        clear(path)
        _hold(probed, release)  # probed (the first manager's socket), under the lock, not bound

    monkeypatch.setattr(endpoint_module, "clear_stale_socket", held_clear)  # called by claim_directory
    second = await _on(other_loop, _make(directory))
    starts: list[asyncio.Future[None]] = []
    remove_endpoint = group_module.remove_endpoint

    def start_second_first(*args: Any) -> None:
        # The first manager's close unlinked its socket's name, closed its listener and links and
        # is about to remove its directory: a second manager starts there and has probed (nothing).
        if threading.current_thread() is threading.main_thread() and not starts:
            starts.append(_on(other_loop, second.start()))
            assert probed.wait(30), "the second start never probed"
        remove_endpoint(*args)

    monkeypatch.setattr(group_module, "remove_endpoint", start_second_first)
    try:
        await first.aclose()
        release.set()
        await starts[0]  # its bind failed FileNotFoundError: the directory was gone
        await _reachable(second, other_loop)
    finally:
        release.set()
        if starts:
            await asyncio.wait(starts)
        await _on(other_loop, second.aclose())


@pytest.mark.asyncio
async def test_a_directory_removed_before_the_lock_is_made_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other_loop: asyncio.AbstractEventLoop
) -> None:
    directory = tmp_path / "mgr"
    first = _group(directory)
    await first.start()
    opened, release = threading.Event(), threading.Event()
    flock = fcntl.flock

    def held_flock(fd: int, operation: int) -> None:
        if operation & fcntl.LOCK_EX:
            _hold(opened, release)  # the directory is open, not locked yet
        flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", held_flock)
    second = await _on(other_loop, _make(directory))
    second_start = _on(other_loop, second.start())
    try:
        await until_thread(opened.is_set, "the second start's open")
        await first.aclose()  # nobody held the lock: the directory goes
        assert not directory.exists()
        release.set()
        await second_start  # it locked the removed directory and bound in none: FileNotFoundError
        assert second.address == directory / SOCKET_NAME
        await _reachable(second, other_loop)
    finally:
        release.set()
        await asyncio.wait([second_start])
        await _on(other_loop, second.aclose())


@pytest.mark.asyncio
async def test_a_start_refused_by_the_lock_leaves_the_directory_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other_loop: asyncio.AbstractEventLoop
) -> None:
    # The refused manager makes the directory; the other opens it and locks it first.
    directory = tmp_path / "mgr"
    opened, go_on = threading.Event(), threading.Event()
    holding, release = threading.Event(), threading.Event()
    flock, bind = fcntl.flock, socket.socket.bind
    first = await _on(other_loop, _make(directory))
    first_start: asyncio.Future[Any] | None = None

    def held_flock(fd: int, operation: int) -> None:
        if operation & fcntl.LOCK_EX:
            _hold(opened, go_on, REFUSED)  # the refused start made and opened the directory
        flock(fd, operation)

    def held_bind(self: socket.socket, address: Any) -> None:
        _hold(holding, release)  # the first start holds the lock, probed, not bound yet
        bind(self, address)

    monkeypatch.setattr(fcntl, "flock", held_flock)
    monkeypatch.setattr(socket.socket, "bind", held_bind)
    refused = _group(directory)

    async def refused_run() -> None:
        try:
            await refused.start()
        finally:
            await refused.aclose()

    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=REFUSED)
    refused_start = asyncio.get_running_loop().run_in_executor(executor, asyncio.run, refused_run())
    try:
        await until_thread(opened.is_set, "the refused start's open")
        first_start = _on(other_loop, first.start())
        await until_thread(holding.is_set, "the first start's lock")
        go_on.set()
        with pytest.raises(RuntimeError, match="another manager is starting"):
            await refused_start
        release.set()
        await first_start  # its bind failed FileNotFoundError: the refused start removed the directory
        await _reachable(first, other_loop)
    finally:
        go_on.set()
        release.set()
        await asyncio.wait([refused_start] + ([first_start] if first_start else []))
        await _on(other_loop, first.aclose())
        executor.shutdown()
