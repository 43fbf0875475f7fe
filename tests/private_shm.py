"""Run a test file's scenario as root in a mount namespace of its own over a small /dev/shm (a
real tmpfs: space is really short there, nothing mocked); tests skip where that is not possible."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest

SCENARIO = "--scenario"
"""The argument a test file's ``__main__`` takes to run its scenario inside the namespace."""


def can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


needs_namespace = pytest.mark.skipif(not can_unshare(), reason="needs root and unshare -m (a private /dev/shm)")


def run_in_private_shm(test_file: str, shm_mib: int, *args: str, timeout: float = 120) -> dict[str, Any]:
    """Run ``python test_file --scenario args...`` over a ``shm_mib`` MiB /dev/shm of its own; the
    JSON report its last line of output holds. Its imports see this process's ``sys.path`` (the
    test's directory and ``tests/`` first)."""
    here = Path(test_file).parent
    script = (f"mount -t tmpfs -o size={shm_mib}m tmpfs /dev/shm && "
              f"exec {sys.executable} {test_file} {SCENARIO} {' '.join(args)}")
    path = os.pathsep.join([str(here), str(here.parent), *sys.path])
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, done.stderr[-4000:]
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def fork_pool_creator(layout: Any, size: int) -> tuple[BaseProcess, str]:
    """A forked process that creates a pool of ``size`` bytes (one chunk, no CUDA) and sleeps: the
    process and its segment's name (kill it to leave a dead creator's segment behind)."""
    import asyncio
    import multiprocessing

    from aiokv.pool import PagePool

    ctx = multiprocessing.get_context("fork")
    names = ctx.Queue()

    def creator() -> None:
        async def main() -> None:
            pool = await PagePool.open(layout, size, register_cuda=False, chunk_bytes=size)
            names.put(pool.name)
            await asyncio.sleep(3600)

        asyncio.run(main())

    proc = ctx.Process(target=creator, daemon=True)
    proc.start()
    return proc, names.get(timeout=60)


def killed_mid_preparation(size: int, prepared: int) -> str:
    """A forked creator makes a segment of ``size`` bytes through aiokv, touches its first
    ``prepared`` bytes (as a prepared chunk is) and is SIGKILLed: its segment's name (sparse past
    ``prepared``)."""
    import multiprocessing
    import signal
    import time

    from aiokv.shm import SharedSegment

    ctx = multiprocessing.get_context("fork")
    names = ctx.Queue()

    def creator() -> None:
        seg = SharedSegment.create(size)
        seg.buffer[:prepared] = b"\1" * prepared
        names.put(seg.name)
        time.sleep(3600)

    proc = ctx.Process(target=creator, daemon=True)
    proc.start()
    name: str = names.get(timeout=60)
    os.kill(proc.pid or 0, signal.SIGKILL)
    proc.join(30)
    return name


def start_pool(layout: Any, size: int, chunk_bytes: int = 4 << 20) -> tuple[str | None, list[str]]:
    """Open (then close) a pool of ``size`` bytes, rounded down to pages, in a loop of its own: the
    name of the error its start raised (a ``SegmentSpaceError``) or None, and the segments its
    start reclaimed."""
    import asyncio

    from aiokv.pool import PagePool
    from aiokv.shm import SegmentSpaceError

    async def start() -> tuple[str | None, list[str]]:
        try:
            pool = await PagePool.open(layout, size // layout.page_bytes * layout.page_bytes,
                                       register_cuda=False, chunk_bytes=chunk_bytes)
        except SegmentSpaceError as exc:
            return type(exc).__name__, []
        reclaimed = [s.name for s in await pool.wait_reclaimed()]
        await pool.aclose()
        return None, reclaimed

    return asyncio.run(start())
