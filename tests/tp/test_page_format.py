"""Rank-major pages of a TP cache: ``[parts, L, T, rows / parts, D]``, one contiguous part per head slice.

Each rank moves its part of every page whole, with an ordinary whole-row mover over a strided view
of the pool, so a CUDA rank takes the STAGING path (one copy-engine memcpy per page) and never the
DIRECT kernel. The page format is in the layout fingerprint: caches of other TP splits over one
disk directory miss, they never read these bytes.

Rank workers run in this process (the async runner, on the test's loop: no process start-up), so
every layout case is cheap. The STAGING path runs its Triton kernels under the interpreter on a
CPU (``TRITON_INTERPRET=1``, set by ``tests/conftest.py`` without CUDA); the interpreter is not
thread-safe, so there each rank's :class:`RankExecutor` copies on the test's loop, one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from tp_helpers import CONFIG, expected_page, full_kv, rank_kv

from aiokv import CacheConfig, KVCache, KVLayout
from aiokv.kernels import TransferPath
from aiokv.keys import namespace_seed
from aiokv.layout import KVBuffer, TPSlice
from aiokv.storage import DiskConfig
from aiokv.tp import RankWorker, TPCache

MHA = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
MHA2 = KVLayout.mha(2, 2, 8, torch.bfloat16, page_tokens=4)
"""Two KV heads: TP 4 runs two replicas of each head."""
MLA = KVLayout.mla(2, 16, torch.bfloat16, page_tokens=4)
CASES = {"mha-tp2": (MHA, 2), "mha-tp4": (MHA, 4), "mla-tp2": (MLA, 2), "replicas-tp4": (MHA2, 4)}
SLOTS = 64
PAGES = 5


def _staging_usable() -> bool:
    from aiokv.kernels.paths import interpreting

    return torch.cuda.is_available() or interpreting()




def _config(layout: KVLayout, disk: Path | None) -> CacheConfig:
    tier = None if disk is None else DiskConfig(directory=disk, capacity_bytes=64 * (layout.page_bytes + 4096))
    return CacheConfig(
        cpu_bytes=16 * layout.page_bytes, disk=tier, namespace="tp-format", pool_chunk_bytes=4 * layout.page_bytes,
    )


# -- the format -------------------------------------------------------------------------------------


def test_page_format_per_tp_split() -> None:
    assert [MHA.for_tp(t).parts for t in (1, 2, 4)] == [1, 2, 4]
    assert MHA.for_tp(1) == MHA  # TP 1 pages are whole-row pages: same fingerprint, same files
    assert MHA2.for_tp(4).parts == 2  # replicas of a head share its part
    assert MLA.for_tp(2) == MLA  # the latent is replicated, not split: whole pages
    tp2 = MHA.for_tp(2)
    assert tp2.page_shape == (2, 2, 4, 4, 8) and tp2.page_bytes == MHA.page_bytes
    assert tp2.part_layout == KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4)
    assert [TPSlice.of(MHA, r, 2).part for r in range(2)] == [0, 1]
    assert [TPSlice.of(MHA2, r, 4).part for r in range(4)] == [0, 0, 1, 1]
    assert [TPSlice.of(MLA, r, 2).part for r in range(2)] == [0, 0]
    assert "2 rank-major parts" in tp2.describe()
    with pytest.raises(ValueError, match="divisible"):
        MHA.for_tp(3)
    with pytest.raises(ValueError, match="page parts"):
        KVLayout(MHA.kind, 2, 4, 8, torch.float16, 4, parts=3)
    with pytest.raises(ValueError, match="page parts"):
        KVLayout(MLA.kind, 2, 1, 16, torch.bfloat16, 4, parts=2)
    with pytest.raises(ValueError, match="rank-major"):
        KVBuffer.wrap(tp2, torch.zeros(2, 8, 8, 8, dtype=torch.float16))


def test_page_format_is_in_the_fingerprint_and_the_keys() -> None:
    prints = {MHA.fingerprint, MHA.for_tp(2).fingerprint, MHA.for_tp(4).fingerprint}
    assert len(prints) == 3
    seeds = {namespace_seed(layout, "ns") for layout in (MHA, MHA.for_tp(2), MHA.for_tp(4))}
    assert len(seeds) == 3


def test_rank_part_is_a_whole_row_buffer_of_the_part() -> None:
    full = full_kv(MHA2, 1, slots=8)
    for rank in range(4):
        kv = KVBuffer.wrap(MHA2, rank_kv(full, MHA2, rank, 4), TPSlice.of(MHA2, rank, 4))
        part = kv.rank_part()
        assert part.layout == MHA2.for_tp(4).part_layout and not part.is_partial
        assert part.tp.writer == (rank % 2 == 0)  # one replica of each head writes
        assert part.k_layers == kv.k_layers


# -- end to end, ranks in this process --------------------------------------------------------------


@contextlib.asynccontextmanager
async def _ranks(cache: TPCache, layout: KVLayout, tp: int, kvs: list[torch.Tensor],
                 path: TransferPath) -> AsyncIterator[list[RankWorker]]:
    workers = [RankWorker(cache.address, r, tp, layout, kvs[r], CONFIG, path=path) for r in range(tp)]
    async with contextlib.AsyncExitStack() as stack:
        for worker in workers:
            await stack.enter_async_context(worker)
        await cache.wait_ranks()
        for worker in workers:
            assert worker.statistics().transfer_path is path  # never DIRECT: each part is contiguous
        yield workers


def _assert_heads(kvs: list[torch.Tensor], full: torch.Tensor, layout: KVLayout, source: torch.Tensor,
                  target: torch.Tensor) -> None:
    for rank, kv in enumerate(kvs):
        want = rank_kv(full, layout, rank, len(kvs))[:, source]
        assert torch.equal(kv[:, target].view(torch.uint8), want.view(torch.uint8)), f"rank {rank} is not its heads"


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(CASES))
async def test_ranks_store_their_parts_and_load_them_back_from_pool_and_disk(case: str, tmp_path: Path) -> None:
    layout, tp = CASES[case]
    path = TransferPath.REFERENCE  # the STAGING path: test_staging_moves_each_part_with_one_copy_per_page
    t = layout.page_tokens
    n = PAGES * t
    full = full_kv(layout, 6, slots=SLOTS)
    tokens = list(range(900, 900 + n))
    source = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(4))[:n]
    target = torch.arange(SLOTS - 1, SLOTS - n, -1)  # descending, the first page partly (skip 1)
    blank = [torch.zeros_like(rank_kv(full, layout, r, tp)) for r in range(tp)]
    disk = tmp_path / "disk"
    async with TPCache(_config(layout, disk), layout, tp_size=tp, num_slots=SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "sock") as cache:
        assert cache.pool.layout == layout.for_tp(tp)
        writers = [rank_kv(full, layout, r, tp) for r in range(tp)]
        async with _ranks(cache, layout, tp, writers, path):
            assert (await cache.offload(tokens, source)).stored == PAGES
        keys = cache.keys(tokens)
        for i, key in enumerate(keys):  # the pool holds rank-major pages, every part from its writer
            handle = cache.pool.table.acquire(key)
            assert handle is not None
            try:
                want = expected_page(full, source[i * t : (i + 1) * t].tolist(), cache.pool.layout)
                assert torch.equal(cache.pool.tensor(handle).view(torch.uint8), want.view(torch.uint8))
            finally:
                cache.pool.table.release(handle)
        readers = [b.clone() for b in blank]
        async with _ranks(cache, layout, tp, readers, path):
            match = await cache.match(tokens)
            assert match.pool_pages == PAGES
            assert (await cache.load(match, target, from_token=1)).tokens == n
        _assert_heads(readers, full, layout, source[1:], target)
        await cache.flush()
    # A restarted cache serves the page files to fresh ranks.
    async with TPCache(_config(layout, disk), layout, tp_size=tp, num_slots=SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "sock") as cache:
        readers = [b.clone() for b in blank]
        async with _ranks(cache, layout, tp, readers, path):
            match = await cache.match(tokens)
            assert (match.pool_pages, match.disk_pages) == (0, PAGES)
            assert (await cache.load(match, torch.arange(n))).tokens == n
        _assert_heads(readers, full, layout, source, torch.arange(n))
        cache.pool.table.check_invariants()
        assert cache.stats().pool_reserved == 0 and cache.stats().pool_referenced == 0


@pytest.mark.asyncio
async def test_caches_of_other_tp_splits_over_one_directory_miss(tmp_path: Path) -> None:
    # Offload under TP 2, then open the directory as TP 4 and as one process (TP 1): both miss, and
    # the reverse too. Each page format has its own fingerprint directory and keys.
    layout = MHA
    t = layout.page_tokens
    n = 3 * t
    full = full_kv(layout, 8, slots=SLOTS)
    disk = tmp_path / "disk"
    tp2_tokens, tp1_tokens = list(range(100, 100 + n)), list(range(200, 200 + n))
    async with TPCache(_config(layout, disk), layout, tp_size=2, num_slots=SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "a") as cache:
        async with _ranks(cache, layout, 2, [rank_kv(full, layout, r, 2) for r in range(2)], TransferPath.REFERENCE):
            assert (await cache.offload(tp2_tokens, torch.arange(n))).stored == 3
            assert (await cache.offload(tp1_tokens, torch.arange(n))).stored == 3
        await cache.flush()
    async with KVCache(_config(layout, disk), layout, full.clone()) as one:
        assert (await one.match(tp2_tokens)).tokens == 0  # TP 2's pages are not whole-row pages
        assert (await one.offload(tp1_tokens, torch.arange(n))).stored == 3
        await one.flush()
    async with TPCache(_config(layout, disk), layout, tp_size=4, num_slots=SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "b") as cache:
        assert (await cache.match(tp2_tokens)).tokens == 0
        assert (await cache.match(tp1_tokens)).tokens == 0
    async with TPCache(_config(layout, disk), layout, tp_size=2, num_slots=SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "c") as cache:
        # Its own pages are still there; the one-process cache's (same tokens) are not its bytes.
        readers = [torch.zeros_like(rank_kv(full, layout, r, 2)) for r in range(2)]
        async with _ranks(cache, layout, 2, readers, TransferPath.REFERENCE):
            match = await cache.match(tp1_tokens)
            assert match.disk_pages == 3
            assert (await cache.load(match, torch.arange(n))).tokens == n
        _assert_heads(readers, full, layout, torch.arange(n), torch.arange(n))
    dirs = {p.name for p in disk.iterdir() if p.is_dir()}
    assert {layout.fingerprint.hex(), layout.for_tp(2).fingerprint.hex()} <= dirs


@pytest.mark.asyncio
@pytest.mark.skipif(not _staging_usable(), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("case", list(CASES))
async def test_staging_moves_each_part_with_one_copy_per_page(case: str) -> None:
    # Every rank's executor over the same rank-major pool takes STAGING (a partial rank once fell
    # back to DIRECT): its gather fills whole-part staging pages, each copied to its part of a pool
    # page through a strided view. The pool must hold exactly the rank-major reference, the other
    # pages untouched, and every rank must load its own heads back bit-exact.
    from aiokv.cuda import CompletionBridge
    from aiokv.pool import PagePool
    from aiokv.tp import Direction, RankExecutor, RankStatus, TransferSpec

    layout, tp = CASES[case]
    t = layout.page_tokens
    device = "cuda" if torch.cuda.is_available() else "cpu"
    full = full_kv(layout, 12, slots=SLOTS)
    page_ids = [6, 1, 3]  # not consecutive, not ascending
    source = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(8))[: len(page_ids) * t]
    target = torch.arange(5, 5 + len(page_ids) * t - 2)
    pool = PagePool.create(layout.for_tp(tp), 8 * layout.page_bytes, register_cuda=device == "cuda")
    bridge = CompletionBridge()
    executors: list[RankExecutor] = []
    try:
        await pool.wait_ready()
        pool.pages.view(torch.uint8).fill_(0x5A)
        before = pool.pages.clone()
        stream = torch.cuda.current_stream() if device == "cuda" else None
        buffers = [rank_kv(full, layout, rank, tp).to(device) for rank in range(tp)]
        for rank in range(tp):
            kv = KVBuffer.wrap(layout, buffers[rank], TPSlice.of(layout, rank, tp))
            executor = RankExecutor(kv, PagePool.attach(pool.name, pool.layout), 1, bridge, CONFIG, stream,
                                    TransferPath.STAGING, copy_on_loop=True)
            executors.append(executor)
            assert executor.transfer_path is TransferPath.STAGING
            report = await executor.execute(TransferSpec.build(1, Direction.OFFLOAD, 1, t, page_ids, source))
            assert report.status is RankStatus.OK, report
        for i, page in enumerate(page_ids):
            want = expected_page(full, source[i * t : (i + 1) * t].tolist(), pool.layout)
            assert torch.equal(pool.pages[page].view(torch.uint8), want.view(torch.uint8)), f"page {page}"
        others = [p for p in range(pool.num_pages) if p not in page_ids]
        assert torch.equal(pool.pages[others], before[others]), "a page outside the spec changed"
        for rank, executor in enumerate(executors):
            buffers[rank].zero_()
            report = await executor.execute(TransferSpec.build(2, Direction.LOAD, 1, t, page_ids, target, 2))
            assert report.status is RankStatus.OK, report
            got = buffers[rank].cpu()
            want = rank_kv(full, layout, rank, tp)[:, source[2:]]
            assert torch.equal(got[:, target].view(torch.uint8), want.view(torch.uint8)), f"rank {rank}"
    finally:
        for executor in executors:
            await executor.aclose()
        await asyncio.to_thread(bridge.close)
        await pool.aclose()
