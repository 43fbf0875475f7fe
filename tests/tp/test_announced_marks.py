"""A rank's engine announces a load stream (``RankWorker.begin_stream``) before its worker reads the
manager's STREAM_BEGINS frame: the rank's mark is recorded then, and the earlier of the two is kept.

``TPLoadStream.stream_id`` and ``.epoch`` go into the engine's own step message; the rank's engine
calls ``begin_stream(stream_id, epoch)`` at the start of that step, from its own thread. CPU ranks
have no stream to order on: as in ``test_stream_mark.py`` each recorded mark is a recognisable
stand-in (here naming the stream and the path that recorded it), and the tests check which one
reaches the mover with each copy of the stream. The ordering on a GPU is in
``test_stream_mark_gpu.py``.
"""

from __future__ import annotations

import asyncio
import threading
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
    RankStatus,
    RankWorker,
    RankWorkerThread,
    TPCache,
    TPConfig,
    TransferSpec,
)
from aiokv.tp.executor import Announced

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
SLOTS = 96
SEED = 43
N = 6 * T
TOKENS = list(range(8000, 8000 + N))
TARGET = torch.arange(40, 40 + N)
BOUND_S = 30.0


@dataclass(frozen=True)
class StandIn:
    """A CPU rank's mark: the rank, the stream being marked and who recorded it."""

    rank: int
    stream: int
    by: str  # "frame" (begin_stream) or "engine" (announce_stream)


class Spy:
    """Each mark recorded is a :class:`StandIn`; each mover load's ``after`` is logged with the
    stream of the spec that led to it (the real paths run underneath)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.given: dict[int, list[tuple[int, Any]]] = {0: [], 1: []}  # rank -> [(spec's stream, after)]
        self._marking = threading.local()  # (stream, by) while a mark is being recorded on this thread
        self._spec = threading.local()  # the spec whose copy runs on this thread
        self._movers: dict[int, int] = {}
        begin, announce, record = RankExecutor.begin_stream, RankExecutor.announce_stream, RankExecutor._record_mark
        execute, copy = RankExecutor.execute, RankExecutor._copy_on_thread
        spy = self

        def spy_begin(self: RankExecutor, stream: int) -> None:
            spy._marking.now = (stream, "frame")
            try:
                begin(self, stream)
            finally:
                spy._marking.now = None

        def spy_announce(self: RankExecutor, stream: int) -> Announced:
            spy._marking.now = (stream, "engine")
            try:
                return announce(self, stream)
            finally:
                spy._marking.now = None

        def stand_in(self: RankExecutor) -> object:
            assert record(self) is None  # a CPU rank: the real record gives no event
            stream, by = spy._marking.now
            return StandIn(self.kv.tp.rank, stream, by)

        def spy_execute(self: RankExecutor, spec: TransferSpec) -> asyncio.Future[Any]:
            spy._movers[id(self._mover)] = self.kv.tp.rank
            return execute(self, spec)

        def spy_copy(self: RankExecutor, spec: TransferSpec, *args: Any) -> Any:
            spy._spec.now = spec
            return copy(self, spec, *args)

        def spy_load(original: Callable[..., Any]) -> Callable[..., Any]:
            def spied(mover: PageMover, *args: Any, **kwargs: Any) -> Any:
                rank = spy._movers.get(id(mover))
                if rank is not None:
                    spy.given[rank].append((spy._spec.now.stream, kwargs.get("after")))
                return original(mover, *args, **kwargs)

            return spied

        monkeypatch.setattr(RankExecutor, "begin_stream", spy_begin)
        monkeypatch.setattr(RankExecutor, "announce_stream", spy_announce)
        monkeypatch.setattr(RankExecutor, "_record_mark", stand_in)
        monkeypatch.setattr(RankExecutor, "execute", spy_execute)
        monkeypatch.setattr(RankExecutor, "_copy_on_thread", spy_copy)
        monkeypatch.setattr(PageMover, "load", spy_load(PageMover.load))
        monkeypatch.setattr(PageMover, "load_layers", spy_load(PageMover.load_layers))


@dataclass
class Ranks:
    cache: TPCache
    kv: list[torch.Tensor]
    worker: RankWorker  # rank 0, on this loop: it reads frames only when the loop turns
    thread: RankWorkerThread  # rank 1, on a thread of its own: it reads frames at once

    def want(self, rank: int) -> torch.Tensor:
        return rank_kv(full_kv(LAYOUT, SEED, SLOTS), LAYOUT, rank, 2)[:, :N]

    def landed(self) -> bool:
        return all(torch.equal(self.kv[r][:, TARGET], self.want(r)) for r in range(2))

    def clear(self) -> None:
        for kv in self.kv:
            kv[:, TARGET] = 0

    async def stats(self, rank: int) -> Any:
        return self.worker.statistics() if rank == 0 else await asyncio.to_thread(self.thread.statistics)


@pytest_asyncio.fixture
async def ranks(tmp_path: Path) -> AsyncIterator[Ranks]:
    config = CacheConfig(cpu_bytes=32 * LAYOUT.page_bytes, disk=None, namespace="tp-announced-marks")
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
        yield Ranks(cache, kv, worker, thread)
        assert cache.group.jobs.in_flight == 0, "a rank still copies"
        stats = cache.stats()
        assert stats.pool_reserved == 0 and stats.pool_referenced == 0, "references leaked"


@pytest.mark.asyncio
@pytest.mark.parametrize("layered", [False, True])
async def test_an_announcement_before_the_frame_is_read_is_the_mark_the_stream_s_copies_follow(
    ranks: Ranks, monkeypatch: pytest.MonkeyPatch, layered: bool
) -> None:
    spy = Spy(monkeypatch)
    cache = ranks.cache
    ranks.clear()
    stream = cache.start_load(await cache.match(TOKENS), TARGET, layered=layered)
    assert stream.stream_id > 0 and stream.epoch == cache.group.epoch
    # No await since start_load: rank 0's worker (this loop) has not read the frame yet. The
    # engine announces the stream as its step begins: the mark is recorded now, and the frame read
    # later keeps it (it was recorded first).
    assert ranks.worker.begin_stream(stream.stream_id, stream.epoch) is True
    assert ranks.worker.begin_stream(stream.stream_id, stream.epoch) is False  # held: the first one stays
    async with asyncio.timeout(BOUND_S):
        result = await stream.finish()
    assert result.loaded_from == 0 and result.tokens == N, result
    assert ranks.landed()
    given = spy.given[0]
    assert given and given == [(stream.stream_id, StandIn(0, stream.stream_id, "engine"))] * len(given), given
    # Rank 1 read its frame on its own thread: its mark is the frame's, and an announcement now
    # changes nothing (the frame's mark was recorded first).
    assert ranks.thread.begin_stream(stream.stream_id, stream.epoch) is False
    assert spy.given[1] == [(stream.stream_id, StandIn(1, stream.stream_id, "frame"))] * len(spy.given[1])
    s0, s1 = await ranks.stats(0), await ranks.stats(1)
    assert (s0.stream_marks, s0.stream_marks_announced, s0.stream_announces_held, s0.stream_announces_ignored,
            s0.stream_marks_missed) == (1, 1, 1, 0, 0), s0
    assert (s1.stream_marks, s1.stream_marks_announced, s1.stream_announces_held, s1.stream_announces_ignored,
            s1.stream_marks_missed) == (1, 0, 1, 0, 0), s1


@pytest.mark.asyncio
async def test_bad_announcements_raise_or_are_counted_and_never_disturb_the_worker(
    ranks: Ranks, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = Spy(monkeypatch)
    cache, worker, epoch = ranks.cache, ranks.worker, ranks.cache.group.epoch
    for runner in (worker, ranks.thread):
        for bad_id in ("1", 1.0, None, True, torch.tensor(1)):
            with pytest.raises(TypeError, match="stream_id must be an int"):
                runner.begin_stream(bad_id, epoch)  # type: ignore[arg-type]
        for bad_epoch in ("1", None, False, 1.5):
            with pytest.raises(TypeError, match="epoch must be an int"):
                runner.begin_stream(1, bad_epoch)  # type: ignore[arg-type]
        for bad_id in (-1, 2**64):
            with pytest.raises(ValueError, match="stream_id must be in"):
                runner.begin_stream(bad_id, epoch)
        for bad_epoch in (0, -5, 2**64):
            with pytest.raises(ValueError, match="epoch must be in"):
                runner.begin_stream(1, bad_epoch)
        assert runner.begin_stream(0, epoch) is False  # a stream without an id: nothing to do, not counted
    stats = await ranks.stats(0)
    assert (stats.stream_announces_held, stats.stream_announces_ignored, stats.stream_marks) == (0, 0, 0), stats
    # Counted, recorded nothing: another pool's epoch; an id far past every stream begun here
    # (a mark recorded before its stream began would miss the engine's work queued until then).
    other = epoch + 1 if epoch + 1 < 2**64 else 1
    assert worker.begin_stream(1, other) is False
    assert worker.begin_stream(CONFIG.stream_marks + 1, epoch) is False
    assert worker.begin_stream(2**64 - 1, epoch) is False
    stats = await ranks.stats(0)
    assert (stats.stream_marks, stats.stream_announces_ignored) == (0, 3), stats
    # The worker serves on: a stream begun now (id 1) gets the frame's mark on both ranks.
    stream = cache.start_load(await cache.match(TOKENS), TARGET)
    assert stream.stream_id == 1
    async with asyncio.timeout(BOUND_S):
        assert (await stream.finish()).loaded_from == 0
    assert ranks.landed()
    for rank in range(2):
        assert spy.given[rank] and all(after == StandIn(rank, 1, "frame") for _, after in spy.given[rank])
    # Announced after its frame was read: held (the earlier mark stays); once its mark was dropped
    # as old (stream_marks newer streams since): stale, ignored.
    assert worker.begin_stream(1, epoch) is False
    executor = worker._executor
    assert executor is not None
    for newer in range(2, 2 + executor.config.stream_marks):
        executor.begin_stream(newer)  # as if the manager had begun them (no specs)
    assert 1 not in executor._marks
    assert worker.begin_stream(1, epoch) is False
    stats = await ranks.stats(0)
    assert (stats.stream_announces_held, stats.stream_announces_ignored, stats.link_errors) == (1, 4, 0), stats
    assert set(stats.reports) == {RankStatus.OK}, stats


@pytest.mark.asyncio
async def test_an_engine_thread_hammering_begin_stream_while_streams_run_never_misorders_a_copy(
    ranks: Ranks, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real second thread announces the current stream (and junk: bad types, other epochs, ids
    # far ahead, old ids) as fast as it can, on both ranks, while streams run. Each copy of a
    # stream must be given a mark of that very stream (the engine's or the frame's, whichever was
    # recorded first), never none and never another stream's; every load lands; nothing raises on
    # the worker's loop or thread; every valid announcement is counted exactly once.
    spy = Spy(monkeypatch)
    cache, epoch = ranks.cache, ranks.cache.group.epoch
    other = epoch + 1 if epoch + 1 < 2**64 else 1
    current = [0]
    stop = threading.Event()
    calls = {0: 0, 1: 0}
    errors: list[BaseException] = []
    runners: dict[int, RankWorker | RankWorkerThread] = {0: ranks.worker, 1: ranks.thread}

    def hammer() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            for rank, runner in runners.items():
                try:
                    stream = current[0]
                    for stream_id, ep in ((stream, epoch), (stream, other), (stream + 10**6, epoch),
                                          (max(1, stream - 3), epoch)):
                        if stream_id:
                            runner.begin_stream(stream_id, ep)
                            calls[rank] += 1
                    with pytest.raises(TypeError):
                        runner.begin_stream("x", epoch)  # type: ignore[arg-type]
                except BaseException as exc:  # reported by the test
                    errors.append(exc)
                    return

    thread = threading.Thread(target=hammer, name="engine-hammer")
    thread.start()
    try:
        for _ in range(12):
            ranks.clear()
            stream = cache.start_load(await cache.match(TOKENS), TARGET, layered=bool(_ % 2))
            current[0] = stream.stream_id
            await asyncio.sleep(0)
            async with asyncio.timeout(BOUND_S):
                result = await stream.finish()
            assert result.loaded_from == 0 and result.tokens == N, result
            assert ranks.landed()
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, BOUND_S)
    assert not errors, errors
    by = {"engine": 0, "frame": 0}
    for rank in range(2):
        assert spy.given[rank]
        for stream_id, after in spy.given[rank]:
            assert isinstance(after, StandIn) and after.rank == rank and after.stream == stream_id, after
            by[after.by] += 1
        stats = await ranks.stats(rank)
        counted = stats.stream_marks_announced + stats.stream_announces_held + stats.stream_announces_ignored
        assert counted == calls[rank], (stats, calls[rank])
        assert (stats.stream_marks, stats.stream_marks_missed, stats.link_errors) == (12, 0, 0), stats
        assert set(stats.reports) == {RankStatus.OK}, stats
    assert sum(by.values()) == len(spy.given[0]) + len(spy.given[1])


@pytest.mark.asyncio
async def test_announcing_to_a_closed_or_detached_worker_is_a_counted_no_op(tmp_path: Path) -> None:
    config = CacheConfig(cpu_bytes=16 * LAYOUT.page_bytes, disk=None, namespace="tp-announced-close")
    kv = [rank_kv(full_kv(LAYOUT, SEED, SLOTS), LAYOUT, r, 2) for r in range(2)]
    async with TPCache(config, LAYOUT, tp_size=2, num_slots=SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "sock") as cache:
        epoch = cache.group.epoch
        thread = RankWorkerThread(cache.address, 1, 2, LAYOUT, kv[1], CONFIG)
        assert thread.begin_stream(1, epoch) is False  # not started: no pool attached
        thread.start()
        worker = RankWorker(cache.address, 0, 2, LAYOUT, kv[0], CONFIG)
        assert worker.begin_stream(1, epoch) is False  # before run(): no pool attached
        async with worker:
            async with asyncio.timeout(BOUND_S):
                await cache.wait_ranks()
            assert worker.begin_stream(1, epoch) is True  # attached: recorded (id 1 is the next stream)
        assert worker.begin_stream(2, epoch) is False  # closed
        await asyncio.to_thread(thread.close, BOUND_S)
        assert thread.begin_stream(2, epoch) is False  # closed: no error, no hang
        stats = worker.statistics()
        assert (stats.attached, stats.stream_announces_ignored, stats.stream_announces_held) == (False, 2, 0), stats
        assert thread.worker.statistics().stream_announces_ignored == 2


@pytest.mark.asyncio
async def test_the_executor_keeps_the_first_mark_recorded_and_refuses_what_it_cannot_use() -> None:
    pool = await new_pool(LAYOUT.for_tp(2), 8)
    bridge = CompletionBridge()
    full = full_kv(LAYOUT, 5, slots=64)
    kv = KVBuffer.wrap(LAYOUT, rank_kv(full, LAYOUT, 0, 2), TPSlice.of(LAYOUT, 0, 2))
    executor = RankExecutor(kv, PagePool.attach(pool.name, pool.layout), 1, bridge, TPConfig(stream_marks=4),
                            copy_on_loop=True)
    recorded: list[str] = []

    def record(by: str) -> Callable[[], object]:
        def stand_in() -> object:  # set on the instance: called without self
            recorded.append(by)
            return f"{by}-{len(recorded)}"

        return stand_in

    try:
        assert (await executor.execute(TransferSpec.build(1, Direction.OFFLOAD, 1, T, [0], range(T)))).status \
            is RankStatus.OK
        executor._record_mark = record("engine")  # type: ignore[method-assign,assignment]
        assert executor.announce_stream(1) is Announced.RECORDED
        executor._record_mark = record("frame")  # type: ignore[method-assign,assignment]
        executor.begin_stream(1)  # the frame after the announcement: the announced mark stays
        assert executor._marks[1].event == "engine-1" and recorded == ["engine"]
        executor.begin_stream(2)  # the frame first, then the announcement: the frame's stays
        executor._record_mark = record("engine")  # type: ignore[method-assign,assignment]
        assert executor.announce_stream(2) is Announced.HELD
        assert executor._marks[2].event == "frame-2"
        # A spec executed before its stream's announcement takes what is held (the frame's mark).
        spec = TransferSpec.build(2, Direction.LOAD, 1, T, [0], range(8, 8 + T), stream=3)
        executor._record_mark = record("frame")  # type: ignore[method-assign,assignment]
        executor.begin_stream(3)
        assert executor._after(spec) == "frame-3"
        executor._record_mark = record("engine")  # type: ignore[method-assign,assignment]
        assert executor.announce_stream(3) is Announced.HELD and executor._after(spec) == "frame-3"
        assert (await executor.execute(spec)).status is RankStatus.OK
        # Ids the frames passed whose marks are gone, and ids too far ahead, record nothing.
        executor._marks.pop(3)
        assert executor.announce_stream(3) is Announced.STALE
        assert executor.announce_stream(3 + 4 + 1) is Announced.AHEAD
        assert executor.announce_stream(3 + 4) is Announced.RECORDED  # the edge of the window
        count = len(recorded)

        def failing() -> object:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

        executor._record_mark = failing  # type: ignore[method-assign,assignment]
        assert executor.announce_stream(5) is Announced.FAILED and 5 not in executor._marks
        executor._record_mark = record("frame")  # type: ignore[method-assign,assignment]
        executor.begin_stream(5)  # the fallback: the frame records its own
        assert executor._marks[5].event == f"frame-{count + 1}"
        assert (executor.stream_marks, executor.stream_marks_announced, executor.stream_marks_failed) == (5, 2, 0)
        executor.fence()
        assert executor.announce_stream(6) is Announced.CLOSING and 6 not in executor._marks
    finally:
        await executor.aclose()
        await asyncio.to_thread(bridge.close)
        await pool.aclose()


@pytest.mark.asyncio
async def test_a_stream_without_an_id_says_so_and_announcing_it_does_nothing(
    ranks: Ranks, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A group out of ids (or closing) begins a stream without one: stream_id 0, no frame, and its
    # copies are ordered at their launch on every rank. Announcing 0 is a no-op, not counted.
    spy = Spy(monkeypatch)
    cache = ranks.cache
    cache.group._next_stream = 2**64  # the last id was given out
    ranks.clear()
    stream = cache.start_load(await cache.match(TOKENS), TARGET)
    assert stream.stream_id == 0 and stream.epoch == cache.group.epoch
    assert ranks.worker.begin_stream(stream.stream_id, stream.epoch) is False
    assert ranks.thread.begin_stream(stream.stream_id, stream.epoch) is False
    async with asyncio.timeout(BOUND_S):
        assert (await stream.finish()).loaded_from == 0
    assert ranks.landed()
    for rank in range(2):
        assert spy.given[rank] and all(given == (0, None) for given in spy.given[rank]), spy.given[rank]
        stats = await ranks.stats(rank)
        assert (stats.stream_marks, stats.stream_marks_announced, stats.stream_announces_held,
                stats.stream_announces_ignored) == (0, 0, 0, 0), stats
