"""A FUSE file system in memory that emulates ``flock`` with POSIX locks, as NFS does, for tests of
the TP manager's start lock on such a file system.

It asks the kernel for ``FUSE_POSIX_LOCKS | FUSE_FLOCK_LOCKS``: every ``flock`` and ``fcntl`` lock of
its files comes here as a POSIX lock request (``SETLK``), answered as NFSv4 answers it: a write lock
on a descriptor opened without write access is refused ``EBADF`` (an exclusive ``flock`` of a file
opened ``O_RDONLY``), a read lock on one opened without read access too, a conflicting lock
``EAGAIN``. Directories, regular files and sockets (a Unix-domain ``bind`` makes one, ``MKNOD``) can
be made, looked up, listed, chmodded and removed, and regular files written and read; nothing is
cached by the kernel (every lookup and ``stat`` asks here). A file made takes the lowest inode
number free, one just freed included, as ext4 (an NFS server's, too) gives it.

It speaks the kernel's FUSE protocol over ``/dev/fuse`` itself (``include/uapi/linux/fuse.h``), as
``tests/storage/fuse_eio.py`` does: no libfuse. Run as root: ``python fuse_lockfs.py MOUNTPOINT [MOUNTPOINT ...]``;
it mounts with ``mount(2)``, prints ``ready`` (or why not) and serves until every mount point is
unmounted. Several mount points show one tree, each through a mount of its own, as two hosts see an
NFS export: a socket bound through one is a file through the others, whose connects it refuses, and
a directory's ``flock`` (the kernel's, per mount) keeps out only processes locking it through the
same mount.
Each lock request is counted: a line ``lock NODE TYPE -> ERRNO`` on stderr.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import stat
import struct
import sys
import threading
from dataclasses import dataclass, field

_IN = struct.Struct("<IIQQIIIHH")  # fuse_in_header: len, opcode, unique, nodeid, uid, gid, pid, extlen, pad
_OUT = struct.Struct("<IiQ")  # fuse_out_header: len, error (negative errno), unique
# fuse_attr: ino, size, blocks, atime, mtime, ctime, [am c]timensec, mode, nlink, uid, gid, rdev, blksize, flags.
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
_ATTR_OUT = struct.Struct("<QII")  # attr_valid, attr_valid_nsec, dummy; then fuse_attr
_ENTRY_OUT = struct.Struct("<QQQQII")  # nodeid, generation, entry_valid, attr_valid, their nsecs; then fuse_attr
# fuse_init_out (64 bytes): major, minor, max_readahead, flags, max_background, congestion_threshold,
# max_write, time_gran, max_pages, map_alignment, flags2, max_stack_depth, then padding.
_INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")
_OPEN_IN = struct.Struct("<II")  # flags, open_flags
_OPEN_OUT = struct.Struct("<QIi")  # fh, open_flags, backing_id
_MKDIR_IN = struct.Struct("<II")  # mode, umask; then the name
_MKNOD_IN = struct.Struct("<IIII")  # mode, rdev, umask, padding; then the name
_SETATTR_VALID = struct.Struct("<I")  # fuse_setattr_in.valid; its mode at byte 68
_SETATTR_MODE_AT = 68
_FATTR_MODE = 1 << 0
_LK_IN = struct.Struct("<QQQQIII")  # fh, owner, lk.start, lk.end, lk.type, lk.pid, lk_flags
_RELEASE_IN = struct.Struct("<QIIQ")  # fh, flags, release_flags, lock_owner
_READ_IN = struct.Struct("<QQI")  # fh, offset, size
_WRITE_IN = struct.Struct("<QQIIQII")  # fh, offset, size, write_flags, lock_owner, flags, padding; then the data
_WRITE_OUT = struct.Struct("<II")  # size, padding
_DIRENT = struct.Struct("<QQII")  # ino, off, namelen, type; then the name, padded to 8 bytes
_STATFS_OUT = struct.Struct("<QQQQQIIII24x")  # blocks, bfree, bavail, files, ffree, bsize, namelen, frsize, pad

(LOOKUP, FORGET, GETATTR, SETATTR, MKNOD, MKDIR, UNLINK, RMDIR, OPEN, READ, WRITE, STATFS, RELEASE, FLUSH, INIT,
 OPENDIR, READDIR, RELEASEDIR, GETLK, SETLK, SETLKW, ACCESS, INTERRUPT, DESTROY, BATCH_FORGET) = (
    1, 2, 3, 4, 8, 9, 10, 11, 14, 15, 16, 17, 18, 25, 26, 27, 28, 29, 31, 32, 33, 34, 36, 38, 42)
_NO_REPLY = {FORGET, BATCH_FORGET, INTERRUPT}
_FUSE_POSIX_LOCKS, _FUSE_FLOCK_LOCKS = 1 << 1, 1 << 10
_RELEASE_FLOCK_UNLOCK = 1 << 1
_F_RDLCK, _F_WRLCK, _F_UNLCK = 0, 1, 2
_MS_NOSUID, _MS_NODEV = 0x2, 0x4
_MNT_DETACH = 2
_MAX_WRITE = 1 << 16


@dataclass
class Node:
    mode: int
    ino: int
    children: dict[bytes, int] = field(default_factory=dict)
    locks: dict[int, int] = field(default_factory=dict)  # lock owner -> F_RDLCK or F_WRLCK (whole file)
    data: bytearray = field(default_factory=bytearray)  # a regular file's bytes


class LockFs:
    """The tree (node ids from 1, the root) and the open handles."""

    def __init__(self) -> None:
        self.nodes: dict[int, Node] = {1: Node(stat.S_IFDIR | 0o700, 1)}
        self.next_node = 2
        self.inos = {1}  # those of the files in the tree (a node id is never reused, its number is)
        self.handles: dict[int, tuple[int, int]] = {}  # fh -> (node, open flags)
        self.next_handle = 1

    def attr(self, node: int) -> bytes:
        found = self.nodes[node]
        nlink = 2 if stat.S_ISDIR(found.mode) else 1
        return _ATTR.pack(found.ino, len(found.data), 0, 0, 0, 0, 0, 0, 0, found.mode, nlink, os.geteuid(),
                          os.getegid(), 0, 4096, 0)

    def entry(self, node: int) -> bytes:
        return _ENTRY_OUT.pack(node, 1, 0, 0, 0, 0) + self.attr(node)  # valid 0 s: nothing cached

    def make(self, parent: int, name: bytes, mode: int) -> tuple[int, bytes]:
        if name in self.nodes[parent].children:
            return -errno.EEXIST, b""
        node, self.next_node = self.next_node, self.next_node + 1
        ino = min(set(range(1, len(self.inos) + 2)) - self.inos)
        self.inos.add(ino)
        self.nodes[node] = Node(mode, ino)
        self.nodes[parent].children[name] = node
        return 0, self.entry(node)

    def remove(self, parent: int, name: bytes, directory: bool) -> tuple[int, bytes]:
        node = self.nodes[parent].children.get(name)
        if node is None:
            return -errno.ENOENT, b""
        if directory != stat.S_ISDIR(self.nodes[node].mode):
            return -(errno.ENOTDIR if directory else errno.EISDIR), b""
        if directory and self.nodes[node].children:
            return -errno.ENOTEMPTY, b""
        del self.nodes[parent].children[name]
        self.inos.discard(self.nodes[node].ino)
        return 0, b""

    def open(self, node: int, flags: int) -> tuple[int, bytes]:
        handle, self.next_handle = self.next_handle, self.next_handle + 1
        self.handles[handle] = (node, flags)
        return 0, _OPEN_OUT.pack(handle, 0, 0)

    def lock(self, node: int, data: bytes) -> tuple[int, bytes]:
        handle, owner, _start, _end, kind, _pid, _flags = _LK_IN.unpack_from(data, _IN.size)
        access = self.handles.get(handle, (node, os.O_RDONLY))[1] & os.O_ACCMODE
        # NFSv4's open-mode check (nfs4_proc_lock): flock() reaches it unchecked by the VFS.
        if (kind == _F_WRLCK and access == os.O_RDONLY) or (kind == _F_RDLCK and access == os.O_WRONLY):
            return -errno.EBADF, b""
        locks = self.nodes[node].locks
        if kind == _F_UNLCK:
            locks.pop(owner, None)
            return 0, b""
        if any(other != owner and (kind == _F_WRLCK or held == _F_WRLCK) for other, held in locks.items()):
            return -errno.EAGAIN, b""
        locks[owner] = kind
        return 0, b""

    def listing(self, node: int, offset: int, size: int) -> bytes:
        out = b""
        for index, (name, child) in enumerate(list(self.nodes[node].children.items())[offset:], offset + 1):
            entry = _DIRENT.pack(child, index, len(name), stat.S_IFMT(self.nodes[child].mode) >> 12) + name
            entry += b"\0" * (-len(entry) % 8)
            if len(out) + len(entry) > size:
                break
            out += entry
        return out

    def answer(self, data: bytes) -> tuple[int, bytes]:
        _len, opcode, _unique, node, *_rest = _IN.unpack_from(data)
        body = _IN.size
        if opcode == INIT:
            _major, minor = struct.unpack_from("<II", data, body)
            flags = _FUSE_POSIX_LOCKS | _FUSE_FLOCK_LOCKS
            return 0, _INIT_OUT.pack(7, min(minor, 31), 0, flags, 1, 1, _MAX_WRITE, 1, 1, 0, 0, 0)
        if node not in self.nodes and opcode not in (DESTROY, STATFS):
            return -errno.ENOENT, b""
        if opcode == LOOKUP:
            child = self.nodes[node].children.get(data[body:].rstrip(b"\0"))
            return (0, self.entry(child)) if child is not None else (-errno.ENOENT, b"")
        if opcode == GETATTR:
            return 0, _ATTR_OUT.pack(0, 0, 0) + self.attr(node)
        if opcode == SETATTR:
            if _SETATTR_VALID.unpack_from(data, body)[0] & _FATTR_MODE:
                mode = struct.unpack_from("<I", data, body + _SETATTR_MODE_AT)[0]
                self.nodes[node].mode = stat.S_IFMT(self.nodes[node].mode) | stat.S_IMODE(mode)
            return 0, _ATTR_OUT.pack(0, 0, 0) + self.attr(node)
        if opcode == MKDIR:
            mode, _umask = _MKDIR_IN.unpack_from(data, body)
            return self.make(node, data[body + _MKDIR_IN.size:].rstrip(b"\0"), stat.S_IFDIR | stat.S_IMODE(mode))
        if opcode == MKNOD:
            mode, _rdev, _umask, _pad = _MKNOD_IN.unpack_from(data, body)
            return self.make(node, data[body + _MKNOD_IN.size:].rstrip(b"\0"), mode)
        if opcode in (UNLINK, RMDIR):
            return self.remove(node, data[body:].rstrip(b"\0"), opcode == RMDIR)
        if opcode in (OPEN, OPENDIR):
            return self.open(node, _OPEN_IN.unpack_from(data, body)[0])
        if opcode in (GETLK, SETLK, SETLKW):
            error, reply = self.lock(node, data) if opcode != GETLK else (-errno.ENOSYS, b"")
            kind = _LK_IN.unpack_from(data, body)[4]
            print(f"lock {node} {kind} -> {-error}", file=sys.stderr, flush=True)
            return error, reply
        if opcode == READDIR:
            _fh, offset, size = _READ_IN.unpack_from(data, body)
            return 0, self.listing(node, offset, size)
        if opcode == READ:
            _fh, offset, size = _READ_IN.unpack_from(data, body)
            return 0, bytes(self.nodes[node].data[offset:offset + size])
        if opcode == WRITE:
            _fh, offset, size, *_more = _WRITE_IN.unpack_from(data, body)
            content = self.nodes[node].data
            content[offset:offset + size] = data[body + _WRITE_IN.size:body + _WRITE_IN.size + size]
            return 0, _WRITE_OUT.pack(size, 0)
        if opcode in (RELEASE, RELEASEDIR):
            handle, _flags, release_flags, owner = _RELEASE_IN.unpack_from(data, body)
            self.handles.pop(handle, None)
            if release_flags & _RELEASE_FLOCK_UNLOCK:  # the last close of a file that flock()ed
                self.nodes[node].locks.pop(owner, None)
            return 0, b""
        if opcode in (FLUSH, ACCESS, DESTROY):
            return 0, b""
        if opcode == STATFS:
            return 0, _STATFS_OUT.pack(0, 0, 0, 0, 0, 4096, 255, 4096, 0)
        return -errno.ENOSYS, b""


def serve(fd: int, fs: LockFs, turns: threading.Lock) -> None:
    """Answer requests until the file system is unmounted (read fails with ENODEV); ``turns`` keeps
    the mounts' servers off the shared tree at once."""
    while True:
        try:
            data = os.read(fd, _MAX_WRITE + 4096)
        except OSError as exc:
            if exc.errno == errno.ENODEV:
                return
            if exc.errno in (errno.EINTR, errno.ENOENT):  # ENOENT: a request interrupted meanwhile
                continue
            raise
        _len, opcode, unique, *_rest = _IN.unpack_from(data)
        if opcode in _NO_REPLY:
            continue
        with turns:
            error, body = fs.answer(data)
        try:
            os.write(fd, _OUT.pack(_OUT.size + len(body), error, unique) + body)
        except OSError as exc:
            if exc.errno != errno.ENOENT:  # ENOENT: the request was interrupted meanwhile
                raise


def main(targets: list[str]) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fds = []
    for target in targets:
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        options = f"fd={fd},rootmode=40000,user_id={os.geteuid()},group_id={os.getegid()}".encode()
        if libc.mount(b"aiokv-lockfs", target.encode(), b"fuse", ctypes.c_ulong(_MS_NOSUID | _MS_NODEV), options):
            print(f"mount(2) of FUSE failed: {os.strerror(ctypes.get_errno())}", flush=True)
            for mounted in targets[:len(fds)]:
                libc.umount2(mounted.encode(), _MNT_DETACH)
            sys.exit(1)
        fds.append(fd)
    print("ready", flush=True)
    fs, turns = LockFs(), threading.Lock()
    servers = [threading.Thread(target=serve, args=(fd, fs, turns)) for fd in fds]
    for server in servers:
        server.start()
    for server in servers:
        server.join()


if __name__ == "__main__":
    main(sys.argv[1:])
