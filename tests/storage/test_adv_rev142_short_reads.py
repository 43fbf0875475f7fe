"""Real short reads at every point of a read's chain, on both io_uring backends, cold (the chain
from its open: OPENAT, header and page, FIXED_FD_INSTALL, CLOSE) and warm (opened on the loop,
then header and page, CLOSE), one page at a time and as a batch, also cancelled part-way.

With registered buffers header and page are two transfers and the header's posts its CQE
(``uring.LOUD_TRANSFERS``): a file cut inside the header breaks the chain at a loud op, whose
cancelled followers post CQEs of their own after the chain ended; cut inside the page, at a silent
op, whose followers post none. Injected faults never show the first (an injected op is silent).
Files truncated in place and replaced by shorter ones (a new inode), a longer file, and planted
FIFO, directory and symlink. Oracles: a hit serves exactly the page written, anything else is a
miss; the ring's count of ops in flight ends at 0; every I/O slot's fixed-file entry ends empty
(a chain broken before its CLOSE must have it closed); no reservation or reference is left.
Held on the first run (review 142 of bff17ed): kept as the regression net for those paths."""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from disk_helpers import assert_clean, config, key_of, payload, reserve, stored_page

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.backends import UringPageIO
from aiokv.storage.pagefile import HEADER_BYTES
from aiokv.storage.uring import OP_CLOSE, Op

URING = [DiskBackend.URING_FIXED, DiskBackend.URING]
DEPTH = 4


def _cut(size: int) -> Callable[[str], None]:
    return lambda path: os.truncate(path, size)


def _shorter(size: int) -> Callable[[str], None]:
    def replace(path: str) -> None:
        with open(path, "rb") as f:
            head = f.read(size)
        with open(path + ".new", "wb") as f:
            f.write(head)
        os.rename(path + ".new", path)

    return replace


def _longer(path: str) -> None:
    with open(path, "ab") as f:
        f.write(b"z" * 5000)


def _fifo(path: str) -> None:
    os.unlink(path)
    os.mkfifo(path, 0o600)


def _directory(path: str) -> None:
    os.unlink(path)
    os.mkdir(path, 0o700)


def _symlink(path: str) -> None:
    os.rename(path, path + ".real")
    os.symlink(os.path.basename(path) + ".real", path)


def faults(page_bytes: int) -> dict[str, Callable[[str], None]]:
    whole = HEADER_BYTES + page_bytes
    return {
        "intact": lambda path: None,
        "cut_0": _cut(0), "cut_in_header": _cut(100), "cut_header_less_1": _cut(HEADER_BYTES - 1),
        "cut_after_header": _cut(HEADER_BYTES), "cut_in_page": _cut(HEADER_BYTES + 512),
        "cut_last_block": _cut(whole - 512), "cut_last_byte": _cut(whole - 1),
        "shorter_empty": _shorter(0), "shorter_in_header": _shorter(100),
        "shorter_header_only": _shorter(HEADER_BYTES), "shorter_in_page": _shorter(whole - 512),
        "longer": _longer, "fifo": _fifo, "directory": _directory, "symlink": _symlink,
    }


def _page_files(directory: Path) -> dict[str, str]:
    return {p.name: str(p) for p in directory.rglob("*") if p.is_file()}


async def _empty_entries(io: UringPageIO) -> list[int]:
    # CLOSE of an empty fixed-file entry answers EBADF; 0 would mean a file was left in it.
    out = []
    for slot in range(DEPTH):
        async with asyncio.timeout(5):
            out += await io.engine.chain([Op(OP_CLOSE, 0, file_index=slot + 1)], None)
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", URING, ids=[b.value for b in URING])
@pytest.mark.parametrize("cold", [True, False], ids=["cold", "warm"])
@pytest.mark.parametrize("batch", [True, False], ids=["read_many", "read"])
@pytest.mark.parametrize("cancel_after", [None, 1, 3, 8], ids=lambda n: f"cancel_{n}")
async def test_short_reads_are_misses_and_leave_nothing_behind(tmp_path: Path, backend: DiskBackend, cold: bool,
                                                               batch: bool, cancel_after: int | None,
                                                               layout: KVLayout, pool: PagePool) -> None:
    tier = DiskTier(config(tmp_path / "disk", backend, queue_depth=DEPTH), layout, pool)
    await tier.start()
    try:
        io = tier.backend
        assert isinstance(io, UringPageIO) and io.direct and io.chain_reads
        await tier.wait_registered()  # URING_FIXED: header and page as two transfers
        if cold:
            io._cached.available = False  # every read is the chain from its open
        plants = faults(layout.page_bytes)
        names = list(plants)
        written = [await stored_page(tier, pool, i) for i in range(len(names))]
        files = _page_files(Path(tier.config.directory))
        for i, name in enumerate(names):
            plants[name](files[key_of(i).hex()])
        keys = [key_of(i) for i in range(len(names))]
        handles = [reserve(pool, k) for k in keys]

        async def each() -> list[bool]:
            return [await tier.read(k, h) for k, h in zip(keys, handles, strict=True)]

        reads = asyncio.ensure_future(tier.read_many(keys, handles) if batch else each())
        if cancel_after is not None:
            for _ in range(cancel_after):
                await asyncio.sleep(0)
            reads.cancel()
        try:
            async with asyncio.timeout(20):
                got = await reads
        except asyncio.CancelledError:
            assert cancel_after is not None
            got = None
        if got is not None:
            assert got[names.index("intact")] and got[names.index("longer")]
            for i, ok in enumerate(got):
                assert not ok or torch.equal(payload(pool, handles[i]), written[i]), names[i]
            assert tier.statistics().misses == len(names) - 2
        for h in handles:
            pool.table.abort(h)
        async with asyncio.timeout(20):
            await tier._until_idle()
        assert tier.statistics().in_flight == 0
        assert await _empty_entries(io) == [-errno.EBADF] * DEPTH
    finally:
        async with asyncio.timeout(20):
            await tier.aclose()
    assert io.engine.in_flight == 0  # every op's completion came (or was known not to come)
    assert_clean(pool)
