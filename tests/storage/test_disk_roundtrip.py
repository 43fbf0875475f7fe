"""Round trips, restart, index, capacity, write-behind and caller errors, on every backend."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from disk_helpers import assert_clean, config, fill, key_of, page_files, payload, reserve

from aiokv.layout import SUPPORTED_DTYPES, KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.backends import Loaded
from aiokv.storage.pagefile import HEADER_BYTES

LAYOUTS = [KVLayout.mha(2, 2, 64, dtype, page_tokens=16) for dtype in SUPPORTED_DTYPES] + [
    KVLayout.mla(3, 96, dtype, page_tokens=8) for dtype in SUPPORTED_DTYPES  # payload not 4096-aligned
]


async def _round_trip(tier: DiskTier, pool: PagePool, count: int, seed: int) -> None:
    handles = [fill(pool, key_of(i, seed), seed * 1000 + i) for i in range(count)]
    expect = [payload(pool, h) for h in handles]
    assert all(await asyncio.gather(*(tier.write(key_of(i, seed), h) for i, h in enumerate(handles))))
    for h in handles:
        pool.table.release(h)
    for i in range(count):
        assert tier.contains(key_of(i, seed))
        into = reserve(pool, key_of(100 + i, seed))
        pool.tensor(into).view(torch.uint8).zero_()
        assert await tier.read(key_of(i, seed), into)
        assert torch.equal(payload(pool, into), expect[i])
        pool.table.abort(into)


@pytest.mark.asyncio
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.describe().replace(" ", "_"))
async def test_round_trip_every_dtype_and_kind(tmp_path: Path, backend: DiskBackend, layout: KVLayout) -> None:
    pool = PagePool.create(layout, 16 * layout.page_bytes, register_cuda=False, workers=1)
    try:
        pool.wait_ready_blocking()
        async with DiskTier(config(tmp_path, backend), layout, pool) as tier:
            await _round_trip(tier, pool, 5, 1)
            stats = tier.statistics()
            assert stats.backend is backend
            assert stats.hits == 5
            assert stats.writes == 5
            assert stats.bytes_written == 5 * (HEADER_BYTES + layout.page_bytes)
        assert_clean(pool)
    finally:
        pool.close()


@pytest.mark.asyncio
async def test_restart_keeps_pages(disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    n = 20
    async with DiskTier(config(disk_dir, backend), layout, pool) as tier:
        handles = [fill(pool, key_of(i), i) for i in range(n)]
        expect = [payload(pool, h) for h in handles]
        assert all(await asyncio.gather(*(tier.write(key_of(i), h) for i, h in enumerate(handles))))
        for h in handles:
            pool.table.release(h)
    pool.table.evict(n)
    async with DiskTier(config(disk_dir, backend), layout, pool) as again:
        assert again.statistics().pages == n
        assert again.keys_present_prefix([key_of(i) for i in range(n)] + [key_of(999)]) == n
        for i in range(n):
            into = reserve(pool, key_of(i))
            assert await again.read(key_of(i), into)
            assert torch.equal(payload(pool, into), expect[i])
            pool.table.commit(into)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_files_modes_and_names(tier: DiskTier, pool: PagePool, layout: KVLayout, disk_dir: Path) -> None:
    h = fill(pool, key_of(7), 7)
    assert await tier.write(key_of(7), h)
    pool.table.release(h)
    (path,) = page_files(disk_dir)
    assert path == disk_dir / layout.fingerprint.hex() / key_of(7).hex()[:2] / key_of(7).hex()
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.stat().st_size == HEADER_BYTES + layout.page_bytes
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert (disk_dir / layout.fingerprint.hex()).stat().st_mode & 0o777 == 0o700


@pytest.mark.asyncio
async def test_miss_delete_and_rewrite(tier: DiskTier, pool: PagePool) -> None:
    into = reserve(pool, key_of(1))
    assert not await tier.read(key_of(2), into)  # never written
    h = fill(pool, key_of(3), 3)
    assert await tier.write(key_of(2), h)
    assert await tier.write(key_of(2), h)  # already stored: no second file
    assert tier.statistics().writes == 1
    await tier.delete(key_of(2))
    assert not tier.contains(key_of(2))
    assert not await tier.read(key_of(2), into)
    assert await tier.write(key_of(2), h)
    assert await tier.read(key_of(2), into)
    pool.table.release(h)
    pool.table.abort(into)
    stats = tier.statistics()
    assert (stats.hits, stats.misses, stats.corrupt) == (1, 2, 0)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_capacity_lru_eviction_and_drop(disk_dir: Path, backend: DiskBackend, layout: KVLayout,
                                              pool: PagePool) -> None:
    per_file = HEADER_BYTES + layout.page_bytes
    async with DiskTier(config(disk_dir, backend, capacity=3 * per_file), layout, pool) as tier:
        handles = [fill(pool, key_of(i), i) for i in range(5)]
        for i in range(3):
            assert await tier.write(key_of(i), handles[i])
        into = reserve(pool, key_of(50))
        assert await tier.read(key_of(0), into)  # 0 becomes most recent: 1 is the oldest
        assert await tier.write(key_of(3), handles[3])
        assert [tier.contains(key_of(i)) for i in range(4)] == [True, False, True, True]
        assert await tier.write(key_of(4), handles[4])
        assert [tier.contains(key_of(i)) for i in range(5)] == [True, False, False, True, True]
        stats = tier.statistics()
        assert stats.evictions == 2
        assert stats.bytes_stored == 3 * per_file
        pool.table.abort(into)
        for h in handles:
            pool.table.release(h)
    assert len(page_files(disk_dir / layout.fingerprint.hex())) == 3
    # A budget below one file drops every write, counted.
    async with DiskTier(config(disk_dir, backend, capacity=per_file - 1), layout, pool) as tiny:
        assert tiny.statistics().pages == 0  # the restart trimmed the index to the new budget
        h = fill(pool, key_of(9), 9)
        assert not await tiny.write(key_of(9), h)
        assert tiny.statistics().dropped == 1
        pool.table.release(h)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_touch_orders_eviction(disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    per_file = HEADER_BYTES + layout.page_bytes
    async with DiskTier(config(disk_dir, backend, capacity=3 * per_file), layout, pool) as tier:
        handles = [fill(pool, key_of(i), i) for i in range(5)]
        for i in range(3):
            assert await tier.write(key_of(i), handles[i])
        # Bad input first: nothing is touched, even the valid key before the bad one.
        with pytest.raises(TypeError):
            tier.touch(key_of(0))  # a single key, not an iterable of keys
        with pytest.raises(TypeError):
            tier.touch(7)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            tier.touch([key_of(0), "x" * 16])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="16 bytes"):
            tier.touch([key_of(0), b"short"])
        assert tier.touch([]) == 0
        # 0 and 1 become most recent (1 last); the unknown key is skipped: 2 is the oldest.
        assert tier.touch(iter([key_of(0), key_of(77), key_of(1)])) == 2
        assert await tier.write(key_of(3), handles[3])
        assert [tier.contains(key_of(i)) for i in range(4)] == [True, True, False, True]
        assert await tier.write(key_of(4), handles[4])  # then 0, touched before 1
        assert [tier.contains(key_of(i)) for i in range(5)] == [False, True, False, True, True]
        assert tier.statistics().evictions == 2
        for h in handles:
            pool.table.release(h)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_write_behind_owns_reference(tier: DiskTier, pool: PagePool) -> None:
    handles = [fill(pool, key_of(i), i) for i in range(12)]
    taken = [tier.write_behind_nowait(key_of(i), h) for i, h in enumerate(handles)]
    # 8 queue slots; the two workers may already hold a page or two.
    assert taken[:8] == [True] * 8
    refused = [h for h, ok in zip(handles, taken, strict=True) if not ok]
    for h in refused:
        await tier.write_behind(h.key, h)  # waits for room
    await tier.flush()
    for i in range(12):
        assert tier.contains(key_of(i))
    assert tier.statistics().writes == 12
    assert tier.statistics().write_behind_queued == 0
    assert_clean(pool)


@pytest.mark.asyncio
async def test_close_without_drain_drops_queue(disk_dir: Path, backend: DiskBackend, layout: KVLayout,
                                               pool: PagePool) -> None:
    tier = DiskTier(config(disk_dir, backend, drain_on_close=False), layout, pool)
    await tier.start()
    handles = [fill(pool, key_of(i), i) for i in range(8)]
    assert all(tier.write_behind_nowait(key_of(i), h) for i, h in enumerate(handles))
    await tier.aclose()
    await tier.aclose()  # idempotent
    stats = tier.statistics()
    assert stats.writes + stats.dropped == 8
    assert stats.write_behind_queued == 0
    h = fill(pool, key_of(20), 20)
    assert not tier.write_behind_nowait(key_of(20), h)  # closed: ownership not taken
    assert not await tier.write(key_of(20), h)
    pool.table.release(h)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_caller_errors_change_nothing(tier: DiskTier, pool: PagePool) -> None:
    h = fill(pool, key_of(1), 1)
    into = reserve(pool, key_of(2))
    with pytest.raises(ValueError, match="16 bytes"):
        await tier.write(b"short", h)
    with pytest.raises(TypeError):
        await tier.write("not bytes" * 2, h)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await tier.read(key_of(1), 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reservation"):
        await tier.write(key_of(2), into)  # a reserved page has no data yet
    with pytest.raises(ValueError, match="not a reservation"):
        await tier.read(key_of(1), h)
    with pytest.raises(ValueError, match="reservation"):
        tier.write_behind_nowait(key_of(2), into)
    with pytest.raises(TypeError):
        tier.contains(123)  # type: ignore[arg-type]
    pool.table.release(h)
    with pytest.raises(ValueError, match="released"):
        await tier.write(key_of(1), h)
    with pytest.raises(ValueError, match="released"):
        tier.write_behind_nowait(key_of(1), h)
    pool.table.abort(into)
    assert tier.statistics().writes == 0
    assert tier.statistics().reads == 0
    assert_clean(pool)


def test_config_validates() -> None:
    assert config("dir", DiskBackend.AUTO).directory == Path("dir")  # type: ignore[arg-type]  # a str is kept as a Path
    with pytest.raises(TypeError):
        config(1, DiskBackend.AUTO)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="queue_depth"):
        config(Path("d"), DiskBackend.AUTO, queue_depth=0)
    with pytest.raises(TypeError):
        config(Path("d"), "uring")  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_not_started_raises(disk_dir: Path, layout: KVLayout, pool: PagePool) -> None:
    tier = DiskTier(config(disk_dir, DiskBackend.AUTO), layout, pool)
    h = fill(pool, key_of(1), 1)
    with pytest.raises(RuntimeError, match="not started"):
        await tier.write(key_of(1), h)
    pool.table.release(h)
    with pytest.raises(ValueError, match="layout"):
        DiskTier(config(disk_dir, DiskBackend.AUTO), KVLayout.mla(1, 64, torch.float16), pool)


@pytest.mark.asyncio
async def test_full_tier_recycles_evicted_files(disk_dir: Path, backend: DiskBackend, layout: KVLayout,
                                                pool: PagePool) -> None:
    per_file = HEADER_BYTES + layout.page_bytes
    async with DiskTier(config(disk_dir, backend, capacity=4 * per_file), layout, pool) as tier:
        expect = {}
        for i in range(10):
            h = fill(pool, key_of(i), i)
            expect[i] = payload(pool, h)
            assert await tier.write(key_of(i), h)
            pool.table.release(h)
        stats = tier.statistics()
        assert (stats.pages, stats.evictions, stats.recycled) == (4, 6, 6)
        assert stats.bytes_stored == 4 * per_file
        for i in range(6, 10):
            into = reserve(pool, key_of(100 + i))
            assert await tier.read(key_of(i), into)
            assert torch.equal(payload(pool, into), expect[i])
            pool.table.abort(into)
    assert len(page_files(disk_dir)) == 4
    assert_clean(pool)


@pytest.mark.asyncio
async def test_recycling_skips_a_file_being_read(disk_dir: Path, backend: DiskBackend, layout: KVLayout,
                                                 pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    per_file = HEADER_BYTES + layout.page_bytes
    async with DiskTier(config(disk_dir, backend, capacity=2 * per_file), layout, pool) as tier:
        expect = {}
        for i in (1, 2):
            h = fill(pool, key_of(i), i)
            expect[i] = payload(pool, h)
            assert await tier.write(key_of(i), h)
            pool.table.release(h)
        gate, entered = asyncio.Event(), asyncio.Event()
        real_load = tier.backend.start_load
        held: list[asyncio.Task[None]] = []

        def gated_load(dir_fd: int, name: str, slot: int, page: int, done: Loaded) -> None:
            if name != tier.files.name(key_of(1)):
                real_load(dir_fd, name, slot, page, done)
                return
            entered.set()

            async def later() -> None:
                await gate.wait()
                real_load(dir_fd, name, slot, page, done)

            held.append(asyncio.create_task(later()))

        monkeypatch.setattr(tier.backend, "start_load", gated_load)
        into1 = reserve(pool, key_of(101))
        reading = asyncio.create_task(tier.read(key_of(1), into1))
        await entered.wait()
        into2 = reserve(pool, key_of(102))
        assert await tier.read(key_of(2), into2)  # key 1 is now the LRU file, with a read open
        pool.table.abort(into2)
        h = fill(pool, key_of(3), 3)
        assert await tier.write(key_of(3), h)  # recycles key 2's file, not key 1's
        pool.table.release(h)
        assert [tier.contains(key_of(i)) for i in (1, 2, 3)] == [True, False, True]
        gate.set()
        assert await reading
        assert torch.equal(payload(pool, into1), expect[1])
        pool.table.abort(into1)
        assert tier.statistics().recycled == 1
    assert_clean(pool)


def test_public_api_is_pinned() -> None:
    import aiokv.storage

    assert sorted(aiokv.storage.__all__) == ["DiskBackend", "DiskConfig", "DiskStatistics", "DiskTier", "ErrorKind",
                                             "ReadOnly"]
    assert [b.value for b in DiskBackend] == ["auto", "uring_fixed", "uring", "threads"]
