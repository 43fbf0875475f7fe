"""A TP load stream's copies are ordered on each rank after a mark the rank recorded when the stream
began, not after the rank's engine stream at each copy's launch (CPU side of it).

``TPCache.start_load`` tells every attached rank that a stream begins (a STREAM_BEGINS frame); the
rank records its mark as it reads that (``RankExecutor.begin_stream``: on CUDA an event on the
engine's stream); each LOAD spec of the stream names it (``TransferSpec.stream``) and its copy is
given that rank's mark (the mover's ``after=``). A rank whose mark cannot be recorded orders the
stream's copies at their launch, as before marks. CPU ranks have no stream to order on: these tests
give each rank's mark a recognisable stand-in and check it reaches the mover with the stream's copies
and no other. The ordering itself is checked on a GPU in ``test_stream_mark_gpu.py``.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from tp_helpers import CONFIG, full_kv, new_pool, rank_kv, threads_off_loop

from aiokv import CacheConfig, KVLayout
from aiokv.cuda import CompletionBridge
from aiokv.kernels import PageMover
from aiokv.layout import KVBuffer, TPSlice
from aiokv.pool import PagePool
from aiokv.tp import (
    Direction,
    RankExecutor,
    RankGroup,
    RankStatus,
    RankWorker,
    RankWorkerThread,
    TPCache,
    TPConfig,
    TransferSpec,
)
from aiokv.tp.specs import SPEC_VERSION
from aiokv.tp.transfers import _STREAM
from aiokv.tp.wire import FrameKind, ProtocolError, StreamBegins, frame

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
SLOTS = 96
SEED = 31
N = 6 * T
TOKENS = list(range(7000, 7000 + N))
TARGET = torch.arange(40, 40 + N)
BOUND_S = 30.0


@dataclass(frozen=True)
class StandIn:
    """What a CPU rank's mark is replaced with: which rank recorded it, and its count there."""

    rank: int
    index: int


@dataclass
class Log:
    """Per rank, in order: ("begin", stream), ("spec", stream of a LOAD spec), and each mover load's
    ``after``. Appended from the loop and the thread runner's thread (list appends are atomic)."""

    events: dict[int, list[tuple[str, Any]]]
    marks: dict[int, int]

    def of(self, rank: int, what: str) -> list[Any]:
        return [value for kind, value in self.events[rank] if kind == what]


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> Log:
    """Spy on the real paths (each wrapper calls through): streams begun, LOAD specs executed, the
    ``after`` each mover load is given; each mark recorded is a :class:`StandIn`."""
    log = Log({0: [], 1: []}, {0: 0, 1: 0})
    begin, execute = RankExecutor.begin_stream, RankExecutor.execute
    load, load_layers = PageMover.load, PageMover.load_layers
    movers: dict[int, int] = {}  # id(mover) -> rank

    def spy_begin(self: RankExecutor, stream: int) -> None:
        movers[id(self._mover)] = self.kv.tp.rank
        log.events[self.kv.tp.rank].append(("begin", stream))
        begin(self, stream)

    def stand_in(self: RankExecutor) -> object:
        rank = self.kv.tp.rank
        log.marks[rank] += 1
        return StandIn(rank, log.marks[rank])

    def spy_execute(self: RankExecutor, spec: TransferSpec) -> asyncio.Future[Any]:
        movers[id(self._mover)] = self.kv.tp.rank
        if spec.direction is Direction.LOAD:
            log.events[self.kv.tp.rank].append(("spec", spec.stream))
        return execute(self, spec)

    def spy_load(original: Callable[..., Any]) -> Callable[..., Any]:
        def spied(self: PageMover, *args: Any, **kwargs: Any) -> Any:
            rank = movers.get(id(self))  # None: a mover of no rank executor (a warm-up's twin)
            if rank is not None:
                log.events[rank].append(("after", kwargs.get("after")))
            return original(self, *args, **kwargs)

        return spied

    monkeypatch.setattr(RankExecutor, "begin_stream", spy_begin)
    monkeypatch.setattr(RankExecutor, "_record_mark", stand_in)
    monkeypatch.setattr(RankExecutor, "execute", spy_execute)
    monkeypatch.setattr(PageMover, "load", spy_load(load))
    monkeypatch.setattr(PageMover, "load_layers", spy_load(load_layers))
    return log


@dataclass
class Ranks:
    cache: TPCache
    kv: list[torch.Tensor]
    thread: RankWorkerThread
    worker: RankWorker

    async def stats(self, rank: int) -> Any:
        if rank == 0:
            return self.worker.statistics()
        return await asyncio.to_thread(self.thread.statistics)

    def want(self, rank: int) -> torch.Tensor:
        return rank_kv(full_kv(LAYOUT, SEED, SLOTS), LAYOUT, rank, 2)[:, :N]


@pytest_asyncio.fixture
async def ranks(tmp_path: Path) -> AsyncIterator[Ranks]:
    """A TPCache, rank 0 on this loop and rank 1 on a thread of its own, and the pages of ``TOKENS``
    offloaded from slots ``[0, N)``; loads go to ``TARGET``, which holds other bytes."""
    config = CacheConfig(cpu_bytes=32 * LAYOUT.page_bytes, disk=None, namespace="tp-stream-mark",
                         pool_chunk_bytes=8 * LAYOUT.page_bytes)
    kv = [rank_kv(full_kv(LAYOUT, SEED, SLOTS), LAYOUT, r, 2) for r in range(2)]
    async with (
        TPCache(config, LAYOUT, tp_size=2, num_slots=SLOTS, tp_config=CONFIG,
                directory=tmp_path / "sock") as cache,
        threads_off_loop(RankWorkerThread(cache.address, 1, 2, LAYOUT, kv[1], CONFIG)) as (thread,),
        RankWorker(cache.address, 0, 2, LAYOUT, kv[0], CONFIG) as worker,
    ):
        async with asyncio.timeout(BOUND_S):
            await cache.wait_ranks()
        assert (await cache.offload(TOKENS, torch.arange(N))).stored == N // T
        yield Ranks(cache, kv, thread, worker)
        assert cache.group.jobs.in_flight == 0, "a rank still copies"
        stats = cache.stats()
        assert stats.pool_reserved == 0 and stats.pool_referenced == 0, "references leaked"


def _landed(ranks: Ranks, rank: int) -> bool:
    return torch.equal(ranks.kv[rank][:, TARGET], ranks.want(rank))


@pytest.mark.asyncio
@pytest.mark.parametrize("layered", [False, True])
async def test_each_rank_gives_a_stream_s_copies_the_mark_it_recorded_when_the_stream_began(
    ranks: Ranks, log: Log, layered: bool
) -> None:
    cache = ranks.cache
    # A plain load belongs to no stream: ordered at its launch (no mark, after=None).
    assert (await cache.load(await cache.match(TOKENS), torch.arange(48, 48 + N))).tokens == N
    for round_ in range(2):
        for kv in ranks.kv:
            kv[:, TARGET] = 0
        stream = cache.start_load(await cache.match(TOKENS), TARGET, layered=layered)
        async with asyncio.timeout(BOUND_S):
            result = await stream.finish()
        assert result.loaded_from == 0 and result.tokens == N, result
        assert all(_landed(ranks, rank) for rank in range(2)), f"round {round_}: bytes wrong"
    for rank in range(2):
        # Split the rank's log where each stream began: the plain load before, then each stream's.
        events = log.events[rank]
        starts = [i for i, (kind, _) in enumerate(events) if kind == "begin"]
        segments = [events[: starts[0]], events[starts[0] : starts[1]], events[starts[1] :]]
        begun = [events[i][1] for i in starts]
        assert len(starts) == 2 and 0 < begun[0] < begun[1], events
        for index, segment in enumerate(segments):
            specs = [value for kind, value in segment if kind == "spec"]
            given = [value for kind, value in segment if kind == "after"]
            # Each stream began on the rank before any of its specs arrived; every LOAD spec of the
            # stream names it, and each copy is given this rank's mark of that stream (a plain
            # load: no stream, no mark).
            stream_id = begun[index - 1] if index else 0
            mark = StandIn(rank, index) if index else None
            assert specs and specs == [stream_id] * len(specs), (rank, index, events)
            assert given == [mark] * len(specs), (rank, index, events)
    for rank in range(2):
        stats = await ranks.stats(rank)
        assert (stats.stream_marks, stats.stream_marks_failed, stats.stream_marks_missed) == (2, 0, 0), stats


@pytest.mark.asyncio
async def test_a_rank_whose_mark_fails_orders_the_stream_s_copies_at_launch_and_the_stream_ends_whole(
    ranks: Ranks, log: Log, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 1 (the thread runner) fails to record its mark, as a CUDA error would make it: it must
    # neither drop the stream's copies nor order them after another mark; they are ordered at their
    # launch (after=None), land, report OK, and the stream's pages go back as usual.
    recorded = RankExecutor._record_mark

    def failing(self: RankExecutor) -> object:
        if self.kv.tp.rank == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        return recorded(self)

    monkeypatch.setattr(RankExecutor, "_record_mark", failing)
    cache = ranks.cache
    stream = cache.start_load(await cache.match(TOKENS), TARGET)
    async with asyncio.timeout(BOUND_S):
        result = await stream.finish()
    assert result.loaded_from == 0 and result.tokens == N, result
    assert _landed(ranks, 0) and _landed(ranks, 1)
    assert cache.stats().pool_referenced == 0
    given = log.of(1, "after")
    assert given and all(after is None for after in given), given
    assert log.of(0, "after") == [StandIn(0, 1)] * len(log.of(0, "after"))
    stats = await ranks.stats(1)
    assert (stats.stream_marks, stats.stream_marks_failed, stats.stream_marks_missed) == (0, 1, len(given)), stats
    assert (await ranks.stats(0)).stream_marks_missed == 0
    # The rank goes on serving; its next stream gets a mark again.
    monkeypatch.setattr(RankExecutor, "_record_mark", recorded)
    for kv in ranks.kv:
        kv[:, TARGET] = 0
    stream = cache.start_load(await cache.match(TOKENS), TARGET)
    async with asyncio.timeout(BOUND_S):
        assert (await stream.finish()).loaded_from == 0
    assert _landed(ranks, 1)
    assert log.of(1, "after")[len(given):] == [StandIn(1, 1)] * (len(log.of(1, "after")) - len(given))
    stats = await ranks.stats(1)
    assert (stats.stream_marks, stats.stream_marks_failed, stats.stream_marks_missed) == (1, 1, len(given)), stats


@pytest.mark.asyncio
async def test_a_stream_begin_that_raises_in_the_manager_leaves_the_match_with_the_caller(
    ranks: Ranks, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stream begins on the ranks from mark(), before the match is taken: a fault there (here
    # injected) raises from start_load with the match still the caller's, who releases it.
    def broken(self: RankGroup) -> int:
        raise RuntimeError("sending the stream's start failed (injected)")

    monkeypatch.setattr(RankGroup, "begin_stream", broken)
    cache = ranks.cache
    match = await cache.match(TOKENS)
    with pytest.raises(RuntimeError, match="injected"):
        cache.start_load(match, TARGET)
    assert cache.stats().pool_referenced == N // T
    match.release()
    assert cache.stats().pool_referenced == 0
    monkeypatch.undo()
    assert _STREAM.get() is None, "the stream's scope outlived its failed construction"
    stream = cache.start_load(await cache.match(TOKENS), TARGET)
    async with asyncio.timeout(BOUND_S):
        assert (await stream.finish()).loaded_from == 0


@pytest.mark.asyncio
async def test_the_rank_keeps_the_newest_marks_and_orders_the_rest_at_launch() -> None:
    # TPConfig.stream_marks bounds the marks a rank keeps; a spec of a stream whose mark is gone, or
    # of one never announced, is ordered at its launch (and counted), never refused.
    pool = await new_pool(LAYOUT.for_tp(2), 8)
    bridge = CompletionBridge()
    full = full_kv(LAYOUT, 5, slots=64)
    kv = KVBuffer.wrap(LAYOUT, rank_kv(full, LAYOUT, 0, 2), TPSlice.of(LAYOUT, 0, 2))
    executor = RankExecutor(kv, PagePool.attach(pool.name, pool.layout), 1, bridge, TPConfig(stream_marks=2),
                            copy_on_loop=True)
    try:
        assert (await executor.execute(TransferSpec.build(1, Direction.OFFLOAD, 1, T, [0], range(T)))).status \
            is RankStatus.OK
        for stream in (1, 2, 3):
            executor.begin_stream(stream)
        assert list(executor._marks) == [2, 3]
        for job, stream, missed in ((2, 3, 0), (3, 2, 0), (4, 1, 1), (5, 99, 2)):
            spec = TransferSpec.build(job, Direction.LOAD, 1, T, [0], range(8, 8 + T), stream=stream)
            assert (await executor.execute(spec)).status is RankStatus.OK
            assert executor.stream_marks_missed == missed, (stream, executor.stream_marks_missed)
        assert executor.stream_marks == 3
        executor.fence()
        executor.begin_stream(4)  # a fenced rank starts nothing, marks included
        assert executor.stream_marks == 3 and 4 not in executor._marks
    finally:
        await executor.aclose()
        await asyncio.to_thread(bridge.close)
        await pool.aclose()


def test_a_spec_carries_its_stream_in_a_versioned_validated_form() -> None:
    plain = TransferSpec.build(1, Direction.LOAD, 7, 4, [3, 5], torch.arange(6), 2)
    streamed = TransferSpec.build(1, Direction.LOAD, 7, 4, [3, 5], torch.arange(6), 2, stream=2**64 - 1)
    raw = streamed.to_bytes()
    assert raw[4] == SPEC_VERSION == 2 and raw[7] == 4  # flags: STREAM (bit 2)
    assert len(raw) == streamed.encoded_bytes == len(plain.to_bytes()) + 8
    assert TransferSpec.from_bytes(raw) == streamed and TransferSpec.from_bytes(raw).stream == 2**64 - 1
    assert pickle.loads(pickle.dumps(streamed)).stream == 2**64 - 1
    assert streamed != plain and plain.stream == 0 and plain.to_bytes()[7] == 0
    layered = TransferSpec.build(1, Direction.LOAD, 7, 4, [3], range(4), layered=True, stream=5)
    assert TransferSpec.from_bytes(layered.to_bytes()) == layered and layered.to_bytes()[7] == 5
    assert "stream=5" in repr(layered)
    old = bytearray(plain.to_bytes())
    old[4] = 1  # the version before streams
    with pytest.raises(ValueError, match="version 1 is not supported"):
        TransferSpec.from_bytes(bytes(old))
    zero = bytearray(raw)
    struct.pack_into("<Q", zero, 40, 0)
    with pytest.raises(ValueError, match="stream id 0"):
        TransferSpec.from_bytes(bytes(zero))
    with pytest.raises(ValueError, match="truncated"):
        TransferSpec.from_bytes(raw[:-1])
    flagged = bytearray(plain.to_bytes())
    flagged[7] = 4  # the flag without the field: the length no longer matches
    with pytest.raises(ValueError, match="truncated"):
        TransferSpec.from_bytes(bytes(flagged))
    with pytest.raises(ValueError, match="only a LOAD spec belongs to a load stream"):
        TransferSpec.build(1, Direction.OFFLOAD, 7, 4, [3], range(4), stream=1)
    offload = bytearray(TransferSpec.build(1, Direction.OFFLOAD, 7, 4, [3], range(4)).to_bytes())
    offload[7] = 4
    offload[40:40] = struct.pack("<Q", 1)
    with pytest.raises(ValueError, match="only a LOAD spec belongs to a load stream"):
        TransferSpec.from_bytes(bytes(offload))
    with pytest.raises(ValueError, match="stream"):
        TransferSpec.build(1, Direction.LOAD, 7, 4, [3], range(4), stream=-1)


def test_the_stream_start_frame_is_validated() -> None:
    payload = StreamBegins(9).encode()
    assert StreamBegins.decode(payload) == StreamBegins(9)
    assert frame(FrameKind.STREAM_BEGINS, payload)[4] == FrameKind.STREAM_BEGINS.value
    with pytest.raises(ProtocolError, match="stream 0"):
        StreamBegins.decode(struct.pack("<Q", 0))
    for bad in (b"", payload[:7], payload + b"\0"):
        with pytest.raises(ProtocolError, match="stream start"):
            StreamBegins.decode(bad)


@pytest.mark.asyncio
async def test_the_group_numbers_streams_and_refuses_a_spec_of_a_stream_it_never_began(tmp_path: Path) -> None:
    pool = await new_pool(LAYOUT.for_tp(2), 4)
    try:
        async with RankGroup(LAYOUT, 2, pool.name, pool.num_pages, CONFIG, tmp_path / "g") as group:
            first, second = group.begin_stream(), group.begin_stream()  # no rank attached: nothing sent
            assert 0 < first < second
            group.spec(Direction.LOAD, [0], torch.arange(T), stream=second)  # begun: accepted by build
            with pytest.raises(ValueError, match="never began"):
                group.submit_nowait(group.spec(Direction.LOAD, [0], torch.arange(T), stream=second + 1))
        assert group.begin_stream() == 0, "a closed group begins nothing"
    finally:
        await pool.aclose()
