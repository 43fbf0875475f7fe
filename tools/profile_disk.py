"""Profile the disk tier's loop thread while it writes and reads page files (issue #14).

For each depth, a fresh :class:`DiskTier` (one directory per run) goes through four phases of
``--total-mib`` each: writes into the empty tier (every write creates a file), reads of them, writes
of as many new pages into the now full tier (every write recycles an evicted file), reads of those.
Before every read phase the page files' cached pages and, as root, the dentry and inode caches are
dropped (``/proc/sys/vm/drop_caches``; otherwise ``posix_fadvise(DONTNEED)`` per file only).

Each configuration runs ``--repeats`` times unprofiled (medians), then once profiled, each run in
its own directory:
- unprofiled: CPU per GB for the loop thread (``getrusage(RUSAGE_THREAD)``, user and kernel time)
  and for the whole process (``RUSAGE_SELF``: checksum thread, pool workers, io-wq workers included);
- under cProfile on the loop thread only (Python 3.11's profiler hooks the thread that enables it):
  the top ``--top`` entries by cumulative time and by own time, per phase kind (writes, reads),
  timed with the thread's CPU clock (``time.thread_time``): waits in epoll are not counted; then
  the own time summed per source file, and per page: Python calls, turns of the loop, ring
  wake-ups and queued ring submissions.
  Profiling inflates the loop thread's time, so its CPU figures are not printed. The loop thread
  also runs this driver (``profile_disk.py``, the pool's reserve/abort per read): listed as such.

The unprofiled run ends with the baseline of issue #14: the same io_uring engine writing, then
reading, one op per page into one O_DIRECT file; each tier phase's process CPU is shown as a ratio
to it (writes to its write, reads to its read). Where the tier issues page ops through io-wq
(``issue_async``: queue depth x page >= 64 MiB, a bound on the loop's stalls in ``io_uring_enter``),
the raw engine runs once more that way too (``raw ... io-wq``) and the tier's ratios to it follow.

``--turns-ms T`` adds one more run (tier and raw engine) with the loop's turns timed
(:class:`TurnSampler`): per phase the turn-length and CPU-per-turn percentiles, and for turns longer
than T ms the callbacks that ran in them by name, with the turn's split into the loop thread's CPU,
its run-queue wait (``/proc/<tid>/schedstat``: runnable, not running) and the rest (asleep in a
syscall). ``--async-data on|off`` forces the engine's IOSQE_ASYNC for page ops (A/B);
``--chain-reads on|off`` cold reads as one chain from the open, or open first (A/B);
``--page-first on|off`` a write's page op before its header op, or after (A/B). ``--batch [N]``
adds a third run to every unprofiled round: the tier reading in ``DiskTier.read_many`` batches of N
pages (default: the queue depth), two batches in flight, writes as before (per-page vs batched
alternated in one process, ratios to the same rounds' raw engine); the profiled run then reads
in batches too. ``--load`` times
``KVCache.load`` of the same pages from disk through the cache (a fresh cache per round, page cache
dropped), its reads one page a group or in read groups (``CacheConfig.read_group_bytes``),
alternated.

Usage: ``python tools/profile_disk.py --dir /var/tmp/aiokv-prof --page-mib 1 --depth 8 32``;
loop turns only: ``... --page-mib 4 --depth 32 --repeats 0 --no-profile --turns-ms 1``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import gc
import io
import os
import pstats
import resource
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from aiokv import CacheConfig, KVCache
from aiokv.config import DEFAULT_READ_GROUP_BYTES
from aiokv.layout import KVLayout
from aiokv.pagetable import PageHandle
from aiokv.pool import PagePool
from aiokv.results import Match
from aiokv.storage import DiskBackend, DiskConfig, DiskTier
from aiokv.storage.backends import UringPageIO, issue_async
from aiokv.storage.pagefile import HEADER_BYTES
from aiokv.storage.uring import UringEngine

GB = 1e9
ASYNC_DATA: bool | None = None
CHAIN_READS: bool | None = None
PAGE_FIRST: bool | None = None
"""``--page-first``: force a write's page op before (on) or after (off) its header op."""
"""``--chain-reads``: force cold reads as one chain from the open on or off (None: the default)."""
"""``--async-data``: force the engine's ``async_data`` on or off (None: the tier's own choice)."""
PHASES = ("write new", "read new", "write recycled", "read recycled")
BATCHES_IN_FLIGHT = 2
"""``--batch``: ``read_many`` calls in flight at once (two: the next batch's pages are queued for
I/O slots while the last ones of the batch before end, so the device sees the queue depth
throughout, as with one ``read`` per slot)."""


@dataclass
class Phase:
    """CPU seconds of one phase (``nbytes`` moved)."""

    name: str
    nbytes: int
    wall_s: float
    loop_user_s: float
    loop_sys_s: float
    proc_s: float
    hash_s: float = 0.0
    """Of ``proc_s``: hashing payloads (the tier's checksum seconds, loop and thread)."""

    def per_gb(self, seconds: float) -> float:
        return seconds / (self.nbytes / GB)


class TurnSampler:
    """Times every turn of the loop and every callback in it, to name what holds the loop long.

    A turn is the span from one return of the selector's poll to the next call of it (the loop's
    own work: timers, ready callbacks). Each callback (``Handle._run``) is timed; a turn longer than
    ``long_s`` keeps its callbacks (by name) and garbage-collector pauses, and its CPU time on the
    loop thread (a turn much longer in wall time than in CPU was preempted or blocked in a syscall).
    Installed for the duration of a phase; costs two clock reads per callback."""

    def __init__(self, long_s: float = 1e-3) -> None:
        self.long_s = long_s
        self.turns: list[float] = []
        self.turn_cpu: list[float] = []
        """The loop thread's CPU seconds per turn: what the code holds it for (wall less waits)."""
        self.long: list[tuple[float, float, float, list[tuple[float, str]]]] = []
        """(wall s, CPU s, run-queue wait s, [(callback s, name)]) of each long turn: the rest of
        the wall time the thread slept (blocked in a syscall or on the GIL)."""
        self.by_name: dict[str, list[float]] = {}
        """Per callback name: [calls in long turns, seconds in long turns, longest single run]."""
        self._calls: list[tuple[float, object]] = []
        self._t0 = 0.0
        self._c0 = 0.0
        self._w0 = 0.0
        self._gc_t = 0.0
        self._undo: list[Callable[[], None]] = []

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        selector = loop._selector  # type: ignore[attr-defined]
        select = selector.select
        run = asyncio.events.Handle._run
        calls = self._calls
        clock, cpu = time.perf_counter, time.thread_time

        stat_fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)

        def waited() -> float:
            # Seconds this thread spent runnable but not running (the kernel's run-queue wait).
            return int(os.pread(stat_fd, 64, 0).split()[1]) / 1e9

        def timed_select(timeout: float | None = None) -> object:
            self._end_turn(clock(), cpu(), waited())
            try:
                return select(timeout)
            finally:
                self._t0, self._c0, self._w0 = clock(), cpu(), waited()
                calls.clear()

        def timed_run(handle: asyncio.Handle) -> None:
            t = clock()
            try:
                run(handle)
            finally:
                calls.append((clock() - t, handle))

        def gc_pause(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                self._gc_t = clock()
            else:
                calls.append((clock() - self._gc_t, f"gc gen {info.get('generation')}"))

        selector.select = timed_select
        asyncio.events.Handle._run = timed_run  # type: ignore[method-assign,assignment]
        gc.callbacks.append(gc_pause)
        self._t0, self._c0, self._w0 = clock(), cpu(), waited()

        def undo() -> None:
            os.close(stat_fd)
            selector.select = select
            asyncio.events.Handle._run = run  # type: ignore[method-assign]
            gc.callbacks.remove(gc_pause)
        self._undo.append(undo)

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _end_turn(self, now: float, now_cpu: float, now_waited: float) -> None:
        wall = now - self._t0
        self.turns.append(wall)
        self.turn_cpu.append(now_cpu - self._c0)
        if wall < self.long_s:
            return
        named = sorted(((s, callback_name(h)) for s, h in self._calls), reverse=True)
        self.long.append((wall, now_cpu - self._c0, now_waited - self._w0, named))
        for s, name in named:
            entry = self.by_name.setdefault(name, [0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += s
            entry[2] = max(entry[2], s)

    def report(self, top: int) -> str:
        if not self.turns:
            return "  no turns"
        ordered = sorted(self.turns)
        def q(f: float) -> float:
            return ordered[min(len(ordered) - 1, int(f * len(ordered)))] * 1e3
        long_wall = sum(t[0] for t in self.long)
        long_cpu = sum(t[1] for t in self.long)
        long_wait = sum(t[2] for t in self.long)
        lines = [f"  turns {len(ordered)}: p50 {q(0.5):.3f} p99 {q(0.99):.3f} max {ordered[-1] * 1e3:.2f} ms; "
                 f"{len(self.long)} over {self.long_s * 1e3:.1f} ms (wall {long_wall * 1e3:.1f} ms: loop-thread "
                 f"CPU {long_cpu * 1e3:.1f}, run-queue wait {long_wait * 1e3:.1f}, asleep "
                 f"{(long_wall - long_cpu - long_wait) * 1e3:.1f})"]
        cpu = sorted(self.turn_cpu)
        def qc(f: float) -> float:
            return cpu[min(len(cpu) - 1, int(f * len(cpu)))] * 1e3
        lines.append(f"  CPU per turn: p50 {qc(0.5):.3f} p99 {qc(0.99):.3f} max {cpu[-1] * 1e3:.2f} ms")
        lines.append(f"  {'calls':>6} {'sum ms':>8} {'max ms':>7}  callback (in long turns)")
        for name, (n, s, m) in sorted(self.by_name.items(), key=lambda kv: -kv[1][1])[:top]:
            lines.append(f"  {int(n):6d} {s * 1e3:8.2f} {m * 1e3:7.3f}  {name}")
        lines.append("  longest turns (wall/CPU/run-queue wait ms: top callbacks ms)")
        for wall, c, w, named in sorted(self.long, key=lambda t: -t[0])[:5]:
            parts = ", ".join(f"{name} {s * 1e3:.2f}" for s, name in named[:4])
            lines.append(f"    {wall * 1e3:6.2f}/{c * 1e3:5.2f}/{w * 1e3:5.2f}: {len(named)} callbacks; {parts}")
        return "\n".join(lines)


def callback_name(handle: object) -> str:
    """A readable name for what a handle ran: the function, or the coroutine a task step ran."""
    if isinstance(handle, str):
        return handle
    callback = getattr(handle, "_callback", None)
    while isinstance(callback, functools.partial):
        callback = callback.func
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, asyncio.Task):
        coro = owner.get_coro()
        return f"task {getattr(coro, '__qualname__', type(coro).__name__)}"
    return getattr(callback, "__qualname__", None) or type(callback).__name__


def rusage(who: int) -> tuple[float, float]:
    r = resource.getrusage(who)
    return r.ru_utime, r.ru_stime


def drop_caches(directory: Path) -> str:
    """Drop the cached pages of every file under ``directory`` (and dentries/inodes as root)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3")
        return "drop_caches"
    except OSError:
        for path in directory.rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        return "fadvise"


def layout_for(page_mib: int) -> KVLayout:
    # As tools/bench_disk.py: 4 layers x 128 tokens x 8 rows x 128 x fp16 = 1 MiB; layers scale it.
    return KVLayout.mha(4 * page_mib, 4, 128, torch.float16, page_tokens=128)


def fill_pool(pool: PagePool) -> list[PageHandle]:
    """Every pool page READY with random bytes; returns a held reference to each."""
    keys = [b"\xff" + p.to_bytes(15, "little") for p in range(pool.num_pages)]
    g = torch.Generator().manual_seed(0)
    held: list[PageHandle] = []
    for res in pool.reserve(keys):
        assert res.handle is not None
        raw = pool.tensor(res.handle).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
        handle = pool.table.commit(res.handle, keep=True)
        assert handle is not None
        held.append(handle)
    return held


async def bounded(count: int, depth: int, one: Callable[[int], Awaitable[None]]) -> None:
    """``one(i)`` for every ``i < count``, ``depth`` at a time."""
    it = iter(range(count))

    async def worker() -> None:
        for i in it:
            await one(i)

    await asyncio.gather(*(worker() for _ in range(depth)))


async def run(directory: Path, backend: DiskBackend, page_mib: int, depth: int, total_mib: int,
              profiles: dict[str, cProfile.Profile] | None,
              turns: dict[str, TurnSampler] | None = None, batch: int = 0) -> tuple[list[Phase], str]:
    """The four phases against a fresh tier in ``directory``; ``profiles`` (by "write"/"read")
    collect the loop thread's profile when given, ``turns`` (by phase name) its turns. ``batch``:
    read in ``DiskTier.read_many`` batches of that many pages, :data:`BATCHES_IN_FLIGHT` at once
    (0: one ``read`` per page, ``depth`` at once)."""
    layout = layout_for(page_mib)
    pb = layout.page_bytes
    count = max(depth, total_mib // page_mib)
    pool = PagePool.create(layout, min(count, 64) * pb, register_cuda=False, workers=2)
    pool.wait_ready_blocking()
    config = DiskConfig(directory=directory, capacity_bytes=count * (pb + HEADER_BYTES), backend=backend,
                        queue_depth=depth, threads=depth)
    phases: list[Phase] = []
    dropped = ""
    async with DiskTier(config, layout, pool) as tier:
        io = tier.backend
        if ASYNC_DATA is not None and isinstance(io, UringPageIO):
            io.engine.async_data = ASYNC_DATA
        if CHAIN_READS is not None and isinstance(io, UringPageIO):
            io.chain_reads = CHAIN_READS
        if PAGE_FIRST is not None and isinstance(io, UringPageIO):
            io.page_first = PAGE_FIRST
        for first in (1, count + 1):
            keys = [i.to_bytes(16, "little") for i in range(first, first + count)]
            held = fill_pool(pool)

            async def write(i: int, keys: list[bytes] = keys, held: list[PageHandle] = held) -> None:
                assert await tier.write(keys[i], held[i % len(held)])

            async def read(i: int, keys: list[bytes] = keys) -> None:
                (res,) = pool.reserve([keys[i]])
                assert res.handle is not None
                ok = await tier.read(keys[i], res.handle)
                pool.table.abort(res.handle)
                assert ok

            async def read_batch(i: int, keys: list[bytes] = keys) -> None:
                wanted = keys[i * batch : (i + 1) * batch]
                handles = []
                for res in pool.reserve(wanted):
                    assert res.handle is not None
                    handles.append(res.handle)
                oks = await tier.read_many(wanted, handles)
                for h in handles:
                    pool.table.abort(h)
                assert all(oks)

            for kind, one in (("write", write), ("read", read)):
                drive = functools.partial(bounded, count, depth, one)
                if kind == "read" and batch:
                    drive = functools.partial(bounded, -(-count // batch), BATCHES_IN_FLIGHT, read_batch)
                if kind == "read":
                    for h in held:
                        pool.table.release(h)
                    pool.table.evict(pool.num_pages)
                    dropped = await asyncio.to_thread(drop_caches, directory)
                prof = None if profiles is None else profiles[kind]
                hashed = tier.checksum_seconds
                name = PHASES[len(phases)]
                phases.append(await measured(name, count * pb, drive, prof,
                                             None if turns is None else turns[name]))
                phases[-1].hash_s = tier.checksum_seconds - hashed
    pool.close()
    return phases, dropped


async def raw_engine(directory: Path, page_mib: int, depth: int, total_mib: int,
                     turns: dict[str, TurnSampler] | None = None, async_data: bool = False) -> list[Phase]:
    """The baseline: the same io_uring engine moving the pool's pages to and from one O_DIRECT file,
    one op per page (registered buffers; no header, checksum, index or page file). ``async_data``:
    its ops through io-wq (IOSQE_ASYNC) as the tier issues them at this page size and depth
    (phases named ``raw write io-wq``/``raw read io-wq``)."""
    layout = layout_for(page_mib)
    pb = layout.page_bytes
    count = max(depth, total_mib // page_mib)
    pool = PagePool.create(layout, min(count, 64) * pb, register_cuda=False, workers=2)
    pool.wait_ready_blocking()
    for h in fill_pool(pool):
        pool.table.release(h)
    await asyncio.to_thread(directory.mkdir, parents=True)
    path = directory / "raw"
    engine = UringEngine.open(max(depth, 8))
    engine.async_data = async_data
    (regions,) = engine.register_buffers([(pool.memory.segment.address, pool.num_pages * pb, pb)])
    base, per_region = pool.memory.segment.address, regions[0].length
    phases: list[Phase] = []
    try:
        for write in (True, False):
            if not write:
                await asyncio.to_thread(drop_caches, directory)
            fd = os.open(path, (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY) | os.O_DIRECT, 0o600)

            async def one(i: int, fd: int = fd, write: bool = write) -> None:
                page = i % pool.num_pages
                op = engine.write if write else engine.read
                assert await op(fd, base + page * pb, pb, i * pb, None, regions[page * pb // per_region]) == pb

            try:
                name = f"raw {'write' if write else 'read'}{' io-wq' if async_data else ''}"
                phases.append(await measured(name, count * pb, lambda: bounded(count, depth, one), None,
                                             None if turns is None else turns[name]))
            finally:
                os.close(fd)
    finally:
        await engine.aclose()
        pool.close()
    return phases


async def load_rounds(directory: Path, backend: DiskBackend, page_mib: int, depth: int, total_mib: int,
                      repeats: int) -> dict[str, list[Phase]]:
    """``--load``: ``KVCache.load`` of a prefix whose pages are all on disk (a fresh cache, its pool
    empty, page cache dropped), its disk pages read in groups (``CacheConfig.read_group_bytes``,
    one ``read_many`` each) or one page a group; alternated ``repeats`` times. Process CPU of the
    whole load: reads, promotions, the copies into a CPU KV buffer."""
    layout = layout_for(page_mib)
    count = max(depth, total_mib // page_mib)
    tokens = list(range(1, count * layout.page_tokens + 1))
    slots = torch.arange(len(tokens))
    kv = torch.zeros(layout.num_layers, len(tokens), layout.rows, layout.head_dim, dtype=layout.dtype)
    kv.view(torch.uint8).copy_(torch.randint(0, 256, kv.view(torch.uint8).shape, dtype=torch.uint8,
                                             generator=torch.Generator().manual_seed(0)))
    disk = DiskConfig(directory=directory, capacity_bytes=2 * count * (layout.page_bytes + HEADER_BYTES),
                      backend=backend, queue_depth=depth, threads=depth)

    def cache(group_bytes: int = DEFAULT_READ_GROUP_BYTES) -> KVCache:
        return KVCache(CacheConfig(cpu_bytes=(count + 8) * layout.page_bytes, disk=disk, namespace="profile",
                                   read_group_bytes=group_bytes), layout, kv)

    async with cache() as writer:
        await writer.pool.wait_ready()
        await writer.offload(tokens, slots)
        await writer.flush()
    out: dict[str, list[Phase]] = {"load per page": [], "load in groups": []}
    for _ in range(repeats):
        # One page a group: a group of 1 byte rounds up to one page.
        for name, group_bytes in (("load per page", 1), ("load in groups", DEFAULT_READ_GROUP_BYTES)):
            async with cache(group_bytes) as reader:
                await reader.pool.wait_ready()
                assert reader.disk is not None
                await reader.disk.wait_registered()
                await asyncio.to_thread(drop_caches, directory)
                match = await reader.match(tokens)
                assert match.disk_pages == count, (match.disk_pages, count)

                async def load(reader: KVCache = reader, match: Match = match) -> None:
                    result = await reader.load(match, slots)
                    assert result.disk_pages == count

                out[name].append(await measured(name, count * layout.page_bytes, load, None))
    return out


async def measured(name: str, nbytes: int, job: Callable[[], Awaitable[None]],
                   prof: cProfile.Profile | None, turns: TurnSampler | None = None) -> Phase:
    """Run ``job`` on the loop thread, under ``prof`` and ``turns`` when given; its wall time and CPU."""
    gc.collect()
    if turns is not None:
        turns.install(asyncio.get_running_loop())
    t_user, t_sys = rusage(resource.RUSAGE_THREAD)
    p_user, p_sys = rusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    await job()
    if prof is not None:
        prof.disable()
    if turns is not None:
        turns.uninstall()
    wall = time.perf_counter() - t0
    t_user2, t_sys2 = rusage(resource.RUSAGE_THREAD)
    p_user2, p_sys2 = rusage(resource.RUSAGE_SELF)
    return Phase(name, nbytes, wall, t_user2 - t_user, t_sys2 - t_sys, (p_user2 + p_sys2) - (p_user + p_sys))


def top(prof: cProfile.Profile, sort: str, n: int) -> str:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).strip_dirs().sort_stats(sort).print_stats(n)
    lines = out.getvalue().splitlines()
    # Keep the totals line and the table; drop pstats' blank lines and "Ordered by" chatter.
    return "\n".join(line for line in lines if line.strip() and not line.strip().startswith("Ordered by"))


def by_file(prof: cProfile.Profile, n: int) -> str:
    """Own time summed per source file (built-ins under their own label): where the loop's time goes."""
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    files: dict[str, list[float]] = {}
    total = 0.0
    for (filename, _, name), (_, calls, tottime, _, _) in stats.items():
        label = os.path.basename(filename) if filename != "~" else f"built-in {name}"
        entry = files.setdefault(label, [0.0, 0.0])
        entry[0] += tottime
        entry[1] += calls
        total += tottime
    rows = sorted(files.items(), key=lambda item: -item[1][0])[:n]
    lines = [f"  {'own s':>7} {'share':>6} {'calls':>8}  file"]
    lines += [f"  {t:7.3f} {t / total:6.1%} {int(c):8d}  {label}" for label, (t, c) in rows]
    return "\n".join(lines)


def per_page(prof: cProfile.Profile, pages: int) -> str:
    """Python calls, turns of the loop (``_run_once``), ring wake-ups (``_on_eventfd``) and queued
    ring submissions (``_submit``) per page: what the turn count of #14 is about."""
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    calls = 0
    named = {"_run_once": 0, "_on_eventfd": 0, "_submit": 0}
    for (filename, _, name), (_, count, _, _, _) in stats.items():
        calls += count
        if name in named and os.path.basename(filename) in ("base_events.py", "uring.py"):
            named[name] += count
    return (f"  per page ({pages} pages): {calls / pages:.1f} calls, {named['_run_once'] / pages:.2f} turns, "
            f"{named['_on_eventfd'] / pages:.2f} ring wake-ups, {named['_submit'] / pages:.2f} queued submissions")


async def fresh(directory: Path) -> Path:
    """``directory``, removed first if a killed run left it."""
    await asyncio.to_thread(shutil.rmtree, directory, True)
    return directory


def median_phase(runs: list[Phase]) -> Phase:
    """Field by field, the median of one phase's runs."""
    def med(values: list[float]) -> float:
        return statistics.median(values)
    return Phase(runs[0].name, runs[0].nbytes, med([p.wall_s for p in runs]), med([p.loop_user_s for p in runs]),
                 med([p.loop_sys_s for p in runs]), med([p.proc_s for p in runs]), med([p.hash_s for p in runs]))


def print_cpu(phases: list[Phase]) -> None:
    by_name = {p.name: p for p in phases}
    iowq = "raw read io-wq" in by_name
    print(f"  {'phase':<15} {'GB/s':>6} {'loop usr':>9} {'loop sys':>9} {'loop':>7} {'process':>8}"
          f" {'xxh3':>6}   (core-s/GB; process / raw engine's, with and without xxh3"
          f"{'; then / the raw engine through io-wq, as the tier issues' if iowq else ''})")
    for p in phases:
        kind = "read" if "read" in p.name else "write"
        base = by_name[f"raw {kind}"]
        ratio = "" if p.name.startswith("raw") else (
            f"   {p.proc_s / base.proc_s:4.1f}x / {(p.proc_s - p.hash_s) / base.proc_s:4.1f}x")
        if ratio and iowq:
            base = by_name[f"raw {kind} io-wq"]
            ratio += f"   {p.proc_s / base.proc_s:4.1f}x / {(p.proc_s - p.hash_s) / base.proc_s:4.1f}x"
        print(f"  {p.name:<15} {p.nbytes / p.wall_s / GB:6.2f} {p.per_gb(p.loop_user_s):9.3f} "
              f"{p.per_gb(p.loop_sys_s):9.3f} {p.per_gb(p.loop_user_s + p.loop_sys_s):7.3f} "
              f"{p.per_gb(p.proc_s):8.3f} {p.per_gb(p.hash_s):6.3f}{ratio}")


async def main_async(args: argparse.Namespace) -> int:
    backend = DiskBackend(args.backend)
    for depth in args.depth:
        head = f"== {backend.value} page {args.page_mib} MiB qd {depth} {args.total_mib} MiB/phase"
        name = f"p{args.page_mib}-q{depth}"
        # Unprofiled: tier and raw engine alternated, ``--repeats`` rounds, medians per phase.
        # With --batch a third run per round: the tier reading in read_many batches (same round's raw engine).
        rounds: list[list[Phase]] = []
        batched: list[list[Phase]] = []
        dropped = ""
        for _ in range(args.repeats):
            directory = await fresh(args.dir / f"{name}-cpu")
            phases, dropped = await run(directory, backend, args.page_mib, depth, args.total_mib, None)
            await asyncio.to_thread(shutil.rmtree, directory)
            directory = await fresh(args.dir / f"{name}-raw")
            raw = await raw_engine(directory, args.page_mib, depth, args.total_mib)
            await asyncio.to_thread(shutil.rmtree, directory)
            if ASYNC_DATA if ASYNC_DATA is not None else issue_async(args.page_mib << 20, depth):
                # The tier issues page ops through io-wq here (a lag bound): the raw engine so too.
                directory = await fresh(args.dir / f"{name}-raw-iowq")
                raw += await raw_engine(directory, args.page_mib, depth, args.total_mib, async_data=True)
                await asyncio.to_thread(shutil.rmtree, directory)
            rounds.append(phases + raw)
            if args.batch:
                directory = await fresh(args.dir / f"{name}-batch")
                phases, _ = await run(directory, backend, args.page_mib, depth, args.total_mib, None,
                                      batch=depth if args.batch < 0 else args.batch)
                await asyncio.to_thread(shutil.rmtree, directory)
                batched.append(phases + raw)
        if rounds:
            print(f"{head}: CPU, unprofiled, median of {args.repeats} (reads after {dropped})")
            print_cpu([median_phase([r[i] for r in rounds]) for i in range(len(rounds[0]))])
        if batched:
            size = depth if args.batch < 0 else args.batch
            print(f"{head}: CPU, reads in read_many batches of {size} ({BATCHES_IN_FLIGHT} in flight), "
                  f"median of {args.repeats}, the same rounds' raw engine")
            print_cpu([median_phase([r[i] for r in batched]) for i in range(len(batched[0]))])
        if args.turns_ms:
            # Turns of the loop, timed (no profiler: its overhead would make every turn long).
            samplers = {name: TurnSampler(args.turns_ms / 1e3) for name in (*PHASES, "raw write", "raw read")}
            directory = await fresh(args.dir / f"{name}-turns")
            await run(directory, backend, args.page_mib, depth, args.total_mib, None, samplers)
            await asyncio.to_thread(shutil.rmtree, directory)
            directory = await fresh(args.dir / f"{name}-turns-raw")
            await raw_engine(directory, args.page_mib, depth, args.total_mib, samplers)
            await asyncio.to_thread(shutil.rmtree, directory)
            for phase, sampler in samplers.items():
                print(f"{head}: loop turns, {phase}")
                print(sampler.report(args.top))
        if args.load:
            directory = await fresh(args.dir / f"{name}-load")
            loads = await load_rounds(directory, backend, args.page_mib, depth, args.total_mib, args.repeats)
            await asyncio.to_thread(shutil.rmtree, directory)
            print(f"{head}: KVCache.load from disk, per page vs read groups alternated, median of {args.repeats}")
            print(f"  {'phase':<15} {'GB/s':>6} {'loop':>7} {'process':>8}   (core-s/GB)")
            for runs in loads.values():
                p = median_phase(runs)
                print(f"  {p.name:<15} {p.nbytes / p.wall_s / GB:6.2f} {p.per_gb(p.loop_user_s + p.loop_sys_s):7.3f} "
                      f"{p.per_gb(p.proc_s):8.3f}")
        if args.no_profile:
            continue
        # Profiled: the loop thread's CPU clock, so time blocked in epoll or io_uring_enter is not
        # counted as the loop's cost.
        profiles = {kind: cProfile.Profile(time.thread_time) for kind in ("write", "read")}
        directory = await fresh(args.dir / f"{name}-prof")
        await run(directory, backend, args.page_mib, depth, args.total_mib, profiles,
                  batch=0 if not args.batch else depth if args.batch < 0 else args.batch)
        await asyncio.to_thread(shutil.rmtree, directory)
        for kind, prof in profiles.items():
            for sort in ("cumulative", "tottime"):
                print(f"{head}: loop thread, {kind}s (new + recycled), top {args.top} by {sort}")
                print(top(prof, sort, args.top))
            print(f"{head}: loop thread, {kind}s, own time by file")
            print(by_file(prof, args.top))
            print(per_page(prof, 2 * max(depth, args.total_mib // args.page_mib)))  # new and recycled
        sys.stdout.flush()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dir", type=Path, required=True, help="scratch directory (removed runs' files)")
    parser.add_argument("--backend", default=DiskBackend.URING_FIXED.value,
                        choices=[b.value for b in DiskBackend])
    parser.add_argument("--page-mib", type=int, default=1)
    parser.add_argument("--depth", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--total-mib", type=int, default=256, help="bytes per phase")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="unprofiled rounds (medians)")
    parser.add_argument("--turns-ms", type=float, default=0.0, help="also time the loop's turns in one more "
                        "run and name the callbacks of turns longer than this (ms; 0: off)")
    parser.add_argument("--async-data", choices=["auto", "on", "off"], default="auto",
                        help="page ops through io-wq (IOSQE_ASYNC): the tier's choice, or forced")
    parser.add_argument("--chain-reads", choices=["auto", "on", "off"], default="auto",
                        help="cold reads as one chain from the open (A/B): the default, or forced")
    parser.add_argument("--page-first", choices=["auto", "on", "off"], default="auto",
                        help="a write's page op before its header op (A/B): the default, or forced")
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile run")
    parser.add_argument("--load", action="store_true",
                        help="also time KVCache.load of the pages from disk, its reads per page or in read groups "
                             "(alternated, --repeats rounds)")
    parser.add_argument("--batch", type=int, nargs="?", const=-1, default=0,
                        help="also, in every round, a tier run whose reads go in DiskTier.read_many batches of "
                             "this many pages (no value: the queue depth), two batches in flight; printed next "
                             "to the per-page rounds, ratios to the same rounds' raw engine")
    args = parser.parse_args()
    if args.page_mib < 1 or args.total_mib < args.page_mib or args.top < 1 or args.repeats < 0 or min(args.depth) < 1:
        parser.error("sizes, depths and --top must be positive (--total-mib >= --page-mib)")
    if args.batch < -1 or args.batch > 32 or (args.batch < 0 and max(args.depth) > 32):
        parser.error("--batch: 1 to 32 pages (two batches in flight from the tool's pool of 64 pages)")
    global ASYNC_DATA, CHAIN_READS, PAGE_FIRST
    ASYNC_DATA = None if args.async_data == "auto" else args.async_data == "on"
    CHAIN_READS = None if args.chain_reads == "auto" else args.chain_reads == "on"
    PAGE_FIRST = None if args.page_first == "auto" else args.page_first == "on"
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
