"""An ext4 whose reads and writes can be held in the kernel for real: a loop device over a file of
a FUSE file system (``fuse_gate.py``) that stops answering READ and WRITE requests on command.

``fsfreeze`` holds writes only (a frozen file system still serves reads); this holds both, at the
block device, so page-file reads and writes stay in flight until :meth:`GateControl.release`.
Skips the test (with the reason) only where it cannot be set up: not root, tools missing, no
``/dev/fuse`` or loop device. Everything is released and unmounted on exit, also when the test fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

BOUND_S = 30.0


class GateControl:
    """Commands to the running ``fuse_gate.py`` (one at a time, each answered)."""

    def __init__(self, server: subprocess.Popen[str]) -> None:
        self._server = server
        self._lock = threading.Lock()

    def _ask(self, command: str) -> str:
        assert self._server.stdin is not None and self._server.stdout is not None
        with self._lock:
            self._server.stdin.write(command + "\n")
            self._server.stdin.flush()
            return self._server.stdout.readline().strip()

    def hold(self) -> None:
        """READ and WRITE requests reaching the device from now on wait unanswered."""
        assert self._ask("hold") == "held"

    def release(self) -> None:
        """Answer the waiting requests and hold no more (idempotent)."""
        if self._server.poll() is None:
            assert self._ask("release") == "released"

    def fail_reads(self) -> None:
        """READ requests reaching the device from now on fail with EIO (a disk's bad sectors);
        writes still land."""
        assert self._ask("fail") == "failing"

    def heal(self) -> None:
        """Answer READ requests again (idempotent)."""
        if self._server.poll() is None:
            assert self._ask("heal") == "healed"

    def held(self) -> int:
        """Requests waiting now (the loop device sends them one at a time: 0 or 1 mostly)."""
        return int(self._ask("count"))

    def wait_held(self) -> None:
        """Until a request waits at the gate (kernel-side state, no event to wait on), at most BOUND_S."""
        deadline = time.monotonic() + BOUND_S
        pause = threading.Event()
        while self.held() == 0:
            assert time.monotonic() < deadline, f"no I/O reached the gate within {BOUND_S} s"
            pause.wait(0.01)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=False)


def _unmount(path: Path) -> None:
    if _run("umount", str(path)).returncode != 0:
        _run("umount", "-l", str(path))


@contextlib.contextmanager
def gated_ext4(tmp: Path, size_mib: int) -> Iterator[tuple[Path, GateControl]]:
    """A fresh ext4 of ``size_mib`` MiB on a loop device over a held-able FUSE file: its mount
    point and the gate's control."""
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
    script = Path(__file__).with_name("fuse_gate.py")
    server = subprocess.Popen([sys.executable, str(script), str(fuse_dir), str(image)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    gate = GateControl(server)
    try:
        assert server.stdout is not None
        line = server.stdout.readline().strip()  # "ready" once mounted (or why not)
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
                    yield mount, gate
                finally:
                    gate.release()
                    _unmount(mount)
            finally:
                gate.release()
                _run("losetup", "-d", device)
        finally:
            gate.release()
            _unmount(fuse_dir)
    finally:
        for stream in (server.stdin, server.stdout):
            if stream is not None:
                stream.close()
        try:
            server.wait(timeout=BOUND_S)  # it exits once unmounted
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def kill_with_a_write_held(script: str, gate: GateControl) -> None:
    """Run ``script`` (``python -c``) in a child that prints ``ready``, then writes through the
    gated file system on ``go``; SIGKILL it while one of its writes is held at the device, then
    release the gate. The child must die of the signal (a real cut write, temp files left)."""
    with subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdin is not None
            line = proc.stdout.readline()
            assert line == "ready\n", line + (proc.stderr.read() if proc.poll() is not None else "")
            gate.hold()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            gate.wait_held()  # a write of the child reached the device and waits there
            proc.send_signal(signal.SIGKILL)
            gate.release()
            assert proc.wait(30) == -signal.SIGKILL
        finally:
            gate.release()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
