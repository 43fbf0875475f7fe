"""Review 284 (chaos soak): a page read whose chain (header and page, then CLOSE of the file's
descriptor) the kernel refused to take (``io_uring_enter`` failing: here for real, the ring's
descriptor number made to name an eventfd, answered with EOPNOTSUPP) must still close that
descriptor. The refused submission completed every op nobody took with the enter's errno, so the
CLOSE looked run (only ``-ECANCELED`` says a chain skipped it) and each failed read leaked its file
descriptor: the soak's cache, its io_uring_enter refused by a seccomp filter mid-run, held 8,492
descriptors after 8,289 failed reads. A plain descriptor's CLOSE nobody took is now run by the
engine itself, as the kernel would have run it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, read_page, stored_page
from test_adv_rev120_enter_fails import refusing_ring

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.backends import UringPageIO

READS = 12


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.asyncio
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
async def test_a_refused_read_chain_still_closes_its_file(tmp_path: Path, layout: KVLayout, pool: PagePool,
                                                          direct: bool) -> None:
    tier = DiskTier(config(tmp_path / "disk", DiskBackend.URING, direct_io=direct), layout, pool)
    await tier.start()
    try:
        io = tier.backend
        if not isinstance(io, UringPageIO):
            pytest.skip("io_uring refused here")
        await stored_page(tier, pool, 1)
        assert await read_page(tier, pool, 1) is not None  # the ring works: the file's name is cached
        before = _open_fds()
        with refusing_ring(io.engine):
            for _ in range(READS):
                assert await read_page(tier, pool, 1) is None  # refused: a miss
        leaked = _open_fds() - before
        assert leaked <= 0, f"{leaked} file descriptors leaked by {READS} refused reads"
        assert io.engine.enter_failures >= READS
        assert await read_page(tier, pool, 1) is not None  # the ring works again
    finally:
        await tier.aclose()
    assert_clean(pool)
