"""A page file's close that fails is never retried on the same descriptor number (threads backend)."""

from __future__ import annotations

import errno
import os
import sys
import threading
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, fill, key_of

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier


@pytest.mark.asyncio
async def test_a_failed_close_of_a_written_page_file_is_not_closed_twice(
        disk_dir: Path, layout: KVLayout, pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression (review): when close() of a freshly written page file failed (EIO, as NFS may
    # report), the error path closed the same number again; the kernel had released it already, so
    # that second close could close a file another thread had opened meanwhile.
    real_close = os.close
    lock = threading.Lock()
    failed: list[int] = []
    again: list[int] = []
    watching = [True]  # until the first write is over: later files may reuse the number

    def close(fd: int) -> None:
        if sys._getframe(1).f_code.co_name != "_write_rename":
            real_close(fd)
            return
        with lock:
            if watching[0] and fd in failed:
                again.append(fd)  # (before the real close, which would fail with EBADF here)
            real_close(fd)
            if not failed:
                failed.append(fd)
                raise OSError(errno.EIO, "close failed (injected)")

    monkeypatch.setattr(os, "close", close)
    async with DiskTier(config(disk_dir, DiskBackend.THREADS), layout, pool) as tier:
        h = fill(pool, key_of(1), 1)
        assert not await tier.write(key_of(1), h)  # the failed close fails the write: counted, no file
        pool.table.release(h)
        assert failed and not again, f"fd {failed} closed again after its close failed"
        watching[0] = False
        h = fill(pool, key_of(2), 2)
        assert await tier.write(key_of(2), h)  # the next write works
        pool.table.release(h)
    assert_clean(pool)
