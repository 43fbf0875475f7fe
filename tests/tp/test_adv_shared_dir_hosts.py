"""A TP directory shared between hosts (NFS, CephFS, a shared FUSE mount): two hosts pointed at it
must never break each other.

A Unix-domain socket answers only where it was bound: from another host (or through another mount
of the file system) a live manager's socket refuses a connect (``ECONNREFUSED``) as a dead one's
does, and the directory's ``flock`` excludes this host's processes only. A start there took the live
manager's socket for a dead one's, unlinked it and listened in its place: both believed they owned
the directory, the first unreachable, and either's stop could remove the directory under the other.
A start now claims the directory (``manager.owner``, made ``O_EXCL``: ``aiokv.tp.owner``) and judges
a socket by its probe only where that record says this boot and this mount made it.

The other host is real on disk: a record naming another boot id and host name beside a socket that
is bound and not listening (what a remote manager's socket is to this host); and, through
``fuse_lockfs.py`` mounted twice (one tree, two mounts, as two hosts see an NFS export), a live
manager listening through one mount, whose socket the other mount's connects are refused, its
``flock`` not shared, and inode numbers reused at once as ext4 reuses them. The same host's dead
manager (a process killed, a record from before the last boot) is still cleared. A stop unlinks its
socket's name before its claim (another host's start in between once had its new socket unlinked by
that stop) and removes the claim under the directory's lock taken shared (a start on this host in
between once had its fresh claim removed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from loop_probes import until, until_thread, waiting_in
from tp_helpers import CONFIG

from aiokv import KVLayout
from aiokv.tp import endpoint as endpoint_module
from aiokv.tp import group as group_module
from aiokv.tp import owner as owner_module
from aiokv.tp.endpoint import SOCKET_NAME
from aiokv.tp.group import RankGroup
from aiokv.tp.owner import OWNER_NAME, OwnedElsewhere, OwnerRecord, this_host

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
POOL = "/aiokv-shared-dir-hosts-test"
T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
_MNT_DETACH = 2


def _group(directory: Path) -> RankGroup:
    return RankGroup(LAYOUT, 2, POOL, 4, CONFIG, directory)


def _identity(path: Path) -> tuple[int, int]:
    info = os.lstat(path)
    return info.st_dev, info.st_ino


def _record(directory: Path, host: str, machine: str, boot: str, started: float) -> bytes:
    """A claim as another manager writes it; returns its bytes."""
    data = json.dumps({
        "format": "aiokv-tp-owner/1", "host": host, "machine": machine, "boot": boot,
        "dev": os.lstat(directory).st_dev, "pid": 4242, "started": started, "token": uuid.uuid4().hex,
    }).encode()
    (directory / OWNER_NAME).write_bytes(data)
    return data


@contextlib.contextmanager
def _unanswered_socket(path: Path) -> Iterator[None]:
    """A socket bound at ``path`` and open, not listening: a connect is refused, as from another host."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with sock:
        sock.bind(os.fspath(path))
        yield


def _dead_socket(path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(os.fspath(path))
    sock.close()


async def _reachable(group: RankGroup, address: Path | None = None) -> None:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with client:
        client.connect(os.fspath(address or group.address))
        await until(lambda: group.statistics().connections >= 1)


def _mine(directory: Path) -> dict[str, object]:
    doc = json.loads((directory / OWNER_NAME).read_bytes())
    assert isinstance(doc, dict)
    me = this_host()
    assert (doc["host"], doc["boot"], doc["pid"]) == (me.host, me.boot, os.getpid())
    return doc


@pytest.mark.asyncio
@pytest.mark.parametrize("owner", ["other_host", "copy_of_this_host"])
@pytest.mark.parametrize("socket_file", ["listening_there", "not_bound_yet"])
async def test_a_start_in_a_directory_another_host_owns_is_refused_and_removes_nothing(
        tmp_path: Path, owner: str, socket_file: str) -> None:
    directory = tmp_path / "mgr"
    directory.mkdir(mode=0o700)
    me = this_host()
    if owner == "other_host":
        record = _record(directory, "other-host", "f" * 32, str(uuid.uuid4()), time.time())
    else:  # named as this host, another boot, but started after this boot began: not this host's past
        record = _record(directory, me.host, me.machine, str(uuid.uuid4()), time.time())
    path = directory / SOCKET_NAME
    with contextlib.ExitStack() as stack:
        if socket_file == "listening_there":
            stack.enter_context(_unanswered_socket(path))
            bound = _identity(path)
        group = _group(directory)
        try:
            # Before: the socket taken for a dead one's, unlinked, and this start listened in its place.
            with pytest.raises(OwnedElsewhere) as refused:
                await group.start()
        finally:
            await group.aclose()
        message = str(refused.value)
        assert os.fspath(directory) in message and ("other-host" if owner == "other_host" else me.host) in message
        assert (directory / OWNER_NAME).read_bytes() == record
        if socket_file == "listening_there":
            assert _identity(path) == bound
            assert sorted(os.listdir(directory)) == [OWNER_NAME, SOCKET_NAME]
        else:
            assert os.listdir(directory) == [OWNER_NAME]


@pytest.mark.asyncio
@pytest.mark.parametrize("content", [b"", b"{\"format\": \"aiokv-tp-owner/1\", \"host\""], ids=["empty", "torn"])
async def test_a_claim_that_cannot_be_read_refuses_the_start(tmp_path: Path, content: bytes) -> None:
    # Another host's claim being made (created, not yet written), or one left half made: never a dead one's.
    directory = tmp_path / "mgr"
    directory.mkdir(mode=0o700)
    (directory / OWNER_NAME).write_bytes(content)
    group = _group(directory)
    try:
        with pytest.raises(OwnedElsewhere, match="cannot be read"):
            await group.start()
    finally:
        await group.aclose()
    assert os.listdir(directory) == [OWNER_NAME] and (directory / OWNER_NAME).read_bytes() == content


@pytest.mark.asyncio
async def test_this_hosts_manager_from_before_its_last_boot_is_cleared(tmp_path: Path) -> None:
    me = this_host()
    if not me.boot or me.booted is None:
        pytest.skip("no boot id or boot time on this system")
    directory = tmp_path / "mgr"
    directory.mkdir(mode=0o700)
    _record(directory, me.host, me.machine, str(uuid.uuid4()), me.booted - 3600)
    _dead_socket(directory / SOCKET_NAME)
    group = _group(directory)
    await group.start()
    try:
        await _reachable(group)
        assert _mine(directory)["boot"] == me.boot  # before: the old boot's record left in place
    finally:
        await group.aclose()
    assert os.listdir(directory) == []  # its stop removes its claim with its socket


_KILLED_MANAGER = r"""
import os, socket, sys
from pathlib import Path
from aiokv.tp import endpoint

with endpoint.start_lock(Path(sys.argv[1])) as found:
    endpoint.claim_directory(found)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.fspath(found.socket_path))
    listener.listen()
print("listening", flush=True)
sys.stdin.readline()
"""


@pytest.mark.asyncio
async def test_a_killed_managers_claim_and_socket_on_this_host_are_cleared(tmp_path: Path) -> None:
    directory = tmp_path / "mgr"
    manager = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _KILLED_MANAGER, os.fspath(directory),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=REPO,
    )
    try:
        assert manager.stdout is not None
        assert await asyncio.wait_for(manager.stdout.readline(), 30) == b"listening\n"
        record = (directory / OWNER_NAME).read_bytes()
        group = _group(directory)
        try:
            with pytest.raises(RuntimeError, match="another manager is listening"):
                await group.start()  # this host, this boot: its probe answers
        finally:
            await group.aclose()
        assert (directory / OWNER_NAME).read_bytes() == record
    finally:
        manager.kill()  # SIGKILL: its socket and claim stay, nothing of its own cleanup runs
        await manager.wait()
    group = _group(directory)
    await group.start()  # killed: nobody answers on its socket, and its claim says this boot made it
    try:
        await _reachable(group)
        assert _mine(directory)["token"] != json.loads(record)["token"]
    finally:
        await group.aclose()
    assert os.listdir(directory) == []


@contextlib.contextmanager
def _loop_thread(name: str) -> Iterator[Callable[[Coroutine[Any, Any, T]], asyncio.Future[T]]]:
    """An event loop running on a thread named ``name`` (another manager's); yields a function that
    runs a coroutine there and returns a future of this loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=name, daemon=True)
    thread.start()

    def on(coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    try:
        yield on
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


@contextlib.contextmanager
def _two_mounts(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """``fuse_lockfs.py`` serving one tree at ``<tmp>/a`` and ``<tmp>/b``, unmounted after; skips
    where it cannot be mounted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a FUSE file system needs root")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse here")
    mounts = tmp_path / "a", tmp_path / "b"
    for mount in mounts:
        mount.mkdir()
    with open(tmp_path / "lockfs.log", "w") as log:
        server = subprocess.Popen(
            [sys.executable, os.fspath(Path(__file__).with_name("fuse_lockfs.py")), *map(os.fspath, mounts)],
            stdout=subprocess.PIPE, stderr=log, text=True,
        )
    try:
        assert server.stdout is not None
        line = server.stdout.readline().strip()
        if line != "ready":
            pytest.skip(f"FUSE mount not possible here: {line or server.wait()}")
        try:
            yield mounts
        finally:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            for mount in mounts:
                if libc.umount2(os.fsencode(mount), 0) != 0:
                    libc.umount2(os.fsencode(mount), _MNT_DETACH)
    finally:
        if server.stdout is not None:
            server.stdout.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.mark.asyncio
async def test_a_live_manager_through_another_mount_is_left_alone(tmp_path: Path) -> None:
    with _two_mounts(tmp_path) as (a, b):
        first = _group(a / "mgr")
        await first.start()  # made the directory: its stop removes it
        try:
            path = a / "mgr" / SOCKET_NAME
            bound = _identity(path)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe, pytest.raises(ConnectionRefusedError):
                probe.connect(os.fspath(b / "mgr" / SOCKET_NAME))  # as from another host
            second = _group(b / "mgr")
            try:
                # Before: started, the first's socket unlinked through this mount and replaced.
                with pytest.raises(OwnedElsewhere, match="another mount"):
                    await second.start()
            finally:
                await second.aclose()
            assert _identity(path) == bound
            assert sorted(os.listdir(a / "mgr")) == [OWNER_NAME, SOCKET_NAME]
            await _reachable(first)
        finally:
            await first.aclose()
        assert not (a / "mgr").exists()  # its claim and socket went with it, then its directory
        second = _group(b / "mgr")
        await second.start()  # nobody owns it now
        try:
            assert sorted(os.listdir(b / "mgr")) == [OWNER_NAME, SOCKET_NAME]
            await _reachable(second)
        finally:
            await second.aclose()
        assert not (b / "mgr").exists()


@pytest.mark.asyncio
async def test_two_starts_through_two_mounts_at_once_leave_one_owner(tmp_path: Path) -> None:
    # Their flocks do not meet (two mounts, as two hosts): the O_EXCL claim decides. Each manager
    # runs on a loop of its own in a thread; both stay until the test has looked at the directory.
    attempted, looked = threading.Barrier(3), threading.Barrier(3)

    def life(directory: Path) -> BaseException | None:
        async def run() -> BaseException | None:
            group = _group(directory)
            outcome: BaseException | None = None
            try:
                await group.start()
            except OwnedElsewhere as exc:
                outcome = exc
            try:
                attempted.wait(30)
                looked.wait(30)
            finally:
                await group.aclose()
            return outcome

        return asyncio.run(run())

    with _two_mounts(tmp_path) as (a, b):
        (a / "mgr").mkdir(mode=0o700)
        lives = asyncio.gather(asyncio.to_thread(life, a / "mgr"), asyncio.to_thread(life, b / "mgr"))
        try:
            await asyncio.to_thread(attempted.wait, 30)
            assert sorted(os.listdir(a / "mgr")) == [OWNER_NAME, SOCKET_NAME]
        finally:
            await asyncio.to_thread(looked.wait, 30)
            outcomes = await lives
        assert sum(isinstance(outcome, OwnedElsewhere) for outcome in outcomes) == 1, outcomes
        assert os.listdir(a / "mgr") == []  # the owner's stop took its claim and socket


@pytest.mark.asyncio
async def test_a_start_whose_directory_another_hosts_stop_removes_makes_it_anew(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # This host's lock holds back this host's stops only: the maker of the directory, stopping
    # through the other mount, removes it between the start's lock and its claim. The start waits
    # and makes it anew, as after a stop on this host (review 262); before, FileNotFoundError.
    held, release = threading.Event(), threading.Event()
    make_record = owner_module.make_record

    def held_make_record(directory: Path) -> str | None:
        if threading.current_thread().name.startswith("second-host") and not held.is_set():
            held.set()
            assert release.wait(30), "the test never let the start go on"
        return make_record(directory)

    monkeypatch.setattr(owner_module, "make_record", held_make_record)

    def second_life(directory: Path) -> list[str]:
        async def run() -> list[str]:
            group = _group(directory)
            await group.start()
            try:
                await _reachable(group)
                return sorted(os.listdir(directory))
            finally:
                await group.aclose()

        return asyncio.run(run())

    with _two_mounts(tmp_path) as (a, b):
        first = _group(a / "mgr")
        await first.start()  # made the directory: its stop removes it
        executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="second-host")
        second = asyncio.get_running_loop().run_in_executor(executor, second_life, b / "mgr")
        try:
            await until_thread(held.is_set, "the second start's claim")
            await first.aclose()
            assert not (a / "mgr").exists()  # its lock is not the second's: removed
            release.set()
            assert await second == [OWNER_NAME, SOCKET_NAME]
        finally:
            release.set()
            await asyncio.wait([second])
            executor.shutdown()
            await first.aclose()
        assert not (b / "mgr").exists()  # made anew by the second start, removed by its stop


@pytest.mark.asyncio
async def test_a_start_on_another_host_as_a_manager_stops_is_not_broken_by_that_stop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The first manager stops through one mount, held before its socket's name goes; a start through
    # the other mount runs then. Had the claim gone first, that start found a socket of no claim
    # (refusing its connect), unlinked it, and bound its own, given the inode number just freed
    # (ext4 gives it, and fuse_lockfs.py): the stop's unlink, its identity check fooled, then
    # removed the live socket of the new manager. The claim now goes after the socket's name: the
    # start is refused meanwhile, and starts once the stop is over.
    held, release = threading.Event(), threading.Event()
    unlink = group_module.unlink_socket

    def held_unlink(path: Path, identity: tuple[int, int] | None) -> None:
        if threading.current_thread().name == "first-host" and not held.is_set():
            held.set()
            assert release.wait(30), "the test never let the stop go on"
        unlink(path, identity)

    monkeypatch.setattr(group_module, "unlink_socket", held_unlink)
    with _loop_thread("first-host") as on_first, _two_mounts(tmp_path) as (a, b):
        (a / "mgr").mkdir(mode=0o700)  # made by neither: both leave it

        async def make_first() -> RankGroup:
            return _group(a / "mgr")

        first = await on_first(make_first())
        await on_first(first.start())
        stop = on_first(first.aclose())
        second = _group(b / "mgr")
        try:
            await until_thread(held.is_set, "the first stop's unlink of its socket's name")
            try:
                await second.start()
                started = True
            except OwnedElsewhere:
                started = False  # the first's claim still stands: refused, nothing removed
            release.set()
            await stop
            if not started:
                await second.start()  # the stop is over: nobody owns it
            # Before: FileNotFoundError, its socket unlinked by the first manager's stop.
            await _reachable(second, b / "mgr" / SOCKET_NAME)
            assert sorted(os.listdir(b / "mgr")) == [OWNER_NAME, SOCKET_NAME]
        finally:
            release.set()
            await asyncio.wait([stop])
            await second.aclose()
        assert os.listdir(a / "mgr") == []


@pytest.mark.asyncio
async def test_a_start_here_as_a_manager_releases_its_claim_keeps_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The stopping manager's socket name is gone, its claim not yet: a start on this host may judge
    # that claim dead, remove it and make its own. The stop's removal (read the token, unlink)
    # holds the directory's lock shared, so no start here runs inside it; unlocked, a start between
    # its read and its unlink had its fresh claim removed (a live manager of no claim, whose socket
    # the next host's start takes for a dead one's). Held after its read here.
    monkeypatch.setattr(endpoint_module, "STOP_WAIT_S", 30.0)
    held, release = threading.Event(), threading.Event()
    read_record = owner_module.read_record

    def held_read(directory: Path) -> OwnerRecord | None:
        found = read_record(directory)
        if threading.current_thread().name == "stopping" and not held.is_set():
            held.set()
            assert release.wait(30), "the test never let the stop go on"
        return found

    directory = tmp_path / "mgr"
    directory.mkdir(mode=0o700)
    with _loop_thread("stopping") as on_first:
        async def make_first() -> RankGroup:
            return _group(directory)

        first = await on_first(make_first())
        await on_first(first.start())
        monkeypatch.setattr(owner_module, "read_record", held_read)
        stop = on_first(first.aclose())
        second = _group(directory)
        start: asyncio.Future[None] | None = None
        try:
            await until_thread(held.is_set, "the stop's read of its claim")
            start = started = asyncio.ensure_future(second.start())
            await until(lambda: started.done() or waiting_in(started, "sleep"))
            release.set()
            await stop
            await start
            await _reachable(second)
            assert _mine(directory)  # before: its claim removed by the first manager's stop
            assert sorted(os.listdir(directory)) == [OWNER_NAME, SOCKET_NAME]
        finally:
            release.set()
            await asyncio.wait([stop] if start is None else [stop, start])
            await second.aclose()
    assert os.listdir(directory) == []
