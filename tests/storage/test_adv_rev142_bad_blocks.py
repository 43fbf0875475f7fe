"""Real EIO on chosen blocks of page files: an ext4 on a loop device over a FUSE file
(``fuse_gate.py``'s file system, here answering EIO to READ or WRITE requests that touch given
byte ranges of the device: a disk with bad sectors). Opens and metadata work; only the transfers
of the chosen files fail, where the test puts the bad blocks (found with FIEMAP).

With registered buffers a read's header and page are two transfers and the header's posts its
CQE (``uring.LOUD_TRANSFERS``): an EIO there breaks the chain at a loud op (its cancelled
followers post CQEs after the chain ended), one in the page at a silent op. Injected faults never
show the first. Oracles: a failed read is a miss counted as EIO (not corrupt) that keeps its file
(once the blocks read again the page is served, exactly as written); a failed overwrite of a
recycled file is a counted EIO that serves nothing torn; nothing hangs; the ring's count of ops
in flight ends at 0 and every I/O slot's fixed-file entry empty; no reservation or reference left.
Root only (FUSE, loop device)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from disk_helpers import BACKENDS, assert_clean, config, fill, key_of, payload, reserve, stored_page, temp_files
from gate_helpers import BOUND_S, GateControl

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind
from aiokv.storage.backends import UringPageIO
from aiokv.storage.pagefile import HEADER_BYTES
from aiokv.storage.uring import OP_CLOSE, Op

DEPTH = 4

# fuse_gate's file system, with commands "bad read|write START END" (EIO for requests touching
# the device's bytes [START, END)) and "good" (none any more).
_SERVER = r"""
import errno, os, sys
sys.path.insert(0, sys.argv[3])
import fuse_gate as g

class Bad(g.Gate):
    def __init__(self, fd, backing):
        super().__init__(fd, backing)
        self.bad = {g.READ: [], g.WRITE: []}

    def command(self, line):
        words = line.split()
        if words[:1] == ["bad"]:
            self.bad[g.READ if words[1] == "read" else g.WRITE].append((int(words[2]), int(words[3])))
            return "ok"
        if words == ["good"]:
            for ranges in self.bad.values():
                ranges.clear()
            return "ok"
        return super().command(line)

    def answer(self, data):
        opcode = g._IN.unpack_from(data)[1]
        if opcode in self.bad:
            _fh, offset, size, _flags = g._RW_IN.unpack_from(data, g._IN.size)
            if any(offset < end and start < offset + size for start, end in self.bad[opcode]):
                return -errno.EIO, b""
        return super().answer(data)

import ctypes, ctypes.util
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
options = f"fd={fd},rootmode=40000,user_id={os.geteuid()},group_id={os.getegid()}".encode()
if libc.mount(b"aiokv-bad", sys.argv[1].encode(), b"fuse", ctypes.c_ulong(g._MS_NOSUID | g._MS_NODEV), options) != 0:
    print(f"mount(2) of FUSE failed: {os.strerror(ctypes.get_errno())}", flush=True)
    sys.exit(1)
print("ready", flush=True)
g.serve(Bad(fd, sys.argv[2]))
"""


class BadBlocks(GateControl):
    def bad(self, what: str, start: int, end: int) -> None:
        """EIO for ``what`` ("read" or "write") requests touching the device's bytes [start, end)."""
        assert self._ask(f"bad {what} {start} {end}") == "ok"

    def good(self) -> None:
        assert self._ask("good") == "ok"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=False)


def _unmount(path: Path) -> None:
    if _run("umount", str(path)).returncode != 0:
        _run("umount", "-l", str(path))


@contextlib.contextmanager
def bad_block_ext4(tmp: Path, size_mib: int) -> Iterator[tuple[Path, BadBlocks]]:
    """A fresh ext4 on a loop device over a FUSE file whose chosen bytes answer EIO."""
    if os.geteuid() != 0:
        pytest.skip("a FUSE file system and a loop device need root")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse here")
    for tool in ("mkfs.ext4", "losetup", "mount", "umount"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    image, fuse_dir, mount = tmp / "backing.img", tmp / "fuse", tmp / "mnt"
    fuse_dir.mkdir()
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(size_mib << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
    here = str(Path(__file__).parent)
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(fuse_dir), str(image), here],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    control = BadBlocks(server)
    try:
        assert server.stdout is not None
        line = server.stdout.readline().strip()
        if line != "ready":
            pytest.skip(f"FUSE mount not possible here: {line or server.wait()}")
        try:
            attach = _run("losetup", "--find", "--show", str(fuse_dir / "disk.img"))
            if attach.returncode != 0:
                pytest.skip(f"no loop device over a FUSE file here: {attach.stderr.strip()}")
            device = attach.stdout.strip()
            try:
                done = _run("mount", device, str(mount))
                if done.returncode != 0:
                    pytest.skip(f"mounting the loop device is not possible here: {done.stderr.strip()}")
                try:
                    yield mount, control
                finally:
                    control.good()
                    _unmount(mount)
            finally:
                _run("losetup", "-d", device)
        finally:
            _unmount(fuse_dir)
    finally:
        for stream in (server.stdin, server.stdout):
            if stream is not None:
                stream.close()
        try:
            server.wait(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


_FS_IOC_FIEMAP = 0xC020660B
_FIEMAP = struct.Struct("<QQIIII")  # fm_start, fm_length, fm_flags, fm_mapped_extents, fm_extent_count, reserved
_EXTENT = struct.Struct("<QQQQQIIII")  # logical, physical, length, reserved64 x2, flags, reserved x3


def device_ranges(path: str, start: int, end: int) -> list[tuple[int, int]]:
    """The device's bytes holding the file's bytes [start, end), one range per extent they span (a
    page file written while others are can be split: the H200 host's run of 16 test processes did)."""
    count = 32
    buf = bytearray(_FIEMAP.pack(0, 1 << 62, 1, 0, count, 0) + bytes(_EXTENT.size * count))
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, _FS_IOC_FIEMAP, buf)
    finally:
        os.close(fd)
    out, covered = [], 0
    for i in range(_FIEMAP.unpack_from(buf)[3]):
        logical, physical, length, *_ = _EXTENT.unpack_from(buf, _FIEMAP.size + i * _EXTENT.size)
        a, b = max(start, logical), min(end, logical + length)
        if a < b:
            out.append((physical + a - logical, physical + b - logical))
            covered += b - a
    if covered != end - start:
        raise AssertionError(f"{path}: [{start}, {end}) is not all mapped ({covered} bytes)")
    return out


_FIFREEZE, _FITHAW = 0xC0045877, 0xC0045878  # _IOWR('X', 119 and 120, int)


def _held_open(path: Path) -> list[str]:
    """Descriptors of any process naming ``path`` or a file under it (a file held open pins its
    dentry: a lookup of it never reads the directory's block)."""
    held = []
    for link in Path("/proc").glob("[0-9]*/fd/*"):
        with contextlib.suppress(OSError):
            if os.readlink(link).startswith(str(path)):
                held.append(str(link))
    return held


def drop_caches_until(path: Path, uncached: Callable[[], bool]) -> str | None:
    """Caches dropped until ``uncached()``: the next access to ``path`` reads the device (the bad
    blocks set there meet it). Each round writes back and checkpoints the journal of ``path``'s file
    system (a freeze and a thaw: ``drop_caches`` cannot drop a metadata block the journal still
    holds, and the checkpoint lags on a busy host), then drops clean pages, dentries and inodes.
    No ``sync()``: it writes back every file system of the host, and waits as long as another
    test's held one does. Rounds until ``uncached()`` or past BOUND_S; returns None, or why it is
    still cached."""
    deadline = time.monotonic() + BOUND_S
    rounds = 0
    while True:
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, _FIFREEZE, 0)  # writes back, then ext4 commits and checkpoints the whole journal
            fcntl.ioctl(fd, _FITHAW, 0)
        finally:
            os.close(fd)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        rounds += 1
        if uncached():
            return None
        if time.monotonic() > deadline:
            return f"{rounds} rounds of checkpoint and drop in {BOUND_S:.0f} s; held open: {_held_open(path)}"


async def _empty_entries(io: UringPageIO) -> list[int]:
    # CLOSE of an empty fixed-file entry answers EBADF; 0 would mean a file was left in it.
    out = []
    for slot in range(DEPTH):
        async with asyncio.timeout(5):
            out += await io.engine.chain([Op(OP_CLOSE, 0, file_index=slot + 1)], None)
    return out


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _left_open(before: set[str], mount: Path) -> dict[str, str]:
    """Descriptors opened since ``before`` that are the tier's kind: a file under ``mount``, a ring
    or an eventfd (what else the process opened meanwhile, a library's, is not the tier's)."""
    out = {}
    for fd in _open_fds() - before:
        with contextlib.suppress(OSError):  # (the listing's own descriptor, closed by now)
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(mount)) or "io_uring" in target or "eventfd" in target:
                out[fd] = target
    return out


def _page_files(directory: Path) -> dict[str, str]:
    return {p.name: str(p) for p in directory.rglob("*") if p.is_file()}


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
@pytest.mark.parametrize("cold", [True, False], ids=["cold", "warm"])
@pytest.mark.parametrize("batch", [True, False], ids=["read_many", "read"])
@pytest.mark.parametrize("cancel_after", [None, 2, 6], ids=lambda n: f"cancel_{n}")
async def test_eio_reads_are_counted_misses_that_keep_the_file(tmp_path: Path, backend: DiskBackend, cold: bool,
                                                               batch: bool, cancel_after: int | None,
                                                               layout: KVLayout, pool: PagePool) -> None:
    if cold and backend is DiskBackend.THREADS:
        pytest.skip("the threads backend has no chain")
    with bad_block_ext4(tmp_path, 16) as (mount, blocks):
        fds = _open_fds()
        tier = DiskTier(config(mount / "disk", backend, queue_depth=DEPTH, min_free_bytes=0), layout, pool)
        await tier.start()
        try:
            io = tier.backend
            await tier.wait_registered()
            if cold:
                assert isinstance(io, UringPageIO) and io.chain_reads
                io._cached.available = False
            whole = HEADER_BYTES + layout.page_bytes
            # Where the EIO lands: the header, the page's first or last block, all of it; page 4 reads well.
            where = [(0, HEADER_BYTES), (HEADER_BYTES, HEADER_BYTES + 4096), (whole - 4096, whole), (0, whole), None]
            written = [await stored_page(tier, pool, i) for i in range(len(where))]
            files = _page_files(Path(tier.config.directory))
            for i, span in enumerate(where):
                if span is not None:
                    for a, b in device_ranges(files[key_of(i).hex()], *span):
                        blocks.bad("read", a, b)
            before = tier.statistics()
            keys = [key_of(i) for i in range(len(where))]
            handles = [reserve(pool, k) for k in keys]

            async def each() -> list[bool]:
                return [await tier.read(k, h) for k, h in zip(keys, handles, strict=True)]

            reads = asyncio.ensure_future(tier.read_many(keys, handles) if batch else each())
            if cancel_after is not None:
                for _ in range(cancel_after):
                    await asyncio.sleep(0)
                reads.cancel()
            try:
                async with asyncio.timeout(BOUND_S):
                    got = await reads
            except asyncio.CancelledError:
                assert cancel_after is not None
                got = None
            if got is not None:
                assert got == [False] * (len(where) - 1) + [True]
                assert torch.equal(payload(pool, handles[-1]), written[-1])
                after = tier.statistics()
                assert after.errors[ErrorKind.EIO] == before.errors[ErrorKind.EIO] + len(where) - 1, after.errors
                assert after.corrupt == before.corrupt
            for h in handles:
                pool.table.abort(h)
            async with asyncio.timeout(BOUND_S):
                await tier._until_idle()
            assert tier.statistics().in_flight == 0
            if isinstance(io, UringPageIO):
                assert await _empty_entries(io) == [-errno.EBADF] * DEPTH
            # The blocks read again: every file is still there and serves its page exactly.
            blocks.good()
            for i in range(len(where)):
                assert tier.contains(key_of(i)), i
                into = reserve(pool, key_of(i))
                async with asyncio.timeout(BOUND_S):
                    assert await tier.read(key_of(i), into), i
                assert torch.equal(payload(pool, into), written[i]), i
                pool.table.abort(into)
        finally:
            async with asyncio.timeout(BOUND_S):
                await tier.aclose()
        if isinstance(io, UringPageIO):
            assert io.engine.in_flight == 0
        assert _left_open(fds, mount) == {}  # no page file, ring or eventfd of the tier left open
        assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
@pytest.mark.parametrize("where", ["page", "header", "all"])
async def test_eio_overwrites_of_recycled_files_serve_nothing_torn(tmp_path: Path, backend: DiskBackend, where: str,
                                                                   layout: KVLayout, pool: PagePool) -> None:
    whole = HEADER_BYTES + layout.page_bytes
    span = {"page": (HEADER_BYTES, whole), "header": (0, HEADER_BYTES), "all": (0, whole)}[where]
    n = 4
    with bad_block_ext4(tmp_path, 16) as (mount, blocks):
        fds = _open_fds()
        tier = DiskTier(config(mount / "disk", backend, capacity=n * whole, queue_depth=DEPTH, min_free_bytes=0),
                        layout, pool)
        await tier.start()
        try:
            io = tier.backend
            await tier.wait_registered()
            old = [await stored_page(tier, pool, i) for i in range(n)]
            files = _page_files(Path(tier.config.directory))
            for i in range(n):
                for a, b in device_ranges(files[key_of(i).hex()], *span):
                    blocks.bad("write", a, b)
            before = tier.statistics()
            handles = [fill(pool, key_of(100 + j), 100 + j) for j in range(n)]
            new = [payload(pool, h) for h in handles]
            async with asyncio.timeout(BOUND_S):
                got = await asyncio.gather(*(tier.write(key_of(100 + j), h) for j, h in enumerate(handles)))
            # Each write recycles a victim, whose overwrite meets the bad blocks, unless an earlier
            # write's failure already took its victim out of the index: then there is room and the
            # write makes a new file on good blocks (the threads backend on a loaded machine ends a
            # write before the last one claims: [False, False, False, True] once). The first claim
            # always recycles. What is served is checked below either way.
            assert got.count(False) >= 1, got
            for h in handles:
                pool.table.release(h)
            pool.table.evict(pool.num_pages)
            after = tier.statistics()
            assert after.errors[ErrorKind.EIO] > before.errors[ErrorKind.EIO], after.errors
            assert temp_files(mount / "disk") == []
            if isinstance(io, UringPageIO):
                assert await _empty_entries(io) == [-errno.EBADF] * DEPTH
            blocks.good()
            # Whatever is indexed serves its own page exactly; nothing torn is served.
            for j in range(n):
                for key, want in ((key_of(100 + j), new[j]), (key_of(j), old[j])):
                    if not tier.contains(key):
                        continue
                    into = reserve(pool, key)
                    async with asyncio.timeout(BOUND_S):
                        ok = await tier.read(key, into)
                    assert not ok or torch.equal(payload(pool, into), want), key
                    pool.table.abort(into)
        finally:
            async with asyncio.timeout(BOUND_S):
                await tier.aclose()
        if isinstance(io, UringPageIO):
            assert io.engine.in_flight == 0
        assert _left_open(fds, mount) == {}  # no page file, ring or eventfd of the tier left open
        assert_clean(pool)
