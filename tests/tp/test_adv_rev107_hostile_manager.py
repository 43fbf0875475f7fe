"""Adversarial (review 107): a real `RankWorker` against a hostile manager on its socket.

The worker trusts the manager's socket (a private 0700 directory) for what to copy, but not for
well-formed input: specs naming pages beyond the pool or slots beyond its buffer, another epoch
or page size, replays, withdrawals of jobs never sent, malformed frames; welcomes naming a symlink,
a FIFO, a segment of the wrong size or a name with a path in it. Checked: each bad spec is
reported (BAD_SPEC / STALE_EPOCH) with no byte of the KV buffer or the pool changed; a malformed
frame ends the session (counted) and the worker reconnects; a bad pool is refused (ATTACHED not
ok) within a bound, never followed or blocked on; nothing reaches the loop's exception handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import struct
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from tp_helpers import full_kv, new_pool, rank_kv

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.shm import SHM_DIR
from aiokv.tp import Direction, RankStatus, RankWorker, TPConfig, TransferSpec
from aiokv.tp.wire import (
    PROTOCOL_VERSION,
    Attached,
    Closed,
    Done,
    FrameKind,
    Hello,
    Welcome,
    Withdrawn,
    frame,
    read_frame,
)

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
PAGES = LAYOUT.for_tp(2)
T = LAYOUT.page_tokens
SLOTS = 64
NUM_PAGES = 8
EPOCH = 0x1234
BOUND_S = 10.0
FAST = TPConfig(reconnect_initial_s=0.001, reconnect_max_s=0.01, handshake_timeout_s=BOUND_S)


class FakeManager:
    """A listening socket whose connections the test drives frame by frame."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(mode=0o700)
        self.address = directory / "s"
        self.connections: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []
        self.links: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.closed_frames = 0
        """CLOSED frames read by :meth:`end_at_closed`."""

    async def __aenter__(self) -> FakeManager:
        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.writers.append(writer)
            self.links.append((reader, writer))
            await self.connections.put((reader, writer))

        self.server = await asyncio.start_unix_server(accept, os.fspath(self.address))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        await self.server.wait_closed()

    @contextlib.asynccontextmanager
    async def worker(self, kv: torch.Tensor, config: TPConfig) -> AsyncIterator[RankWorker]:
        """Rank 0's :class:`RankWorker` on this manager, closed at the exit as a real manager ends
        it: each link is read up to the worker's CLOSED, then ended (:meth:`end_at_closed`). A
        manager that never ends the link holds the worker's close ``handshake_timeout_s``
        (``test_a_manager_that_never_ends_the_link_holds_the_close_for_the_bound_only``)."""
        async with RankWorker(self.address, 0, 2, LAYOUT, kv, config) as worker:
            try:
                yield worker
            finally:
                closing = asyncio.ensure_future(worker.aclose())
                await self.end_at_closed()
                async with asyncio.timeout(BOUND_S):
                    await closing

    async def end_at_closed(self) -> None:
        """End every link once the worker's CLOSED is read on it (or it ended), as a manager does."""
        for reader, writer in self.links:
            if writer.is_closing():
                continue
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, ValueError):
                async with asyncio.timeout(BOUND_S):
                    while (await read_frame(reader, 1 << 20))[0] is not FrameKind.CLOSED:
                        pass
                    self.closed_frames += 1
            writer.close()

    async def hello(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The worker's next connection, its hello read."""
        async with asyncio.timeout(BOUND_S):
            reader, writer = await self.connections.get()
            kind, payload = await read_frame(reader, 1 << 20)
        assert kind is FrameKind.HELLO and Hello.decode(payload).rank == 0
        return reader, writer

    async def welcome(self, name: str, num_pages: int = NUM_PAGES) -> tuple[asyncio.StreamReader,
                                                                           asyncio.StreamWriter, Attached]:
        reader, writer = await self.hello()
        welcome = Welcome(PROTOCOL_VERSION, 2, PAGES.fingerprint, EPOCH, num_pages, PAGES.page_bytes, name, SLOTS)
        writer.write(frame(FrameKind.WELCOME, welcome.encode()))
        async with asyncio.timeout(BOUND_S):
            kind, payload = await read_frame(reader, 1 << 20)
        assert kind is FrameKind.ATTACHED
        return reader, writer, Attached.decode(payload)


async def done(reader: asyncio.StreamReader) -> Done:
    async with asyncio.timeout(BOUND_S):
        kind, payload = await read_frame(reader, 1 << 20)
    assert kind is FrameKind.DONE, kind
    return Done.decode(payload)


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[PagePool]:
    pool = await new_pool(PAGES, NUM_PAGES)
    gen = torch.Generator().manual_seed(5)
    pool.pages.copy_(torch.randn(pool.pages.shape, generator=gen).to(LAYOUT.dtype))
    yield pool
    await pool.aclose()


@contextlib.contextmanager
def planted(kind: str, target: str) -> Iterator[str]:
    """A name in /dev/shm that is not a pool: a symlink to ``target``'s segment, or a FIFO."""
    name = f"/aiokv-rev107-{os.getpid()}-{kind}"
    path = SHM_DIR + name
    if kind == "link":
        os.symlink(SHM_DIR + target, path)
    else:
        os.mkfifo(path, 0o600)
    try:
        yield name
    finally:
        os.unlink(path)


def held(name: str) -> tuple[int, int]:
    """How many mappings and descriptors of segment ``name`` this process has."""
    with open("/proc/self/maps") as maps:
        mapped = sum(1 for line in maps if line.rstrip().endswith(SHM_DIR + name))
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            fds += os.readlink(f"/proc/self/fd/{fd}") == SHM_DIR + name
    return mapped, fds


def spec(direction: Direction, pages: list[int], slots: list[int], epoch: int = EPOCH, job: int = 1,
         page_tokens: int = T, skip: int = 0) -> bytes:
    return frame(FrameKind.SPEC, TransferSpec.build(job, direction, epoch, page_tokens, pages, slots, skip).to_bytes())


@pytest.mark.asyncio
async def test_bad_specs_change_no_byte_and_bad_frames_end_only_the_session(tmp_path: Path, pool: PagePool) -> None:
    kv = rank_kv(full_kv(LAYOUT, 3, SLOTS), LAYOUT, 0, 2)
    kv_before, pool_before = kv.clone(), pool.pages.clone()
    held_before = held(pool.name)
    async with FakeManager(tmp_path / "mgr") as manager, manager.worker(kv, FAST) as worker:
        reader, writer, attached = await manager.welcome(pool.name)
        assert attached.ok and attached.epoch == EPOCH, attached
        assert held(pool.name)[0] == held_before[0] + 1  # the worker's own mapping
        hostile = [
            (spec(Direction.OFFLOAD, [NUM_PAGES], list(range(T))), RankStatus.BAD_SPEC),
            (spec(Direction.OFFLOAD, [0, 2**32 - 1], list(range(2 * T))), RankStatus.BAD_SPEC),
            (spec(Direction.LOAD, [0], [0, 1, 2, SLOTS]), RankStatus.BAD_SPEC),
            (spec(Direction.OFFLOAD, [1], [0, 1, 2, 2**40]), RankStatus.BAD_SPEC),
            (spec(Direction.LOAD, [0], list(range(T)), epoch=EPOCH + 1), RankStatus.STALE_EPOCH),
            (spec(Direction.LOAD, [0], list(range(2 * T)), page_tokens=2 * T), RankStatus.BAD_SPEC),
        ]
        for data, status in hostile:
            writer.write(frame(FrameKind.WITHDRAWN, Withdrawn(77).encode()))  # never sent: nothing answers
            writer.write(data)
            report = await done(reader)
            assert report.status is status, report
        assert torch.equal(kv, kv_before), "a refused spec wrote the KV buffer"
        assert torch.equal(pool.pages, pool_before), "a refused spec wrote the pool"
        # A good load, replayed: the same bytes twice, two reports; other slots and pages untouched.
        for _ in range(2):
            writer.write(spec(Direction.LOAD, [3], list(range(8, 8 + T)), job=9))
            assert (await done(reader)).status is RankStatus.OK
        assert torch.equal(kv[:, 8 : 8 + T], pool.pages[3][0].to(kv.dtype))
        assert torch.equal(kv[:, :8], kv_before[:, :8]) and torch.equal(kv[:, 8 + T :], kv_before[:, 8 + T :])
        assert torch.equal(pool.pages, pool_before)
        writer.write(frame(FrameKind.SPEC, b"AKVS\x01"))  # a truncated spec: the session ends
        async with asyncio.timeout(BOUND_S):
            assert await reader.read() == b""
        # The worker comes back (the ended session counted), and a frame of the wrong kind
        # mid-session ends that one too.
        reader, writer, attached = await manager.welcome(pool.name)
        assert attached.ok and worker.statistics().link_errors == 1
        for bad in (frame(FrameKind.WELCOME, b"x" * 8), struct.pack("<IB", 2**31, FrameKind.SPEC.value),
                    struct.pack("<IB", 1, 200)):
            writer.write(bad)
            async with asyncio.timeout(BOUND_S):
                assert await reader.read() == b""
            reader, writer, attached = await manager.welcome(pool.name)
            assert attached.ok
        assert worker.statistics().link_errors == 4 and worker.statistics().sessions == 5
    assert manager.closed_frames == 1  # the last session, ended by the worker's close
    assert torch.equal(pool.pages, pool_before)
    gc.collect()
    assert held(pool.name) == held_before, "the worker's sessions left a mapping or descriptor of the pool"


@pytest.mark.asyncio
@pytest.mark.parametrize("bad", ["link", "fifo", "size", "path", "none"])
async def test_a_welcome_naming_no_pool_of_the_manager_is_refused(tmp_path: Path, pool: PagePool, bad: str) -> None:
    kv = rank_kv(full_kv(LAYOUT, 3, SLOTS), LAYOUT, 0, 2)
    held_before = held(pool.name)
    with contextlib.ExitStack() as stack:
        name, pages = pool.name, NUM_PAGES
        if bad in ("link", "fifo"):
            name = stack.enter_context(planted(bad, pool.name))
        elif bad == "size":
            pages = NUM_PAGES + 1
        elif bad == "path":
            name = "/../" + pool.name.lstrip("/")
        else:
            name = "/aiokv-rev107-no-such-pool"
        async with FakeManager(tmp_path / "mgr") as manager, manager.worker(kv, FAST) as worker:
            _, _, attached = await manager.welcome(name, pages)
            assert not attached.ok, attached
            # It tries again (a restarted manager may name a good pool) and attaches a good one.
            _, _, attached = await manager.welcome(pool.name)
            assert attached.ok
            assert worker.statistics().sessions == 1
        gc.collect()
        assert held(pool.name) == held_before


@pytest.mark.asyncio
async def test_a_manager_that_never_ends_the_link_holds_the_close_for_the_bound_only(
        tmp_path: Path, pool: PagePool) -> None:
    """The worker's close waits for the manager's end of the link ``handshake_timeout_s`` at most
    (a spec it wrote meanwhile is failed on its side, not lost to a write error): a manager that
    reads the CLOSED and never ends the link has the worker close its end once the bound passed."""
    wait_s = 1.0
    kv = rank_kv(full_kv(LAYOUT, 3, SLOTS), LAYOUT, 0, 2)
    async with FakeManager(tmp_path / "mgr") as manager, \
            RankWorker(manager.address, 0, 2, LAYOUT, kv, TPConfig(handshake_timeout_s=wait_s)) as worker:
        reader, _, attached = await manager.welcome(pool.name)
        assert attached.ok, attached
        loop = asyncio.get_running_loop()
        began = loop.time()
        closing = asyncio.ensure_future(worker.aclose())
        async with asyncio.timeout(BOUND_S):
            kind, payload = await read_frame(reader, 1 << 20)
            assert kind is FrameKind.CLOSED and Closed.decode(payload) == Closed(0, 0), (kind, payload)
            assert await reader.read() == b""  # its write side shut after the CLOSED
            await closing  # the link never ended by the manager: the bound ends the wait
        elapsed = loop.time() - began
        assert wait_s <= elapsed < BOUND_S, elapsed
        assert not worker.attached
