"""A rank worker's kernel warm-up: it launches every variant the rank's real copies launch, the first
spec waits for it (unread, never on the loop), the session's end stops it before the pool is
unmapped, and a failure is counted while copies go on.

CPU only, kernels under the Triton interpreter (``TRITON_INTERPRET=1`` from ``tests/conftest.py``):
a rank on the STAGING path launches them there. The warm-up thread is held inside its first launch
by a :func:`record_launches` hook, so every ordering below is forced, not timed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from loop_probes import until, waiting_in
from tp_helpers import expected_page, full_kv, key, new_pool, reserve, threads_off_loop
from warmup_gate import WARM, Gate, open_into_close, warm_threads, warmup_gates

from aiokv.kernels import TransferPath
from aiokv.kernels.launch import LaunchRecord, record_launches
from aiokv.kernels.paths import interpreting
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.tp import Direction, RankGroup, RankStatus, RankWorker, RankWorkerThread, TPConfig

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU test: kernels under the Triton interpreter")

LAYOUT = KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
FAST = TPConfig(reconnect_initial_s=0.001, reconnect_max_s=0.05)


@pytest.fixture
def gated() -> Iterator[Callable[..., tuple[Gate, LaunchRecord]]]:
    with warmup_gates() as make:
        yield make


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[PagePool]:
    pool = await new_pool(LAYOUT.for_tp(1), 16)
    yield pool
    assert pool.table.statistics().reserved == 0, "a test left pages reserved"
    await pool.aclose()


@pytest_asyncio.fixture
async def group(pool: PagePool, tmp_path: Path) -> AsyncIterator[RankGroup]:
    async with RankGroup(LAYOUT, 1, pool.name, pool.num_pages, FAST, tmp_path / "g") as group:
        yield group


def _worker(group: RankGroup, kv: torch.Tensor, path: TransferPath = TransferPath.STAGING) -> RankWorker:
    return RankWorker(group.address, 0, 1, LAYOUT, kv, FAST, path=path)


@pytest.mark.asyncio
async def test_rank_copies_wait_for_the_warm_up_and_launch_only_its_variants(
    pool: PagePool, group: RankGroup, gated: Callable[..., tuple[Gate, LaunchRecord]]
) -> None:
    gate, record = gated()
    full = full_kv(LAYOUT, 1, 64)
    kv = full.clone()
    handles = reserve(pool, [key(i) for i in range(3)])
    pages = [h.page for h in handles]
    slots = torch.arange(5, 5 + 3 * T)
    async with _worker(group, kv) as worker:
        await group.wait_attached()
        assert worker._executor is not None
        worker._executor._mover.load_runs = False  # every load launches a kernel: the variants are checked
        await gate.held.wait()  # the session's warm-up is in its first launch
        offload = group.submit_nowait(group.spec(Direction.OFFLOAD, pages, slots))
        await until(lambda: waiting_in(worker._session_task, "until"))
        assert worker.statistics().specs == 0 and not gate.other.is_set(), "a spec ran before the kernels were warm"
        gate.open()
        assert (await offload).ok
        for i, page in enumerate(pages):
            pool.table.commit(handles[i])
            assert torch.equal(pool.pages[page], expected_page(full, slots[i * T : (i + 1) * T].tolist(), LAYOUT))
        # Loads: whole pages, from mid-page, layer by layer, to other slots.
        loads = [group.spec(Direction.LOAD, pages, range(32, 32 + 3 * T)),
                 group.spec(Direction.LOAD, pages, range(20, 20 + 3 * T - 1), skip_first=1),
                 group.spec(Direction.LOAD, pages[:2], range(44, 44 + 2 * T - 3), skip_first=3, layered=True)]
        for spec in loads:
            assert (await (await group.submit(spec))).ok
        assert torch.equal(kv[:, 32 : 32 + 3 * T], full[:, slots])
        warm = await worker.wait_warm()
        assert warm is not None and not warm.stopped and warm.variants > 0
        assert worker.statistics().reports == {RankStatus.OK: 4}
    warm_keys = {k for k, t in zip(record.keys, record.threads, strict=True) if t == WARM}
    real = {k for k, t in zip(record.keys, record.threads, strict=True) if t != WARM}
    assert real, "the rank's copies launched no kernel"
    assert real <= warm_keys, f"variants the rank's warm-up missed: {sorted(real - warm_keys, key=str)}"
    assert len(warm_keys) == warm.variants
    assert worker.statistics().warm_up_failed == 0


@pytest.mark.asyncio
async def test_closing_the_worker_stops_its_warm_up_before_the_pool_is_unmapped(
    group: RankGroup, gated: Callable[..., tuple[Gate, LaunchRecord]]
) -> None:
    gate, record = gated()
    worker = _worker(group, full_kv(LAYOUT, 2, 64))
    await worker.__aenter__()
    await gate.held.wait()
    threads = warm_threads()
    assert len(threads) == 1
    warm = worker._warm
    assert warm is not None
    executor = worker._executor
    assert executor is not None
    closing = asyncio.ensure_future(worker.aclose())
    await until(lambda: warm._stop.is_set())
    await until(lambda: waiting_in(worker._session_task, "aclose"))  # the session waits for the warm-up
    assert not closing.done() and executor._mover is not None, "the close went on while the warm-up ran"
    await open_into_close(gate, closing, record, threads[0])
    assert executor._mover is None  # unmapped, after the warm-up ended
    result = warm.result
    assert result is not None and result.stopped
    assert worker.statistics().warm_up_failed == 0


@pytest.mark.asyncio
async def test_a_failed_rank_warm_up_is_counted_and_specs_go_on(
    pool: PagePool, group: RankGroup, gated: Callable[..., tuple[Gate, LaunchRecord]]
) -> None:
    gate, record = gated(fail=True)  # the warm-up's first launch raises
    handles = reserve(pool, [key(7)])
    async with _worker(group, full_kv(LAYOUT, 3, 64)) as worker:
        await group.wait_attached()
        assert await worker.wait_warm() is None
        assert worker.statistics().warm_up_failed == 1
        # Slots out of order: a run of slots would be copied without a kernel (TPConfig.offload_runs).
        slots = range(T - 1, -1, -1)
        assert (await (await group.submit(group.spec(Direction.OFFLOAD, [handles[0].page], slots)))).ok
        assert gate.other.is_set()  # the copy launched its kernels itself
    assert WARM in record.threads
    pool.table.abort(handles[0])


@pytest.mark.asyncio
async def test_a_rank_without_kernels_starts_no_warm_up(pool: PagePool, group: RankGroup) -> None:
    handles = reserve(pool, [key(9)])
    with record_launches(launch=False) as record:
        async with _worker(group, full_kv(LAYOUT, 4, 64), TransferPath.REFERENCE) as worker:
            await group.wait_attached()
            assert not warm_threads()
            assert await worker.wait_warm() is None
            assert (await (await group.submit(group.spec(Direction.OFFLOAD, [handles[0].page], range(T))))).ok
    assert record.keys == []
    pool.table.abort(handles[0])


@pytest.mark.asyncio
async def test_a_thread_runner_waits_for_its_warm_up(group: RankGroup) -> None:
    kv = full_kv(LAYOUT, 5, 64)
    runner = RankWorkerThread(group.address, 0, 1, LAYOUT, kv, FAST, path=TransferPath.DIRECT)
    async with threads_off_loop(runner):
        await asyncio.to_thread(runner.wait_attached, 60)
        warm = await asyncio.to_thread(runner.wait_warm, 120)
        assert warm is not None and not warm.stopped and warm.variants > 0
        for thread in warm_threads():
            thread.join(10)  # it returned its result; only its exit may be left
        assert not warm_threads()  # it ended; the session goes on
    assert runner.error is None
