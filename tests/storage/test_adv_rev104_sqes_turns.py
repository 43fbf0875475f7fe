"""Review of #14: SQE tuples written out by hand, and the checksum's inline batch run from the
ring's submission callback.

- Every SQE the page chains submit (new file, recycled file, read of a hot name, cold read chain,
  read opened through the ring) is checked field by field against what it must say: the fields
  :func:`uring.sqe` leaves 0 are 0 (``user_data`` among them: the engine numbers ops itself),
  the fixed-file flag exactly where ``fd`` is an I/O slot, ``buf_index`` the registered region that
  holds the buffer, lengths and offsets of header and page, the names the kernel will read.
- The inline batch is never lost (every backend): with a zero per-turn deadline each batch hashes
  one page and asks for the next turn from inside the submission callback; on a ring that sat idle;
  with the tier closed right after the writes started.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_helpers import assert_clean, config, fill, key_of, payload, read_copy, stored_page

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, uring
from aiokv.storage import checksum as checksum_module
from aiokv.storage.backends import UringPageIO
from aiokv.storage.pagefile import HEADER_BYTES

URING = [DiskBackend.URING_FIXED, DiskBackend.URING]
TIMEOUT_S = 20.0


def _string(address: int) -> bytes:
    return ctypes.string_at(address)


class _Checker:
    """Checks each op of each submitted chain; records which kinds of chain it saw."""

    def __init__(self, tier: DiskTier, io: UringPageIO) -> None:
        self.tier, self.io = tier, io
        self.pb = tier.layout.page_bytes
        assert tier._slots is not None
        self.slots = tier._slots
        self.seen: set[str] = set()
        self.transfers = 0

    def region_index(self, address: int, length: int) -> int | None:
        io = self.io
        if self.slots.address <= address < self.slots.address + self.slots.count * HEADER_BYTES:
            region = io._slot_region
        elif io._base <= address < io._pool_end:
            region = io._page_region(address)
        else:
            region = io._external_region(address)
        if region is None:
            return None
        assert region.address <= address and address + length <= region.address + region.length
        return region.index

    def check_transfer(self, op: tuple[int, ...], fd: int, fixed: bool, page: int | None) -> None:
        opcode, flags, _ioprio, op_fd, off, addr, length, op_flags, _ud, buf_index = op[:10]
        assert op_fd == fd and flags == (uring.IOSQE_FIXED_FILE if fixed else 0) and op_flags == 0
        self.transfers += 1
        if opcode in (uring.OP_READV, uring.OP_WRITEV):
            assert (off, length, buf_index) == (0, 2, 0)
            pair = (uring.IoVec * 2).from_address(addr)
            assert pair[0].len == HEADER_BYTES and pair[1].len == self.pb
            assert (pair[0].base - self.slots.address) % HEADER_BYTES == 0
            assert page is None or pair[1].base == page
            return
        assert opcode in (uring.OP_READ_FIXED, uring.OP_WRITE_FIXED)
        if off == 0:  # the header, from the slot's header buffer
            assert length == HEADER_BYTES and (addr - self.slots.address) % HEADER_BYTES == 0
        else:
            assert (off, length) == (HEADER_BYTES, self.pb)
            assert page is None or addr == page
        assert self.region_index(addr, length) == buf_index

    def __call__(self, ops: list[tuple[int, ...]], kwargs: dict[str, Any]) -> None:
        for op in ops:
            assert len(op) == 14 and all(type(f) is int for f in op), op
            # ioprio, user_data, personality, addr3, pad: what uring.sqe leaves 0.
            assert (op[2], op[8], op[10], op[12], op[13]) == (0, 0, 0, 0, 0), op
            assert op[1] in (0, uring.IOSQE_FIXED_FILE), op
        codes = [op[0] for op in ops]
        first = ops[0]
        if codes[0] == uring.OP_OPENAT and len(ops) > 2 and codes[-2] == uring.OP_FIXED_FD_INSTALL:
            self.seen.add("load chain")
            slot = first[11] - 1
            assert 0 <= slot < self.slots.count
            assert first[1] == 0 and first[4] == 0 and first[6] == 0 and first[9] == 0
            flags = first[7]
            assert flags & os.O_NOFOLLOW and flags & os.O_NONBLOCK and flags & os.O_DIRECT
            assert flags & os.O_ACCMODE == os.O_RDONLY and not flags & os.O_CREAT
            assert len(_string(first[5])) == 32 or b"/" in _string(first[5])
            assert ops[-2] == (uring.OP_FIXED_FD_INSTALL, uring.IOSQE_FIXED_FILE, 0, slot, 0, 0, 0, 0, 0, 0, 0, 0,
                               0, 0)
            for op in ops[1:-2]:
                assert op[0] in (uring.OP_READV, uring.OP_READ_FIXED)
                self.check_transfer(op, slot, True, None)
            assert ops[-1] == uring.sqe(uring.OP_CLOSE, 0, file_index=slot + 1)
            assert kwargs.get("report") == len(ops) - 2
        elif codes[0] == uring.OP_OPENAT and len(ops) > 1:
            self.seen.add("new file")
            slot = first[11] - 1
            assert 0 <= slot < self.slots.count
            assert (first[1], first[4], first[6], first[9]) == (0, 0, 0o600, 0)
            flags = first[7]
            assert flags & os.O_CREAT and flags & os.O_EXCL and flags & os.O_NOFOLLOW
            assert flags & os.O_ACCMODE == os.O_WRONLY
            temp = _string(first[5])
            assert temp.split(b"/")[-1].startswith(b".tmp-")
            dir_fd = first[3]
            moves = [op for op in ops[1:] if op[0] in (uring.OP_WRITEV, uring.OP_WRITE_FIXED)]
            assert len(moves) in (1, 2)
            for op in moves:
                self.check_transfer(op, slot, True, None)
            close, rename = ops[-2], ops[-1]
            assert close == uring.sqe(uring.OP_CLOSE, 0, file_index=slot + 1)
            assert rename == uring.sqe(uring.OP_RENAMEAT, dir_fd, first[5], dir_fd & 0xFFFFFFFF, rename[4])
            final = _string(rename[4])
            assert temp.split(b"/")[-1][5:37] == final.split(b"/")[-1]  # the key's name
        elif codes[-1] == uring.OP_RENAMEAT:
            self.seen.add("recycled file")
            close, rename = ops[-2], ops[-1]
            fd = close[3]
            assert close == uring.sqe(uring.OP_CLOSE, fd) and fd > 0
            for op in ops[:-2]:
                if op[0] == uring.OP_FSYNC:
                    continue
                assert op[0] in (uring.OP_WRITEV, uring.OP_WRITE_FIXED)
                self.check_transfer(op, fd, False, None)
            victim_dir, old, new_dir, new = rename[3], rename[5], rename[6], rename[4]
            assert rename == uring.sqe(uring.OP_RENAMEAT, victim_dir, old, new_dir, new)
            assert len(_string(old).split(b"/")[-1]) == 32 and len(_string(new).split(b"/")[-1]) == 32
        elif codes[-1] == uring.OP_CLOSE and len(ops) > 1:
            self.seen.add("read of an open file")
            fd = ops[-1][3]
            assert ops[-1] == uring.sqe(uring.OP_CLOSE, fd) and fd > 0
            for op in ops[:-1]:
                assert op[0] in (uring.OP_READV, uring.OP_READ_FIXED)
                self.check_transfer(op, fd, False, None)
        elif codes == [uring.OP_OPENAT]:
            self.seen.add("open through the ring")
            assert first[11] == 0 and first[1] == 0 and first[7] & os.O_NOFOLLOW


def _record(tier: DiskTier, monkeypatch: pytest.MonkeyPatch) -> _Checker:
    io = tier.backend
    assert isinstance(io, UringPageIO)
    checker = _Checker(tier, io)
    real = io.engine.submit

    def submit(ops: list[Any], keep: object, callback: Any, *args: Any, **kwargs: Any) -> None:
        checker(ops, kwargs)
        real(ops, keep, callback, *args, **kwargs)

    monkeypatch.setattr(io.engine, "submit", submit)
    return checker


async def _load(tier: DiskTier, pool: PagePool, i: int) -> torch.Tensor | None:
    return await read_copy(tier, pool, i, key_of(7000 + i), TIMEOUT_S)


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", URING, ids=[b.value for b in URING])
async def test_every_page_chain_sqe_says_what_it_must(disk_dir: Path, backend: DiskBackend, layout: KVLayout,
                                                      pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    capacity = 3 * (layout.page_bytes + HEADER_BYTES)  # three files: the fourth write recycles
    async with DiskTier(config(disk_dir, backend, capacity, min_free_bytes=0), layout, pool) as tier:
        io = tier.backend
        assert isinstance(io, UringPageIO)
        await io.wait_registered()
        checker = _record(tier, monkeypatch)
        data = {i: await stored_page(tier, pool, i) for i in range(5)}  # 3 and 4 recycle 0 and 1's files
        assert tier.statistics().recycled >= 1
        for i in (2, 3):  # hot names: opened on the loop, one chain
            got = await _load(tier, pool, i)
            assert got is not None and torch.equal(got, data[i])
        monkeypatch.setattr(io._cached, "open", lambda *a: None)  # cold names: the chain from the open
        got = await _load(tier, pool, 4)
        assert got is not None and torch.equal(got, data[4])
        io.chain_reads = False  # the checked way: OPENAT through the ring, then one chain
        got = await _load(tier, pool, 2)
        assert got is not None and torch.equal(got, data[2])
        # An external, page-aligned buffer: plain or fixed buffers alike.
        region = memoryview(bytearray(2 * layout.page_bytes + 4096))
        address = ctypes.addressof(ctypes.c_char.from_buffer(region))
        start = -address % 4096
        buf = region[start : start + layout.page_bytes]
        io.chain_reads = True
        assert await asyncio.wait_for(tier.read_into(key_of(3), buf), TIMEOUT_S)
        assert torch.equal(torch.frombuffer(bytearray(buf[: layout.payload_bytes]), dtype=torch.uint8), data[3])
    assert checker.seen == {"new file", "recycled file", "read of an open file", "load chain",
                            "open through the ring"}, checker.seen
    assert checker.transfers >= 8
    assert_clean(pool)


async def _writes_and_reads(tier: DiskTier, pool: PagePool, count: int, base: int) -> None:
    handles = [fill(pool, key_of(base + i), base + i) for i in range(count)]
    data = [payload(pool, h) for h in handles]
    results = await asyncio.wait_for(
        asyncio.gather(*(tier.write(key_of(base + i), h) for i, h in enumerate(handles))), TIMEOUT_S)
    assert all(results)
    for h in handles:
        pool.table.release(h)
    pool.table.evict(pool.num_pages)
    got = await asyncio.wait_for(asyncio.gather(*(_load(tier, pool, base + i) for i in range(count))), TIMEOUT_S)
    for want, read in zip(data, got, strict=True):
        assert read is not None and torch.equal(read, want)


@pytest.mark.asyncio
async def test_inline_batches_cut_by_the_turn_deadline_all_run(tier: DiskTier, pool: PagePool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A zero deadline: each batch hashes one page, then asks for the next turn from inside the
    submission callback that runs it; 16 writes then 16 reads at once all end, verified."""
    monkeypatch.setattr(checksum_module, "DELIVER_TURN_S", 0.0)
    await _writes_and_reads(tier, pool, 16, 0)
    assert tier.statistics().in_flight == 0
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_batch_started_on_an_idle_ring_runs(tier: DiskTier, pool: PagePool) -> None:
    """Nothing in flight and nothing prepared for a while: the first write's hash (the first thing
    the turn does) still runs, and so does the first read's."""
    for round_ in range(3):
        await asyncio.sleep(0.05)
        assert tier.statistics().in_flight == 0
        await _writes_and_reads(tier, pool, 1, 100 + round_)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_close_right_after_writes_started_ends(disk_dir: Path, backend: DiskBackend, layout: KVLayout,
                                                     pool: PagePool) -> None:
    """Writes whose hashes are only queued for the next turn, then the close at once: every write
    ends (stored or not), the close ends, nothing is leaked."""
    tier = DiskTier(config(disk_dir, backend), layout, pool)
    await tier.start()
    handles = [fill(pool, key_of(i), i) for i in range(8)]
    writes = [asyncio.ensure_future(tier.write(key_of(i), h)) for i, h in enumerate(handles)]
    await asyncio.sleep(0)  # the writes start (hashes queued), the close follows in the same turn
    await asyncio.wait_for(tier.aclose(), TIMEOUT_S)
    results = await asyncio.wait_for(asyncio.gather(*writes), TIMEOUT_S)
    assert all(type(r) is bool for r in results)
    for h in handles:
        pool.table.release(h)
    assert tier.statistics().in_flight == 0
    assert_clean(pool)
