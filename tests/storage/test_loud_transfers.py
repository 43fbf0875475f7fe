"""A transfer in a silent chain posts its CQE (#14, ``uring.LOUD_TRANSFERS``).

An O_DIRECT transfer completes in the loop thread's task work: the kernel wakes the thread out of
the loop's ``epoll_wait`` to run it (EINTR). When nothing was posted by it, CPython's
``epoll.poll`` slept again for the remaining timeout rounded up to a whole ms, so a timer due in
0.2 ms ran 1.5-2 ms late while 1 MiB pages streamed. Posted, the retried poll finds the ring's
eventfd ready. A transfer right before the reporting op or the chain's last stays silent (that
op's CQE posts in the same task work), and so does an op standing for an injected fault.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import mmap
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from aiokv.storage import uring
from aiokv.storage.uring import AT_FDCWD, OP_CLOSE, OP_NOP, OP_OPENAT, OP_READ, OP_WRITE, Op, UringEngine, sqe


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[UringEngine]:
    e = UringEngine.open(8)
    if not e.skip_success:
        await e.aclose()
        pytest.skip("the kernel cannot skip CQEs of successful ops (before 5.17)")
    e.register_files(2)
    try:
        yield e
    finally:
        await e.aclose()



class Counted:
    """The CQEs the engine handles (results in order), and one chain's callback results."""

    def __init__(self, engine: UringEngine) -> None:
        self.cqes: list[int] = []
        self.results: list[int] | None = None
        self.done = asyncio.Event()
        complete = engine._complete

        def counting(user_data: int, res: int) -> None:
            self.cqes.append(res)
            complete(user_data, res)

        engine._complete = counting  # type: ignore[method-assign]

    def finished(self, results: list[int]) -> None:
        self.results = list(results)
        self.done.set()

    async def run(self, engine: UringEngine, ops: list[uring.SqeFields], keep: object, expect: list[int],
                  report: int = -1) -> list[int]:
        self.cqes.clear()
        self.done.clear()
        engine.submit(ops, keep, self.finished, expect=expect, report=report)
        async with asyncio.timeout(10):
            await self.done.wait()
        assert self.results is not None
        return self.results


def _write_chain(path: ctypes.Array[ctypes.c_char], address: int) -> tuple[list[uring.SqeFields], list[int]]:
    # OPENAT into fixed entry 1, two transfers, CLOSE of the entry, a NOP ending the chain.
    ops = [
        sqe(OP_OPENAT, AT_FDCWD, ctypes.addressof(path), 0o600, 0, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
            file_index=2),
        sqe(OP_WRITE, 1, address, 4096, 0, fixed_file=True),
        sqe(OP_WRITE, 1, address + 4096, 4096, 4096, fixed_file=True),
        sqe(OP_CLOSE, 0, file_index=2),
        sqe(OP_NOP),
    ]
    return ops, [0, 4096, 4096, 0, 0]


@pytest.mark.asyncio
async def test_transfers_post_their_cqes(engine: UringEngine, tmp_path: Path, buffer: tuple[mmap.mmap, int],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    m, address = buffer
    m[:8192] = b"a" * 4096 + b"b" * 4096
    path = ctypes.create_string_buffer(str(tmp_path / "f").encode())
    ops, expect = _write_chain(path, address)
    counted = Counted(engine)
    assert await counted.run(engine, ops, path, expect) == expect
    assert counted.cqes == [4096, 4096, 0]  # both transfers, then the chain's last op
    assert (tmp_path / "f").read_bytes() == b"a" * 4096 + b"b" * 4096
    # As before: only the last op posts.
    monkeypatch.setattr(uring, "LOUD_TRANSFERS", False)
    assert await counted.run(engine, ops, path, expect) == expect
    assert counted.cqes == [0]
    assert engine.in_flight == 0


@pytest.mark.asyncio
async def test_a_transfer_before_the_reporting_op_stays_silent(engine: UringEngine, tmp_path: Path,
                                                              buffer: tuple[mmap.mmap, int]) -> None:
    m, address = buffer
    (tmp_path / "f").write_bytes(b"r" * 8192)
    path = ctypes.create_string_buffer(str(tmp_path / "f").encode())
    # OPENAT into entry 1, two reads, a second OPENAT that reports its fd, CLOSE of the entry.
    ops = [
        sqe(OP_OPENAT, AT_FDCWD, ctypes.addressof(path), 0, 0, os.O_RDONLY, file_index=2),
        sqe(OP_READ, 1, address, 4096, 0, fixed_file=True),
        sqe(OP_READ, 1, address + 4096, 4096, 4096, fixed_file=True),
        sqe(OP_OPENAT, AT_FDCWD, ctypes.addressof(path), 0, 0, os.O_RDONLY | os.O_CLOEXEC),
        sqe(OP_CLOSE, 0, file_index=2),
    ]
    counted = Counted(engine)
    results = await counted.run(engine, ops, path, [0, 4096, 4096, 0, 0], report=3)
    fd = results[3]
    assert fd >= 0
    os.close(fd)
    assert results == [0, 4096, 4096, fd, 0]
    assert counted.cqes == [4096, fd, 0]  # the second read's success is the reporting op's CQE's
    assert m[:8192] == b"r" * 8192
    assert engine.in_flight == 0


@pytest.mark.asyncio
async def test_a_failing_reporting_op_after_a_loud_transfer(engine: UringEngine, tmp_path: Path,
                                                            buffer: tuple[mmap.mmap, int]) -> None:
    # The reporting op fails for real (ENOENT) after the first transfer posted its success: the
    # chain still waits for the CLOSE cancelled after it, and the ring's count ends at zero. Counting
    # every op before the reporting one as silent, the callback ran before the CLOSE's CQE with a
    # success for it (the entry was in fact left open), and the count of ops in flight went wrong.
    m, address = buffer
    m[:8192] = b"w" * 8192
    path = ctypes.create_string_buffer(str(tmp_path / "f").encode())
    missing = ctypes.create_string_buffer(str(tmp_path / "missing").encode())
    ops = [
        sqe(OP_OPENAT, AT_FDCWD, ctypes.addressof(path), 0o600, 0, os.O_WRONLY | os.O_CREAT, file_index=2),
        sqe(OP_WRITE, 1, address, 4096, 0, fixed_file=True),
        sqe(OP_WRITE, 1, address + 4096, 4096, 4096, fixed_file=True),
        sqe(OP_OPENAT, AT_FDCWD, ctypes.addressof(missing), 0, 0, os.O_RDONLY | os.O_CLOEXEC),
        sqe(OP_CLOSE, 0, file_index=2),
    ]
    counted = Counted(engine)
    results = await counted.run(engine, ops, (path, missing), [0, 4096, 4096, 0, 0], report=3)
    assert results == [0, 4096, 4096, -errno.ENOENT, -errno.ECANCELED]
    assert counted.cqes == [4096, -errno.ENOENT, -errno.ECANCELED]
    assert engine.in_flight == 0
    assert await engine.chain([Op(OP_CLOSE, 0, file_index=2)], None) == [0]  # the entry the chain left open


@pytest.mark.asyncio
async def test_a_failing_loud_transfer_breaks_the_chain_once(engine: UringEngine, tmp_path: Path,
                                                             buffer: tuple[mmap.mmap, int]) -> None:
    # The first transfer fails for real (a read-only file): the ops after it are cancelled with
    # CQEs of their own (it was not silent), which come after the chain ended and are ignored.
    _, address = buffer
    (tmp_path / "f").write_bytes(b"x")
    path = ctypes.create_string_buffer(str(tmp_path / "f").encode())
    ops, expect = _write_chain(path, address)
    ops[0] = sqe(OP_OPENAT, AT_FDCWD, ctypes.addressof(path), 0, 0, os.O_RDONLY, file_index=2)
    counted = Counted(engine)
    calls = 0
    finished = counted.finished

    def once(results: list[int]) -> None:
        nonlocal calls
        calls += 1
        finished(results)

    counted.finished = once  # type: ignore[method-assign]
    results = await counted.run(engine, ops, path, expect)
    assert results == [0, -errno.EBADF, -errno.ECANCELED, -errno.ECANCELED, -errno.ECANCELED]
    for _ in range(5):  # the late CQEs of the cancelled ops
        await engine.chain([Op(OP_NOP)], None)
    assert calls == 1
    assert counted.cqes[:1] == [-errno.EBADF]
    assert engine.in_flight == 0
    assert await engine.chain([Op(OP_CLOSE, 0, file_index=2)], None) == [0]
    assert (tmp_path / "f").read_bytes() == b"x"
