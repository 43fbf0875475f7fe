"""Review 289 (after review 284's fix): a page chain ending in the CLOSE of a plain descriptor (a
read the checked way: header and page, then CLOSE; an overwrite of a recycled file: header and
page, CLOSE, RENAMEAT) in a submission the kernel refused (``io_uring_enter`` failing: here for
real, the ring's descriptor number made to name an eventfd, answered with EOPNOTSUPP). The engine
runs such a CLOSE itself (review 284), but where the kernel leaves successful ops silent it had
already ended the chain at its first op's failure, the rest ``-ECANCELED``: the CLOSE read as
skipped, and its owner closed the descriptor again, through the ring — by then maybe the number
of another file: here one opened right after the engine's close, as another thread of the process
may (the engine's close is wrapped to open it then), which the second close shut under it. The
refused chain now completes op by op, its CLOSE reporting that it ran."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, read_page, stored_page
from follow_helpers import is_open
from test_adv_rev120_enter_fails import refusing_ring

import aiokv.storage.uring as uring_module
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.backends import UringPageIO

READS = 6


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", [DiskBackend.URING, DiskBackend.URING_FIXED], ids=["plain", "fixed"])
async def test_a_refused_read_chain_closes_its_file_once(tmp_path: Path, layout: KVLayout, pool: PagePool,
                                                         backend: DiskBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    others: list[int] = []
    closes: list[tuple[int, int]] = []
    real_close = uring_module._close_quietly

    def then_another_file(fd: int) -> int:
        res = real_close(fd)
        closes.append((fd, res))
        if res == 0 and fd not in others:
            # Another file of the process takes the lowest free number: the one just freed.
            others.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        return res

    tier = DiskTier(config(tmp_path / "disk", backend, direct_io=False), layout, pool)
    await tier.start()
    try:
        io = tier.backend
        if not isinstance(io, UringPageIO):
            pytest.skip("io_uring refused here")
        await tier.wait_registered()
        expect = await stored_page(tier, pool, 1)
        assert await read_page(tier, pool, 1) is not None  # the ring works: the file's name is cached
        monkeypatch.setattr(uring_module, "_close_quietly", then_another_file)
        with refusing_ring(io.engine):
            for _ in range(READS):
                assert await read_page(tier, pool, 1) is None  # refused: a miss
        monkeypatch.undo()
        got = await read_page(tier, pool, 1)  # the ring works again
        assert got is not None and bool((got == expect).all())
        closed = [fd for fd in others if not is_open(fd)]
        assert not closed, f"files of the process closed under them by a second close: {closed} ({closes})"
        assert len(others) == READS, f"the engine did not close each refused read's file once: {closes}"
    finally:
        for fd in others:
            if is_open(fd):
                os.close(fd)
        await tier.aclose()
    assert_clean(pool)
