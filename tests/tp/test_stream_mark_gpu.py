"""On a CUDA rank, a TP load stream's copies are ordered after the mark the rank recorded on its
engine's stream when the stream began, not after the engine's stream at each copy's launch.

As in one process (``tests/cache/test_stream_copies_after_start.py``): copies ordered behind every
chunk the engine queued meanwhile landed only once those chunks had run, and ``finish()`` waited
for them (~40 ms at the meeting point of an 8K split on the H200). Each rank records its mark as it
reads the manager's STREAM_BEGINS frame, sent by ``start_load``; the mark covers all the rank's
engine queued before it (and so everything queued before ``start_load``), and nothing queued after.

The manager and two CUDA ranks (thread runners) share this process and the GPU; the test is the
engine of both ranks, on one non-default engine stream (a mark recorded on the wrong stream, the
worker thread's default one, would miss the engine's work). Skipped without CUDA.

The engine's announcement (``RankWorker.begin_stream``, the last tests): ranks on this test's loop
read the frame only when the loop turns, as a rank whose runner shares the engine's loop does, so a
chunk the engine queues between ``start_load`` and that read is covered by the frame's mark. The
engine announces the stream before queuing its chunk: the mark is recorded then, and the copies do
not wait for the chunk (without the announcement they do: the control test).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from tp_helpers import CONFIG, full_kv, rank_kv

from aiokv import CacheConfig, KVLayout
from aiokv.tp import RankExecutor, RankWorker, RankWorkerThread, TPCache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LAYOUT = KVLayout.mha(4, 8, 128, torch.bfloat16, page_tokens=16)
T = LAYOUT.page_tokens
TP = 2
SLOTS = 256
N = 4 * T
MARK = 7.0
BOUND_S = 60.0
SLEEP_CYCLES = 2_000_000_000  # ~1 s of one GPU thread spinning (400M cycles took ~0.2 s on the H200)


@dataclass
class Ranks:
    cache: TPCache
    kv: list[torch.Tensor]
    runners: list[RankWorkerThread]
    engine: torch.cuda.Stream
    tokens: list[int]
    marked: threading.Semaphore
    """Released once per mark a rank recorded (on its worker thread)."""


@pytest_asyncio.fixture
async def ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Ranks]:
    marked = threading.Semaphore(0)
    begin = RankExecutor.begin_stream

    def begin_and_tell(self: RankExecutor, stream: int) -> None:  # the real one, then a signal
        begin(self, stream)
        marked.release()

    monkeypatch.setattr(RankExecutor, "begin_stream", begin_and_tell)
    engine = torch.cuda.Stream()
    kv = [rank_kv(full_kv(LAYOUT, 41, SLOTS), LAYOUT, r, TP).cuda() for r in range(TP)]
    config = CacheConfig(cpu_bytes=32 * LAYOUT.for_tp(TP).page_bytes, disk=None, namespace="tp-stream-mark-gpu",
                         launch_pages=1, launch_turn_s=0)
    async with TPCache(config, LAYOUT, tp_size=TP, num_slots=SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "sock") as cache:
        runners = [RankWorkerThread(cache.address, r, TP, LAYOUT, kv[r], CONFIG, engine_stream=engine)
                   for r in range(TP)]
        for runner in runners:
            runner.start()
        try:
            async with asyncio.timeout(BOUND_S):
                await cache.wait_ranks()
            for runner in runners:
                await asyncio.to_thread(runner.wait_warm, BOUND_S)
            tokens = list(range(3000, 3000 + N))
            assert (await cache.offload(tokens, torch.arange(N))).stored == N // T  # registers the pool too
            torch.cuda.synchronize()
            yield Ranks(cache, kv, runners, engine, tokens, marked)
            assert cache.stats().pool_referenced == 0
        finally:
            for runner in runners:
                await asyncio.to_thread(runner.close, BOUND_S)


def load_module(kvs: list[torch.Tensor], slots: torch.Tensor) -> None:
    """Launch the engine's "writes" once before the sleep: a kernel's first launch in a process
    loads its module (CUDA lazy loading), which waits for the device to go idle; after the sleep it
    blocked the host ~1 s on the H200 (tests/cache/test_stream_copies_after_start.py)."""
    for kv in kvs:
        kv.index_fill_(1, slots, -MARK)  # not the mark: the engine's own write must still land last
    torch.cuda.synchronize()


@pytest.mark.slow(seconds=14)
@pytest.mark.asyncio
async def test_a_rank_s_copies_do_not_wait_for_chunks_its_engine_queued_after_the_stream_began(ranks: Ranks) -> None:
    cache, engine = ranks.cache, ranks.engine
    sources = [kv[:, :N].clone() for kv in ranks.kv]
    target = torch.arange(40, 40 + N)
    on_device = target.cuda()  # before the sleep: a pageable copy would wait for it
    load_module(ranks.kv, on_device[:T])
    stream = cache.start_load(await cache.match(ranks.tokens), target)
    # No await until the chunk is queued: the loader sends no spec before it. The ranks read the
    # stream's start on their own threads meanwhile; wait (blocking this loop) until both recorded
    # their mark, so the chunk below is queued after the marks, as a rank's engine does it once
    # the stream began.
    for _ in range(TP):
        assert ranks.marked.acquire(timeout=BOUND_S), "a rank never recorded the stream's mark"
    assert stream.claim(T) == T
    with torch.cuda.stream(engine):
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        for kv in ranks.kv:
            # index_fill_: the scalar is a kernel argument (kv[...] = MARK would copy it from
            # pageable memory and block the host until the sleep ends).
            kv.index_fill_(1, on_device[:T], MARK)
        chunk_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        chunk_done.record(engine)
    assert not chunk_done.query(), "the host waited for the sleep: the test would not test the order"
    async with asyncio.timeout(BOUND_S):
        result = await stream.finish()
    assert not chunk_done.query(), "a rank's copies waited for a chunk its engine queued after the stream began"
    assert result.loaded_from == T and result.pool_pages == N // T - 1, result
    torch.cuda.synchronize()
    for rank, kv in enumerate(ranks.kv):
        # The engine's stream is still ordered after the copies, and the claimed page is its own.
        assert torch.equal(kv[:, on_device[T:]], sources[rank][:, T:N]), f"rank {rank}"
        assert bool((kv[:, on_device[:T]] == MARK).all()), f"rank {rank}"
    for runner in ranks.runners:
        stats = await asyncio.to_thread(runner.statistics)
        assert (stats.stream_marks, stats.stream_marks_failed, stats.stream_marks_missed) == (1, 0, 0), stats


@pytest.mark.asyncio
async def test_a_rank_s_copies_still_wait_for_its_engine_s_work_queued_before_the_stream(ranks: Ranks) -> None:
    # A kernel queued on the engine's stream before start_load that writes the slots (a previous
    # owner's, say) runs first: the loaded bytes land after it, not under it. A mark recorded on
    # another stream than the engine's (the worker thread's current one) would let them land first.
    cache, engine = ranks.cache, ranks.engine
    sources = [kv[:, :N].clone() for kv in ranks.kv]
    target = torch.arange(40, 40 + N)
    on_device = target.cuda()
    load_module(ranks.kv, on_device)
    with torch.cuda.stream(engine):
        torch.cuda._sleep(SLEEP_CYCLES // 4)  # type: ignore[no-untyped-call]
        for kv in ranks.kv:
            kv.index_fill_(1, on_device, MARK)  # no host sync (see above): queued behind the sleep
        queued = torch.cuda.Event()  # type: ignore[no-untyped-call]
        queued.record(engine)
    stream = cache.start_load(await cache.match(ranks.tokens), target)
    assert not queued.query(), "the host waited for the sleep: the test would not test the order"
    async with asyncio.timeout(BOUND_S):
        result = await stream.finish()
    assert result.loaded_from == 0, result
    torch.cuda.synchronize()
    for rank, kv in enumerate(ranks.kv):
        assert torch.equal(kv[:, on_device], sources[rank]), f"rank {rank}: a copy ran before the engine's earlier work"
    for runner in ranks.runners:  # ordered by the mark, not at launch (which would also cover the fill)
        stats = await asyncio.to_thread(runner.statistics)
        assert (stats.stream_marks, stats.stream_marks_failed, stats.stream_marks_missed) == (1, 0, 0), stats


# -- the engine's announcement ---------------------------------------------------------------------


@dataclass
class LoopRanks:
    cache: TPCache
    kv: list[torch.Tensor]
    workers: list[RankWorker]
    """Both ranks' workers, on this test's loop: they read a frame only when the loop turns."""
    engine: torch.cuda.Stream
    tokens: list[int]


@pytest_asyncio.fixture
async def loop_ranks(tmp_path: Path) -> AsyncIterator[LoopRanks]:
    engine = torch.cuda.Stream()
    kv = [rank_kv(full_kv(LAYOUT, 43, SLOTS), LAYOUT, r, TP).cuda() for r in range(TP)]
    config = CacheConfig(cpu_bytes=32 * LAYOUT.for_tp(TP).page_bytes, disk=None, namespace="tp-stream-announce-gpu",
                         launch_pages=1, launch_turn_s=0)
    async with TPCache(config, LAYOUT, tp_size=TP, num_slots=SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "sock") as cache, contextlib.AsyncExitStack() as stack:
        workers = [await stack.enter_async_context(
                       RankWorker(cache.address, r, TP, LAYOUT, kv[r], CONFIG, engine_stream=engine))
                   for r in range(TP)]
        async with asyncio.timeout(BOUND_S):
            await cache.wait_ranks()
            for worker in workers:
                await worker.wait_warm()
        tokens = list(range(5000, 5000 + N))
        assert (await cache.offload(tokens, torch.arange(N))).stored == N // T  # registers the pool too
        torch.cuda.synchronize()
        yield LoopRanks(cache, kv, workers, engine, tokens)
        assert cache.stats().pool_referenced == 0


async def _claimed_chunk_then_finish(ranks: LoopRanks, announce: bool) -> bool:
    """Start a stream; announce it on every rank (or not); queue a long chunk (a sleep, then the
    claimed first page's write) on the engine's stream before any await, so before the ranks read
    the frame; finish the stream. Returns whether the chunk was done when ``finish`` returned;
    checks the bytes."""
    cache, engine = ranks.cache, ranks.engine
    sources = [kv[:, :N].clone() for kv in ranks.kv]
    target = torch.arange(40, 40 + N)
    on_device = target.cuda()  # before the sleep: a pageable copy would wait for it
    load_module(ranks.kv, on_device[:T])
    stream = cache.start_load(await cache.match(ranks.tokens), target)
    assert stream.stream_id > 0
    if announce:
        # The engine's step carrying the stream begins: each rank records its mark now, on the
        # engine's stream, before the chunk below is queued.
        for worker in ranks.workers:
            assert worker.begin_stream(stream.stream_id, stream.epoch) is True
    assert stream.claim(T) == T
    with torch.cuda.stream(engine):
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        for kv in ranks.kv:
            kv.index_fill_(1, on_device[:T], MARK)  # the scalar is a kernel argument: no host sync
        chunk_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        chunk_done.record(engine)
    assert not chunk_done.query(), "the host waited for the sleep: the test would not test the order"
    async with asyncio.timeout(BOUND_S):
        result = await stream.finish()  # the ranks read the frame (and the specs) from here on
    waited = chunk_done.query()
    assert result.loaded_from == T and result.pool_pages == N // T - 1, result
    torch.cuda.synchronize()
    for rank, kv in enumerate(ranks.kv):
        assert torch.equal(kv[:, on_device[T:]], sources[rank][:, T:N]), f"rank {rank}"
        assert bool((kv[:, on_device[:T]] == MARK).all()), f"rank {rank}"
    return waited


@pytest.mark.slow(seconds=19)
@pytest.mark.asyncio
async def test_an_announced_mark_keeps_a_rank_s_copies_from_waiting_for_a_chunk_queued_before_the_frame_was_read(
    loop_ranks: LoopRanks,
) -> None:
    waited = await _claimed_chunk_then_finish(loop_ranks, announce=True)
    assert not waited, "a rank's copies waited for a chunk its engine queued after it announced the stream"
    for worker in loop_ranks.workers:
        s = worker.statistics()
        assert (s.stream_marks, s.stream_marks_announced, s.stream_marks_failed, s.stream_marks_missed,
                s.stream_announces_held, s.stream_announces_ignored) == (1, 1, 0, 0, 0, 0), s


@pytest.mark.asyncio
async def test_without_the_announcement_the_frame_s_mark_covers_a_chunk_queued_before_the_read(
    loop_ranks: LoopRanks,
) -> None:
    # The control of the test above (what the announcement fixes): the same chunk, no
    # announcement; the frame is read once the chunk is queued, so the mark covers it and the
    # copies (and finish) wait for it.
    waited = await _claimed_chunk_then_finish(loop_ranks, announce=False)
    assert waited, "the copies did not wait for the chunk: the test above would prove nothing"
    for worker in loop_ranks.workers:
        s = worker.statistics()
        assert (s.stream_marks, s.stream_marks_announced, s.stream_marks_missed) == (1, 0, 0), s


@pytest.mark.asyncio
async def test_an_announced_mark_still_orders_a_rank_s_copies_after_its_engine_s_work_queued_before(
    loop_ranks: LoopRanks,
) -> None:
    # A kernel queued on the engine's stream before start_load that writes the slots runs first:
    # the loaded bytes land after it. A mark recorded on another stream (the calling thread's
    # current one) or none at all would let them land first.
    cache, engine = loop_ranks.cache, loop_ranks.engine
    sources = [kv[:, :N].clone() for kv in loop_ranks.kv]
    target = torch.arange(40, 40 + N)
    on_device = target.cuda()
    load_module(loop_ranks.kv, on_device)
    with torch.cuda.stream(engine):
        torch.cuda._sleep(SLEEP_CYCLES // 4)  # type: ignore[no-untyped-call]
        for kv in loop_ranks.kv:
            kv.index_fill_(1, on_device, MARK)
        queued = torch.cuda.Event()  # type: ignore[no-untyped-call]
        queued.record(engine)
    stream = cache.start_load(await cache.match(loop_ranks.tokens), target)
    for worker in loop_ranks.workers:
        assert worker.begin_stream(stream.stream_id, stream.epoch) is True
    assert not queued.query(), "the host waited for the sleep: the test would not test the order"
    async with asyncio.timeout(BOUND_S):
        result = await stream.finish()
    assert result.loaded_from == 0, result
    torch.cuda.synchronize()
    for rank, kv in enumerate(loop_ranks.kv):
        assert torch.equal(kv[:, on_device], sources[rank]), f"rank {rank}: a copy ran before the engine's earlier work"
    for worker in loop_ranks.workers:
        s = worker.statistics()
        assert (s.stream_marks, s.stream_marks_announced, s.stream_marks_missed) == (1, 1, 0), s
