"""HostGather on a real PagePool, end to end through KVCache (helper-140's review of 8e6dd2b).

What the property test (``test_host_gather_props``) does not build: the pool is a real
:class:`~aiokv.pool.PagePool` (one shared-memory segment prepared in several chunks, pages padded to
``page_bytes``), written by the real mover through :meth:`KVCache.offload` (the cache's own slot
checks, launch groups and page choices). Every mover offload is checked against
:func:`reference_gather` on the whole segment: the segment is filled with a sentinel first, and
each call's bytes after must equal the reference's on a copy of the bytes before (other pages,
padding, other ranks' rows untouched). The pool is filled first and a random part of it freed, so
the groups get fragmented page lists (several runs, descending, the pool's last chunk). The engine
buffer must be unchanged. Then every prompt is loaded back (into zeroed slots) and compared bit-exact
with the slots it was offloaded from. Last, the TP executor's mover over ``pages[:, part]`` of a
real rank-major pool: every rank in turn, each call against the reference on the whole segment.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cache"))
from cache_helpers import config, mover_of, prompt

from aiokv import KVCache, KVLayout
from aiokv.kernels import PageMover, reference_gather
from aiokv.kernels import hostcopy as hostcopy_module
from aiokv.layout import KVBuffer, TPSlice
from aiokv.pool import PagePool

PROMPTS = 14
POOL_PAGES = 48
FREED = 34
SLOTS = 160


def _engine(layout: KVLayout, form: str, gen: torch.Generator, tp_size: int) -> tuple[object, list[torch.Tensor]]:
    """The engine's buffer as the cache takes it, and its tensors (to compare and to clone)."""
    rows, dim, layers = layout.rows, layout.head_dim, layout.num_layers
    if layout.kind.value != "mla":
        rows //= tp_size  # this rank's heads

    def rand(*shape: int) -> torch.Tensor:
        return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen).view(torch.float16).to(
            layout.dtype) if layout.dtype.itemsize != 2 else torch.randint(
            0, 2**16, shape, dtype=torch.int32, generator=gen).to(torch.int16).view(layout.dtype)

    if form == "stacked":
        kv = rand(layers, SLOTS, rows, dim)
        return kv, [kv]
    if form == "slot_major":  # [S, L, rows, D] storage, seen as [L, S, rows, D]: layers interleaved
        kv = rand(SLOTS, layers, rows, dim).transpose(0, 1)
        return kv, [kv]
    if form == "per_layer":
        ts = [rand(SLOTS, rows, dim) for _ in range(layers)]
        return ts, ts
    heads = rows // 2
    ks = [rand(SLOTS, heads, dim) for _ in range(layers)]
    vs = [rand(SLOTS, heads, dim) for _ in range(layers)]
    return (ks, vs), ks + vs


def _slots_of(engine: object, slots: torch.Tensor) -> list[torch.Tensor]:
    """Every tensor's rows at ``slots`` (the slot axis: 1 of a stacked buffer, else 0)."""
    if isinstance(engine, torch.Tensor):
        return [engine[:, slots].clone()]
    tensors = [t for part in engine for t in part] if isinstance(engine, tuple) else engine  # type: ignore[union-attr]
    return [t[slots].clone() for t in tensors]


def _draw_slots(gen: torch.Generator, n: int, tokens: int) -> torch.Tensor:
    how = int(torch.randint(0, 5, (1,), generator=gen))
    if how == 0:  # a run, to the end of the buffer sometimes
        start = int(torch.randint(0, SLOTS - n + 1, (1,), generator=gen))
        values = torch.arange(start, start + n)
    elif how == 1:  # spread
        values = torch.randperm(SLOTS, generator=gen)[:n]
    elif how == 2:  # a block table: each page a run, the blocks apart
        blocks = torch.randperm(SLOTS // tokens, generator=gen)[: -(-n // tokens)]
        values = (blocks[:, None] * tokens + torch.arange(tokens)).flatten()[:n]
    elif how == 3:  # descending
        start = int(torch.randint(n - 1, SLOTS, (1,), generator=gen))
        values = torch.arange(start, start - n, -1)
    else:  # a strided int32 view
        values = torch.stack([torch.randperm(SLOTS, generator=gen)[:n], torch.zeros(n, dtype=torch.int64)], 1)[:, 0]
        return values.to(torch.int32)
    return values


def _eq(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact (random bits make NaNs: a float compare would fail them)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _segment_bytes(cache: KVCache) -> torch.Tensor:
    segment = cache.pool.memory.segment
    return torch.frombuffer(segment.buffer, dtype=torch.uint8, count=segment.size)


CASES = [
    ("mha-f16-stacked", KVLayout.mha(3, 2, 8, torch.float16, page_tokens=4), "stacked", 1, 0),
    ("mha-bf16-slot-major", KVLayout.mha(2, 2, 4, torch.bfloat16, page_tokens=3), "slot_major", 1, 0),
    ("mha-f32-per-layer", KVLayout.mha(2, 1, 8, torch.float32, page_tokens=5), "per_layer", 1, 0),
    ("mha-f16-split", KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4), "split", 1, 0),
    ("mha-f16-tp-rank1", KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4), "stacked", 2, 1),
    ("mla-bf16", KVLayout.mla(2, 24, torch.bfloat16, page_tokens=4), "stacked", 1, 0),
    ("mla-tp-replica", KVLayout.mla(2, 24, torch.bfloat16, page_tokens=4), "per_layer", 2, 1),
]


@pytest.fixture(params=[None, 1, 2], ids=["chunk-2MiB", "chunk-1-page", "chunk-2-pages"])
def chunk_pages(request: pytest.FixtureRequest) -> int | None:
    """Pages of one index_select temporary (None: CHUNK_BYTES as shipped, every group one chunk)."""
    return request.param


@pytest.mark.asyncio
@pytest.mark.parametrize(("layout", "form", "tp_size", "rank"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_offloads_into_a_real_page_pool_match_the_reference_byte_for_byte(
        layout: KVLayout, form: str, tp_size: int, rank: int, chunk_pages: int | None) -> None:
    gen = torch.Generator().manual_seed(140)
    engine, tensors = _engine(layout, form, gen, tp_size)
    # The pool in chunks of 3 pages: 16 chunks.
    cfg = dataclasses.replace(config(None, pool_pages=POOL_PAGES, layout=layout, tp_size=tp_size, tp_rank=rank),
                              pool_chunk_bytes=3 * layout.page_bytes)
    chunk_bytes = hostcopy_module.CHUNK_BYTES if chunk_pages is None else chunk_pages * layout.payload_bytes + 1
    with mock.patch.object(hostcopy_module, "CHUNK_BYTES", chunk_bytes):  # read when the mover is built
        async with KVCache(cfg, layout, engine) as cache:
            await _check(cache, engine, tensors, layout, chunk_pages, gen)


async def _check(cache: KVCache, engine: object, tensors: list[torch.Tensor], layout: KVLayout,
                 chunk_pages: int | None, gen: torch.Generator) -> None:
    tokens = layout.page_tokens
    engine_before = [t.clone() for t in tensors]
    await cache.wait_started()
    await cache.pool.wait_ready()  # every chunk prepared before the sentinel goes in
    assert cache.pool.statistics().chunks_total >= 10, "the pool should be prepared in many chunks"
    seg = _segment_bytes(cache)
    seg.fill_(0xA5)  # the sentinel: every byte no offload should write
    mover = mover_of(cache)
    assert mover._host_gather is not None, "the CPU mover does not go by HostGather"
    if chunk_pages is not None:
        assert mover._host_gather._chunk == chunk_pages
    calls: list[list[int]] = []
    original = mover._host_gather.offload

    def checked(slots: torch.Tensor, ids: list[int]) -> None:
        before = seg.clone()
        pages = cache.pool.pages
        expect = before.clone()
        view = expect.view(pages.dtype).as_strided(pages.shape, pages.stride(), pages.storage_offset())
        reference_gather(mover.kv, slots, view, ids, True)
        original(slots, ids)
        if not torch.equal(seg, expect):
            bad = (seg != expect).nonzero().flatten()
            raise AssertionError(f"pool bytes differ from the reference at {bad[:8].tolist()} (ids {ids})")
        calls.append(list(ids))

    mover._host_gather.offload = checked  # type: ignore[method-assign]
    # Fill the pool with one-page prompts, then free a random part of them: the prompts under
    # test get pages from a fragmented free list (several runs, across chunks, the pool's end).
    fillers = [prompt(5000 + j, tokens) for j in range(POOL_PAGES)]
    for j, toks in enumerate(fillers):
        assert (await cache.offload(toks, torch.arange(j % (SLOTS // tokens) * tokens, ((j % (SLOTS // tokens)) + 1)
                                                        * tokens))).dropped == 0
    await cache.flush()
    freed = [POOL_PAGES - 1, *torch.randperm(POOL_PAGES - 1, generator=gen).tolist()[: FREED - 1]]
    for j in freed:
        for key in cache.keys(fillers[j]):
            assert cache.pool.table.discard(key) or not mover.kv.tp.writer
    calls.clear()
    offloaded = []
    budget = FREED
    for i in range(PROMPTS):
        count = min(budget, 1 + int(torch.randint(0, 5, (1,), generator=gen)))
        if count == 0:
            break
        budget -= count
        n = count * tokens + int(torch.randint(0, tokens, (1,), generator=gen))
        toks = prompt(1000 + i, n)
        slots = _draw_slots(gen, n, tokens)
        result = await cache.offload(toks, slots)
        assert result.dropped == 0, result
        await cache.flush()
        offloaded.append((toks, slots[: count * tokens].to(torch.int64), count))
    assert all(_eq(a, b) for a, b in zip(tensors, engine_before, strict=True)), "the buffer was written"
    if mover.kv.tp.writer:
        assert sum(map(len, calls)) == sum(c for _, _, c in offloaded), calls
        assert any(len(c) > 1 and c != list(range(c[0], c[0] + len(c))) for c in calls), calls
        assert any(max(c) >= POOL_PAGES - 3 for c in calls), calls  # the pool's last chunk
    else:
        assert calls == [] and bool((seg == 0xA5).all()), "a TP replica wrote the pool"
        return

    for toks, slots, count in offloaded:
        match = await cache.match(toks)
        assert match.tokens == count * tokens, (match.tokens, count)
        target = torch.randperm(SLOTS, generator=gen)[: match.tokens]
        # Into this cache's own buffer, the target slots zeroed first.
        for t in tensors:
            if t.dim() == 4:
                t[:, target] = 0
            else:
                t[target] = 0
        await cache.load(match, target)
        got = _slots_of(engine, target)
        want = [e[:, slots] if e.dim() == 4 else e[slots] for e in engine_before]
        for g_, w_ in zip(got, want, strict=True):
            assert _eq(g_, w_), toks[:3]
        for t, e in zip(tensors, engine_before, strict=True):
            t.copy_(e)


@pytest.mark.asyncio
@pytest.mark.parametrize(("tp_size", "heads"), [(2, 4), (4, 4), (4, 2)])
async def test_ranks_offload_into_their_parts_of_a_real_rank_major_pool(tp_size: int, heads: int) -> None:
    """The TP executor's mover: ``pages[:, part]`` of a rank-major PagePool (pages padded, prepared
    in chunks of 3). Every rank, writer or replica, offloads the same pages in turn (a fragmented
    list: runs, descending, the pool's last page); each call leaves the whole segment as the
    reference would, so no rank writes another's part, the padding or other pages."""
    layout = KVLayout.mha(2, heads, 8, torch.float16, page_tokens=4)
    pool_layout = layout.for_tp(tp_size)
    count = 13
    pool = await PagePool.open(pool_layout, count * pool_layout.page_bytes, register_cuda=False,
                               chunk_bytes=3 * pool_layout.page_bytes)
    try:
        await pool.wait_ready()
        seg = torch.frombuffer(pool.memory.segment.buffer, dtype=torch.uint8, count=pool.memory.segment.size)
        seg.fill_(0x5A)
        gen = torch.Generator().manual_seed(141)
        groups = [[12], [5], [11, 10, 9], [0, 5, 6, 7, 12, 1], [3, 4], [1, 2, 9], [8, 2, 12, 0, 11]]
        for rank in range(tp_size):
            tp = TPSlice.of(layout, rank, tp_size)
            buf = torch.randint(0, 2**16, (2, SLOTS, 2 * tp.local_heads, 8), dtype=torch.int32, generator=gen)
            kv = KVBuffer.wrap(layout, buf.to(torch.int16).view(torch.float16), tp)
            part = kv.rank_part()
            pages = pool.memory.pages[:, tp.part]
            mover = PageMover(part, pages)
            assert mover._host_gather is not None
            for ids in groups:
                slots = _draw_slots(gen, len(ids) * 4, 4)
                expect = seg.clone()
                view = expect.view(torch.float16).as_strided(pages.shape, pages.stride(), pages.storage_offset())
                reference_gather(part, slots, view, ids)
                with mock.patch.object(hostcopy_module, "reference_gather", side_effect=AssertionError("reference")):
                    mover.offload(slots, ids)
                assert torch.equal(seg, expect), (rank, ids, (seg != expect).nonzero().flatten()[:8].tolist())
            del mover, pages
        assert not bool((seg == 0x5A).all()), "nothing was written"
    finally:
        seg = None
        await pool.aclose()
