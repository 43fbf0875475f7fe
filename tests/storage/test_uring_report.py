"""A chain whose successful ops post no CQE (IOSQE_CQE_SKIP_SUCCESS) with one op that reports its
result all the same (``UringEngine.submit(report=...)``): an fd installed from a fixed-file entry.
Its success, a failure before it (silent: its result ``-ECANCELED``), its own failure (the kernel
then posts the cancelled ops' CQEs, which the chain waits for) and a failure after it."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from aiokv.storage.uring import OP_CLOSE, OP_FIXED_FD_INSTALL, OP_NOP, OP_OPENAT, OP_READ, UringEngine, sqe


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[UringEngine]:
    e = UringEngine.open(8)
    e.register_files(2)
    try:
        if not e.skip_success:
            pytest.skip("this kernel posts every CQE (no IOSQE_CQE_SKIP_SUCCESS)")
        yield e
    finally:
        await e.aclose()


async def _run(engine: UringEngine, ops: list[tuple[int, ...]], keep: object, expect: list[int],
               report: int) -> list[int]:
    done: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
    engine.submit(ops, keep, done.set_result, expect=expect, report=report)  # type: ignore[arg-type]
    results = await done
    assert engine.in_flight == 0
    return results


def _chain(path: ctypes.Array[ctypes.c_char], entry: int, install_entry: int) -> list[tuple[int, ...]]:
    return [sqe(OP_OPENAT, -100, ctypes.addressof(path), 0, 0, os.O_RDONLY, file_index=entry + 1),
            sqe(OP_FIXED_FD_INSTALL, install_entry, fixed_file=True),
            sqe(OP_CLOSE, 0, file_index=entry + 1)]


@pytest.mark.asyncio
async def test_the_reporting_op_gives_its_result_on_success(engine: UringEngine, tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_bytes(b"x")
    path = ctypes.create_string_buffer(str(target).encode())
    results = await _run(engine, _chain(path, 0, 0), path, [0, 0, 0], 1)
    fd = results[1]
    assert results[0] == 0 and results[2] == 0 and fd >= 0
    try:
        assert os.path.samestat(os.fstat(fd), os.stat(target))  # the installed fd is the opened file
    finally:
        os.close(fd)


@pytest.mark.asyncio
async def test_a_failure_before_it_leaves_it_cancelled(engine: UringEngine, tmp_path: Path) -> None:
    path = ctypes.create_string_buffer(str(tmp_path / "missing").encode())
    results = await _run(engine, _chain(path, 0, 0), path, [0, 0, 0], 1)
    assert results == [-errno.ENOENT, -errno.ECANCELED, -errno.ECANCELED]


@pytest.mark.asyncio
async def test_its_own_failure_waits_for_the_cancelled_ops(engine: UringEngine, tmp_path: Path) -> None:
    # Installing entry 1, which nothing filled: EBADF when it runs. Not silent, so the kernel posts
    # the CLOSE's -ECANCELED too; the chain completes once that arrived, and entry 0 stays filled.
    target = tmp_path / "f"
    target.write_bytes(b"x")
    path = ctypes.create_string_buffer(str(target).encode())
    results = await _run(engine, _chain(path, 0, 1), path, [0, 0, 0], 1)
    assert results == [0, -errno.EBADF, -errno.ECANCELED]
    # Entry 0 still holds the file: closed on its own, then a NOP round trip finds nothing left over.
    assert await _run(engine, [sqe(OP_CLOSE, 0, file_index=1)], None, [0], -1) == [0]
    assert await _run(engine, [sqe(OP_NOP)], None, [0], -1) == [0]


@pytest.mark.asyncio
async def test_a_failure_after_it_keeps_its_result(engine: UringEngine, tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_bytes(b"x")
    path = ctypes.create_string_buffer(str(target).encode())
    ops = [*_chain(path, 0, 0)[:2], sqe(OP_READ, -1), sqe(OP_CLOSE, 0, file_index=1)]
    results = await _run(engine, ops, path, [0, 0, 0, 0], 1)
    assert results[0] == 0 and results[1] >= 0 and results[2:] == [-errno.EBADF, -errno.ECANCELED]
    os.close(results[1])
    assert await _run(engine, [sqe(OP_CLOSE, 0, file_index=1)], None, [0], -1) == [0]
