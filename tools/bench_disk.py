"""Disk-tier throughput, CPU and event-loop lag against fio and aiofiles, measured in one run.

For each page size (1, 4 and 32 MiB) and queue depth (8 and 32), writes then reads ``--total-mib`` of
pages (O_DIRECT files need no cache eviction; buffered files are fsynced and dropped with
``posix_fadvise(DONTNEED)`` before reads). Every round runs each contender once, in turn
(fio, raw engine, tier, LMCache, ...), ``--repeats`` rounds; medians are reported — disks here vary
±40% run to run, so only contenders alternated in one run compare. Every contender writes fresh
files, and all of them stay until the configuration ends (then ``--settle-s`` passes): on ext4
without a journal a create right after another contender's mass delete costs twice the CPU.

- ``fio``: ``--ioengine=io_uring --direct=1``, same block size and depth, a fresh file each round
  (overwriting an allocated file is faster than writing a new one: not like for like);
- ``aiokv-file``: the aiokv io_uring engine (registered pool buffers), one op per page into one
  fresh file each round (the "raw engine" the tier's CPU is compared with);
- ``lmcache-odirect`` / ``lmcache-buffered``: LMCache 0.5.6 ``LocalDiskBackend``'s own byte path
  (``write_file``/``read_file``, one file per page, its thread count) with and without
  ``use_odirect``; skipped with a message when LMCache cannot be imported (``--lmcache-path``: a
  directory to import it from, e.g. a ``pip install --target`` outside the project's venv);
- ``tier-<backend>``: the full ``DiskTier`` job (one page file per page: open, header + payload,
  xxh3 checksum, rename; read verifies header and checksum) for uring_fixed, uring and threads;
  ``tier-<backend> spares<N>`` the same with ``spare_files=N`` (``--spares``: new pages written into
  pre-created spare files; the pass starts right after the tier's start, so the spare thread's CPU,
  the first stock's included, is in the tier's; the JSON says how many writes took a spare);
- ``aiofiles``: the same page-file job through aiofiles (buffered, thread per call).

Reports GB/s (of page bytes), ratios to fio and aiofiles, CPU core-seconds per GB (process CPU time
of all threads, ``time.process_time``), and loop lag while streaming (a 1 ms periodic callback:
p50/p99/max lateness, and p99/max net of the loop thread's run-queue waits: what the loop's own
work causes, apart from the scheduler running others), plus the longest single ``io_uring_enter``.

    python tools/bench_disk.py --quick --json out/disk.json --plot out/disk.png
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import xxhash

from aiokv.layout import KVLayout
from aiokv.pagetable import PageHandle
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskConfig, DiskTier
from aiokv.storage.backends import UringPageIO
from aiokv.storage.pagefile import HEADER_BYTES
from aiokv.storage.uring import UringEngine

GB = 1e9


@dataclass
class Row:
    """One path at one (page size, depth)."""

    path: str
    page_mib: int
    depth: int
    write_gbs: float = 0.0
    read_gbs: float = 0.0
    cpu_s_per_gb: float | None = None
    checksum_s_per_gb: float | None = None
    """Of ``cpu_s_per_gb``: hashing payloads (tier rows), so the tier's CPU can be read without it."""
    lag_p50_ms: float | None = None
    lag_p99_ms: float | None = None
    lag_max_ms: float | None = None
    lag_net_p99_ms: float | None = None
    """Lag net of the loop thread's run-queue waits (see :class:`LagProbe`)."""
    lag_net_max_ms: float | None = None
    submit_max_ms: float | None = None
    samples: dict[str, list[float]] = field(default_factory=dict)


class LagProbe:
    """A 1 ms periodic callback recording how late each run is, and how late net of the loop
    thread's run-queue wait since the previous run (``/proc/<tid>/schedstat``: time runnable but
    not running). The net figure is the lag the loop's own work (callbacks, syscalls that sleep,
    GIL waits) causes; the rest is the scheduler giving the CPU to other threads and processes,
    which on a shared 2-vCPU machine dominates (#14)."""

    def __init__(self) -> None:
        self.late: list[float] = []
        self.late_net: list[float] = []
        self._handle: asyncio.TimerHandle | None = None
        self._stat_fd = -1

    def start(self) -> None:
        """Start ticking (again a no-op: one probe may span several phases)."""
        if self._handle is not None:
            return
        loop = asyncio.get_running_loop()
        try:
            self._stat_fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
        except OSError:  # no schedstat here: the net figures equal the gross ones
            self._stat_fd = -1
        stat_fd = self._stat_fd
        waited = [self._waited()]

        def tick(due: float) -> None:
            now = loop.time()
            late = max(0.0, now - due)
            self.late.append(late)
            if stat_fd >= 0:
                w = self._waited()
                late = max(0.0, late - (w - waited[0]))
                waited[0] = w
            self.late_net.append(late)
            self._handle = loop.call_at(now + 0.001, tick, now + 0.001)

        now = loop.time()
        self._handle = loop.call_at(now + 0.001, tick, now + 0.001)

    def _waited(self) -> float:
        if self._stat_fd < 0:
            return 0.0
        return int(os.pread(self._stat_fd, 64, 0).split()[1]) / 1e9

    @property
    def running(self) -> bool:
        return self._handle is not None

    def stop(self) -> tuple[float, float, float]:
        """p50, p99 and max lateness in ms; :meth:`net` gives the figures net of run-queue waits."""
        if self._handle is not None:
            self._handle.cancel()
        if self._stat_fd >= 0:
            os.close(self._stat_fd)
            self._stat_fd = -1
        return quantiles(self.late)

    def net(self) -> tuple[float, float, float]:
        return quantiles(self.late_net)


def quantiles(values: list[float]) -> tuple[float, float, float]:
    """p50, p99, max of ``values`` (seconds) in ms; zeros when empty."""
    if not values:
        return 0.0, 0.0, 0.0
    ordered = sorted(values)

    def p(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return p(0.5), p(0.99), ordered[-1] * 1000


def layout_for(page_mib: int) -> KVLayout:
    # 4 layers x 128 tokens x 8 rows x 128 x fp16 = 1 MiB; layers scale the page.
    return KVLayout.mha(4 * page_mib, 4, 128, torch.float16, page_tokens=128)


def cpu_seconds() -> float:
    # CLOCK_PROCESS_CPUTIME_ID: every thread of the process (io_uring's io-wq workers included, live
    # or exited), to the nanosecond. os.times() counts in 10 ms ticks: one page's CPU is ~0.1 ms,
    # so a pass's figure moved by tens of percent with where the ticks fell.
    return time.process_time()


async def timed(job: Callable[[], Awaitable[None]], nbytes: int, lag: LagProbe | None = None
                ) -> tuple[float, float]:
    """(GB/s, CPU core-seconds) of ``job``."""
    # Each contender starts from a collected heap: a full collection owed to the previous contender's
    # garbage would otherwise land in this one's lag and CPU. Not while its lag probe already runs
    # (its read pass after its write pass): that would be a stall of our own making.
    if lag is None or not lag.running:
        gc.collect()
    if lag is not None:
        lag.start()
    c0, t0 = cpu_seconds(), time.perf_counter()
    await job()
    elapsed, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    return nbytes / elapsed / GB, cpu


async def bounded(count: int, depth: int, one: Callable[[int], Awaitable[None]]) -> None:
    """Run ``one(i)`` for i < count with ``depth`` in flight."""
    next_i = 0

    async def worker() -> None:
        nonlocal next_i
        while next_i < count:
            i = next_i
            next_i += 1
            await one(i)

    await asyncio.gather(*(worker() for _ in range(depth)))


def drop_cache(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def run_fio(path: str, rw: str, bs: int, depth: int, size: int) -> tuple[float, float]:
    """(GB/s, CPU core-seconds) of one fio pass."""
    out = subprocess.run(
        ["fio", "--name=aiokv", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", f"--iodepth={depth}",
         "--ioengine=io_uring", "--direct=1", f"--size={size}", "--output-format=json"],
        check=True, capture_output=True, text=True,
    )
    job = json.loads(out.stdout)["jobs"][0]
    cpu = (float(job["usr_cpu"]) + float(job["sys_cpu"])) / 100 * float(job["job_runtime"]) / 1000
    return float(job["write" if rw == "write" else "read"]["bw_bytes"]) / GB, cpu


async def engine_file(pool: PagePool, path: str, count: int, depth: int, write: bool, row: Row,
                      lag: LagProbe) -> tuple[float, float]:
    """The aiokv io_uring engine moving pool pages to/from one file (registered buffers)."""
    pb = pool.layout.page_bytes
    engine = UringEngine.open(max(depth, 8))
    (regions,) = engine.register_buffers([(pool.memory.segment.address, pool.num_pages * pb, pb)])
    flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
    fd = os.open(path, flags | os.O_DIRECT, 0o600)
    base = pool.memory.segment.address
    per_region = regions[0].length

    async def one(i: int) -> None:
        page = i % pool.num_pages
        address = base + page * pb
        region = regions[page * pb // per_region]
        op = engine.write if write else engine.read
        assert await op(fd, address, pb, i * pb, None, region) == pb

    try:
        return await timed(lambda: bounded(count, depth, one), count * pb, lag)
    finally:
        os.close(fd)
        row.submit_max_ms = max(row.submit_max_ms or 0.0, engine.submit_max_s * 1000)
        await engine.aclose()


async def tier_job(pool: PagePool, directory: Path, backend: DiskBackend, count: int, depth: int,
                   spares: int = 0) -> list[Row]:
    """The full DiskTier job, twice: into an empty tier (every write creates a file, or takes a
    spare file), then as many new pages into the now full tier (every write recycles an evicted
    file, or takes a spare left from the first pass). Each pass is read back."""
    layout, pb = pool.layout, pool.layout.page_bytes
    page_mib = pb >> 20
    config = DiskConfig(directory=directory, capacity_bytes=count * (pb + HEADER_BYTES), backend=backend,
                        queue_depth=depth, threads=depth)
    rows: list[Row] = []
    label = f"tier-{backend.value}" + (f" spares{spares}" if spares else "")
    async with DiskTier(config, layout, pool, spare_files=spares) as tier:
        for name, first in (("", 1), (" full", count + 1)):
            keys = [i.to_bytes(16, "little") for i in range(first, first + count)]
            fill_pool(pool)
            held = [pool.table.acquire(page_key(p)) for p in range(pool.num_pages)]

            async def write(i: int, keys: list[bytes] = keys, held: list[PageHandle | None] = held) -> None:
                handle = held[i % len(held)]
                assert handle is not None
                assert await tier.write(keys[i], handle)

            lag = LagProbe()
            hashed = tier.checksum_seconds
            taken = tier.spare_statistics().taken
            w_gbs, w_cpu = await timed(lambda: bounded(count, depth, write), count * pb, lag)
            held_lag = lag
            for h in held:
                if h is not None:
                    pool.table.release(h)
            pool.table.evict(pool.num_pages)

            async def read(i: int, keys: list[bytes] = keys) -> None:
                (res,) = pool.reserve([keys[i]])
                assert res.handle is not None
                ok = await tier.read(keys[i], res.handle)
                pool.table.abort(res.handle)
                assert ok

            r_gbs, r_cpu = await timed(lambda: bounded(count, depth, read), count * pb, held_lag)
            cpu = (w_cpu + r_cpu) / (2 * count * pb / GB)
            row = Row(f"{label}{name}", page_mib, depth, w_gbs, r_gbs, cpu,
                      samples={"cpu_w": [w_cpu], "cpu_r": [r_cpu], "cpu_hash": [tier.checksum_seconds - hashed],
                               "spares_taken": [tier.spare_statistics().taken - taken]})
            row.lag_p50_ms, row.lag_p99_ms, row.lag_max_ms = held_lag.stop()
            _, row.lag_net_p99_ms, row.lag_net_max_ms = held_lag.net()
            io = tier.backend
            if isinstance(io, UringPageIO):
                row.submit_max_ms = io.engine.submit_max_s * 1000
            rows.append(row)
        assert tier.statistics().recycled + int(rows[-1].samples["spares_taken"][0]) == count
    return rows


def page_key(page: int) -> bytes:
    return b"\xff" + page.to_bytes(15, "little")


async def aiofiles_job(pool: PagePool, directory: Path, count: int, depth: int) -> tuple[float, float, float, float]:
    import aiofiles
    import aiofiles.os

    pb = pool.layout.page_bytes
    await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
    header = bytes(HEADER_BYTES)
    paths = [str(directory / f"{i:08x}") for i in range(count)]

    async def write(i: int) -> None:
        view = pool.memory.page_view(i % pool.num_pages)
        tmp = paths[i] + ".tmp"
        async with aiofiles.open(tmp, "wb") as f:
            await f.write(header)
            await f.write(view)
        await aiofiles.os.rename(tmp, paths[i])

    w_gbs, w_cpu = await timed(lambda: bounded(count, depth, write), count * pb)
    await asyncio.to_thread(drop_cache, paths)

    async def read(i: int) -> None:
        async with aiofiles.open(paths[i], "rb") as f:
            data = await f.read()
        xxhash.xxh3_64_intdigest(memoryview(data)[HEADER_BYTES:])

    r_gbs, r_cpu = await timed(lambda: bounded(count, depth, read), count * pb)
    return w_gbs, w_cpu, r_gbs, r_cpu


def fill_pool(pool: PagePool) -> None:
    reservations = pool.reserve([page_key(p) for p in range(pool.num_pages)])
    g = torch.Generator().manual_seed(0)
    for res in reservations:
        if res.handle is None:
            continue  # still READY from an earlier pass
        raw = pool.tensor(res.handle).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
        pool.table.commit(res.handle)


class Samples:
    """Per contender: GB/s each way, CPU core-seconds and bytes, loop lag, over the rounds."""

    def __init__(self) -> None:
        self.write: list[float] = []
        self.read: list[float] = []
        self.cpu_s = 0.0
        self.hash_s: float | None = None
        self.bytes = 0
        self.lag: list[tuple[float, float, float]] = []
        self.lag_net: list[tuple[float, float]] = []
        self.submit_max_ms: float | None = None
        self.spares_taken: list[int] = []

    def row(self, path: str, page_mib: int, depth: int) -> Row:
        row = Row(path, page_mib, depth, statistics.median(self.write), statistics.median(self.read),
                  self.cpu_s / (self.bytes / GB) if self.bytes else None,
                  samples={"write": self.write, "read": self.read, "cpu_s": [self.cpu_s],
                           "spares_taken": [float(n) for n in self.spares_taken]})
        if self.hash_s is not None and self.bytes:
            row.checksum_s_per_gb = self.hash_s / (self.bytes / GB)
        if self.lag:
            row.lag_p50_ms = statistics.median(lag[0] for lag in self.lag)
            row.lag_p99_ms = max(lag[1] for lag in self.lag)
            row.lag_max_ms = max(lag[2] for lag in self.lag)
        if self.lag_net:
            row.lag_net_p99_ms = max(lag[0] for lag in self.lag_net)
            row.lag_net_max_ms = max(lag[1] for lag in self.lag_net)
        row.submit_max_ms = self.submit_max_ms
        return row


def lmcache_backend(path: str | None) -> tuple[type, int] | str:
    """LMCache's ``LocalDiskBackend`` class and its default thread count, or why it is unavailable."""
    if path is not None and path not in sys.path:
        sys.path.append(path)
    try:
        from lmcache.v1.storage_backend import local_disk_backend as ldb
    except Exception as exc:  # ImportError, or its own start-up failing on a missing dependency
        return f"{type(exc).__name__}: {exc}"
    return ldb.LocalDiskBackend, int(getattr(ldb, "_DEFAULT_THREAD_COUNT", 4))


async def lmcache_job(cls: type, threads: int, pool: PagePool, directory: Path, count: int, depth: int,
                      direct: bool, lag: LagProbe) -> tuple[float, float, float, float]:
    """LMCache's byte path: ``write_file``/``read_file`` of ``LocalDiskBackend`` (one file per page,
    whole page per call), in its own thread pool, ``depth`` pages in flight."""
    from concurrent.futures import ThreadPoolExecutor

    pb = pool.layout.page_bytes
    await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
    backend = cls.__new__(cls)  # only the I/O methods: no CPU allocator, no controller
    backend.os_disk_bs = os.statvfs(directory).f_bsize
    backend.use_odirect = direct
    backend.dict = {}
    paths = [str(directory / f"{i:08x}.pt") for i in range(count)]
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(threads, thread_name_prefix="lmcache-disk")
    try:
        async def write(i: int) -> None:
            view = pool.memory.page_view(i % pool.num_pages)
            await loop.run_in_executor(executor, backend.write_file, view, paths[i])

        w_gbs, w_cpu = await timed(lambda: bounded(count, depth, write), count * pb, lag)
        if not direct:
            await asyncio.to_thread(drop_cache, paths)

        async def read(i: int) -> None:
            view = pool.memory.page_view(i % pool.num_pages)
            await loop.run_in_executor(executor, backend.read_file, i, view, paths[i])

        r_gbs, r_cpu = await timed(lambda: bounded(count, depth, read), count * pb, lag)
    finally:
        executor.shutdown(wait=True)
    return w_gbs, w_cpu, r_gbs, r_cpu


SETTLE_S = 35.0
"""Seconds to wait after deleting a configuration's files before the next configuration starts.
ext4 without a journal (the development VM's) skips, at every file creation, the free inodes whose
deletion is less than 30 s old, looking each one up: creating files right after a mass delete
cost about twice the CPU (0.25 -> 0.5 core-s/GB for 1 MiB files, measured), and whichever
contender came right after another's delete paid for it."""


def scratch_bytes(page_mib: int, depth: int, total_mib: int, repeats: int, backends: int, lmcache: bool) -> int:
    """Disk space one configuration holds when every contender's files are kept until its end."""
    count = max(depth, total_mib // page_mib)
    per_round = (2 + backends + (2 if lmcache else 0) + 1) * count * ((page_mib << 20) + HEADER_BYTES)
    return repeats * per_round


async def remove_all(paths: list[Path]) -> None:
    for path in paths:
        if path.is_dir():
            await asyncio.to_thread(shutil.rmtree, path)
        else:
            path.unlink(missing_ok=True)


async def measure(work: Path, page_mib: int, depth: int, total_mib: int, repeats: int, fio: bool,
                  backends: list[DiskBackend], lmcache: tuple[type, int] | None, keep: bool = True,
                  spares: tuple[int, ...] = (0,), aiofiles: bool = True) -> list[Row]:
    """One configuration, ``repeats`` alternated rounds. ``keep``: every contender's files stay until
    the configuration ends (no contender creates files right after another's deletes: see
    :data:`SETTLE_S`); else each is removed after its pass (less disk space)."""
    layout = layout_for(page_mib)
    pb = layout.page_bytes
    count = max(depth, total_mib // page_mib)
    trash: list[Path] = []

    async def done_with(path: Path) -> None:
        if keep:
            trash.append(path)
        else:
            await remove_all([path])
    pool = PagePool.create(layout, min(count, 64) * pb, register_cuda=False, workers=2)
    samples: dict[str, Samples] = {}

    def add(path: str, w: float, wc: float, r: float, rc: float, lag: LagProbe | None) -> Samples:
        got = samples.setdefault(path, Samples())
        got.write.append(w)
        got.read.append(r)
        got.cpu_s += wc + rc
        got.bytes += 2 * count * pb
        if lag is not None:
            got.lag.append(lag.stop())
            got.lag_net.append(lag.net()[1:])
        return got

    try:
        await pool.wait_ready()
        fill_pool(pool)
        for round_ in range(repeats):  # one pass of every contender per round, in turn
            if fio:
                path = work / f"fio-{round_}.bin"  # a fresh file each round, like the tier's new files
                w, wc = await asyncio.to_thread(run_fio, str(path), "write", pb, depth, count * pb)
                r, rc = await asyncio.to_thread(run_fio, str(path), "read", pb, depth, count * pb)
                await done_with(path)
                add("fio", w, wc, r, rc, None)
            path = work / f"engine-{round_}.bin"
            lag, probe = LagProbe(), Row("aiokv-file", page_mib, depth)
            w, wc = await engine_file(pool, str(path), count, depth, True, probe, lag)
            r, rc = await engine_file(pool, str(path), count, depth, False, probe, lag)
            await done_with(path)
            add("aiokv-file", w, wc, r, rc, lag).submit_max_ms = probe.submit_max_ms
            # Spare counts alternate their order every round: neither always runs right after
            # another contender's pass.
            for n_spares in spares if round_ % 2 == 0 else spares[::-1]:
                for backend in backends:
                    directory = work / f"tier-{backend.value}-s{n_spares}-{round_}"
                    for row in await tier_job(pool, directory, backend, count, depth, n_spares):
                        got = add(row.path, row.write_gbs, row.samples["cpu_w"][0], row.read_gbs,
                                  row.samples["cpu_r"][0], None)
                        got.lag.append((row.lag_p50_ms or 0.0, row.lag_p99_ms or 0.0, row.lag_max_ms or 0.0))
                        got.lag_net.append((row.lag_net_p99_ms or 0.0, row.lag_net_max_ms or 0.0))
                        got.hash_s = (got.hash_s or 0.0) + row.samples["cpu_hash"][0]
                        got.submit_max_ms = row.submit_max_ms
                        got.spares_taken.append(int(row.samples["spares_taken"][0]))
                    await done_with(directory)
            if lmcache is not None:
                for direct in (True, False):
                    name = f"lmcache-{'odirect' if direct else 'buffered'}"
                    directory = work / f"{name}-{round_}"
                    lag = LagProbe()
                    w, wc, r, rc = await lmcache_job(*lmcache, pool, directory, count, depth, direct, lag)
                    add(name, w, wc, r, rc, lag)
                    await done_with(directory)
            fill_pool(pool)
            if not aiofiles:
                continue
            lag = LagProbe()
            lag.start()
            directory = work / f"aiofiles-{round_}"
            w, wc, r, rc = await aiofiles_job(pool, directory, count, depth)
            add("aiofiles", w, wc, r, rc, lag)
            await done_with(directory)
    finally:
        await pool.aclose()
        await remove_all(trash)
    return [got.row(path, page_mib, depth) for path, got in samples.items()]


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(rows: list[Row]) -> str:
    out = ["| page | depth | path | write GB/s | read GB/s | w/fio | r/fio | w/LMCache-odirect | "
           "r/LMCache-odirect | w/aiofiles | r/aiofiles | core-s/GB | of it xxh3 | CPU / raw engine | "
           "CPU w/o xxh3 / raw | lag p50/p99/max ms | net of run-queue wait p99/max | max submit ms |",
           "|" + " --- |" * 18]
    for row in rows:
        peers = {r.path: r for r in rows if (r.page_mib, r.depth) == (row.page_mib, row.depth)}
        fio, aio, lmc, raw = (peers.get(name) for name in ("fio", "aiofiles", "lmcache-odirect", "aiokv-file"))

        def ratio(peer: Row | None, attr: str, row: Row = row) -> str:
            if peer is None or row is peer or not getattr(peer, attr):
                return "-"
            return f"{getattr(row, attr) / getattr(peer, attr):.2f}x"

        lag = "-" if row.lag_p50_ms is None else (
            f"{row.lag_p50_ms:.2f}/{row.lag_p99_ms:.2f}/{row.lag_max_ms:.1f}")
        net = "-" if row.lag_net_p99_ms is None else f"{row.lag_net_p99_ms:.2f}/{row.lag_net_max_ms:.1f}"
        out.append(
            f"| {row.page_mib} MiB | {row.depth} | {row.path} | {row.write_gbs:.2f} | {row.read_gbs:.2f} | "
            f"{ratio(fio, 'write_gbs')} | {ratio(fio, 'read_gbs')} | {ratio(lmc, 'write_gbs')} | "
            f"{ratio(lmc, 'read_gbs')} | {ratio(aio, 'write_gbs')} | {ratio(aio, 'read_gbs')} | "
            f"{fmt(row.cpu_s_per_gb, 3)} | {fmt(row.checksum_s_per_gb, 3)} | {ratio(raw, 'cpu_s_per_gb')} | "
            f"{without_hash(row, raw)} | {lag} | {net} | {fmt(row.submit_max_ms)} |"
        )
    return "\n".join(out)


def without_hash(row: Row, raw: Row | None) -> str:
    """The tier's CPU less its payload hashing, over the raw engine's (which hashes nothing)."""
    if raw is None or row.checksum_s_per_gb is None or not row.cpu_s_per_gb or not raw.cpu_s_per_gb:
        return "-"
    return f"{(row.cpu_s_per_gb - row.checksum_s_per_gb) / raw.cpu_s_per_gb:.2f}x"


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r.page_mib, r.depth) for r in rows})
    paths = list(dict.fromkeys(r.path for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    width = 0.8 / len(paths)
    for ax, attr in zip(axes, ("write_gbs", "read_gbs"), strict=True):
        for j, name in enumerate(paths):
            values = [next((getattr(r, attr) for r in rows if r.path == name and (r.page_mib, r.depth) == g), 0.0)
                      for g in groups]
            ax.bar([i + j * width for i in range(len(groups))], values, width, label=name)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
        ax.set_xticklabels([f"{p} MiB / qd{d}" for p, d in groups])
        ax.set_title(attr.replace("_gbs", " GB/s"))
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory on the disk under test "
                        "(default: a temporary directory under the current directory)")
    parser.add_argument("--page-mib", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--depth", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--total-mib", type=int, default=1024, help="bytes moved per pass")
    parser.add_argument("--repeats", type=int, default=3, help="rounds, every contender once per round (>= 3)")
    parser.add_argument("--backends", nargs="+", default=[b.value for b in (DiskBackend.URING_FIXED, DiskBackend.URING,
                                                                             DiskBackend.THREADS)],
                        choices=[b.value for b in DiskBackend if b is not DiskBackend.AUTO], help="tier backends")
    parser.add_argument("--lmcache-path", type=str, default=None, help="directory to import LMCache from (a "
                        "pip --target install kept out of the project's venv)")
    parser.add_argument("--spares", type=int, nargs="+", default=[0], help="tier rows for each spare-file "
                        "stock (DiskTier spare_files; 0: none), alternated within each round")
    parser.add_argument("--skip", nargs="+", default=[], choices=["fio", "aiofiles"],
                        help="contenders left out (shorter runs when only the tier and the raw engine matter)")
    parser.add_argument("--quick", action="store_true", help="256 MiB per pass (about 2 minutes)")
    parser.add_argument("--settle-s", type=float, default=SETTLE_S, help="seconds between configurations, "
                        "after their files are deleted (ext4 without a journal: see SETTLE_S)")
    parser.add_argument("--json", type=str, default=None)
    parser.add_argument("--plot", type=str, default=None)
    args = parser.parse_args()
    total = 256 if args.quick else args.total_mib
    have_fio = shutil.which("fio") is not None and "fio" not in args.skip
    if not have_fio and "fio" not in args.skip:
        print("WARNING: fio is not installed (apt-get install fio): no fio baseline, ratios to fio "
              "are missing", file=sys.stderr)
    lmcache = lmcache_backend(args.lmcache_path)
    if isinstance(lmcache, str):
        print(f"WARNING: LMCache is not importable ({lmcache}): no LMCache rows, ratios to it are missing "
              "(pip install --target DIR lmcache==0.5.6, then --lmcache-path DIR)", file=sys.stderr)
    backends = [DiskBackend(b) for b in args.backends]
    rows: list[Row] = []
    work = Path(tempfile.mkdtemp(prefix="aiokv-bench-", dir=args.dir or Path.cwd()))
    configs = [(page_mib, depth) for page_mib in args.page_mib for depth in args.depth]
    loads: list[float] = []
    try:
        for n, (page_mib, depth) in enumerate(configs):
            if n:
                # The last configuration's files were just deleted: let ext4's window pass.
                time.sleep(args.settle_s)
            need = scratch_bytes(page_mib, depth, total, args.repeats, len(backends) * len(args.spares),
                                 not isinstance(lmcache, str))
            stat = os.statvfs(work)
            keep = need * 1.2 < stat.f_bavail * stat.f_frsize
            if not keep:
                print(f"WARNING: {need >> 30} GiB of scratch space needed to keep every contender's files "
                      "until the configuration ends: removing each after its pass instead (contenders after "
                      "another's delete pay ext4's recently-deleted scan)", file=sys.stderr)
            loads.append(os.getloadavg()[0])
            rows += asyncio.run(measure(work, page_mib, depth, total, args.repeats, have_fio, backends,
                                        None if isinstance(lmcache, str) else lmcache, keep, tuple(args.spares),
                                        "aiofiles" not in args.skip))
            loads.append(os.getloadavg()[0])
            print(f"done: {page_mib} MiB pages, depth {depth}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(rows))
    print(f"\n1-minute load average at the start and end of each configuration: {min(loads):.1f}-{max(loads):.1f} "
          f"({os.cpu_count()} CPUs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"total_mib": total, "fio": have_fio, "lmcache": not isinstance(lmcache, str),
                       "load_average": [min(loads), max(loads)], "rows": [asdict(r) for r in rows]}, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
