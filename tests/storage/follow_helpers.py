"""Helpers of the follow tests (``test_follow_*.py``): writer processes, and waits for a following
tier's looks (driven by the looks themselves, each bounded by a deadline)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import glob
import os
import sys
import threading
import traceback
from collections.abc import AsyncIterator, Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from child_procs import end_child, fork_context
from disk_helpers import config, fill, key_of, payload, reserve, seed_payload, small_layout

from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.follow import Look

WRITER_TAG = 7
"""Pages of the writer processes: ``key_of(i, WRITER_TAG)`` with seed ``i`` (fan-out directory 07)."""


class Looks:
    """Counts the looks a following tier applied and wakes waiters after each."""

    def __init__(self, tier: DiskTier) -> None:
        self.tier = tier
        self.applied = 0
        self.changed = asyncio.Condition()
        real = tier._apply_look

        async def counted(found: Look) -> None:
            try:
                await real(found)
            finally:
                self.applied += 1
                async with self.changed:
                    self.changed.notify_all()

        tier._apply_look = counted  # type: ignore[method-assign]

    async def next(self, limit_s: float = 30.0) -> None:
        """A look that starts after this call, applied (one in progress first ends)."""
        want = self.tier._follow_started + 1
        self.tier._look_soon()
        try:
            async with asyncio.timeout(limit_s), self.changed:
                await self.changed.wait_for(lambda: self.applied >= want or self.tier._follow_task is None
                                            or self.tier._follow_task.done())
        except TimeoutError as exc:
            raise AssertionError(f"no look applied in {limit_s} s: {self._where()}") from exc

    def _where(self) -> str:
        """Where the looks are (for a timeout's message): counts, and the look threads' stacks."""
        frames = sys._current_frames()
        stacks = ["".join(traceback.format_stack(frames[t.ident]))
                  for t in threading.enumerate() if t.name.startswith("aiokv-disk-follow") and t.ident in frames]
        return (f"started {self.tier._follow_started}, applied {self.applied}, looks "
                f"{self.tier.statistics().follow_looks}, task {self.tier._follow_task}; look threads:\n"
                + "\n".join(stacks))

    async def until(self, predicate: Callable[[], bool], limit_s: float = 30.0, force: bool = True) -> None:
        """Until ``predicate()`` holds after a look (``force``: each look asked for at once; else
        they come every ``follow_interval_s``). Raises TimeoutError after ``limit_s`` seconds."""
        async with asyncio.timeout(limit_s):
            while not predicate():
                if self.tier._follow_task is None or self.tier._follow_task.done():
                    # No look comes any more (the tier took over or stopped following), and next()
                    # returns at once without yielding: this loop spun for good and the timeout,
                    # a loop callback, never fired (a run hung in Looks(third).until). What is left
                    # to make the predicate hold runs on the loop or a thread: poll it, bounded.
                    await asyncio.sleep(0.001)
                elif force:
                    await self.next(limit_s)
                else:
                    async with self.changed:
                        await self.changed.wait()


def follow_config(directory: Path, backend: DiskBackend, capacity: int = 1 << 30,
                  interval: float = 3600.0, **overrides: object) -> Any:
    """:func:`disk_helpers.config` of a follower: looks only when a test asks (``interval``)."""
    return config(directory, backend, capacity, follow_interval_s=interval, **overrides)


def writer_child(directory: str, backend: str, capacity_files: int, conn: Connection) -> None:
    """Another engine process: holds the directory and writes on demand. Sends ``("ready",
    read_only)``; then ``("write", [i, ...])`` writes ``key_of(i, WRITER_TAG)`` (seed ``i``) in
    order and answers ``("written", [ok, ...])``; ``"close"`` closes the tier and answers
    ``"closed"``, then waits for ``"exit"``."""

    async def main() -> None:
        layout = small_layout()
        pool = PagePool.create(layout, 16 * layout.page_bytes, register_cuda=False, workers=1)
        try:
            pool.wait_ready_blocking()
            capacity = capacity_files * (layout.page_bytes + 4096)
            tier = DiskTier(config(Path(directory), DiskBackend(backend), capacity), layout, pool)
            await tier.start()
            try:
                conn.send(("ready", tier.read_only))
                while (message := await asyncio.to_thread(conn.recv)) != "close":
                    oks = []
                    for i in message[1]:
                        key = key_of(i, WRITER_TAG)
                        h = fill(pool, key, i)
                        oks.append(await tier.write(key, h))
                        pool.table.release(h)
                        pool.table.discard(key)
                    conn.send(("written", oks))
            finally:
                await tier.aclose()
            conn.send("closed")
            await asyncio.to_thread(conn.recv)
        finally:
            pool.close()

    asyncio.run(main())


def stuck_writer_child(directory: str, stored_before: int, conn: Connection) -> None:
    """A writer (threads backend) that stores ``stored_before`` pages ``key_of(i, WRITER_TAG)``
    (seed ``i``), reports ``("stored", i)`` for each, then starts four more whose ``pwritev`` never
    returns: their temporary files exist, created and empty. Reports ``"stuck"`` once they are all in
    the kernel's hands and waits to be SIGKILLed."""

    async def main() -> None:
        layout = small_layout()
        pool = PagePool.create(layout, 16 * layout.page_bytes, register_cuda=False, workers=1)
        pool.wait_ready_blocking()
        real, held, never = os.pwritev, [0], threading.Event()
        loop = asyncio.get_running_loop()
        all_held = loop.create_future()

        def pwritev(fd: int, buffers: Any, offset: int) -> int:
            if stopped[0]:
                held[0] += 1
                if held[0] == 4:
                    loop.call_soon_threadsafe(all_held.set_result, None)
                never.wait()  # the process is SIGKILLed here, mid-write
            return real(fd, buffers, offset)

        stopped = [False]
        os.pwritev = pwritev  # the tier's worker threads call os.pwritev
        tier = DiskTier(config(Path(directory), DiskBackend.THREADS, threads=4), layout, pool)
        await tier.start()
        for i in range(stored_before):
            key = key_of(i, WRITER_TAG)
            h = fill(pool, key, i)
            assert await tier.write(key, h)
            pool.table.release(h)
            pool.table.discard(key)
            conn.send(("stored", i))
        stopped[0] = True
        handles = [fill(pool, key_of(1000 + i, WRITER_TAG), 1000 + i) for i in range(4)]
        writes = [asyncio.ensure_future(tier.write(key_of(1000 + i, WRITER_TAG), h)) for i, h in enumerate(handles)]
        await all_held
        conn.send("stuck")
        await asyncio.gather(*writes)  # never

    asyncio.run(main())


def recycling_writer_child(directory: str, conn: Connection) -> None:
    """A writer (threads backend) whose budget holds 3 page files: stores pages 0, 1, 2
    (``key_of(i, WRITER_TAG)``, seed ``i``) and sends ``"ready"``. On ``("recycle", i)`` it stores
    page ``i``, which recycles the least recently used file (page 0's: overwritten under its name,
    then renamed to page ``i``'s), and holds that rename until told: sends ``"held"`` once the
    file under page 0's name holds page ``i``'s bytes, renames on ``"go"`` and answers
    ``("written", ok, recycled)``. ``"close"``: closes, answers ``"closed"``."""

    async def main() -> None:
        layout = small_layout()
        pool = PagePool.create(layout, 16 * layout.page_bytes, register_cuda=False, workers=1)
        loop = asyncio.get_running_loop()
        real, go, hold = os.rename, threading.Event(), [False]
        held: asyncio.Future[None] = loop.create_future()

        def rename(*args: Any, **kwargs: Any) -> None:
            if hold[0]:  # the tier's worker thread, its overwrite done
                hold[0] = False
                loop.call_soon_threadsafe(held.set_result, None)
                go.wait(60)
            real(*args, **kwargs)

        os.rename = rename  # the threads backend's publish and recycle rename through os.rename
        try:
            pool.wait_ready_blocking()
            capacity = 3 * (layout.page_bytes + 4096)
            async with started(DiskTier(config(Path(directory), DiskBackend.THREADS, capacity), layout, pool)) as tier:

                async def store(i: int) -> bool:
                    key = key_of(i, WRITER_TAG)
                    handle = fill(pool, key, i)
                    try:
                        return await tier.write(key, handle)
                    finally:
                        pool.table.release(handle)
                        pool.table.discard(key)

                for i in range(3):
                    assert await store(i)
                conn.send("ready")
                while (message := await asyncio.to_thread(conn.recv)) != "close":
                    hold[0] = True
                    write = asyncio.ensure_future(store(message[1]))
                    await held
                    conn.send("held")
                    assert await asyncio.to_thread(conn.recv) == "go"
                    go.set()
                    conn.send(("written", await write, tier.statistics().recycled))
            conn.send("closed")
        finally:
            pool.close()

    asyncio.run(main())


@contextlib.contextmanager
def child(target: Callable[..., None], *args: object) -> Iterator[tuple[Connection, Any]]:
    """``target(*args, conn)`` in a process of its own; yields the parent's end of the pipe and the
    process. On exit the process is SIGKILLed if still alive, reaped, and the shared memory of a
    killed pool removed."""
    ctx = fork_context()
    parent, theirs = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, theirs), daemon=True)
    proc.start()
    theirs.close()
    try:
        yield parent, proc
    finally:
        end_child(proc)
        parent.close()
        for path in glob.glob(f"/dev/shm/aiokv-{proc.pid}-*"):  # a killed pool never unlinks its segment
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


async def receive(conn: Connection, limit_s: float = 60.0) -> Any:
    """The next message from a child, within ``limit_s`` seconds (it died or hangs: the test fails)."""
    if not await asyncio.to_thread(conn.poll, limit_s):
        raise TimeoutError("the child process sent nothing")
    return conn.recv()


def open_fds() -> set[int]:
    """This process's open descriptors (the listing's own excluded)."""
    with os.scandir("/proc/self/fd") as entries:
        listed = {int(entry.name) for entry in entries}
    return {fd for fd in listed if is_open(fd)}


def is_open(fd: int) -> bool:
    """Whether ``fd`` names an open descriptor of this process."""
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def follow_threads() -> list[str]:
    """Names of look threads still running 5 s on (one that delivered its result ends just after)."""
    for thread in threading.enumerate():
        if thread.name.startswith("aiokv-disk-follow"):
            thread.join(5)
    return [t.name for t in threading.enumerate() if t.name.startswith("aiokv-disk-follow")]


_CAP_DAC = (1 << 1) | (1 << 2) | (1 << 3)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER


def drop_dac_capabilities() -> None:
    """Make this thread (and the threads it starts later) subject to file permission bits like any
    user, root included: its effective and permitted DAC capabilities are dropped (``capset``).
    Call it first in a new process, before any thread starts."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    header = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (Data * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    data[0].effective &= ~_CAP_DAC
    data[0].permitted &= ~_CAP_DAC
    data[0].inheritable &= ~_CAP_DAC
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


@contextlib.asynccontextmanager
async def started(tier: DiskTier) -> AsyncIterator[DiskTier]:
    await tier.start()
    try:
        yield tier
    finally:
        await tier.aclose()


def unprivileged_follower_child(directory: str, backend: str, conn: Connection) -> None:
    """A follower in a process whose DAC capabilities are dropped (permission bits bind it, as any
    user). Sends ``("ready", pages, read_only)``; on ``("look", [(i, tag), ...])`` it looks at once
    and answers ``(pages, errors by kind name, [contains, ...])``; on ``("read", [(i, tag, seed),
    ...])`` it answers whether each reads back bit for bit as ``fill``'s seed; ``"close"``: closes,
    answers ``"closed"``."""
    drop_dac_capabilities()  # first: every thread started later inherits it

    async def main() -> None:
        layout = small_layout()
        pool = PagePool.create(layout, 16 * layout.page_bytes, register_cuda=False, workers=1)
        try:
            pool.wait_ready_blocking()
            tier = DiskTier(follow_config(Path(directory), DiskBackend(backend)), layout, pool)
            await tier.start()
            try:
                looks = Looks(tier)
                conn.send(("ready", tier.statistics().pages, tier.read_only))
                while (message := await asyncio.to_thread(conn.recv)) != "close":
                    if message[0] == "look":
                        await looks.next()
                        stats = tier.statistics()
                        conn.send((stats.pages, {k.value: n for k, n in stats.errors.items()},
                                   [tier.contains(key_of(i, tag)) for i, tag in message[1]]))
                        continue
                    oks = []
                    for i, tag, seed in message[1]:
                        into = reserve(pool, key_of(500 + i, 99))
                        ok = await tier.read(key_of(i, tag), into)
                        oks.append(ok and bool((payload(pool, into) == seed_payload(pool, seed, 98)).all()))
                        pool.table.abort(into)
                    conn.send(oks)
            finally:
                await tier.aclose()
            conn.send("closed")
        finally:
            pool.close()

    asyncio.run(main())


async def store_page(tier: DiskTier, pool: PagePool, i: int, tag: int = WRITER_TAG) -> bool:
    """Write seed ``i``'s page under ``key_of(i, tag)`` through ``tier``; whether it was stored."""
    key = key_of(i, tag)
    handle = fill(pool, key, i)
    try:
        return await tier.write(key, handle)
    finally:
        pool.table.release(handle)
        pool.table.discard(key)


async def read_back(tier: DiskTier, pool: PagePool, i: int, tag: int = WRITER_TAG) -> bool:
    """Whether ``key_of(i, tag)`` reads back as seed ``i``'s page bit for bit (other bytes fail the
    test; a miss: False)."""
    into = reserve(pool, key_of(900 + i, 99))
    try:
        ok = await tier.read(key_of(i, tag), into)
        if ok:
            assert torch.equal(payload(pool, into), seed_payload(pool, i, 98)), f"page {i} served other bytes"
        return ok
    finally:
        pool.table.abort(into)
