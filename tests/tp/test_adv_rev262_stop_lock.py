"""Review 262: a manager starting while another stops in the same directory.

A manager that made its directory removes it as it stops, under the directory's start lock (review
252: removed under a start that had probed, that start's bind failed). A start meeting that lock was
refused "another manager is starting" as if another start held it: an engine restarting its manager
right after a stop (the old one still removing its directory) failed, a false refusal. The stop now
holds the lock shared, and a start that finds it held shared (a stop, a few system calls long) waits
for it and tries again; one that finds it held exclusive (another start) is still refused at once.

A stop whose removal meets a start's lock leaves the directory, and so does a manager that did not
make it: the directory may outlive every manager. That is harmless: the next start reuses it.

Real processes, flocks, sockets and directories: the stop runs the real ``remove_endpoint`` in a
process of its own, held at its ``rmdir`` (the lock taken), then let go or killed there (SIGKILL);
the start that holds the lock in the second test is the real ``start_lock`` in a process killed
inside it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import socket
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from lock_scenarios import STARTING, STOPPING, reap, spawn
from loop_probes import until, until_thread, waiting_in
from tp_helpers import CONFIG

from aiokv import KVLayout
from aiokv.tp import endpoint as endpoint_module
from aiokv.tp.endpoint import SOCKET_NAME
from aiokv.tp.group import RankGroup
from aiokv.tp.owner import OWNER_NAME

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
POOL = "/aiokv-stop-lock-test"


def _group(directory: Path) -> RankGroup:
    return RankGroup(LAYOUT, 2, POOL, 4, CONFIG, directory)


async def _reachable(group: RankGroup) -> None:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with client:
        client.connect(os.fspath(group.address))
        await until(lambda: group.statistics().connections == 1)


@pytest.mark.asyncio
@pytest.mark.parametrize("stop_ends", ["removed", "killed"])
async def test_a_start_waits_for_a_stop_removing_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop_ends: str
) -> None:
    # The wait is bounded (a stop frozen holding the lock refuses the start in the end): long enough
    # here for a loaded host to let the stopping process go on.
    monkeypatch.setattr(endpoint_module, "STOP_WAIT_S", 30.0, raising=False)
    directory = tmp_path / "mgr"
    directory.mkdir(mode=0o700)  # made by the stopping manager: its stop removes it
    stopping = await spawn(STOPPING, directory)
    group = _group(directory)
    start = asyncio.ensure_future(group.start())
    try:
        # Before: refused at once, "another manager is starting in ...".
        await until(lambda: start.done() or waiting_in(start, "sleep"))
        assert not start.done(), start.exception()
        assert stopping.stdin is not None and stopping.stdout is not None
        if stop_ends == "removed":
            stopping.stdin.write(b"go\n")
            await stopping.stdin.drain()
            assert await stopping.stdout.readline() == b"removed\n"
        else:  # killed at its rmdir, the lock taken: the directory stays, the lock ends with it
            stopping.kill()
        assert await stopping.wait() == (0 if stop_ends == "removed" else -signal.SIGKILL)
        await start
        assert group.address == directory / SOCKET_NAME
        await _reachable(group)
    finally:
        await reap(stopping)
        await asyncio.wait([start])
        await group.aclose()
    # Made anew by this start after the removal, it goes with this manager; one that the killed stop
    # left was not made by it, and stays (harmless: see the test below).
    assert directory.exists() == (stop_ends == "killed")


@pytest.mark.asyncio
async def test_a_start_meeting_another_start_is_still_refused_at_once(tmp_path: Path) -> None:
    directory = tmp_path / "mgr"
    directory.mkdir(mode=0o700)
    starting = await spawn(STARTING, directory)
    try:
        group = _group(directory)
        try:
            with pytest.raises(RuntimeError, match="another manager is starting"):
                await group.start()
        finally:
            await group.aclose()
    finally:
        await reap(starting)


@pytest.mark.asyncio
async def test_a_directory_left_by_a_stop_a_start_held_is_reused(tmp_path: Path) -> None:
    directory = tmp_path / "mgr"
    first = _group(directory)
    await first.start()  # it made the directory: its stop removes it, unless a start holds the lock
    starting = await spawn(STARTING, directory)
    try:
        await first.aclose()
        assert directory.exists()  # left to the start holding its lock
        starting.kill()  # that start dies after its probe: the directory outlives every manager
        await starting.wait()
    finally:
        await reap(starting)
    # Its claim too, left to the start holding the lock (which would find its socket gone and clear
    # it): the next start here clears it so (its stop leaves nothing below).
    assert os.listdir(directory) == [OWNER_NAME]
    for _ in range(2):  # reused by the next start, and by the one after its stop (which keeps it)
        group = _group(directory)
        await group.start()
        try:
            assert group.address == directory / SOCKET_NAME
            await _reachable(group)
        finally:
            await group.aclose()
        info = os.lstat(directory)
        assert stat.S_IMODE(info.st_mode) == 0o700 and os.listdir(directory) == []


@pytest.mark.asyncio
@pytest.mark.parametrize("cut", ["aclose", "cancel"])
async def test_a_start_waiting_for_a_stop_can_be_closed_or_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: str
) -> None:
    # The wait is the start's only await: a close or a cancel there leaves nothing listening.
    monkeypatch.setattr(endpoint_module, "STOP_WAIT_S", 30.0)
    directory = tmp_path / "mgr"
    directory.mkdir(mode=0o700)
    stopping = await spawn(STOPPING, directory)
    group = _group(directory)
    start = asyncio.ensure_future(group.start())
    try:
        await until(lambda: start.done() or waiting_in(start, "sleep"))
        if cut == "aclose":
            await group.aclose()  # it had nothing to close yet
        else:
            start.cancel()
        assert stopping.stdin is not None and stopping.stdout is not None
        stopping.stdin.write(b"go\n")
        await stopping.stdin.drain()
        assert await stopping.stdout.readline() == b"removed\n"
        if cut == "aclose":
            with pytest.raises(RuntimeError, match="aclose"):
                await start
        else:
            with pytest.raises(asyncio.CancelledError):
                await start
        assert not directory.exists()  # not made anew: nothing listens there
        with pytest.raises(RuntimeError, match="not started"):
            group.address  # noqa: B018 (the property raises)
    finally:
        await reap(stopping)
        await asyncio.wait([start])
        await group.aclose()


@pytest.mark.asyncio
async def test_a_stop_frozen_holding_the_lock_refuses_the_start_after_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stopping process frozen at its rmdir (held there, as a SIGSTOP would): the wait is bounded.
    monkeypatch.setattr(endpoint_module, "STOP_WAIT_S", 0.05)
    directory = tmp_path / "mgr"
    directory.mkdir(mode=0o700)
    stopping = await spawn(STOPPING, directory)
    group = _group(directory)
    try:
        with pytest.raises(endpoint_module.ManagerStopping, match="a manager is stopping"):
            await group.start()
        assert os.listdir(directory) == []  # nothing bound
    finally:
        await reap(stopping)
        await group.aclose()
    # The stop died there: its lock went with it, and the directory it left is reused.
    group = _group(directory)
    await group.start()
    try:
        await _reachable(group)
    finally:
        await group.aclose()


@pytest.mark.asyncio
async def test_a_directory_removed_between_its_mkdir_and_its_check_is_made_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The start's mkdir met the stopping manager's directory (EEXIST); that manager removed it before
    # the start looked at it (lstat): FileNotFoundError out of the start, a false refusal again
    # (found by three processes starting and stopping managers in one directory in a loop).
    directory = tmp_path / "mgr"
    first = _group(directory)
    await first.start()  # made by this manager: its stop removes it
    held, release = threading.Event(), threading.Event()
    lstat = os.lstat
    starter = "rev262-starter"

    def held_lstat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        mine = threading.current_thread().name.startswith(starter) and os.fspath(path) == os.fspath(directory)
        if mine and not held.is_set():  # the first look: private_directory's, after its mkdir failed
            held.set()
            assert release.wait(30), "the test never let the start go on"
        return lstat(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", held_lstat)
    second = _group(directory)

    async def second_run() -> bool:
        await second.start()
        try:
            await _reachable(second)
            return second.address == directory / SOCKET_NAME
        finally:
            await second.aclose()

    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=starter)
    started = asyncio.get_running_loop().run_in_executor(executor, asyncio.run, second_run())
    try:
        await until_thread(held.is_set, "the start's look at the directory")
        await first.aclose()
        assert not directory.exists()  # nobody held its lock: it went
        release.set()
        assert await started  # before: FileNotFoundError from private_directory's lstat
    finally:
        release.set()
        await asyncio.wait([started])
        executor.shutdown()
