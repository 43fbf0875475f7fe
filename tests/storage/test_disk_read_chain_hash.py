"""Where a read's payload checksum runs (#14): a page read of up to 1 MiB is hashed on the loop,
in the one inline-hash callback per turn (bounded by its per-turn budget), not handed to the
checksum thread, whose hand-off cost a second wake-up of the loop per page; larger pages (4 and
32 MiB) still go to the thread, so the loop never hashes them. Every backend, real files."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from disk_helpers import assert_clean, config, fill, key_of, payload, reserve

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage import checksum as checksum_module


@pytest.mark.asyncio
@pytest.mark.parametrize("page_mib", [1, 2])
async def test_reads_up_to_1_mib_are_hashed_on_the_loop_larger_ones_on_the_thread(
        tmp_path: Path, backend: DiskBackend, page_mib: int, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = KVLayout.mha(4 * page_mib, 4, 128, torch.float16, page_tokens=128)
    assert layout.payload_bytes == page_mib << 20
    pool = PagePool.create(layout, 4 * layout.page_bytes, register_cuda=False, workers=1)
    pool.wait_ready_blocking()
    hashed_in: list[str] = []
    real = checksum_module.payload_checksum

    def spy(view: memoryview) -> int:
        hashed_in.append(threading.current_thread().name)
        return real(view)

    monkeypatch.setattr(checksum_module, "payload_checksum", spy)
    try:
        async with DiskTier(config(tmp_path / "disk", backend), layout, pool) as tier:
            h = fill(pool, key_of(1), 1)
            want = payload(pool, h)
            assert await tier.write(key_of(1), h)
            pool.table.release(h)
            del hashed_in[:]
            into = reserve(pool, key_of(2))
            assert await tier.read(key_of(1), into)
            assert torch.equal(payload(pool, into), want)
            pool.table.abort(into)
            loop_thread = threading.current_thread().name
            assert hashed_in == ([loop_thread] if page_mib == 1 else ["aiokv-checksum-0"])
        assert_clean(pool)
    finally:
        pool.close()
