"""An ext4 whose directory blocks can be held or made to fail for real, for tests of the disk
tier's listings of fan-out directories: a loop device over a file of a FUSE file system
(``fuse_gate.py``'s) that holds, or answers EIO to, READ requests touching chosen byte ranges of
the device (the blocks of one directory, found with FIEMAP).

The ext4 has no directory index (``mkfs -O ^dir_index``): a directory is listed in the order of
its blocks, so a hold (or a bad block) in its middle stops ``getdents`` there, with the entries
of the blocks before it listed. Read-ahead is off on the loop device (each directory block is its
own READ request: a hold catches that block only) and :meth:`ListingFs.cold` drops the device's
cached blocks, so the next listing reads them through the FUSE file system. Root only; skips the
test (with the reason) where it cannot be set up.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from gate_helpers import BOUND_S, GateControl

BLOCK = 4096

# fuse_gate's file system with commands "hold START END" (READ requests touching the device's bytes
# [START, END) wait unanswered), "free START END" (that hold ended, its held requests answered),
# "bad START END" (answered EIO), "good" (no bad range any more), "release" (every held request
# answered, no hold any more) and "count" (how many wait).
_SERVER = r"""
import errno, os, sys
sys.path.insert(0, sys.argv[3])
import fuse_gate as g

class Ranges(g.Gate):
    def __init__(self, fd, backing):
        super().__init__(fd, backing)
        self.holds, self.bads = [], []

    @staticmethod
    def touches(data, ranges):
        _fh, offset, size, _flags = g._RW_IN.unpack_from(data, g._IN.size)
        return any(offset < end and start < offset + size for start, end in ranges)

    def command(self, line):
        words = line.split()
        if words[:1] == ["hold"]:
            self.holds.append((int(words[1]), int(words[2])))
            return "ok"
        if words[:1] == ["bad"]:
            self.bads.append((int(words[1]), int(words[2])))
            return "ok"
        if words == ["good"]:
            self.bads.clear()
            return "ok"
        if words[:1] == ["free"]:
            span = (int(words[1]), int(words[2]))
            self.holds.remove(span)
            keep = []
            for data in self.held:
                if self.touches(data, [span]) and not self.touches(data, self.holds):
                    self.reply(data)
                else:
                    keep.append(data)
            self.held = keep
            return "ok"
        if words == ["release"]:
            self.holds.clear()
        return super().command(line)

    def request(self, data):
        if g._IN.unpack_from(data)[1] == g.READ and self.touches(data, self.holds):
            self.held.append(data)
            return
        super().request(data)

    def answer(self, data):
        if g._IN.unpack_from(data)[1] == g.READ and self.touches(data, self.bads):
            return -errno.EIO, b""
        return super().answer(data)

import ctypes, ctypes.util
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
options = f"fd={fd},rootmode=40000,user_id={os.geteuid()},group_id={os.getegid()}".encode()
if libc.mount(b"aiokv-ranges", sys.argv[1].encode(), b"fuse", ctypes.c_ulong(g._MS_NOSUID | g._MS_NODEV),
              options) != 0:
    print(f"mount(2) of FUSE failed: {os.strerror(ctypes.get_errno())}", flush=True)
    sys.exit(1)
print("ready", flush=True)
g.serve(Ranges(fd, sys.argv[2]))
"""

_BLKRASET = 0x1262
_BLKFLSBUF = 0x1261
_FS_IOC_FIEMAP = 0xC020660B
_FIEMAP = struct.Struct("<QQIIII")  # fm_start, fm_length, fm_flags, fm_mapped_extents, fm_extent_count, reserved
_EXTENT = struct.Struct("<QQQQQIIII")  # logical, physical, length, reserved64 x2, flags, reserved x3


class ListingFs(GateControl):
    """Commands to the running server, and the loop device under the mount."""

    def __init__(self, server: subprocess.Popen[str], mount: Path) -> None:
        super().__init__(server)
        self.mount = mount
        self.device = ""

    def hold_block(self, directory: Path, block: int) -> None:
        """READ requests of ``directory``'s block number ``block`` wait unanswered until :meth:`release`."""
        start = dir_block(directory, block)
        assert self._ask(f"hold {start} {start + BLOCK}") == "ok"

    def free_block(self, directory: Path, block: int) -> None:
        """End :meth:`hold_block` of ``directory``'s block ``block``: its held reads are answered."""
        start = dir_block(directory, block)
        assert self._ask(f"free {start} {start + BLOCK}") == "ok"

    def bad_block(self, directory: Path, block: int) -> None:
        """READ requests of ``directory``'s block number ``block`` fail with EIO until :meth:`good`."""
        start = dir_block(directory, block)
        assert self._ask(f"bad {start} {start + BLOCK}") == "ok"

    def good(self) -> None:
        assert self._ask("good") == "ok"

    def cold(self) -> None:
        """Drop the device's cached blocks: the next listing reads them. The journal is flushed
        first (a freeze and thaw): blocks it still holds for its checkpoint are never dropped."""
        os.sync()
        subprocess.run(["fsfreeze", "-f", str(self.mount)], check=True, capture_output=True)
        subprocess.run(["fsfreeze", "-u", str(self.mount)], check=True, capture_output=True)
        fd = os.open(self.device, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, _BLKFLSBUF)
        finally:
            os.close(fd)


def dir_block(directory: Path, block: int) -> int:
    """The device's byte offset of ``directory``'s block number ``block`` (FIEMAP)."""
    count = 32
    buf = bytearray(_FIEMAP.pack(0, 1 << 62, 1, 0, count, 0) + bytes(_EXTENT.size * count))  # FIEMAP_FLAG_SYNC
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, _FS_IOC_FIEMAP, buf)
    finally:
        os.close(fd)
    want = block * BLOCK
    for i in range(_FIEMAP.unpack_from(buf)[3]):
        logical, physical, length, *_ = _EXTENT.unpack_from(buf, _FIEMAP.size + i * _EXTENT.size)
        if logical <= want < logical + length:
            return physical + want - logical
    raise AssertionError(f"{directory} has no block {block}")


def dir_blocks(directory: Path) -> int:
    """How many blocks ``directory`` spans."""
    return os.stat(directory).st_size // BLOCK


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=False)


def _unmount(path: Path) -> None:
    if _run("umount", str(path)).returncode != 0:
        _run("umount", "-l", str(path))


@contextlib.contextmanager
def listing_ext4(tmp: Path, size_mib: int) -> Iterator[ListingFs]:
    """A fresh ext4 (no directory index) of ``size_mib`` MiB on a loop device (read-ahead off)
    over the FUSE file; mounted at ``<tmp>/mnt`` (:attr:`ListingFs.mount`)."""
    if os.geteuid() != 0:
        pytest.skip("a FUSE file system and a loop device need root")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse here")
    for tool in ("mkfs.ext4", "losetup", "mount", "umount", "fsfreeze"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    image, fuse_dir, mount = tmp / "backing.img", tmp / "fuse", tmp / "mnt"
    fuse_dir.mkdir()
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(size_mib << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-O", "^dir_index", str(image)], check=True, capture_output=True)
    here = str(Path(__file__).parent)
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(fuse_dir), str(image), here],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    control = ListingFs(server, mount)
    try:
        assert server.stdout is not None
        line = server.stdout.readline().strip()
        if line != "ready":
            pytest.skip(f"FUSE mount not possible here: {line or server.wait()}")
        try:
            attach = _run("losetup", "--find", "--show", str(fuse_dir / "disk.img"))
            if attach.returncode != 0:
                pytest.skip(f"no loop device over a FUSE file here: {attach.stderr.strip()}")
            control.device = attach.stdout.strip()
            try:
                fd = os.open(control.device, os.O_RDONLY)
                try:
                    fcntl.ioctl(fd, _BLKRASET, 0)
                finally:
                    os.close(fd)
                done = _run("mount", "-o", "errors=continue", control.device, str(mount))
                if done.returncode != 0:
                    pytest.skip(f"mounting the loop device is not possible here: {done.stderr.strip()}")
                try:
                    yield control
                finally:
                    control.good()
                    control.release()
                    _unmount(mount)
            finally:
                control.release()
                _run("losetup", "-d", control.device)
        finally:
            control.release()
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
