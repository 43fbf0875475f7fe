"""Real file systems for fault tests: a small ext4 on a loop device, and a FUSE directory whose
listing fails with EIO. Each skips the test (with the reason) only where it cannot be set up:
not root, tools missing, no loop device or /dev/fuse. Mounts and loop devices are released even
when the test fails."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


def _need_root(what: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"{what} needs root")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=False)


def _unmount(path: Path) -> None:
    if _run("umount", str(path)).returncode != 0:
        _run("umount", "-l", str(path))  # still busy: detach now, freed when the last user goes


@contextlib.contextmanager
def loop_ext4(tmp: Path, size_mib: int, inodes: int | None = None, inode_bytes: int | None = None,
              reserved_percent: int | None = None) -> Iterator[Path]:
    """A fresh ext4 of ``size_mib`` MiB (``inodes``: ``mkfs -N``; ``inode_bytes``: ``mkfs -I``, 128
    leaves no room for the extra timestamp fields: every change time a whole second;
    ``reserved_percent``: ``mkfs -m``, 0 where root, as the tests run, must see ENOSPC exactly where
    ``statvfs``' available bytes end) mounted on a loop device."""
    _need_root("mounting a loop device")
    for tool in ("mkfs.ext4", "losetup", "mount", "umount"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    image, mount = tmp / "ext4.img", tmp / "mnt"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(size_mib << 20)
    mkfs = ["mkfs.ext4", "-q", "-F", *(["-N", str(inodes)] if inodes else []),
            *(["-I", str(inode_bytes)] if inode_bytes else []),
            *(["-m", str(reserved_percent)] if reserved_percent is not None else []), str(image)]
    subprocess.run(mkfs, check=True, capture_output=True)
    attach = _run("losetup", "--find", "--show", str(image))
    if attach.returncode != 0:
        pytest.skip(f"no loop device here: {attach.stderr.strip()}")
    device = attach.stdout.strip()
    try:
        done = _run("mount", device, str(mount))
        if done.returncode != 0:
            pytest.skip(f"mounting a loop device is not possible here: {done.stderr.strip()}")
        try:
            yield mount
        finally:
            _unmount(mount)
    finally:
        _run("losetup", "-d", device)


EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
EXT4_GOING_FLAGS_NOLOGFLUSH = 0x2


def shut_down_ext4(mount: Path) -> None:
    """Every later operation on the ext4 at ``mount`` fails with EIO (what a dying disk looks like;
    no device mapper needed). Skips the test where the kernel refuses it."""
    fd = os.open(mount, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
    except OSError as exc:
        if exc.errno in (errno.ENOTTY, errno.EOPNOTSUPP, errno.EPERM):
            pytest.skip(f"ext4 shutdown not possible here: {exc}")
        raise
    finally:
        os.close(fd)


def remount(mount: Path, mode: str) -> None:
    """``mount -o remount,<mode>`` (``ro`` / ``rw``)."""
    done = _run("mount", "-o", f"remount,{mode}", str(mount))
    assert done.returncode == 0, done.stderr


def freeze(mount: Path) -> None:
    """``fsfreeze -f``: writes to the file system block in the kernel until :func:`thaw`."""
    subprocess.run(["fsfreeze", "-f", str(mount)], check=True, capture_output=True)


def thaw(mount: Path) -> None:
    """``fsfreeze -u`` (no error if it is not frozen: a test's clean-up may thaw twice)."""
    subprocess.run(["fsfreeze", "-u", str(mount)], check=False, capture_output=True)


def fill_up(path: Path, leave: int) -> None:
    """Fill the file system holding ``path`` with one file until ENOSPC, then give back ``leave``
    bytes: what another program filling the disk does."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        chunk = bytes(1 << 16)
        size = 0
        while True:
            try:
                got = os.write(fd, chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
            size += got
        os.ftruncate(fd, max(0, size - leave))
        os.fsync(fd)
    finally:
        os.close(fd)


def use_up_inodes(directory: Path) -> int:
    """Create empty files in ``directory`` until the file system has no inode left; how many."""
    made = 0
    while True:
        try:
            os.close(os.open(directory / f"inode-{made}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            return made
        made += 1


@contextlib.contextmanager
def eio_directory(target: Path) -> Iterator[None]:
    """Mount over the directory ``target`` a FUSE file system (``fuse_eio.py``, speaking the kernel
    protocol itself: no libfuse needed) whose listing fails with a real EIO from ``getdents``."""
    _need_root("mounting a FUSE file system")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse here")
    server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("fuse_eio.py")), str(target)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline().strip()  # "ready" once mounted (or why not)
        if line != "ready":
            pytest.skip(f"FUSE mount not possible here: {line or server.wait()}")
        try:
            yield
        finally:
            _unmount(target)
    finally:
        if server.stdout is not None:
            server.stdout.close()
        try:
            server.wait(timeout=30)  # it exits once unmounted
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@contextlib.contextmanager
def bind_mount(source: Path, target: Path) -> Iterator[None]:
    """``mount --bind source target`` (``target``: an existing directory), unmounted on exit: a
    directory of another file system in place of one of the cache's, which can be frozen alone."""
    _need_root("a bind mount")
    done = _run("mount", "--bind", str(source), str(target))
    if done.returncode != 0:
        pytest.skip(f"a bind mount is not possible here: {done.stderr.strip()}")
    try:
        yield
    finally:
        _unmount(target)
