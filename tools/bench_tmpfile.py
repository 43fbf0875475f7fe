"""New page files through io_uring: temporary name + rename against O_TMPFILE + linkat, measured in one run.

The disk tier publishes a new page file as one linked chain (OPENAT of a temporary name with
``O_CREAT|O_EXCL|O_NOFOLLOW|O_DIRECT`` into a fixed-file slot, WRITE, CLOSE, RENAMEAT onto the final
name), so a reader never finds a partial file under a final name; LMCache 0.5.6 opens the final name
and writes it. This measures, with the tier's own ring (``aiokv.storage.uring``), registered buffers
(WRITE_FIXED of header + page from one buffer per in-flight page) and 256 fan-out directories held
open, what each way of naming a new file costs:

- ``direct``: the LMCache-like baseline, one chain: OPENAT of the final name (``O_CREAT|O_WRONLY|
  O_DIRECT``, LMCache's flags) into a fixed-file slot, WRITE_FIXED, CLOSE. Not crash safe.
- ``temp-rename``: the tier's chain today (candidate b, linked since the fourth session): OPENAT
  temporary name, WRITE_FIXED, CLOSE, RENAMEAT temporary -> final.
- ``temp-rename-split``: the same four ops as four round trips (what linking them saved).
- ``temp-rename-fd``: as ``tmpfile-empty`` below, with a temporary name: OPENAT (a plain fd), then
  one chain: WRITE_FIXED, CLOSE, RENAMEAT (no fixed-file slot: tells the fd's part from the name's).
- ``temp-rename-noclose`` (c): OPENAT into a fixed-file slot replaces (and so closes) the file the slot
  held, so the chain needs no CLOSE: OPENAT, WRITE_FIXED, RENAMEAT.
- ``tmpfile-empty`` (a): OPENAT ``O_TMPFILE|O_WRONLY|O_DIRECT`` in the fan-out directory (a plain fd:
  LINKAT takes no fixed file), then one chain: WRITE_FIXED, LINKAT(fd, "", dir, final,
  ``AT_EMPTY_PATH``), CLOSE. Unprivileged ``AT_EMPTY_PATH`` needs Linux 6.10 (the file opened with
  the caller's credentials). Two round trips per page: the fd is not known before the OPENAT.
- ``tmpfile-proc`` (a): the same, linking ``/proc/self/fd/N`` with ``AT_SYMLINK_FOLLOW``.
- ``tmpfile-loop`` (a): the ``O_TMPFILE`` opened on the loop thread (``os.open``, a blocking
  syscall: its time on the loop is reported), then the one chain: one round trip per page.
- ``direct-async``, ``temp-rename-async``, ``temp-rename-fd-async``, ``tmpfile-empty-async`` (c):
  every op with ``IOSQE_ASYNC``. Without it the kernel first tries each op inline (an O_CREAT
  open, or an O_DIRECT write that extends a file on ext4, cannot be done without blocking: punted
  to an io-wq worker), and each
  next op of a chain is issued from task work of the submitting thread (the loop), which punts
  it again; with it an io-wq worker runs the op and goes on with the chain's next op itself.
- ``lmcache``: LMCache 0.5.6 ``LocalDiskBackend.write_file`` with ``use_odirect`` in its own thread
  pool (``--lmcache-path``; skipped with a message when not importable). Writes the page only.

Every pass writes ``--total-mib`` of new files into a directory of its own under ``--dir`` (nothing
is written elsewhere; all of it is removed at the end unless ``--keep``), variants rotated every
round, ``os.sync()`` before each pass (the previous pass's metadata written back) and the page cache
dropped too with ``--drop-caches`` (root; not needed for O_DIRECT files that did not exist before).
Files are kept until the end: ext4 without a journal made creates right after a mass delete cost
about twice the CPU (see ``tools/bench_disk.py``, ``SETTLE_S``). CPU is ``time.process_time()``
(every thread, io-wq workers included) per GB of pages. Figures are medians of ``--rounds``; ratios
against ``direct`` and against ``temp-rename`` (the tier's chain) are medians of each round's ratio
(paired: the VM's disk drifts between rounds), with their range.

``--crash-rounds N``: spawns a writer of one variant (``--crash-variants``) that writes pages whose
every byte is known (the key repeated), kills it with SIGKILL after a random delay, then reads every
file under a final name: complete and intact, or counted partial. ``direct`` is the control (a kill
between its OPENAT and its write leaves a partial final file).

    python tools/bench_tmpfile.py --dir /var/tmp/scratch --page-mib 1 4 --depth 8 32 --rounds 3
    python tools/bench_tmpfile.py --dir /var/tmp/scratch --lmcache-path /opt/lmc --json out.json
    python tools/bench_tmpfile.py --dir /var/tmp/scratch --crash-rounds 20 --page-mib 1 --rounds 0
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import mmap
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiokv.storage import uring

HEADER_BYTES = 4096
"""The tier's page-file header (written with the page in one op here)."""
OP_LINKAT = 39
AT_EMPTY_PATH = 0x1000
AT_SYMLINK_FOLLOW = 0x400
GB = 1e9
VARIANTS = ("direct", "temp-rename", "temp-rename-split", "temp-rename-noclose", "tmpfile-empty",
            "tmpfile-proc", "tmpfile-loop", "temp-rename-fd", "direct-async", "temp-rename-async",
            "temp-rename-fd-async", "tmpfile-empty-async")
CRASH_VARIANTS = ("direct", "temp-rename", "tmpfile-empty", "tmpfile-proc", "tmpfile-loop", "tmpfile-empty-async")


class Writer:
    """A ring, ``depth`` registered buffers of header + page, fixed-file slots, one pass directory at a time."""

    def __init__(self, engine: uring.UringEngine, depth: int, page_bytes: int) -> None:
        self.engine = engine
        self.depth = depth
        self.page_bytes = page_bytes
        self.unit = HEADER_BYTES + page_bytes
        self.memory = mmap.mmap(-1, depth * self.unit)
        self.memory.write(os.urandom(min(len(self.memory), 1 << 20)) * (len(self.memory) // (1 << 20) or 1))
        self._anchor = ctypes.c_char.from_buffer(self.memory)
        self.base = ctypes.addressof(self._anchor)
        regions = engine.register_buffers([(self.base, depth * self.unit, self.unit)])[0]
        self.region_of = [next(r.index for r in regions if r.address <= self.base + w * self.unit < r.address
                               + r.length) for w in range(depth)]
        self.fans: list[int] = []
        self.loop_open_s: list[float] = []
        self.counter = 0
        self.async_ops = False

    def address(self, w: int) -> int:
        return self.base + w * self.unit

    def fill(self, w: int, key: bytes) -> None:
        """Worker ``w``'s buffer holds ``key`` repeated (the crash check knows every byte)."""
        self.memory[w * self.unit:(w + 1) * self.unit] = key * (self.unit // len(key))

    def open_dir(self, directory: Path) -> None:
        """256 fan-out directories made and held open, as the tier holds its own."""
        self.close_dir()
        fans = []
        for i in range(256):
            sub = directory / f"{i:02x}"
            sub.mkdir(mode=0o700)
            fans.append(os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC))
        self.fans = fans

    def close_dir(self) -> None:
        for fd in self.fans:
            os.close(fd)
        self.fans = []

    def close(self) -> None:
        self.close_dir()
        del self._anchor
        self.memory.close()

    def _write_sqe(self, w: int, fd: int, fixed: bool) -> uring.SqeFields:
        return uring.sqe(uring.OP_WRITE_FIXED, fd, self.address(w), self.unit, 0, 0, self.region_of[w],
                         fixed_file=fixed)

    def _flags(self, ops: list[uring.SqeFields]) -> list[uring.SqeFields]:
        if not self.async_ops:
            return ops
        return [(op[0], op[1] | uring.IOSQE_ASYNC, *op[2:]) for op in ops]

    async def _chain(self, ops: list[uring.SqeFields], keep: object, expect: list[int]) -> list[int]:
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self.engine.submit(self._flags(ops), keep, None, future, expect)
        results = await future
        if results != expect:
            raise OSError(f"chain failed: {results} (expected {expect})")
        return results

    async def _one(self, op: uring.SqeFields, keep: object) -> int:
        res = (await self._chain_raw([op], keep))[0]
        if res < 0:
            raise OSError(-res, os.strerror(-res))
        return res

    async def _chain_raw(self, ops: list[uring.SqeFields], keep: object, expect: list[int] | None = None
                         ) -> list[int]:
        """The chain's results, whatever they are (``expect``: one CQE per chain, as the tier's)."""
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self.engine.submit(self._flags(ops), keep, None, future, expect)
        return await future

    async def page(self, variant: str, w: int, key: bytes) -> None:
        """Write one new page file named ``key.hex()`` with worker ``w``'s buffer and fixed slot."""
        self.async_ops = variant.endswith("-async")
        variant = variant.removesuffix("-async")
        name = key.hex().encode()
        fan = self.fans[key[0]]
        slot = w + 1
        final = ctypes.create_string_buffer(name)
        if variant == "direct":
            flags = os.O_WRONLY | os.O_CREAT | os.O_DIRECT
            await self._chain([uring.sqe(uring.OP_OPENAT, fan, ctypes.addressof(final), 0o644, 0, flags,
                                         file_index=slot),
                               self._write_sqe(w, w, True), uring.sqe(uring.OP_CLOSE, 0, file_index=slot)],
                              final, [0, self.unit, 0])
            return
        if variant.startswith("temp-rename"):
            self.counter += 1
            temp = ctypes.create_string_buffer(b".tmp-" + name + b"-%d" % self.counter)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_DIRECT
            rename = uring.sqe(uring.OP_RENAMEAT, fan, ctypes.addressof(temp), fan & 0xFFFFFFFF,
                               ctypes.addressof(final))
            if variant == "temp-rename-fd":
                fd = await self._one(uring.sqe(uring.OP_OPENAT, fan, ctypes.addressof(temp), 0o600, 0,
                                               flags | os.O_CLOEXEC), temp)
                results = await self._chain_raw([self._write_sqe(w, fd, False), uring.sqe(uring.OP_CLOSE, fd),
                                                 rename], (temp, final), [self.unit, 0, 0])
                if results[1] != 0:
                    os.close(fd)
                if results != [self.unit, 0, 0]:
                    raise OSError(f"chain failed: {results}")
                return
            if variant == "temp-rename-split":
                fd = await self._one(uring.sqe(uring.OP_OPENAT, fan, ctypes.addressof(temp), 0o600, 0,
                                               flags | os.O_CLOEXEC), temp)
                try:
                    await self._one(self._write_sqe(w, fd, False), None)
                finally:
                    await self._one(uring.sqe(uring.OP_CLOSE, fd), None)
                await self._one(rename, (temp, final))
                return
            opened = uring.sqe(uring.OP_OPENAT, fan, ctypes.addressof(temp), 0o600, 0, flags, file_index=slot)
            if variant == "temp-rename-noclose":
                # The next OPENAT into this slot closes this file (the pass closes the last ones).
                await self._chain([opened, self._write_sqe(w, w, True), rename], (temp, final), [0, self.unit, 0])
                return
            await self._chain([opened, self._write_sqe(w, w, True), uring.sqe(uring.OP_CLOSE, 0, file_index=slot),
                               rename], (temp, final), [0, self.unit, 0, 0])
            return
        # O_TMPFILE: an unnamed inode in the fan-out directory; O_EXCL would forbid linking it.
        flags = os.O_TMPFILE | os.O_WRONLY | os.O_DIRECT
        dot = ctypes.create_string_buffer(b".")
        if variant == "tmpfile-loop":
            t0 = time.perf_counter()
            fd = os.open(".", flags | os.O_CLOEXEC, 0o600, dir_fd=fan)
            self.loop_open_s.append(time.perf_counter() - t0)
        else:
            fd = await self._one(uring.sqe(uring.OP_OPENAT, fan, ctypes.addressof(dot), 0o600, 0,
                                           flags | os.O_CLOEXEC), dot)
        if variant == "tmpfile-proc":
            old = ctypes.create_string_buffer(b"/proc/self/fd/%d" % fd)
            link = uring.sqe(OP_LINKAT, uring.AT_FDCWD, ctypes.addressof(old), fan & 0xFFFFFFFF,
                             ctypes.addressof(final), AT_SYMLINK_FOLLOW)
        else:
            old = ctypes.create_string_buffer(b"")
            link = uring.sqe(OP_LINKAT, fd, ctypes.addressof(old), fan & 0xFFFFFFFF, ctypes.addressof(final),
                             AT_EMPTY_PATH)
        results = await self._chain_raw([self._write_sqe(w, fd, False), link, uring.sqe(uring.OP_CLOSE, fd)],
                                        (old, final), [self.unit, 0, 0])
        if results[2] != 0:  # a broken chain skipped its CLOSE: the unnamed inode goes with the fd
            os.close(fd)
        if results[:2] != [self.unit, 0]:
            raise OSError(f"chain failed: {results}")

    async def close_slots(self) -> None:
        """Close what ``temp-rename-noclose`` left in the fixed-file slots."""
        for w in range(self.depth):
            await self._chain_raw([uring.sqe(uring.OP_CLOSE, 0, file_index=w + 1)], None)


async def bounded(count: int, depth: int, one: Callable[[int, int], Awaitable[None]]) -> None:
    """``one(i, worker)`` for i < count, ``depth`` workers."""
    next_i = 0

    async def worker(w: int) -> None:
        nonlocal next_i
        while next_i < count:
            i = next_i
            next_i += 1
            await one(i, w)

    await asyncio.gather(*(worker(w) for w in range(depth)))


def settle(drop_caches: bool) -> None:
    os.sync()
    if drop_caches:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")


def lmcache_class(path: str | None) -> tuple[Any, int] | str:
    """LMCache's ``LocalDiskBackend`` and its default thread count, or why it cannot be imported."""
    if path is not None and path not in sys.path:
        sys.path.append(path)
    try:
        from lmcache.v1.storage_backend import local_disk_backend as ldb  # type: ignore[import-not-found]
    except Exception as exc:  # ImportError, or its import failing on a missing dependency
        return f"{type(exc).__name__}: {exc}"
    return ldb.LocalDiskBackend, int(getattr(ldb, "_DEFAULT_THREAD_COUNT", 4))


async def lmcache_pass(lmc: tuple[Any, int], writer: Writer, directory: Path, count: int, depth: int) -> None:
    cls, threads = lmc
    backend = cls.__new__(cls)  # its byte path only: no allocator, no controller
    backend.os_disk_bs = os.statvfs(directory).f_bsize
    backend.use_odirect = True
    loop = asyncio.get_running_loop()
    view = memoryview(writer.memory)
    with ThreadPoolExecutor(threads, thread_name_prefix="lmcache-disk") as pool:
        async def one(i: int, w: int) -> None:
            buf = view[w * writer.unit + HEADER_BYTES:(w + 1) * writer.unit]
            await loop.run_in_executor(pool, backend.write_file, buf, str(directory / f"{i:08x}.pt"))

        await bounded(count, depth, one)
    view.release()


async def one_pass(writer: Writer, variant: str, directory: Path, count: int, depth: int,
                   lmc: tuple[Any, int] | None, drop_caches: bool) -> dict[str, float]:
    await asyncio.to_thread(directory.mkdir, mode=0o700)
    await asyncio.to_thread(writer.open_dir, directory)
    keys = [os.urandom(16) for _ in range(count)]
    writer.loop_open_s = []
    await asyncio.to_thread(settle, drop_caches)
    c0, t0 = time.process_time(), time.perf_counter()
    if variant == "lmcache":
        assert lmc is not None
        await lmcache_pass(lmc, writer, directory, count, depth)
    else:
        await bounded(count, depth, lambda i, w: writer.page(variant, w, keys[i]))
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    if variant == "temp-rename-noclose":
        await writer.close_slots()
    writer.close_dir()
    gb = count * writer.page_bytes / GB
    row = {"gbs": gb / elapsed, "core_s_per_gb": cpu / gb}
    if writer.loop_open_s:
        row["loop_open_us_mean"] = statistics.fmean(writer.loop_open_s) * 1e6
        row["loop_open_us_max"] = max(writer.loop_open_s) * 1e6
    return row


async def measure(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    lmc: tuple[Any, int] | None = None
    variants = list(args.variants)
    if args.lmcache_path is not None:
        found = lmcache_class(args.lmcache_path)
        if isinstance(found, str):
            print(f"WARNING: LMCache not importable ({found}): no lmcache row", file=sys.stderr)
        else:
            lmc = found
            variants.append("lmcache")
    rows: list[dict[str, Any]] = []
    for page_mib in args.page_mib:
        for depth in args.depth:
            # A ring per configuration: the kernel allows one buffer registration per ring.
            engine = uring.UringEngine.open(max(64, 8 * depth))
            engine.register_files(depth)
            writer = Writer(engine, depth, page_mib << 20)
            count = max(depth, args.total_mib // page_mib)
            samples: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
            try:
                for r in range(args.rounds):
                    order = variants[r % len(variants):] + variants[:r % len(variants)]
                    for variant in order:
                        directory = root / f"p{page_mib}-q{depth}-r{r}-{variant}"
                        samples[variant].append(await one_pass(writer, variant, directory, count, depth, lmc,
                                                               args.drop_caches))
            finally:
                await engine.aclose()
                writer.close()
            for variant, got in samples.items():
                if not got:
                    continue
                row: dict[str, Any] = {"page_mib": page_mib, "depth": depth, "variant": variant,
                                       "pages": count, "rounds": len(got)}
                for k in got[0]:
                    row[k] = statistics.median(g[k] for g in got)
                row["samples"] = got
                for ref, suffix in ((samples.get("direct"), "direct"), (samples.get("temp-rename"), "tier")):
                    if not ref:
                        continue
                    # Paired by round (the disk and the machine's load drift between rounds): the median
                    # of the rounds' ratios and their range.
                    for key, name in (("gbs", "gbs_vs_"), ("core_s_per_gb", "cpu_vs_")):
                        ratios = [g[key] / b[key] for g, b in zip(got, ref, strict=True)]
                        row[name + suffix] = statistics.median(ratios)
                        row[name + suffix + "_range"] = [min(ratios), max(ratios)]
                rows.append(row)
            print(f"page {page_mib} MiB, qd {depth}: done", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| page MiB / qd | variant | GB/s | core-s/GB | GB/s ÷ direct (range) | CPU ÷ direct (range) | "
           "GB/s ÷ temp-rename (range) | CPU ÷ temp-rename (range) | loop open µs mean/max |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def ratio(r: dict[str, Any], name: str) -> str:
        if name not in r:
            return ""
        low, high = r[name + "_range"]
        return f"{r[name]:.2f}x ({low:.2f}-{high:.2f})"

    for r in rows:
        lo = f"{r['loop_open_us_mean']:.0f}/{r['loop_open_us_max']:.0f}" if "loop_open_us_mean" in r else ""
        out.append(f"| {r['page_mib']}/{r['depth']} | {r['variant']} | {r['gbs']:.2f} | {r['core_s_per_gb']:.3f} | "
                   f"{ratio(r, 'gbs_vs_direct')} | {ratio(r, 'cpu_vs_direct')} | {ratio(r, 'gbs_vs_tier')} | "
                   f"{ratio(r, 'cpu_vs_tier')} | {lo} |")
    return "\n".join(out)


# -- crash safety ----------------------------------------------------------------------------------

async def crash_child(args: argparse.Namespace) -> None:
    """Write pages of known bytes forever (until killed) into ``--dir``."""
    directory = Path(args.dir)
    engine = uring.UringEngine.open(64)
    depth = args.depth[0]
    engine.register_files(depth)
    writer = Writer(engine, depth, args.page_mib[0] << 20)
    writer.open_dir(directory)
    print("ready", flush=True)

    async def worker(w: int) -> None:
        while True:
            key = os.urandom(16)
            writer.fill(w, key)
            await writer.page(args.crash_child, w, key)

    await asyncio.gather(*(worker(w) for w in range(depth)))


def check_files(directory: Path, unit: int, keyed: bool = True) -> tuple[int, int, int]:
    """(intact, partial, temporary) files in ``directory``'s fan-out directories: a final name must
    hold ``unit`` bytes, its key repeated (``keyed``: a crash writer's) or any (a pass's)."""
    intact = partial = temporary = 0
    for sub in sorted(directory.iterdir()):
        for f in sub.iterdir():
            if f.name.startswith(".tmp-"):
                temporary += 1
                continue
            data = f.read_bytes()
            if len(data) == unit and (not keyed or data == bytes.fromhex(f.name) * (unit // 16)):
                intact += 1
            else:
                partial += 1
    return intact, partial, temporary


def crash_rounds(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    rows = []
    unit = HEADER_BYTES + (args.page_mib[0] << 20)
    rng = random.Random(args.seed)
    for variant in args.crash_variants:
        totals = [0, 0, 0]
        for r in range(args.crash_rounds):
            directory = root / f"crash-{variant}-{r}"
            directory.mkdir(mode=0o700)
            child = subprocess.Popen(
                [sys.executable, __file__, "--crash-child", variant, "--dir", str(directory),
                 "--page-mib", str(args.page_mib[0]), "--depth", str(args.depth[0])],
                stdout=subprocess.PIPE, text=True)
            try:
                assert child.stdout is not None
                if child.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"crash writer ({variant}) did not start")
                time.sleep(rng.uniform(0.05, 0.5))
                os.kill(child.pid, signal.SIGKILL)
            finally:
                child.kill()
                child.wait()
            for i, n in enumerate(check_files(directory, unit)):
                totals[i] += n
            shutil.rmtree(directory)
        rows.append({"variant": variant, "kills": args.crash_rounds, "intact": totals[0], "partial": totals[1],
                     "temporary": totals[2]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--dir", required=True, help="scratch directory: everything is written below it")
    parser.add_argument("--page-mib", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--depth", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--total-mib", type=int, default=256, help="written per pass")
    parser.add_argument("--rounds", type=int, default=3, help="passes of each variant (rotated order)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--lmcache-path", default=None, help="directory LMCache 0.5.6 was pip-installed into")
    parser.add_argument("--drop-caches", action="store_true", help="drop the page cache before each pass (root)")
    parser.add_argument("--crash-rounds", type=int, default=0, help="SIGKILL rounds per crash variant")
    parser.add_argument("--crash-variants", nargs="+", choices=CRASH_VARIANTS, default=list(CRASH_VARIANTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="leave the files written")
    parser.add_argument("--json", default=None, help="write the rows here too")
    parser.add_argument("--crash-child", choices=CRASH_VARIANTS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.page_mib) < 1 or min(args.depth) < 1 or args.total_mib < 1 or args.rounds < 0:
        parser.error("page sizes, depths and --total-mib must be positive, --rounds not negative")
    if args.crash_child is not None:
        asyncio.run(crash_child(args))
        return
    base = Path(args.dir)
    need = args.rounds * (len(args.variants) + 1) * len(args.page_mib) * len(args.depth) * (args.total_mib << 20)
    st = os.statvfs(base)
    if need > st.f_bavail * st.f_frsize // 2:
        parser.error(f"--dir has {st.f_bavail * st.f_frsize >> 20} MiB free; this run needs {need >> 20} MiB "
                     "(at most half): fewer rounds or a smaller --total-mib")
    root = Path(tempfile.mkdtemp(prefix="bench-tmpfile-", dir=base))
    out: dict[str, Any] = {"kernel": os.uname().release}
    try:
        out["rows"] = asyncio.run(measure(args, root)) if args.rounds else []
        if out["rows"]:
            print(table(out["rows"]))
        if args.crash_rounds:
            out["crash"] = crash_rounds(args, root)
            for c in out["crash"]:
                print(f"crash {c['variant']}: {c['kills']} kills, final names intact {c['intact']}, "
                      f"partial {c['partial']}, temporary names left {c['temporary']}")
    finally:
        if not args.keep:
            shutil.rmtree(root)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
