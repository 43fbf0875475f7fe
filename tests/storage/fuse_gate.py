"""A FUSE file system of one regular file, ``disk.img``, backed by a real file, whose reads and
writes can be held (tests put a loop device and an ext4 on it, so page-file I/O hangs in the kernel
for real, reads included: ``fsfreeze`` holds writes only).

It speaks the kernel's FUSE protocol over ``/dev/fuse`` itself (``include/uapi/linux/fuse.h``), as
``fuse_eio.py`` does: no libfuse. Run as root: ``python fuse_gate.py MOUNTPOINT BACKING``; it mounts
with ``mount(2)``, prints ``ready`` (or why not) and serves until the mount point is unmounted.
The file is opened ``FOPEN_DIRECT_IO``: every read and write reaches this process, none is served
from the page cache. Commands on stdin, one a line, each answered on stdout: ``hold`` (READ and
WRITE requests from now on wait unanswered; ``held``), ``release`` (answer the waiting ones, in
order, and hold no more; ``released``), ``count`` (how many wait now), ``fail`` (READ requests from
now on fail with EIO, as a disk's bad sectors; ``failing``), ``heal`` (answer them again; ``healed``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import select
import struct
import sys

_IN = struct.Struct("<IIQQIIIHH")  # fuse_in_header: len, opcode, unique, nodeid, uid, gid, pid, extlen, pad
_OUT = struct.Struct("<IiQ")  # fuse_out_header: len, error (negative errno), unique
# fuse_attr: ino, size, blocks, atime, mtime, ctime, [am c]timensec, mode, nlink, uid, gid, rdev, blksize, flags.
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
_ATTR_OUT = struct.Struct("<QII")  # attr_valid, attr_valid_nsec, dummy; then fuse_attr
_ENTRY_OUT = struct.Struct("<QQQQII")  # nodeid, generation, entry_valid, attr_valid, their nsecs; then fuse_attr
# fuse_init_out (64 bytes): major, minor, max_readahead, flags, max_background, congestion_threshold,
# max_write, time_gran, max_pages, map_alignment, flags2, max_stack_depth, then padding.
_INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")
_OPEN_OUT = struct.Struct("<QIi")  # fh, open_flags, backing_id
_RW_IN = struct.Struct("<QQII")  # fuse_read_in / fuse_write_in: fh, offset, size, flags (the rest unused)
_WRITE_IN_BYTES = 40
_WRITE_OUT = struct.Struct("<II")  # size, padding
_STATFS_OUT = struct.Struct("<QQQQQIIII24x")  # blocks, bfree, bavail, files, ffree, bsize, namelen, frsize, pad

(LOOKUP, FORGET, GETATTR, SETATTR, OPEN, READ, WRITE, STATFS, RELEASE, FSYNC, FLUSH, INIT, OPENDIR, READDIR,
 RELEASEDIR, ACCESS, INTERRUPT, DESTROY, BATCH_FORGET) = (1, 2, 3, 4, 14, 15, 16, 17, 18, 20, 25, 26, 27, 28, 29,
                                                          34, 36, 38, 42)
_NO_REPLY = {FORGET, BATCH_FORGET, INTERRUPT}
_MS_NOSUID, _MS_NODEV = 0x2, 0x4
_FUSE_BIG_WRITES, _FUSE_MAX_PAGES = 1 << 5, 1 << 22
_FOPEN_DIRECT_IO = 1 << 0
_MAX_WRITE = 1 << 20
_FILE_NODE = 2
_NAME = b"disk.img"


class Gate:
    """The file system's state: the backing file and the requests held."""

    def __init__(self, fuse_fd: int, backing: str) -> None:
        self.fd = fuse_fd
        self.backing = os.open(backing, os.O_RDWR)
        self.size = os.fstat(self.backing).st_size
        self.holding = False
        self.failing = False
        self.held: list[bytes] = []

    def attr(self, node: int) -> bytes:
        if node == _FILE_NODE:
            return _ATTR.pack(node, self.size, (self.size + 511) // 512, 0, 0, 0, 0, 0, 0, 0o100600, 1,
                              os.geteuid(), os.getegid(), 0, 4096, 0)
        return _ATTR.pack(1, 0, 0, 0, 0, 0, 0, 0, 0, 0o040700, 2, os.geteuid(), os.getegid(), 0, 4096, 0)

    def answer(self, data: bytes) -> tuple[int, bytes]:
        _len, opcode, _unique, node, *_rest = _IN.unpack_from(data)
        body = _IN.size
        if opcode == INIT:
            _major, minor = struct.unpack_from("<II", data, body)
            return 0, _INIT_OUT.pack(7, min(minor, 31), 0, _FUSE_BIG_WRITES | _FUSE_MAX_PAGES, 1, 1, _MAX_WRITE, 1,
                                     _MAX_WRITE // 4096, 0, 0, 0)
        if opcode == LOOKUP:
            if node == 1 and data[body:].rstrip(b"\0") == _NAME:
                return 0, _ENTRY_OUT.pack(_FILE_NODE, 1, 3600, 3600, 0, 0) + self.attr(_FILE_NODE)
            return -errno.ENOENT, b""
        if opcode in (GETATTR, SETATTR):
            return 0, _ATTR_OUT.pack(3600, 0, 0) + self.attr(node)
        if opcode == OPEN:
            return 0, _OPEN_OUT.pack(1, _FOPEN_DIRECT_IO, 0)
        if opcode == OPENDIR:
            return 0, _OPEN_OUT.pack(1, 0, 0)
        if opcode == READ:
            if self.failing:
                return -errno.EIO, b""  # a bad sector: the loop device's read fails
            _fh, offset, size, _flags = _RW_IN.unpack_from(data, body)
            return 0, os.pread(self.backing, size, offset)
        if opcode == WRITE:
            _fh, offset, size, _flags = _RW_IN.unpack_from(data, body)
            start = body + _WRITE_IN_BYTES
            return 0, _WRITE_OUT.pack(os.pwrite(self.backing, data[start : start + size], offset), 0)
        if opcode == READDIR:
            return 0, b""  # an empty listing: the file is looked up by name
        if opcode in (RELEASE, RELEASEDIR, FLUSH, FSYNC, ACCESS, DESTROY):
            return 0, b""
        if opcode == STATFS:
            return 0, _STATFS_OUT.pack(0, 0, 0, 0, 0, 4096, 255, 4096, 0)
        return -errno.ENOSYS, b""

    def reply(self, data: bytes) -> None:
        _len, _opcode, unique, *_rest = _IN.unpack_from(data)
        error, body = self.answer(data)
        try:
            os.write(self.fd, _OUT.pack(_OUT.size + len(body), error, unique) + body)
        except OSError as exc:
            if exc.errno != errno.ENOENT:  # ENOENT: the request was interrupted meanwhile
                raise

    def request(self, data: bytes) -> None:
        opcode = _IN.unpack_from(data)[1]
        if opcode in _NO_REPLY:
            return
        if self.holding and opcode in (READ, WRITE):
            self.held.append(data)
            return
        self.reply(data)

    def command(self, line: str) -> str:
        if line == "hold":
            self.holding = True
            return "held"
        if line == "release":
            self.holding = False
            held, self.held = self.held, []
            for data in held:
                self.reply(data)
            return "released"
        if line == "count":
            return str(len(self.held))
        if line == "fail":
            self.failing = True
            return "failing"
        if line == "heal":
            self.failing = False
            return "healed"
        return f"unknown command {line!r}"


def serve(gate: Gate) -> None:
    """Answer requests and commands until the file system is unmounted (read fails with ENODEV)."""
    control = sys.stdin.fileno()
    pending = b""
    while True:
        ready, _, _ = select.select([gate.fd] + ([control] if control >= 0 else []), [], [])
        if control in ready:
            got = os.read(control, 4096)
            if not got:
                control = -1  # the test went away: hold nothing more, serve until unmounted
                gate.command("release")
            pending += got
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                print(gate.command(line.decode().strip()), flush=True)
        if gate.fd not in ready:
            continue
        try:
            data = os.read(gate.fd, _MAX_WRITE + 4096)
        except OSError as exc:
            if exc.errno == errno.ENODEV:
                return
            if exc.errno in (errno.EINTR, errno.ENOENT, errno.EAGAIN):
                continue
            raise
        gate.request(data)


def main(target: str, backing: str) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    options = f"fd={fd},rootmode=40000,user_id={os.geteuid()},group_id={os.getegid()}".encode()
    if libc.mount(b"aiokv-gate", target.encode(), b"fuse", ctypes.c_ulong(_MS_NOSUID | _MS_NODEV), options) != 0:
        print(f"mount(2) of FUSE failed: {os.strerror(ctypes.get_errno())}", flush=True)
        sys.exit(1)
    print("ready", flush=True)
    serve(Gate(fd, backing))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
