"""Helpers shared by the disk-tier tests (importable by spawned crash children too)."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import signal
import threading
import traceback
from collections.abc import AsyncIterator, Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch
from child_procs import end_child, fork_context
from load_gate import LoadGate

from aiokv.keys import PageKey
from aiokv.layout import KVLayout
from aiokv.pagetable import PageHandle, ReserveOutcome
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskConfig, DiskTier
from aiokv.storage.backends import UringPageIO
from aiokv.storage.pagefile import HEADER_BYTES

BACKENDS = [DiskBackend.URING_FIXED, DiskBackend.URING, DiskBackend.THREADS]
BIG = KVLayout.mha(4, 4, 128, torch.float16, page_tokens=64)
"""256 KiB pages: a small ext4 fills fast (the file-system fault tests)."""
PER_FILE = HEADER_BYTES + BIG.page_bytes
"""Bytes of one page file of :data:`BIG`."""


def small_layout(dtype: torch.dtype = torch.float16) -> KVLayout:
    return KVLayout.mha(2, 2, 64, dtype, page_tokens=16)  # 8 KiB payload: two 4 KiB blocks


def key_of(i: int, tag: int = 0) -> PageKey:
    return bytes([tag]) + i.to_bytes(15, "little")


def config(directory: Path, backend: DiskBackend, capacity: int = 1 << 30, **overrides: object) -> DiskConfig:
    """A small configuration: 8 I/Os in flight, 8 queued pages, 2 writers, 2 threads."""
    fields: dict[str, object] = {"queue_depth": 8, "write_behind_depth": 8, "write_behind_workers": 2,
                                 "threads": 2}
    fields.update(overrides)
    return DiskConfig(directory=directory, capacity_bytes=capacity, backend=backend, **fields)  # type: ignore[arg-type]


def fill(pool: PagePool, key: PageKey, seed: int) -> PageHandle:
    """A READY page of random bytes under ``key``; returns a held reference."""
    (res,) = pool.reserve([key])
    assert res.outcome is ReserveOutcome.RESERVED
    assert res.handle is not None
    g = torch.Generator().manual_seed(seed)
    raw = pool.tensor(res.handle).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    held = pool.table.commit(res.handle, keep=True)
    assert held is not None
    return held


@contextlib.contextmanager
def ready_pool(layout: KVLayout, pages: int) -> Iterator[PagePool]:
    """A prepared pool of ``pages`` pages (no CUDA registration), closed on exit."""
    pool = PagePool.create(layout, pages * layout.page_bytes, register_cuda=False, workers=1)
    pool.wait_ready_blocking()
    try:
        yield pool
    finally:
        pool.close()


def small_tier(disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, pages: int,
               recycle: bool = True) -> DiskTier:
    """A tier with a budget of ``pages`` page files (``recycle``: a full tier's write may
    overwrite the least recently used file no read has open, instead of evicting)."""
    capacity = pages * (HEADER_BYTES + layout.page_bytes)
    return DiskTier(config(disk_dir, backend, capacity=capacity, recycle_files=recycle), layout, pool)


@contextlib.asynccontextmanager
async def gated_small_tier(disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, pages: int,
                           monkeypatch: pytest.MonkeyPatch,
                           request: pytest.FixtureRequest) -> AsyncIterator[tuple[DiskTier, LoadGate]]:
    """A started :func:`small_tier` of ``pages`` page files without recycling (a recycled file is
    never one a read has open, so only eviction reaches them) and a :class:`LoadGate` in front of
    its loads, open (set ``closed`` to hold the next ones). At exit the gate opens (a failed check
    must not leave the close waiting for held loads) and the tier closes."""
    tier = small_tier(disk_dir, backend, layout, pool, pages, recycle=False)
    await tier.start()
    gate = LoadGate(tier, monkeypatch, request)
    gate.open()
    try:
        yield tier, gate
    finally:
        gate.open()
        await tier.aclose()


async def write_page(tier: DiskTier, pool: PagePool, i: int) -> tuple[bool, torch.Tensor]:
    """Write page ``key_of(i)`` (seed ``i``) and empty the pool again; returns (written, its payload)."""
    h = fill(pool, key_of(i), i)
    data = payload(pool, h)
    try:
        ok = await tier.write(key_of(i), h)
    finally:
        pool.table.release(h)  # also when the write raised (a signal's KeyboardInterrupt)
    pool.table.evict(pool.num_pages)  # a small pool: keep it empty
    return ok, data


async def stored_page(tier: DiskTier, pool: PagePool, i: int) -> torch.Tensor:
    """:func:`write_page` that must succeed; returns the payload written."""
    ok, data = await write_page(tier, pool, i)
    assert ok, f"page {i} was not written"
    return data


def seed_payload(pool: PagePool, i: int, tag: int) -> torch.Tensor:
    """The payload :func:`fill` writes with seed ``i`` (built in the pool under ``key_of(i, tag)``,
    a key the test never stores, then dropped)."""
    h = fill(pool, key_of(i, tag), i)
    data = payload(pool, h)
    pool.table.release(h)
    pool.table.discard(key_of(i, tag))
    return data


async def read_page(tier: DiskTier, pool: PagePool, i: int) -> torch.Tensor | None:
    """The payload of page ``key_of(i)`` read back from ``tier``, or None when the read failed."""
    into = reserve(pool, key_of(i))
    ok = await tier.read(key_of(i), into)
    data = payload(pool, into) if ok else None
    pool.table.abort(into)
    return data


async def read_copy(tier: DiskTier, pool: PagePool, i: int, into_key: PageKey,
                    timeout_s: float = 10.0) -> torch.Tensor | None:
    """A copy of page ``key_of(i)``'s payload read into a page reserved under ``into_key`` (then
    aborted), or None when the read failed; a read that blocks past ``timeout_s`` fails the test."""
    into = reserve(pool, into_key)
    try:
        ok = await asyncio.wait_for(tier.read(key_of(i), into), timeout_s)
        return payload(pool, into).clone() if ok else None
    finally:
        pool.table.abort(into)


async def spares_landed(tier: DiskTier) -> None:
    """Until the batch of spare files in flight (if any) has landed: its callback ran (its spares
    in stock), not only its future done (that callback may still be queued then)."""
    refill = tier._refill
    if refill is not None:
        landed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        refill.add_done_callback(lambda _: landed.done() or landed.set_result(None))  # after the tier's
        await landed


async def no_spares_in_flight(tier: DiskTier) -> None:
    """Until no batch of spare files is in flight: a landed batch short of the stock's target starts
    the next one in its own callback, before a waiter of the first wakes (a listing of the spares on
    disk then raced that batch's thread: 40 files against a stock of 32 once in a full run)."""
    while tier._refill is not None:
        await spares_landed(tier)


def reserve(pool: PagePool, key: PageKey) -> PageHandle:
    (res,) = pool.reserve([key])
    assert res.outcome is ReserveOutcome.RESERVED
    assert res.handle is not None
    return res.handle


def assert_clean(pool: PagePool) -> None:
    """No leaked reference or reservation."""
    pool.table.check_invariants()
    stats = pool.table.statistics()
    assert stats.reserved == 0, stats
    assert stats.referenced == 0, stats


def page_files(directory: Path) -> list[Path]:
    """Page files and temporary files under ``directory`` (not the layout directory's lock file)."""
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != ".lock")


def temp_files(directory: Path) -> list[Path]:
    return [p for p in page_files(directory) if p.name.startswith(".tmp-")]


def is_root() -> bool:
    return os.geteuid() == 0


def payload(pool: PagePool, handle: PageHandle) -> torch.Tensor:
    """A copy of the page's payload bytes (uint8: NaN patterns compare bit for bit)."""
    raw = pool.memory.page_view(pool.table.check(handle))[: pool.layout.payload_bytes]
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def seed_of(key: PageKey) -> int:
    """Deterministic page content seed for ``key`` (crash tests regenerate the expected bytes)."""
    return int.from_bytes(key[:8], "little") % (2**31)


async def write_acked(tier: DiskTier, pool: PagePool, key: PageKey, conn: Any) -> None:
    """Write ``key``'s page (seed :func:`seed_of`), drop it from the pool and, once the tier
    acknowledged it, send ``("stored", key)`` to the parent (what a crash child streams)."""
    h = fill(pool, key, seed_of(key))
    ok = await tier.write(key, h)
    pool.table.release(h)
    pool.table.discard(key)
    if ok:
        conn.send(("stored", key))


@contextlib.contextmanager
def sigkilled_child(target: Callable[..., None], *args: object) -> Iterator[Connection]:
    """Spawn ``target(*args, conn)`` (a writer process) and yield the receiving end of its pipe. On
    exit SIGKILL it (writes in flight: temporary files may stay behind), reap it and remove the
    shared memory its pool never unlinks; then check that the kill ended it, not a fault of its own."""
    ctx = fork_context()  # a spawn per kill round re-imported torch
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    child.close()
    try:
        yield parent
    finally:
        end_child(proc)
        parent.close()
        for path in glob.glob(f"/dev/shm/aiokv-{proc.pid}-*"):  # a SIGKILLed pool never unlinks it
            # Another pool's reclaim (a later test's start, its background thread) may get there first.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    assert proc.exitcode == -signal.SIGKILL


def crash_child(directory: str, backend: str, capacity_files: int, conn: Any) -> None:
    """Stream page writes forever (4 in flight), reporting each acknowledged key; killed by the parent.

    With a budget of ``capacity_files`` files most writes recycle an evicted file, so kills land in
    the middle of overwrites too."""

    async def main() -> None:
        layout = small_layout()
        pool = PagePool.create(layout, 16 * layout.page_bytes, register_cuda=False, workers=1)
        pool.wait_ready_blocking()
        capacity = capacity_files * (layout.page_bytes + 4096)
        async with DiskTier(config(Path(directory), DiskBackend(backend), capacity), layout, pool) as tier:
            conn.send(("ready", tier.statistics().temp_files_removed))
            while True:
                keys = [os.urandom(16) for _ in range(4)]
                await asyncio.gather(*(write_acked(tier, pool, k, conn) for k in keys))

    asyncio.run(main())


def holder_child(directory: str, backend: str, capacity_files: int, count: int, conn: Any) -> None:
    """Hold a tier on ``directory`` (another engine process): write ``count`` pages (key_of(i, 7),
    seed i), report ``("ready", read_only)``; then on ``("write", n)`` write ``n`` more pages and
    report ``"written"``, until told ``"close"``."""

    async def main() -> None:
        layout = small_layout()
        pool = PagePool.create(layout, 16 * layout.page_bytes, register_cuda=False, workers=1)
        try:
            pool.wait_ready_blocking()
            capacity = capacity_files * (layout.page_bytes + 4096)
            async with DiskTier(config(Path(directory), DiskBackend(backend), capacity), layout, pool) as tier:
                written = 0

                async def write(n: int) -> None:
                    nonlocal written
                    for i in range(written, written + n):
                        h = fill(pool, key_of(i, 7), i)
                        await tier.write(key_of(i, 7), h)
                        pool.table.release(h)
                        pool.table.discard(key_of(i, 7))
                    written += n

                await write(count)
                conn.send(("ready", tier.read_only))
                while (message := await asyncio.to_thread(conn.recv)) != "close":
                    await write(message[1])
                    conn.send("written")
        finally:
            pool.close()

    asyncio.run(main())


Start = Callable[..., None]


def gated(real: Start, gate: asyncio.Event, entered: asyncio.Event) -> Start:
    """A backend ``start_*`` call held until ``gate`` is set (the I/O is in flight meanwhile)."""
    held: set[asyncio.Task[Any]] = set()

    def wrapper(*args: object) -> None:
        entered.set()

        async def later() -> None:
            await gate.wait()
            real(*args)

        task = asyncio.create_task(later())
        held.add(task)
        task.add_done_callback(held.discard)

    return wrapper


async def spin(times: int) -> None:
    """``times`` loop iterations: lets completions in, no wall-clock wait."""
    for _ in range(times):
        await asyncio.sleep(0)


def thread_starts_on_the_loop(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records each ``Thread.start`` made on the calling (loop) thread as "name from <innermost
    ``storage/`` file on its stack>" (or "from elsewhere")."""
    loop_thread = threading.get_ident()
    started: list[str] = []
    real = threading.Thread.start

    def recording_start(self: threading.Thread) -> None:
        if threading.get_ident() == loop_thread:
            files = [f.filename for f in traceback.extract_stack()[:-1]]
            ours = [f for f in files if "/storage/" in f]
            started.append(f"{self.name} from {ours[-1] if ours else 'elsewhere'}")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", recording_start)
    return started


async def uring_tier(disk_dir: Path, layout: KVLayout, pool: PagePool) -> tuple[DiskTier, UringPageIO]:
    """A started tier on io_uring (``AUTO``) whose pool registration is over; skips the test where
    io_uring is refused (the tier closed)."""
    tier = DiskTier(config(disk_dir, DiskBackend.AUTO), layout, pool)
    await tier.start()
    io = tier.backend
    if not isinstance(io, UringPageIO):
        await tier.aclose()
        pytest.skip("io_uring refused here: nothing is registered")
    await io.wait_registered()
    return tier, io
