"""Review 119: a rank never orders a stream's copy after a mark of another session or stream.

Stream ids are per manager (each starts at 1) and marks per rank session, so a stale mark would be
one recorded for the same id by an earlier session: a manager that restarted (its new streams reuse
the ids), or a rank worker that left and attached again. Every mark is replaced here by a stand-in
naming the executor (session) that recorded it and the stream; each copy's ``after`` must be a mark
of the same executor and the spec's own stream, recorded before the copy, or None (a stream whose
mark the rank does not hold: ordered at its launch). Also: a stream outlived by more than
``TPConfig.stream_marks`` others has its later copies ordered at their launch (counted missed) and
still lands bit-exact.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tp_helpers import CONFIG, full_kv, rank_kv, threads_off_loop

from aiokv import CacheConfig, KVLayout
from aiokv.kernels import PageMover
from aiokv.stream import LoadStream
from aiokv.tp import Direction, RankExecutor, RankWorker, RankWorkerThread, TPCache, TransferSpec
from aiokv.tp.endpoint import SOCKET_NAME

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
SLOTS = 96
N = 4 * T
TOKENS = list(range(5200, 5200 + N))
TARGET = torch.arange(40, 40 + N)
BOUND_S = 30.0


@dataclass(frozen=True)
class StandIn:
    executor: int  # the serial of the executor (rank session) that recorded it
    stream: int


@dataclass
class Spy:
    serials: dict[int, int] = dataclasses.field(default_factory=dict)  # id(executor) -> serial
    movers: dict[int, int] = dataclasses.field(default_factory=dict)  # id(mover) -> serial
    recorded: list[StandIn] = dataclasses.field(default_factory=list)
    # (serial of the executor running the copy, the spec's stream, the after its mover was given)
    given: list[tuple[int, int, Any]] = dataclasses.field(default_factory=list)
    pending: dict[int, int] = dataclasses.field(default_factory=dict)  # serial -> stream of the spec in execute

    def check(self) -> None:
        assert self.given, "no copy of a stream ran"
        for serial, stream, after in self.given:
            if after is None:
                continue
            assert isinstance(after, StandIn), after
            assert (after.executor, after.stream) == (serial, stream), (
                f"session {serial}'s copy of stream {stream} ordered after {after}")
            assert after in self.recorded


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    spy = Spy()
    serial = itertools.count(1)
    begin, execute, load = RankExecutor.begin_stream, RankExecutor.execute, PageMover.load

    def serial_of(executor: RankExecutor) -> int:
        if id(executor) not in spy.serials:
            spy.serials[id(executor)] = next(serial)
        spy.movers[id(executor._mover)] = spy.serials[id(executor)]
        return spy.serials[id(executor)]

    def spy_begin(self: RankExecutor, stream: int) -> None:
        self._spy_stream = stream  # type: ignore[attr-defined]  # read by the stand-in just below
        begin(self, stream)

    def stand_in(self: RankExecutor) -> object:
        mark = StandIn(serial_of(self), self._spy_stream)  # type: ignore[attr-defined]
        spy.recorded.append(mark)
        return mark

    def spy_execute(self: RankExecutor, spec: TransferSpec) -> asyncio.Future[Any]:
        if spec.direction is Direction.LOAD:
            spy.pending[serial_of(self)] = spec.stream
        return execute(self, spec)

    def spy_load(self: PageMover, *args: Any, **kwargs: Any) -> Any:
        owner = spy.movers.get(id(self))
        if owner is not None and owner in spy.pending:
            spy.given.append((owner, spy.pending.pop(owner), kwargs.get("after")))
        return load(self, *args, **kwargs)

    monkeypatch.setattr(RankExecutor, "begin_stream", spy_begin)
    monkeypatch.setattr(RankExecutor, "_record_mark", stand_in)
    monkeypatch.setattr(RankExecutor, "execute", spy_execute)
    monkeypatch.setattr(PageMover, "load", spy_load)
    return spy


def _config(namespace: str) -> CacheConfig:
    return CacheConfig(cpu_bytes=32 * LAYOUT.page_bytes, disk=None, namespace=namespace,
                       pool_chunk_bytes=8 * LAYOUT.page_bytes)


async def _stream_lands(cache: TPCache, kv: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for k in kv:
        k[:, TARGET] = 0
    stream = cache.start_load(await cache.match(TOKENS), TARGET)
    async with asyncio.timeout(BOUND_S):
        result = await stream.finish()
    assert result.loaded_from == 0 and result.tokens == N, result
    for rank in range(2):
        assert torch.equal(kv[rank][:, TARGET], want[rank]), f"rank {rank}: wrong KV"


@pytest.mark.asyncio
async def test_streams_of_a_restarted_manager_and_a_rank_attached_again_use_their_own_session_s_marks(
    tmp_path: Path, spy: Spy
) -> None:
    kv = [rank_kv(full_kv(LAYOUT, 41, SLOTS), LAYOUT, r, 2) for r in range(2)]
    want = [k[:, :N].clone() for k in kv]
    directory = tmp_path / "sock"
    with RankWorkerThread(directory / SOCKET_NAME, 1, 2, LAYOUT, kv[1], CONFIG) as thread:
        for manager_round in range(2):  # the second manager's stream ids start at 1 again
            async with TPCache(_config("tp-rev119-sessions"), LAYOUT, tp_size=2, num_slots=SLOTS,
                               tp_config=CONFIG, directory=directory) as cache:
                for worker_round in range(2):  # rank 0 leaves and attaches again (a new session)
                    async with RankWorker(cache.address, 0, 2, LAYOUT, kv[0], CONFIG) as worker:
                        async with asyncio.timeout(BOUND_S):
                            await cache.wait_ranks()
                        if worker_round == 0:
                            assert (await cache.offload(TOKENS, torch.arange(N))).stored == N // T
                        for _ in range(2):
                            await _stream_lands(cache, kv, want)
                        stats = worker.statistics()
                        assert (stats.stream_marks, stats.stream_marks_missed) == (2, 0), (manager_round, stats)
                    async with asyncio.timeout(BOUND_S):
                        while 0 in cache.group.attached:  # the manager saw this session end
                            await cache.group.wait_change()
                stats = await asyncio.to_thread(thread.statistics)
                assert (stats.stream_marks, stats.stream_marks_missed) == (4, 0), (manager_round, stats)
                assert cache.group.jobs.in_flight == 0 and cache.stats().pool_referenced == 0
    spy.check()
    assert all(after is not None for _, _, after in spy.given), "every copy had its own session's mark"
    assert len({serial for serial, _, _ in spy.given}) == 6, "rank 0: four sessions; rank 1: two"


@pytest.mark.asyncio
async def test_a_stream_outlived_by_more_than_stream_marks_others_is_ordered_at_launch_and_lands(
    tmp_path: Path, spy: Spy, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = [rank_kv(full_kv(LAYOUT, 43, SLOTS), LAYOUT, r, 2) for r in range(2)]
    want = [k[:, :N].clone() for k in kv]
    other = torch.arange(0, N)  # the source slots: loading them back rewrites the same bytes
    few = dataclasses.replace(CONFIG, stream_marks=2)
    async with (
        TPCache(_config("tp-rev119-marks"), LAYOUT, tp_size=2, num_slots=SLOTS, tp_config=few,
                directory=tmp_path / "sock") as cache,
        threads_off_loop(RankWorkerThread(cache.address, 1, 2, LAYOUT, kv[1], few)) as (thread,),
        RankWorker(cache.address, 0, 2, LAYOUT, kv[0], few) as worker,
    ):
        async with asyncio.timeout(BOUND_S):
            await cache.wait_ranks()
        assert (await cache.offload(TOKENS, other)).stored == N // T
        for k in kv:
            k[:, TARGET] = 0
        # The long stream begins; before its loader sends anything, three others begin and end.
        gate = asyncio.Event()
        run = LoadStream._run

        async def held_run(self: LoadStream) -> None:
            if self is long_stream_holder[0]:
                await gate.wait()
            await run(self)

        long_stream_holder: list[LoadStream | None] = [None]
        monkeypatch.setattr(LoadStream, "_run", held_run)
        long_stream = cache.start_load(await cache.match(TOKENS), TARGET)
        long_stream_holder[0] = long_stream
        for _ in range(3):
            short = cache.start_load(await cache.match(TOKENS), other)
            async with asyncio.timeout(BOUND_S):
                assert (await short.finish()).loaded_from == 0
        gate.set()
        async with asyncio.timeout(BOUND_S):
            result = await long_stream.finish()
        assert result.loaded_from == 0 and result.tokens == N, result
        for rank in range(2):
            assert torch.equal(kv[rank][:, TARGET], want[rank]), f"rank {rank}: wrong KV"
        # Four streams marked; the long one's (stream 1) dropped as old before its copies
        # ran: each of them ordered at its launch and counted, no other copy.
        copies = sum(stream == 1 for _, stream, _ in spy.given) // 2
        assert copies >= 1, spy.given
        stats = [worker.statistics(), await asyncio.to_thread(thread.statistics)]
        for s in stats:
            assert (s.stream_marks, s.stream_marks_failed, s.stream_marks_missed) == (4, 0, copies), s
    spy.check()
    assert all((after is None) == (stream == 1) for _, stream, after in spy.given), spy.given
