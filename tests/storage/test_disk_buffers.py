"""`DiskTier.write_from` / `read_into` / `register_memory`: pages in a caller's memory, not the pool."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from disk_helpers import assert_clean, config, fill, gated, key_of, page_files, payload, reserve, spin

import aiokv.storage.memory as memory_mod
import aiokv.storage.uring as uring_mod
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.backends import HEADER_BYTES, UringPageIO


class Region:
    """Anonymous memory (page-aligned, like an engine's shared CPU region) cut into page views."""

    def __init__(self, pages: int, page_bytes: int, offset: int = 0) -> None:
        self.map = mmap.mmap(-1, pages * page_bytes + offset + 4096)
        self.page_bytes = page_bytes
        self.offset = offset
        self.whole = memoryview(self.map)

    def page(self, i: int) -> memoryview:
        start = self.offset + i * self.page_bytes
        return self.whole[start : start + self.page_bytes]

    def fill(self, i: int, seed: int) -> bytes:
        data = bytes((seed * 131 + j * 7 + (j >> 9)) & 0xFF for j in range(self.page_bytes))
        self.page(i)[:] = data
        return data

    def close(self) -> None:
        self.whole.release()
        self.map.close()


@pytest.fixture
def region(layout: KVLayout) -> Iterator[Region]:
    r = Region(8, layout.page_bytes)
    try:
        yield r
    finally:
        r.close()


def _submitted_opcodes(io: UringPageIO) -> list[tuple[int, int]]:
    """Records (opcode, buf_index) of every SQE the tier submits from now on."""
    seen: list[tuple[int, int]] = []
    real = io.engine.submit

    def spy(ops: list[uring_mod.SqeFields], keep: object, callback: Any, future: Any = None,
            expect: Any = None) -> None:
        seen.extend((op[0], op[9]) for op in ops)
        real(ops, keep, callback, future, expect)

    io.engine.submit = spy  # type: ignore[method-assign]
    return seen


# -- round trips ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_round_trip_from_and_into_caller_memory(tier: DiskTier, pool: PagePool, layout: KVLayout,
                                                      region: Region) -> None:
    sent = [region.fill(i, i + 1) for i in range(4)]
    for i in range(4):
        assert await tier.write_from(key_of(i), region.page(i))
    for i in range(4):
        region.page(4 + i)[:] = b"\xee" * layout.page_bytes
        assert await tier.read_into(key_of(i), region.page(4 + i))
        assert bytes(region.page(4 + i)) == sent[i]
    stats = tier.statistics()
    assert (stats.writes, stats.hits, stats.misses, stats.pages) == (4, 4, 0, 4)
    assert stats.bytes_written == stats.bytes_read == 4 * (layout.page_bytes + HEADER_BYTES)
    assert stats.buffered_fallbacks == 0  # mmap memory is aligned: O_DIRECT where the tier uses it
    assert await tier.write_from(key_of(0), region.page(0))  # already stored: True, no new write
    assert tier.statistics().writes == 4
    # The same file format as pool pages: a page written from a buffer reads into a pool page ...
    into = reserve(pool, key_of(100))
    assert await tier.read(key_of(1), into)
    assert bytes(pool.memory.page_view(pool.table.check(into))) == sent[1]
    pool.table.abort(into)
    # ... and a pool page into a buffer.
    h = fill(pool, key_of(50), 50)
    expect = payload(pool, h)
    assert await tier.write(key_of(50), h)
    pool.table.release(h)
    assert await tier.read_into(key_of(50), region.page(7))
    assert bytes(region.page(7))[: layout.payload_bytes] == bytes(expect.numpy())
    assert_clean(pool)


@pytest.mark.asyncio
async def test_read_only_buffer_writes(tier: DiskTier, layout: KVLayout, region: Region) -> None:
    data = os.urandom(layout.page_bytes)
    assert await tier.write_from(key_of(1), memoryview(data))  # bytes: read-only, any alignment
    assert await tier.read_into(key_of(1), region.page(0))
    assert bytes(region.page(0)) == data


@pytest.mark.asyncio
@pytest.mark.parametrize("offset", [1, 512])
async def test_unaligned_buffers_go_buffered(disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
                                            offset: int) -> None:
    r = Region(4, layout.page_bytes, offset)
    try:
        async with DiskTier(config(disk_dir, backend, direct_io=True), layout, pool) as tier:
            sent = [r.fill(i, i + 7) for i in range(2)]
            for i in range(2):
                assert await tier.write_from(key_of(i), r.page(i))
            for i in range(2):
                assert await tier.read_into(key_of(i), r.page(2 + i))
                assert bytes(r.page(2 + i)) == sent[i]
            stats = tier.statistics()
            assert stats.direct_io
            assert stats.buffered_fallbacks == 4  # counted, never an error
            assert (stats.hits, sum(stats.errors.values())) == (2, 0)
    finally:
        r.close()
    assert_clean(pool)


# -- register_memory --------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_registered_memory_uses_fixed_buffers(disk_dir: Path, layout: KVLayout, pool: PagePool,
                                                    region: Region) -> None:
    async with DiskTier(config(disk_dir, DiskBackend.AUTO), layout, pool) as tier:
        io = tier.backend
        assert isinstance(io, UringPageIO)
        await tier.register_memory(region.whole)
        assert tier.statistics().memory_unregistered == 0
        await io.wait_registered()  # the header slots are registered with the pool, in the background
        seen = _submitted_opcodes(io)
        sent = region.fill(0, 3)
        assert await tier.write_from(key_of(1), region.page(0))
        assert await tier.read_into(key_of(1), region.page(1))
        assert bytes(region.page(1)) == sent
        fixed = {op for op, _ in seen if op in (uring_mod.OP_WRITE_FIXED, uring_mod.OP_READ_FIXED)}
        assert fixed == {uring_mod.OP_WRITE_FIXED, uring_mod.OP_READ_FIXED}
        assert not {op for op, _ in seen} & {uring_mod.OP_WRITEV, uring_mod.OP_READV}
    assert_clean(pool)


@pytest.mark.asyncio
async def test_unregistered_memory_uses_plain_buffers(tier: DiskTier, backend: DiskBackend, layout: KVLayout,
                                                      region: Region) -> None:
    # Forced URING (plain buffers), forced URING_FIXED (a full table) and THREADS cannot register
    # a caller's region: counted, and its pages still round trip.
    await tier.register_memory(region.whole)
    assert tier.statistics().memory_unregistered == 1
    sent = region.fill(0, 9)
    assert await tier.write_from(key_of(1), region.page(0))
    assert await tier.read_into(key_of(1), region.page(1))
    assert bytes(region.page(1)) == sent


@pytest.mark.asyncio
async def test_register_memory_failure_falls_back(disk_dir: Path, layout: KVLayout, pool: PagePool, region: Region,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    real = uring_mod.io_uring_register
    refused: list[int] = []

    def no_memlock(fd: int, opcode: int, arg: object, nr: int) -> int:
        if opcode == uring_mod.IORING_REGISTER_BUFFERS_UPDATE:
            refused.append(opcode)
            raise OSError(errno.ENOMEM, "memlock (injected)")
        return real(fd, opcode, arg, nr)  # type: ignore[arg-type]

    monkeypatch.setattr(uring_mod, "io_uring_register", no_memlock)
    async with DiskTier(config(disk_dir, DiskBackend.AUTO), layout, pool) as tier:
        io = tier.backend
        assert isinstance(io, UringPageIO)
        await io.wait_registered()  # the pool's registration fails too: both fall back
        await tier.register_memory(region.whole)
        assert refused
        assert tier.statistics().memory_unregistered == 1
        seen = _submitted_opcodes(io)
        sent = region.fill(2, 5)
        assert await tier.write_from(key_of(1), region.page(2))
        assert await tier.read_into(key_of(1), region.page(3))
        assert bytes(region.page(3)) == sent
        assert {uring_mod.OP_WRITEV, uring_mod.OP_READV} <= {op for op, _ in seen}
    assert_clean(pool)


@pytest.mark.asyncio
async def test_registered_regions_hold_every_page(disk_dir: Path, layout: KVLayout, pool: PagePool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Registration cuts a large region into pieces; a page of the caller's (at any 4 KiB offset: the
    # tier does not know the engine's page boundaries) must lie whole inside one piece.
    monkeypatch.setattr(memory_mod, "REGISTER_REGION_BYTES", 8 * layout.page_bytes)
    r = Region(40, layout.page_bytes)
    try:
        async with DiskTier(config(disk_dir, DiskBackend.AUTO), layout, pool) as tier:
            io = tier.backend
            assert isinstance(io, UringPageIO)
            await tier.register_memory(r.whole)
            await io.wait_registered()
            assert len(io._ext_regions) > 4  # several pieces
            base = memory_mod.buffer_address(r.whole)
            for offset in range(0, len(r.whole) - layout.page_bytes + 1, 4096):
                assert io._external_region(base + offset) is not None, offset
            assert io._external_region(base + len(r.whole) - layout.page_bytes + 4096) is None
            seen = _submitted_opcodes(io)
            sent = []
            offsets = range(4096, 33 * 4096, 9 * 4096)  # pages straddling the pieces' ends
            for i, offset in enumerate(offsets):
                data = os.urandom(layout.page_bytes)
                r.whole[offset : offset + layout.page_bytes] = data
                sent.append(data)
                stored = await tier.write_from(key_of(i), r.whole[offset : offset + layout.page_bytes])
                assert stored
            at = len(r.whole) - 4096 - layout.page_bytes
            for i in range(len(sent)):
                got = await tier.read_into(key_of(i), r.whole[at : at + layout.page_bytes])
                assert got
                assert bytes(r.whole[at : at + layout.page_bytes]) == sent[i]
            assert {op for op, _ in seen} & {uring_mod.OP_WRITEV, uring_mod.OP_READV} == set()
    finally:
        r.close()
    assert_clean(pool)


# -- faults, cancellation, bad input ----------------------------------------------------------


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.asyncio
async def test_corrupt_file_is_a_miss(tier: DiskTier, layout: KVLayout, region: Region, disk_dir: Path) -> None:
    region.fill(0, 1)
    assert await tier.write_from(key_of(1), region.page(0))
    (path,) = page_files(disk_dir)
    _flip(path, HEADER_BYTES + layout.payload_bytes // 2)
    assert not await tier.read_into(key_of(1), region.page(1))
    stats = tier.statistics()
    assert (stats.corrupt, stats.misses, stats.pages) == (1, 1, 0)
    assert not await tier.read_into(key_of(1), region.page(1))  # now a plain miss
    await tier.aclose()  # waits for the unlink
    assert page_files(disk_dir) == []  # deleted


@pytest.mark.asyncio
async def test_cancelled_read_into_waits_for_its_io(tier: DiskTier, region: Region,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    sent = region.fill(0, 4)
    assert await tier.write_from(key_of(1), region.page(0))
    gate, entered = asyncio.Event(), asyncio.Event()
    monkeypatch.setattr(tier.backend, "start_load", gated(tier.backend.start_load, gate, entered))
    task = asyncio.create_task(tier.read_into(key_of(1), region.page(1)))
    await entered.wait()
    task.cancel()
    await spin(5)
    assert not task.done()  # the kernel may still write into the caller's buffer: keep the caller
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert tier.statistics().in_flight == 0
    monkeypatch.undo()
    assert await tier.read_into(key_of(1), region.page(2))  # the file is intact
    assert bytes(region.page(2)) == sent


@pytest.mark.asyncio
async def test_cancelled_write_from_waits_until_the_buffer_is_free(tier: DiskTier, region: Region,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    sent = region.fill(0, 6)
    gate, entered = asyncio.Event(), asyncio.Event()
    monkeypatch.setattr(tier.backend, "start_publish", gated(tier.backend.start_publish, gate, entered))
    task = asyncio.create_task(tier.write_from(key_of(1), region.page(0)))
    await entered.wait()
    task.cancel()
    await spin(5)
    assert not task.done()  # the write still reads the caller's buffer
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    stats = tier.statistics()
    assert (stats.in_flight, stats.writes) == (0, 1)  # the job finished: published
    region.page(0)[:] = b"\0" * len(sent)  # the caller may reuse its buffer now
    monkeypatch.undo()
    assert await tier.read_into(key_of(1), region.page(1))
    assert bytes(region.page(1)) == sent


@pytest.mark.asyncio
async def test_cancelled_read_into_waiting_for_a_slot_leaves_at_once(disk_dir: Path, backend: DiskBackend,
                                                                     layout: KVLayout, pool: PagePool,
                                                                     region: Region,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    async with DiskTier(config(disk_dir, backend, queue_depth=1), layout, pool) as tier:
        region.fill(0, 2)
        assert await tier.write_from(key_of(1), region.page(0))
        gate, entered = asyncio.Event(), asyncio.Event()
        monkeypatch.setattr(tier.backend, "start_load", gated(tier.backend.start_load, gate, entered))
        first = asyncio.create_task(tier.read_into(key_of(1), region.page(1)))
        await entered.wait()
        second = asyncio.create_task(tier.read_into(key_of(1), region.page(2)))
        await spin(3)
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second  # it held no slot: nothing touched its buffer
        gate.set()
        assert await first
    assert_clean(pool)


@pytest.mark.asyncio
async def test_bad_buffers_are_refused_before_anything_changes(tier: DiskTier, layout: KVLayout, region: Region,
                                                               disk_dir: Path) -> None:
    before = tier.statistics()
    pb = layout.page_bytes
    good = region.page(0)
    bad: list[tuple[Any, type[Exception]]] = [
        (bytearray(pb), TypeError),  # not a memoryview
        (region.whole[: pb - 1], ValueError),  # short
        (region.whole[: pb + 4096], ValueError),  # long
        (region.whole[: 2 * pb : 2], ValueError),  # strided: not C-contiguous
    ]
    for buffer, exc in bad:
        with pytest.raises(exc):
            await tier.write_from(key_of(1), buffer)
        with pytest.raises(exc):
            await tier.read_into(key_of(1), buffer)
    with pytest.raises(TypeError, match="writable"):
        await tier.read_into(key_of(1), memoryview(bytes(pb)))
    with pytest.raises(TypeError):
        await tier.write_from("key", good)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="16 bytes"):
        await tier.read_into(b"short", good)
    released = region.whole[:pb]
    released.release()
    with pytest.raises(ValueError, match="released"):
        await tier.write_from(key_of(1), released)
    with pytest.raises(TypeError):
        await tier.register_memory(bytearray(4096))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await tier.register_memory(memoryview(bytes(4096)))
    with pytest.raises(ValueError, match="empty"):
        await tier.register_memory(region.whole[:0])
    assert tier.statistics() == before
    assert page_files(disk_dir) == []


@pytest.mark.asyncio
async def test_buffer_calls_before_start_raise(disk_dir: Path, layout: KVLayout, pool: PagePool,
                                               region: Region) -> None:
    tier = DiskTier(config(disk_dir, DiskBackend.AUTO), layout, pool)
    with pytest.raises(RuntimeError):
        await tier.write_from(key_of(1), region.page(0))
    with pytest.raises(RuntimeError):
        await tier.read_into(key_of(1), region.page(0))
    with pytest.raises(RuntimeError):
        await tier.register_memory(region.whole)
