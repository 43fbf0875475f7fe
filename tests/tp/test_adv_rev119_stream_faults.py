"""Review 119: real rank processes faulted between a load stream's STREAM_BEGINS and its first spec.

``TPCache.start_load`` writes STREAM_BEGINS to every attached rank; the stream's loader sends its
first spec a loop turn later. Here a rank (spawned process, prefix oracle) is, right after it
recorded the stream's mark and before the loader sends anything:

- SIGSTOPped, then continued: the stream does not end while it is stopped; once continued it ends
  whole, bit-exact on every rank, each rank counting one mark and no missed one;
- SIGSTOPped, then SIGKILLed: the stream ends within a bound, shortened, nothing referenced,
  reserved or in flight; the restarted rank loads the next stream bit-exact;
- SIGKILLed and restarted, the new process attached before the first spec goes out: it is sent
  nothing of the stream (no frame, no spec: it never saw the stream begin), the stream ends as a
  miss, and the rank that survived got no byte of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from adv_helpers import START_S, AdvRanks, attach_ranks, idx, rank_prefix_kv, stop_process
from tp_helpers import CONFIG

from aiokv import CacheConfig, KVLayout
from aiokv.stream import LoadStream
from aiokv.tp import TPCache

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
NUM_SLOTS = 128
PAGES = 6
BOUND_S = 30.0
STOPPED_S = 0.4
TOKENS = list(range(4400, 4400 + PAGES * T))
SOURCE = list(range(PAGES * T))
TARGET = list(range(NUM_SLOTS - PAGES * T, NUM_SLOTS))


@dataclasses.dataclass
class Setup:
    cache: TPCache
    ranks: AdvRanks

    async def zero_target(self) -> None:
        for rank in range(2):
            zeros = torch.zeros_like(rank_prefix_kv(LAYOUT, TOKENS, 0, rank, 2))
            await self.ranks.write(rank, TARGET, zeros)

    async def target_is(self, rank: int, whole: bool) -> bool:
        got = await self.ranks.read(rank, TARGET)
        want = rank_prefix_kv(LAYOUT, TOKENS, 0, rank, 2)
        return torch.equal(got, want if whole else torch.zeros_like(want))

    async def marks(self, rank: int) -> tuple[int, int, int]:
        stats = await self.ranks.ask(rank, ("stats",))
        return stats.stream_marks, stats.stream_marks_failed, stats.stream_marks_missed

    def clean(self) -> None:
        stats = self.cache.stats()
        assert stats.pool_reserved == 0 and stats.pool_referenced == 0, stats
        assert self.cache.group_statistics().jobs.in_flight == 0, self.cache.group_statistics()


@pytest_asyncio.fixture
async def setup(tmp_path: Path, ranks_left: list[AdvRanks]) -> AsyncIterator[Setup]:
    config = CacheConfig(cpu_bytes=32 * LAYOUT.page_bytes, disk=None, namespace="tp-adv-119",
                         pool_chunk_bytes=8 * LAYOUT.page_bytes)
    async with TPCache(config, LAYOUT, tp_size=2, num_slots=NUM_SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "sock") as cache:
        ranks = await attach_ranks(cache, ranks_left, LAYOUT, NUM_SLOTS)
        for rank in range(2):
            await ranks.write(rank, SOURCE, rank_prefix_kv(LAYOUT, TOKENS, 0, rank, 2))
        assert (await cache.offload(TOKENS, idx(SOURCE))).stored == PAGES
        yield Setup(cache, ranks)
        await ranks.stop_all()


def _before_first_spec(monkeypatch: pytest.MonkeyPatch, fault: Callable[[], Awaitable[None]]) -> asyncio.Event:
    """Run ``fault`` in the stream's loader before it launches anything (the STREAM_BEGINS frames
    were written by ``start_load``; no spec of the stream is sent yet). The event is set after it."""
    faulted = asyncio.Event()
    run = LoadStream._run

    async def faulted_run(self: LoadStream) -> None:
        await fault()
        faulted.set()
        await run(self)

    monkeypatch.setattr(LoadStream, "_run", faulted_run)
    return faulted


async def _until_marked(setup: Setup, rank: int, marks: int) -> None:
    """Wait until rank ``rank`` recorded ``marks`` stream marks (it read the stream's frame)."""
    async with asyncio.timeout(BOUND_S):
        # Another process's counter: nothing to wait on but its answer (each ask is a round trip).
        while (await setup.marks(rank))[0] < marks:  # noqa: ASYNC110
            await asyncio.sleep(0.01)


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("victim", [0, 1])  # a thread runner, an async runner
@pytest.mark.parametrize("ending", [signal.SIGCONT, signal.SIGKILL])
async def test_a_rank_stopped_after_the_stream_began_holds_the_stream_until_continued_or_killed(
    setup: Setup, monkeypatch: pytest.MonkeyPatch, victim: int, ending: signal.Signals
) -> None:
    cache, ranks = setup.cache, setup.ranks
    await setup.zero_target()
    pid = ranks.ranks[victim].proc.pid
    assert pid is not None

    async def stop() -> None:
        await _until_marked(setup, victim, 1)
        await stop_process(pid)

    faulted = _before_first_spec(monkeypatch, stop)
    stream = cache.start_load(await cache.match(TOKENS), idx(TARGET))
    try:
        async with asyncio.timeout(BOUND_S):
            await faulted.wait()
        finish = asyncio.create_task(stream.finish())
        done, _ = await asyncio.wait({finish}, timeout=STOPPED_S)
        assert not done, f"the stream ended while rank {victim} was stopped: {finish.result()!r}"
        if ending is signal.SIGKILL:
            ranks.kill(victim)
        else:
            os.kill(pid, signal.SIGCONT)
        async with asyncio.timeout(BOUND_S):
            result = await finish
    except BaseException:
        os.kill(pid, signal.SIGCONT)  # else the close waits for the stopped rank for good (by design)
        raise
    monkeypatch.undo()
    whole = ending is signal.SIGCONT
    assert result.loaded_tokens == (PAGES * T if whole else 0), result
    setup.clean()
    other = 1 - victim
    if whole:
        for rank in range(2):
            assert await setup.target_is(rank, whole=True), f"rank {rank}: wrong KV"
            assert await setup.marks(rank) == (1, 0, 0)
    else:
        await ranks.reap_dead()
        ranks.start(victim)
        async with asyncio.timeout(START_S):
            await cache.wait_ranks()
        await setup.zero_target()
        stream = cache.start_load(await cache.match(TOKENS), idx(TARGET))
        async with asyncio.timeout(BOUND_S):
            result = await stream.finish()
        assert result.loaded_tokens == PAGES * T, result
        for rank in range(2):
            assert await setup.target_is(rank, whole=True), f"rank {rank}: wrong KV after the restart"
        assert await setup.marks(victim) == (1, 0, 0), "the new process: its own session's stream only"
        assert await setup.marks(other) == (2, 0, 0)
        setup.clean()


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_rank_restarted_after_the_stream_began_is_sent_nothing_of_it(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, ranks = setup.cache, setup.ranks
    await setup.zero_target()
    victim = 1
    sessions_before = cache.group.sessions()

    async def restart() -> None:
        await _until_marked(setup, victim, 1)
        ranks.kill(victim)
        await ranks.reap_dead()
        ranks.start(victim)
        async with asyncio.timeout(START_S):
            # The new process attached (a new session of rank 1) before the first spec is sent.
            while cache.group.sessions()[victim] in (0, sessions_before[victim]):
                await cache.group.wait_change()

    faulted = _before_first_spec(monkeypatch, restart)
    stream = cache.start_load(await cache.match(TOKENS), idx(TARGET))
    async with asyncio.timeout(START_S + BOUND_S):
        await faulted.wait()
        result = await stream.finish()
    monkeypatch.undo()
    assert result.loaded_tokens == 0, result  # a miss: the process the call was admitted for is gone
    setup.clean()
    stats = await ranks.ask(victim, ("stats",))
    assert (stats.stream_marks, stats.stream_marks_missed, stats.specs) == (0, 0, 0), stats
    assert await setup.marks(0) == (1, 0, 0)
    for rank in range(2):
        assert await setup.target_is(rank, whole=False), f"rank {rank}: a byte of the stream landed"
    # The next stream reaches the new process, announced and marked there.
    stream = cache.start_load(await cache.match(TOKENS), idx(TARGET))
    async with asyncio.timeout(BOUND_S):
        assert (await stream.finish()).loaded_tokens == PAGES * T
    for rank in range(2):
        assert await setup.target_is(rank, whole=True), f"rank {rank}: wrong KV"
    assert await setup.marks(victim) == (1, 0, 0) and await setup.marks(0) == (2, 0, 0)
    setup.clean()


@pytest.mark.slow
@pytest.mark.asyncio
async def test_streams_begun_behind_a_stopped_rank_s_full_socket_all_land_once_it_runs(
    tmp_path: Path, ranks_left: list[AdvRanks]
) -> None:
    # Rank 1 is stopped while STREAMS streams begin: their STREAM_BEGINS frames and specs fill its
    # socket (the manager's send buffer made small) and then the manager's write buffer. Once the
    # rank runs again it reads them in order, far more streams than the marks it keeps
    # (stream_marks=4) and with few specs at once (worker_max_inflight=2): every stream ends whole,
    # bit-exact, no link error, each stream marked once on each rank.
    streams = 60
    rank_config = dataclasses.replace(CONFIG, inline_copy_bytes=0, stream_marks=4, worker_max_inflight=2)
    config = CacheConfig(cpu_bytes=32 * LAYOUT.page_bytes, disk=None, namespace="tp-adv-119-full",
                         pool_chunk_bytes=8 * LAYOUT.page_bytes)
    async with TPCache(config, LAYOUT, tp_size=2, num_slots=NUM_SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "sock") as cache:
        ranks = AdvRanks(cache.address, LAYOUT, 2, NUM_SLOTS, rank_config)
        ranks_left.append(ranks)
        ranks.start_all()
        async with asyncio.timeout(START_S):
            await cache.wait_ranks()
        setup = Setup(cache, ranks)
        for rank in range(2):
            await ranks.write(rank, SOURCE, rank_prefix_kv(LAYOUT, TOKENS, 0, rank, 2))
        assert (await cache.offload(TOKENS, idx(SOURCE))).stored == PAGES
        await setup.zero_target()
        transport = cache.group._ranks[1].transport
        assert transport is not None
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        pid = ranks.ranks[1].proc.pid
        assert pid is not None
        await stop_process(pid)
        try:
            began = [cache.start_load(await cache.match(TOKENS), idx(TARGET)) for _ in range(streams)]
            finishing = [asyncio.create_task(s.finish()) for s in began]
            done, _ = await asyncio.wait(finishing, timeout=STOPPED_S)
            assert not done, "a stream ended while rank 1 was stopped"
            assert transport.get_write_buffer_size() > 0, "the socket never filled: nothing tested"
        finally:
            os.kill(pid, signal.SIGCONT)
        async with asyncio.timeout(BOUND_S):
            results = await asyncio.gather(*finishing)
        assert all(r.loaded_tokens == PAGES * T for r in results), results
        for rank in range(2):
            assert await setup.target_is(rank, whole=True), f"rank {rank}: wrong KV"
            stats = await ranks.ask(rank, ("stats",))
            assert (stats.stream_marks, stats.stream_marks_failed, stats.link_errors) == (streams, 0, 0), stats
            assert stats.sessions == 1, stats
            # All the frames came before the specs: all but the newest stream_marks streams' marks
            # were dropped as old by then (168 of 180 LOAD specs in review 119; a stream sends fewer
            # specs where launch groups grow), their copies ordered at launch: counted, still exact.
            assert stats.stream_marks_missed >= streams - rank_config.stream_marks, stats
        setup.clean()
        await ranks.stop_all()


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_stream_closed_right_after_it_began_sends_no_spec_and_leaves_nothing(setup: Setup) -> None:
    # start_load wrote STREAM_BEGINS; the stream is closed before its loader's first turn, so no
    # spec of it is ever sent: each rank holds a mark nothing uses, nothing is referenced, and the
    # next stream loads whole.
    cache, ranks = setup.cache, setup.ranks
    await setup.zero_target()
    specs = [(await ranks.ask(rank, ("stats",))).specs for rank in range(2)]
    stream = cache.start_load(await cache.match(TOKENS), idx(TARGET))
    async with asyncio.timeout(BOUND_S):
        await stream.aclose()
    setup.clean()
    for rank in range(2):
        await _until_marked(setup, rank, 1)
        stats = await ranks.ask(rank, ("stats",))
        assert stats.specs == specs[rank] and stats.stream_marks_missed == 0, stats
        assert await setup.target_is(rank, whole=False), f"rank {rank}: a byte of the closed stream landed"
    stream = cache.start_load(await cache.match(TOKENS), idx(TARGET))
    async with asyncio.timeout(BOUND_S):
        assert (await stream.finish()).loaded_tokens == PAGES * T
    for rank in range(2):
        assert await setup.target_is(rank, whole=True), f"rank {rank}: wrong KV"
        assert await setup.marks(rank) == (2, 0, 0)
    setup.clean()
