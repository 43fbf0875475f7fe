"""A FUSE file system of one empty directory whose listing fails with EIO (tests inject a REAL
EIO into the disk tier's start-up scan with it).

It speaks the kernel's FUSE protocol over ``/dev/fuse`` itself (``include/uapi/linux/fuse.h``):
no libfuse, nothing to install. Run as root: ``python fuse_eio.py MOUNTPOINT``; it mounts with
``mount(2)``, prints ``ready`` (or why not) and serves until the mount point is unmounted.
Answers: the root directory's attributes (mode 0700, owned by the caller), opendir, and EIO for
every READDIR; LOOKUP finds nothing; anything else is ENOSYS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
import sys

_IN = struct.Struct("<IIQQIIIHH")  # fuse_in_header: len, opcode, unique, nodeid, uid, gid, pid, extlen, pad
_OUT = struct.Struct("<IiQ")  # fuse_out_header: len, error (negative errno), unique
# fuse_attr_out: attr_valid, attr_valid_nsec, dummy, then fuse_attr: ino, size, blocks, atime, mtime,
# ctime, [am c]timensec, mode, nlink, uid, gid, rdev, blksize, flags.
_ATTR_OUT = struct.Struct("<QII" "QQQQQQ" "IIIIIIIIII")
# fuse_init_out (64 bytes): major, minor, max_readahead, flags, max_background, congestion_threshold,
# max_write, time_gran, max_pages, map_alignment, flags2, max_stack_depth, then padding.
_INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")
_OPEN_OUT = struct.Struct("<QIi")  # fh, open_flags, backing_id
_STATFS_OUT = struct.Struct("<QQQQQIIII24x")  # blocks, bfree, bavail, files, ffree, bsize, namelen, frsize, pad

LOOKUP, FORGET, GETATTR, STATFS, INIT, OPENDIR, READDIR, RELEASEDIR, ACCESS, INTERRUPT, DESTROY, BATCH_FORGET = (
    1, 2, 3, 17, 26, 27, 28, 29, 34, 36, 38, 42)
_NO_REPLY = {FORGET, BATCH_FORGET, INTERRUPT}
_MS_NOSUID, _MS_NODEV = 0x2, 0x4


def _answer(opcode: int, data: bytes) -> tuple[int, bytes]:
    if opcode == INIT:
        _major, minor = struct.unpack_from("<II", data, _IN.size)
        return 0, _INIT_OUT.pack(7, min(minor, 31), 0, 0, 1, 1, 4096, 1, 1, 0, 0, 0)
    if opcode == GETATTR:
        return 0, _ATTR_OUT.pack(1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0o040700, 2, os.geteuid(), os.getegid(),
                                 0, 4096, 0)
    if opcode == OPENDIR:
        return 0, _OPEN_OUT.pack(1, 0, 0)
    if opcode == READDIR:
        return -errno.EIO, b""
    if opcode in (RELEASEDIR, ACCESS, DESTROY):
        return 0, b""
    if opcode == STATFS:
        return 0, _STATFS_OUT.pack(0, 0, 0, 0, 0, 4096, 255, 4096, 0)
    if opcode == LOOKUP:
        return -errno.ENOENT, b""
    return -errno.ENOSYS, b""


def serve(fd: int) -> None:
    """Answer requests until the file system is unmounted (read fails with ENODEV)."""
    while True:
        try:
            data = os.read(fd, (1 << 20) + 4096)
        except OSError as exc:
            if exc.errno == errno.ENODEV:
                return
            if exc.errno in (errno.EINTR, errno.ENOENT):  # ENOENT: a request interrupted meanwhile
                continue
            raise
        _len, opcode, unique, *_rest = _IN.unpack_from(data)
        if opcode in _NO_REPLY:
            continue
        error, body = _answer(opcode, data)
        os.write(fd, _OUT.pack(_OUT.size + len(body), error, unique) + body)


def main(target: str) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    options = f"fd={fd},rootmode=40000,user_id={os.geteuid()},group_id={os.getegid()}".encode()
    if libc.mount(b"aiokv-eio", target.encode(), b"fuse", ctypes.c_ulong(_MS_NOSUID | _MS_NODEV), options) != 0:
        print(f"mount(2) of FUSE failed: {os.strerror(ctypes.get_errno())}", flush=True)
        sys.exit(1)
    print("ready", flush=True)
    serve(fd)


if __name__ == "__main__":
    main(sys.argv[1])
