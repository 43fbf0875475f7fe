"""Page I/O goes through io-wq once the tier can hold enough page bytes in flight (#14).

Issued inline, an O_DIRECT read or write runs inside ``io_uring_enter`` on the loop thread, which
sleeps there while the device is busy: 4 MiB pages at queue depth 32 (128 MiB in flight) held the
loop 70-120 ms in one submit. The tier marks its page ops IOSQE_ASYNC from 64 MiB in flight on,
not only for pages of 8 MiB or more.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from disk_helpers import config, read_page, ready_pool, write_page

from aiokv.layout import KVLayout
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.uring import _SQE, DATA_OPS, IOSQE_ASYNC, UringEngine

FOUR_MIB = KVLayout.mha(16, 4, 128, torch.float16, page_tokens=128)


def page_ops_marked(engine: UringEngine) -> list[bool]:
    """For every page read or write still in the ring's SQE slots: whether it was marked async."""
    marked = []
    for i in range(engine.sq_entries):
        opcode, flags = _SQE.unpack_from(engine._sqes, i * 64)[:2]
        if opcode in DATA_OPS:
            marked.append(bool(flags & IOSQE_ASYNC))
    return marked


@pytest.mark.asyncio
@pytest.mark.parametrize("queue_depth", [8, 16])
@pytest.mark.parametrize("backend", [DiskBackend.URING_FIXED, DiskBackend.URING])
async def test_page_ops_go_async_from_64_mib_in_flight(tmp_path: Path, backend: DiskBackend,
                                                       queue_depth: int) -> None:
    assert FOUR_MIB.page_bytes == 4 << 20
    with ready_pool(FOUR_MIB, 2) as pool:
        cfg = config(tmp_path / "d", backend, capacity=64 << 20, queue_depth=queue_depth)
        async with DiskTier(cfg, FOUR_MIB, pool) as tier:
            written, want = await write_page(tier, pool, 1)
            assert written
            got = await read_page(tier, pool, 1)
            assert got is not None and torch.equal(got, want)
            marked = page_ops_marked(tier._io.engine)  # type: ignore[union-attr,unused-ignore]
    # The write's and the read's header and page ops (one vectored op each way without fixed buffers).
    assert len(marked) >= 2
    # 4 MiB x 16 = 64 MiB in flight: async (inline before); 4 MiB x 8 = 32 MiB: inline, as before.
    assert marked == [queue_depth == 16] * len(marked)
