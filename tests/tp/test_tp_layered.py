"""Layer-wise loads through a `TPCache`: every rank copies layer 0 of every page, then layer 1, ...

The rank processes are real (spawned), each with its own CPU KV buffer of its heads; their copies
are gated layer by layer (``RankProcesses(gated=True)``: a layer lands only when the test releases
it), so readiness is checked against what has really landed, not against timing:

- the scheduler's ``stream.wait_layer(l)`` resolves in layer order, each before the load finishes,
  and the bytes are bit-exact on every rank;
- each rank's engine-side ``wait_layer(load, l)`` returns only once layer l is in its buffer;
- a cancelled or abandoned stream returns only when no rank copies into the slots any more;
- a rank SIGKILLed mid-load shortens the load to a miss (counted), never claims a layer it lacks.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from tp_helpers import CONFIG, SLOTS, RankProcesses, full_kv, new_pool, rank_kv

from aiokv import CacheConfig, KVLayout
from aiokv.tp import (
    Direction,
    JobTable,
    LayeredLoad,
    RankGroup,
    RankStatus,
    RankWorker,
    TPCache,
    TPConfig,
    TransferSpec,
)
from aiokv.tp.layers import RETAINED_JOBS, LayerTable

LAYOUT = KVLayout.mha(4, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
N = 6 * T
SEED = 21
START_S = 120.0


def _config() -> CacheConfig:
    return CacheConfig(cpu_bytes=16 * LAYOUT.page_bytes, disk=None, namespace="tp-layered",
                       pool_chunk_bytes=4 * LAYOUT.page_bytes)


@pytest_asyncio.fixture
async def cache(tmp_path: Path) -> AsyncIterator[TPCache]:
    async with TPCache(_config(), LAYOUT, tp_size=2, num_slots=SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "sock") as cache:
        yield cache


@pytest_asyncio.fixture
async def readers(cache: TPCache) -> AsyncIterator[RankProcesses]:
    """Rank processes (rank 0 threaded, 1 async) with gated layered copies, and 6 pages they
    offloaded from slots ``[0, N)``; the loads go to other slots (``TARGET``), which hold other bytes."""
    ranks = RankProcesses(Path(cache.address), LAYOUT, 2, seed=SEED, fill=True, gated=True)
    ranks.start_all()
    try:
        async with asyncio.timeout(START_S):
            await cache.wait_ranks()
        assert (await cache.offload(TOKENS, torch.arange(N))).stored == 6
        for rank in range(2):
            assert not torch.equal((await ranks.dump(rank))[:, TARGET], _want(rank))
        yield ranks
    finally:
        for gate in ranks.gates.values():
            for _ in range(4 * LAYOUT.num_layers):
                gate.release()  # whatever a failed test left gated
        await ranks.kill_all()


TOKENS = list(range(9000, 9000 + N))
SKIP = 3
TARGET = torch.arange(40, 40 + N - SKIP)
"""Slots of tokens ``[SKIP, N)``: a partly needed first page too."""


def _want(rank: int, layer: int | None = None) -> torch.Tensor:
    heads = rank_kv(full_kv(LAYOUT, SEED), LAYOUT, rank, 2)[:, torch.arange(SKIP, N)]
    return heads if layer is None else heads[layer]


def _release(ranks: RankProcesses, layer_count: int = 1) -> None:
    for gate in ranks.gates.values():
        for _ in range(layer_count):
            gate.release()


def _assert_clean(cache: TPCache) -> None:
    assert cache.group.jobs.in_flight == 0, "a rank still copies"
    cache.pool.table.check_invariants()
    stats = cache.stats()
    assert stats.pool_reserved == 0 and stats.pool_referenced == 0, "references leaked"


@pytest.mark.asyncio
async def test_layers_land_in_order_before_the_load_ends_and_bit_exact_on_every_rank(
    cache: TPCache, readers: RankProcesses
) -> None:
    layers = LAYOUT.num_layers
    stream = cache.start_load(await cache.match(TOKENS), TARGET, from_token=SKIP, layered=True)
    await stream.launched()
    load = stream.layered_load()
    assert load.epoch == cache.group.epoch and len(load.jobs) == 1  # all pool pages, one layer-major launch
    # Each rank's engine waits on its own layers before reading them (a thread runner and an async one).
    for rank in range(2):
        readers.send(rank, ("layers", load, TARGET))
    waits = [asyncio.create_task(stream.wait_layer(layer)) for layer in range(layers)]
    finish = asyncio.create_task(stream.finish())
    for layer in range(layers):
        _release(readers)  # layer `layer` may land on both ranks now, and nothing later
        assert await waits[layer] is True
        assert not finish.done(), f"the load ended with layer {layer + 1} still gated"
        assert not any(w.done() for w in waits[layer + 1 :]), f"a layer after {layer} claimed ready"
    result = await finish
    assert (result.loaded_from, result.pool_pages) == (SKIP, 6)
    for rank in range(2):
        per_layer = await readers.reply(rank)
        for layer, (ok, raw) in enumerate(per_layer):
            # What the rank's engine saw right after its wait: layer `layer` complete, bit-exact.
            assert ok is True
            assert torch.equal(readers.tensor(raw), _want(rank, layer)), f"rank {rank} read layer {layer} early"
        got = await readers.dump(rank)
        assert torch.equal(got[:, TARGET], _want(rank)), f"rank {rank} holds bytes that are not its heads"
    jobs = cache.group.statistics().jobs
    assert jobs.stray_reports == 0
    assert jobs.layer_reports == 2 * layers  # every rank reported every layer (LAYERS) before its DONE
    _assert_clean(cache)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["cancel-finish", "aclose"])
async def test_a_stream_given_up_midway_returns_only_when_no_rank_copies(
    cache: TPCache, readers: RankProcesses, how: str
) -> None:
    stream = cache.start_load(await cache.match(TOKENS), TARGET, from_token=SKIP, layered=True)
    await stream.launched()
    _release(readers)
    assert await stream.wait_layer(0) is True
    if how == "cancel-finish":
        ending = asyncio.create_task(stream.finish())
        await asyncio.sleep(0)
        ending.cancel()
    else:
        ending = asyncio.create_task(stream.aclose())
    # Layers 1.. are still gated: the ranks are copying into the slots, so the call must not return.
    done, _ = await asyncio.wait({ending}, timeout=0.3)
    assert not done, "gave up on the stream while a rank still copied into its slots"
    assert cache.group.jobs.in_flight == 1
    _release(readers, LAYOUT.num_layers - 1)
    if how == "cancel-finish":
        with pytest.raises(asyncio.CancelledError):
            await ending
    else:
        await ending
    # At the moment the call returned every rank had reported: no copy still writes the slots.
    assert cache.group.jobs.in_flight == 0
    for rank in range(2):
        assert (await readers.ask(rank, "stats")).in_flight == 0
    _assert_clean(cache)
    # The pages stay cached and serve a whole load afterwards.
    _release(readers, LAYOUT.num_layers)  # (a plain load is not gated; spare releases are harmless)
    loaded = await cache.load(await cache.match(TOKENS), TARGET, from_token=SKIP)
    assert loaded.tokens == N
    for rank in range(2):
        assert torch.equal((await readers.dump(rank))[:, TARGET], _want(rank))


@pytest.mark.asyncio
async def test_a_rank_killed_midway_shortens_the_load_and_claims_no_layer_it_lacks(
    cache: TPCache, readers: RankProcesses
) -> None:
    layers = LAYOUT.num_layers
    stream = cache.start_load(await cache.match(TOKENS), TARGET, from_token=SKIP, layered=True)
    await stream.launched()
    _release(readers)
    assert await stream.wait_layer(0) is True  # layer 0 landed on both ranks
    readers.kill(1)
    await readers.reap(1)
    # Rank 1 never copies layer 1: no layer from 1 on may be reported ready, whatever rank 0 does.
    # A layer is given up only once every rank is accounted for (rank 0 may still copy into the
    # slots), so rank 0 is let through every layer first; waiting before that timed out the gate.
    waits = [asyncio.create_task(stream.wait_layer(layer)) for layer in range(1, layers)]
    _release(readers, layers)
    assert [await wait for wait in waits] == [False] * (layers - 1)
    result = await stream.finish()
    assert result.loaded_tokens == 0 and result.pool_pages == 0, "a load missing a rank's heads was served"
    errors = cache.stats().errors
    assert errors["copy_failed"] >= 1 and errors["load_shortened"] >= 1
    assert cache.group.statistics().jobs.rank_failures[RankStatus.RANK_LOST] >= 1
    _assert_clean(cache)
    # A restarted rank attaches and the pages (never touched by the failed load) serve bit-exact.
    readers.start(1)
    async with asyncio.timeout(START_S):
        await cache.wait_ranks()
    match = await cache.match(TOKENS)
    assert match.pool_pages == 6
    _release(readers, layers)
    stream = cache.start_load(match, TARGET, from_token=SKIP, layered=True)
    assert (await stream.finish()).loaded_from == SKIP
    for rank in range(2):
        assert torch.equal((await readers.dump(rank))[:, TARGET], _want(rank))
    _assert_clean(cache)


@pytest.mark.asyncio
async def test_layered_arguments_are_checked(cache: TPCache, readers: RankProcesses) -> None:
    match = await cache.match(TOKENS)
    with pytest.raises(TypeError, match="layered must be a bool"):
        cache.start_load(match, TARGET, from_token=SKIP, layered=1)  # type: ignore[arg-type]
    assert not match.released  # refused before anything changed
    match.release()
    plain = cache.start_load(await cache.match(TOKENS), TARGET, from_token=SKIP)
    with pytest.raises(RuntimeError, match="without layered=True"):
        plain.layered_load()
    await plain.aclose()
    layered = cache.start_load(await cache.match(TOKENS), TARGET, from_token=SKIP, layered=True)
    with pytest.raises(RuntimeError, match="before launched"):
        layered.layered_load()
    _release(readers, LAYOUT.num_layers)
    await layered.aclose()
    _assert_clean(cache)


# -- the bookkeeping on its own ------------------------------------------------------------------


@pytest.mark.asyncio
async def test_job_table_resolves_a_layer_once_every_rank_has_it() -> None:
    table = JobTable(4)
    spec = TransferSpec.build(1, Direction.LOAD, 5, 4, [0, 1], range(8), layered=True)
    job = table.open(spec, {0, 1}, layers=3)
    first, second, third = job.layer_futures
    assert table.report_layers(1, 0, 2)
    await asyncio.sleep(0)
    assert not first.done(), "layer 0 ready with rank 1 not reporting it"
    assert table.report_layers(1, 1, 1)
    assert first.result() is True and not second.done()
    assert not table.report_layers(1, 1, 1), "a count that does not grow is stray"
    assert not table.report_layers(1, 1, 4), "more layers than the job has is stray"
    assert not table.report_layers(2, 0, 1), "no such job"
    table.report(1, 0, RankStatus.OK)  # rank 0's whole part landed: all its layers
    assert not second.done()
    assert table.rank_lost(1) == 1  # rank 1 died after layer 0
    assert (second.result(), third.result()) == (False, False)
    assert not (await job).ok
    assert table.statistics().stray_reports == 3
    with pytest.raises(ValueError, match="layers=0 for a layered spec"):
        table.open(TransferSpec.build(2, Direction.LOAD, 5, 4, [0], range(4), layered=True), {0})
    with pytest.raises(ValueError, match="layers=2 for a whole spec"):
        table.open(TransferSpec.build(3, Direction.LOAD, 5, 4, [0], range(4)), {0}, layers=2)


@pytest.mark.asyncio
async def test_rank_side_waits_for_jobs_not_arrived_and_fails_those_that_never_come() -> None:
    table = LayerTable(epoch=5, layers=2)
    early = table.progress(3)  # the engine asks before spec 3 arrived
    waiter = asyncio.create_task(early.wait_async(1))
    await asyncio.sleep(0)
    progress = table.arrived(3, layered=True)
    assert progress is early
    progress.mark(1)
    await asyncio.sleep(0)
    assert not waiter.done(), "layer 1 ready after only layer 0 landed"
    progress.mark(2)
    assert await waiter is True
    never = table.progress(4)
    blocked = asyncio.create_task(never.wait_async(0))
    table.arrived(6, layered=False)  # specs arrive in job-id order: 4 will never come
    assert await blocked is False
    assert table.progress(5).wait(0, timeout=0) is False  # arrived earlier than 6 and was not layered
    pending = table.progress(9)
    table.close()
    assert pending.wait(0, timeout=1) is False
    with pytest.raises(TimeoutError):
        LayerTable(1, 1).progress(1).wait(0, timeout=0.01)
    assert LayeredLoad(5, (3,)).jobs == (3,)


def test_rank_side_table_of_a_later_session_ends_waits_for_jobs_issued_before_it() -> None:
    table = LayerTable(epoch=5, layers=2, first_job=10)  # the WELCOME's first job id of the session
    assert table.progress(9).wait(0, timeout=0) is False  # issued before: its spec never comes here
    assert table.progress(1).wait(1, timeout=0) is False
    pending = table.progress(10)  # this session's first job: waits for its spec
    with pytest.raises(TimeoutError):
        pending.wait(0, timeout=0.01)
    progress = table.arrived(10, layered=True)
    assert progress is pending
    progress.mark(2)
    assert pending.wait(1, timeout=0) is True


def test_rank_side_table_keeps_a_bounded_number_of_ended_jobs() -> None:
    table = LayerTable(epoch=1, layers=1)
    running = table.arrived(1, layered=True)
    assert running is not None
    for job in range(2, RETAINED_JOBS + 10):
        done = table.arrived(job, layered=True)
        assert done is not None
        done.mark(1)
        done.end()
    # The oldest job still runs: nothing behind it is dropped yet (bounded by running jobs).
    assert table.progress(2).wait(0, timeout=0) is True
    running.mark(1)
    running.end()
    table.arrived(RETAINED_JOBS + 10, layered=True)
    # Forgotten: not known to be ready (the engine asked far too late); recent ones are kept.
    assert table.progress(1).wait(0, timeout=0) is False
    assert table.progress(RETAINED_JOBS + 9).wait(0, timeout=0) is True


@pytest.mark.asyncio
async def test_a_full_worker_stops_reading_and_resumes_when_a_spec_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Backpressure: beyond ``worker_max_inflight`` specs a worker leaves the rest in its socket."""
    from aiokv.kernels import mover

    gate = threading.Semaphore(0)
    scatter = mover.HostScatter.load

    def gated(*args: Any) -> None:
        assert gate.acquire(timeout=60)
        scatter(*args)

    monkeypatch.setattr(mover.HostScatter, "load", gated)  # every layer of a layered copy waits
    config = TPConfig(reconnect_initial_s=0.001, reconnect_max_s=0.05, worker_max_inflight=2)
    pool = await new_pool(LAYOUT.for_tp(2), 8)
    full = full_kv(LAYOUT, SEED)
    try:
        async with RankGroup(LAYOUT, 2, pool.name, pool.num_pages, config, tmp_path / "m") as group, \
                RankWorker(group.address, 0, 2, LAYOUT, rank_kv(full, LAYOUT, 0, 2), config) as w0, \
                RankWorker(group.address, 1, 2, LAYOUT, rank_kv(full, LAYOUT, 1, 2), config) as w1:
            await group.wait_attached()
            jobs = [group.submit_nowait(group.spec(Direction.LOAD, [i], range(i * T, (i + 1) * T), layered=True))
                    for i in range(5)]
            try:
                async with asyncio.timeout(30):
                    # Worker statistics have no change event: a bounded poll.
                    while w0.statistics().specs < 2 or w1.statistics().specs < 2:  # noqa: ASYNC110
                        await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)  # the workers had every chance to read on: they must not
                assert (w0.statistics().specs, w1.statistics().specs) == (2, 2)
                assert w0.statistics().in_flight == 2 and not any(job.done() for job in jobs)
            finally:
                for _ in range(5 * 2 * LAYOUT.num_layers):
                    gate.release()  # (also when the test failed: closing waits for the copies)
            outcomes = [await job for job in jobs]
            assert all(o.ok for o in outcomes), outcomes
            assert (w0.statistics().specs, w1.statistics().specs) == (5, 5)
    finally:
        await pool.aclose()


@pytest.mark.asyncio
async def test_a_spec_that_cannot_run_after_a_pause_ends_the_link_instead_of_stalling_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the pump that runs a paused spec from a spec's report let an exception other than
    ValueError escape: reading stayed paused, the link stayed up, the jobs waited for ever."""
    from aiokv.tp import worker as worker_module

    runs = {"n": 0}
    real_run = worker_module.RankWorker._run_spec

    def failing(self: Any, link: Any, executor: Any, payload: bytes) -> None:
        runs["n"] += 1
        if runs["n"] > 2:  # each rank's first spec runs; the next, pumped from room(), breaks
            raise RuntimeError("injected: running a spec failed")
        real_run(self, link, executor, payload)

    monkeypatch.setattr(worker_module.RankWorker, "_run_spec", failing)
    config = TPConfig(reconnect_initial_s=0.001, reconnect_max_s=0.05, worker_max_inflight=1)
    pool = await new_pool(LAYOUT.for_tp(2), 8)
    full = full_kv(LAYOUT, SEED)
    try:
        async with RankGroup(LAYOUT, 2, pool.name, pool.num_pages, config, tmp_path / "m") as group, \
                RankWorker(group.address, 0, 2, LAYOUT, rank_kv(full, LAYOUT, 0, 2), config), \
                RankWorker(group.address, 1, 2, LAYOUT, rank_kv(full, LAYOUT, 1, 2), config):
            await group.wait_attached()
            jobs = [group.submit_nowait(group.spec(Direction.LOAD, [i], range(i * T, (i + 1) * T)))
                    for i in range(3)]
            async with asyncio.timeout(30):
                outcomes = [await job for job in jobs]
            assert outcomes[0].ok, outcomes[0]
            assert not all(o.ok for o in outcomes[1:]), "a spec that never ran was reported done"
    finally:
        await pool.aclose()
