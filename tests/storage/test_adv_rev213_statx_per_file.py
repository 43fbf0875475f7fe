"""Review 213: a ``statx`` completion of the looks' io_uring (:mod:`storage.statxring`) that
answered EPERM or EINVAL closed the ring for good (``StatxRefused``): one file of a file system
that answers so for it (a FUSE file system; an LSM) sent every later look back to one ``fstat`` a
descriptor. Such an errno is now that file's outcome (its ``OSError``, as ``os.stat`` gives it),
but on a ring that never gave a result where the plain call gives one (the op itself refused: an
old kernel's EINVAL for every completion).

Real fault: a FUSE file system (this file, run as ``python test_adv_rev213_statx_per_file.py
MOUNTPOINT``, speaking the kernel protocol through ``fuse_eio``'s code) whose root holds ``good``
(a regular file) and answers EPERM for ``eperm`` and EINVAL for ``einval``. Root only."""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

GOOD_NODE = 2
_ENTRY = struct.Struct("<QQQQII")  # fuse_entry_out before its attr: nodeid, generation, entry/attr valid (s, ns)
_LOOKUP = 1
_GETATTR = 3


def _attr(node: int) -> bytes:
    """fuse_attr_out of the root (a 0700 directory) or of ``good`` (a 0600 file of 4096 bytes)."""
    import fuse_eio

    mode, nlink, size = (0o040700, 2, 0) if node == 1 else (0o100600, 1, 4096)
    return fuse_eio._ATTR_OUT.pack(0, 0, 0, node, size, 0, 0, 0, 0, 0, 0, 0, mode, nlink, os.geteuid(),
                                   os.getegid(), 0, 4096, 0)


def _answer(opcode: int, data: bytes) -> tuple[int, bytes]:
    import fuse_eio

    if opcode == _LOOKUP:
        name = data[fuse_eio._IN.size:].split(b"\0", 1)[0]
        if name == b"good":
            return 0, _ENTRY.pack(GOOD_NODE, 0, 0, 0, 0, 0) + _attr(GOOD_NODE)[16:]
        if name == b"eperm":
            return -errno.EPERM, b""
        if name == b"einval":
            return -errno.EINVAL, b""
        return -errno.ENOENT, b""
    if opcode == _GETATTR:
        node = fuse_eio._IN.unpack_from(data)[3]
        return 0, _attr(GOOD_NODE if node == GOOD_NODE else 1)
    return _ORIGINAL[0](opcode, data)


_ORIGINAL: list[Callable[[int, bytes], tuple[int, bytes]]] = []
"""fuse_eio's own answers, for every other request (set where this file serves)."""


@contextlib.contextmanager
def _fuse(target: Path) -> Iterator[None]:
    if os.geteuid() != 0:
        pytest.skip("mounting a FUSE file system needs root")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse here")
    target.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    server = subprocess.Popen([sys.executable, __file__, str(target)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert server.stdout is not None
        line = server.stdout.readline().strip()
        if line != "ready":
            pytest.skip(f"FUSE mount not possible here: {line or server.wait()}")
        try:
            yield
        finally:
            if subprocess.run(["umount", str(target)], check=False).returncode != 0:
                subprocess.run(["umount", "-l", str(target)], check=False)
    finally:
        if server.stdout is not None:
            server.stdout.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _ring() -> object:
    from aiokv.storage.statxring import StatxRefused, open_ring

    try:
        return open_ring(8)
    except StatxRefused as exc:
        pytest.skip(f"io_uring statx is refused here: {exc}")


@pytest.mark.root
@pytest.mark.parametrize("bad", ["eperm", "einval"])
def test_a_file_answering_eperm_or_einval_does_not_close_the_statx_ring(tmp_path: Path, bad: str) -> None:
    want = errno.EPERM if bad == "eperm" else errno.EINVAL
    mount = tmp_path / "fuse"
    with _fuse(mount):
        fd = os.open(mount, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with pytest.raises(OSError, match=os.strerror(want)) as plain:
                os.stat(bad, dir_fd=fd, follow_symlinks=False)
            assert plain.value.errno == want, "the fault is not the one injected"
            assert os.stat("good", dir_fd=fd, follow_symlinks=False).st_size == 4096
            # First batch of a fresh ring, the bad file alone: nothing yet shows the op works.
            ring = _ring()
            got = ring.stat_names(fd, [bad])  # type: ignore[attr-defined]
            assert isinstance(got[0], OSError) and got[0].errno == want, got
            assert not ring.closed, "one file's errno closed the ring"  # type: ignore[attr-defined]
            # Beside a good file, and on a ring that worked.
            got = ring.stat_names(fd, ["good", bad, "good"])  # type: ignore[attr-defined]
            assert [isinstance(x, OSError) for x in got] == [False, True, False], got
            assert got[0].st_size == 4096 and got[1].errno == want  # type: ignore[union-attr]
            got = ring.stat_names(fd, [bad])  # type: ignore[attr-defined]
            assert isinstance(got[0], OSError) and got[0].errno == want
            assert not ring.closed and ring.batches == 3  # type: ignore[attr-defined]
            ring.close()  # type: ignore[attr-defined]
        finally:
            os.close(fd)


if __name__ == "__main__":
    import fuse_eio

    _ORIGINAL.append(fuse_eio._answer)
    fuse_eio._answer = _answer  # its serve() answers through this module's
    fuse_eio.main(sys.argv[1])
