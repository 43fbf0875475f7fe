"""RankGroup and RankWorker in one process: handshake, job ownership, cancellation, faults, restart.

Fake workers (raw frames over the socket) give the tests full control of when a rank reports or
goes away; real workers run on this loop (async runner) or their own thread (thread runner).
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from tp_helpers import expected_page, full_kv, key, new_pool, rank_kv, reserve, threads_off_loop

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.tp import (
    Direction,
    Job,
    RankExecutor,
    RankGroup,
    RankStatus,
    RankWorker,
    RankWorkerThread,
    TPConfig,
    TransferSpec,
    WorkerRefusedError,
)
from aiokv.tp.endpoint import clear_stale_socket, private_directory
from aiokv.tp.wire import (
    PROTOCOL_VERSION,
    Attached,
    Done,
    FrameKind,
    Hello,
    Refuse,
    RefuseReason,
    Welcome,
    frame,
    read_frame,
)

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
PAGES = LAYOUT.for_tp(2)
"""The pool's page format under TP 2: two rank-major parts."""
FAST = TPConfig(reconnect_initial_s=0.001, reconnect_max_s=0.05)


class FakeRank:
    """A worker speaking raw frames: reports only when told to."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reply: Welcome | Refuse) -> None:
        self.reader, self.writer, self.reply = reader, writer, reply

    @classmethod
    async def connect(
        cls, group: RankGroup, rank: int, version: int = PROTOCOL_VERSION, tp_size: int | None = None,
        device: str = "cpu",
    ) -> FakeRank:
        reader, writer = await asyncio.open_unix_connection(os.fspath(group.address))
        hello = Hello(version, rank, tp_size or group.tp_size, group.page_layout.fingerprint, device)
        writer.write(frame(FrameKind.HELLO, hello.encode()))
        kind, payload = await read_frame(reader, 1 << 20)
        if kind is FrameKind.REFUSE:
            return cls(reader, writer, Refuse.decode(payload))
        welcome = Welcome.decode(payload)
        writer.write(frame(FrameKind.ATTACHED, Attached(welcome.epoch, True).encode()))
        return cls(reader, writer, welcome)

    async def next_spec(self) -> TransferSpec:
        kind, payload = await read_frame(self.reader, 1 << 20)
        while kind is FrameKind.STREAM_BEGINS:  # a load stream's start (protocol 7): no reply owed
            kind, payload = await read_frame(self.reader, 1 << 20)
        assert kind is FrameKind.SPEC
        return TransferSpec.from_bytes(payload)

    def report(self, job_id: int, status: RankStatus = RankStatus.OK) -> None:
        self.writer.write(frame(FrameKind.DONE, Done(job_id, status, status.name).encode()))

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[PagePool]:
    pool = await new_pool(PAGES, 16)
    yield pool
    pool.table.check_invariants()
    assert pool.table.statistics().reserved == 0, "a test left pages reserved"
    await pool.aclose()


@pytest_asyncio.fixture
async def group(pool: PagePool, tmp_path: Path) -> AsyncIterator[RankGroup]:
    async with RankGroup(LAYOUT, 2, pool.name, pool.num_pages, FAST, tmp_path / "mgr") as group:
        yield group
        assert group.jobs.in_flight == 0, "a test left jobs in flight"


def settle(pool: PagePool, handles: list) -> object:  # type: ignore[type-arg]
    """The done-callback a manager registers: commit every page on success, abort them all otherwise."""

    def done(job: Job) -> None:
        for handle in handles:
            if job.outcome().ok:
                pool.table.commit(handle)
            else:
                pool.table.abort(handle)

    return done


@pytest.mark.asyncio
async def test_offload_then_load_with_both_runners(pool: PagePool, group: RankGroup) -> None:
    full = full_kv(LAYOUT, 1)
    slots = torch.randperm(full.shape[1], generator=torch.Generator().manual_seed(3))[: 3 * T]
    k0, k1 = rank_kv(full, LAYOUT, 0, 2), rank_kv(full, LAYOUT, 1, 2)
    handles = reserve(pool, [key(i) for i in range(3)])
    pages = [h.page for h in handles]
    async with threads_off_loop(RankWorkerThread(group.address, 1, 2, LAYOUT, k1, FAST)) as (thread_worker,):
        async with RankWorker(group.address, 0, 2, LAYOUT, k0, FAST) as worker:
            await group.wait_attached()
            assert await worker.wait_attached() == group.epoch
            assert await asyncio.to_thread(thread_worker.wait_attached, 30) == group.epoch
            job = group.submit_nowait(group.spec(Direction.OFFLOAD, pages, slots))
            job.add_done_callback(settle(pool, handles))  # type: ignore[arg-type]
            outcome = await job
            assert outcome.ok and job.ranks == {0, 1}
            for i, page in enumerate(pages):
                assert torch.equal(pool.pages[page], expected_page(full, slots[i * T : (i + 1) * T].tolist(), PAGES))
            stats = worker.statistics()
            assert stats.attached and stats.specs == 1 and stats.reports == {RankStatus.OK: 1}
        assert thread_worker.statistics().reports == {RankStatus.OK: 1}
    # Fresh zeroed workers load the pages back, the first page partly (skip 1 token), to other slots.
    z0, z1 = torch.zeros_like(k0), torch.zeros_like(k1)
    refs = [pool.table.acquire(key(i)) for i in range(3)]
    target = torch.arange(40, 40 + 3 * T - 1)
    async with RankWorker(group.address, 0, 2, LAYOUT, z0, FAST), RankWorker(group.address, 1, 2, LAYOUT, z1, FAST):
        await group.wait_attached()
        outcome = await group.submit_nowait(group.spec(Direction.LOAD, pages, target, skip_first=1))
        assert outcome.ok
    for ref in refs:
        assert ref is not None
        pool.table.release(ref)
    for got, want in ((z0, k0), (z1, k1)):
        assert torch.equal(got[:, target], want[:, slots[1:]]), "a rank loaded bytes that are not its heads"
        untouched = torch.ones(got.shape[1], dtype=torch.bool)
        untouched[target] = False
        assert not got[:, untouched].any()


@pytest.mark.asyncio
async def test_submit_without_every_rank_fails_at_once(pool: PagePool, group: RankGroup) -> None:
    spec = group.spec(Direction.OFFLOAD, [0], range(T))
    job = group.submit_nowait(spec)
    assert job.done() and not job.outcome().ok
    missing = {(f.rank, f.status) for f in job.outcome().failures}
    assert missing == {(0, RankStatus.NOT_ATTACHED), (1, RankStatus.NOT_ATTACHED)}
    fake = await FakeRank.connect(group, 0)
    await _wait_ranks(group, {0})
    job = group.submit_nowait(group.spec(Direction.LOAD, [0], range(T)))
    assert [(f.rank, f.status) for f in (await job).failures] == [(1, RankStatus.NOT_ATTACHED)]
    assert group.statistics().jobs.failed == 2
    await fake.close()


@pytest.mark.asyncio
async def test_refusals_are_clear(pool: PagePool, group: RankGroup) -> None:
    other = KVLayout.mha(2, 4, 16, torch.float16, page_tokens=4)
    kv = rank_kv(full_kv(other, 1), other, 0, 2)
    worker = RankWorker(group.address, 0, 2, other, kv, FAST)
    with pytest.raises(WorkerRefusedError, match="LAYOUT") as refused:
        await worker.run()
    assert refused.value.reason is RefuseReason.LAYOUT
    with pytest.raises(WorkerRefusedError):
        await worker.wait_attached()
    kv4 = rank_kv(full_kv(LAYOUT, 1), LAYOUT, 0, 4)
    with pytest.raises(WorkerRefusedError, match="tp_size 4"):
        await RankWorker(group.address, 0, 4, LAYOUT, kv4, FAST).run()
    old = await FakeRank.connect(group, 0, version=PROTOCOL_VERSION + 1)
    expect = f"worker speaks protocol {PROTOCOL_VERSION + 1}, this manager speaks {PROTOCOL_VERSION}"
    assert old.reply == Refuse(RefuseReason.VERSION, expect)
    await old.close()
    out_of_range = await FakeRank.connect(group, 5)
    assert isinstance(out_of_range.reply, Refuse) and out_of_range.reply.reason is RefuseReason.RANK_RANGE
    first = await FakeRank.connect(group, 0)
    assert isinstance(first.reply, Welcome) and first.reply.pool_name == pool.name
    second = await FakeRank.connect(group, 0)
    assert isinstance(second.reply, Refuse) and second.reply.reason is RefuseReason.RANK_TAKEN
    assert RefuseReason.RANK_TAKEN.retry and not RefuseReason.LAYOUT.retry
    stats = group.statistics()
    assert stats.refused == 5 and stats.attached == {0}
    for fake in (out_of_range, first, second):
        await fake.close()


@pytest.mark.asyncio
async def test_a_lost_rank_fails_its_part_of_every_job_in_flight(pool: PagePool, group: RankGroup) -> None:
    ranks = [await FakeRank.connect(group, r) for r in (0, 1)]
    await group.wait_attached()
    jobs = [group.submit_nowait(group.spec(Direction.OFFLOAD, [i], range(T))) for i in range(3)]
    specs = [await ranks[0].next_spec() for _ in jobs]
    ranks[0].report(specs[0].job_id)
    await ranks[1].close()  # rank 1 dies with three jobs in flight
    await _wait_ranks(group, {0})
    # Rank 1's parts failed at once; rank 0 still owes jobs 2 and 3 (it may be writing their pages).
    assert jobs[0].done()
    assert [f.status for f in jobs[0].outcome().failures] == [RankStatus.RANK_LOST]
    assert not jobs[1].done() and group.jobs.pending_ranks(jobs[1].id) == {0}
    ranks[0].report(specs[1].job_id, RankStatus.COPY_FAILED)
    ranks[0].report(specs[2].job_id)
    outcomes = [await job for job in jobs]
    assert [sorted(f.rank for f in o.failures) for o in outcomes] == [[1], [0, 1], [1]]
    stats = group.statistics().jobs
    assert stats.failed == 3 and stats.rank_failures == {RankStatus.RANK_LOST: 3, RankStatus.COPY_FAILED: 1}
    assert group.statistics().disconnects == 1
    await ranks[0].close()


@pytest.mark.asyncio
async def test_cancelled_waiter_leaves_the_job_owned_until_every_rank_reported(
    pool: PagePool, group: RankGroup
) -> None:
    ranks = [await FakeRank.connect(group, r) for r in (0, 1)]
    await group.wait_attached()
    handles = reserve(pool, [key(1)])
    job = group.submit_nowait(group.spec(Direction.OFFLOAD, [handles[0].page], range(T)))
    settled: list[bool] = []
    job.add_done_callback(lambda j: settled.append(j.outcome().ok))
    job.add_done_callback(settle(pool, handles))  # type: ignore[arg-type]
    waiter = asyncio.create_task(job.wait())
    specs = [await r.next_spec() for r in ranks]
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    # A second job is the barrier: once it is done, rank 0's earlier report on the same connection
    # has been handled too.
    barrier = group.submit_nowait(group.spec(Direction.LOAD, [5], range(T)))
    barrier_ids = [(await r.next_spec()).job_id for r in ranks]
    ranks[0].report(specs[0].job_id)
    ranks[0].report(barrier_ids[0])
    ranks[1].report(barrier_ids[1])
    assert (await barrier).ok
    assert group.jobs.pending_ranks(job.id) == {1}
    assert group.jobs.in_flight == 1 and not settled, "the job must stay owned while rank 1 may still write"
    assert pool.table.statistics().reserved == 1
    ranks[1].report(specs[1].job_id)
    assert (await job).ok
    # The settling callbacks were registered before this await's own: they have run.
    assert settled == [True] and pool.table.contains(key(1))
    for r in ranks:
        await r.close()


@pytest.mark.asyncio
async def test_queue_bound_nowait_twin_and_waiting_submit(pool: PagePool, tmp_path: Path) -> None:
    config = TPConfig(max_jobs=2)
    async with RankGroup(LAYOUT, 1, pool.name, pool.num_pages, config, tmp_path / "q") as group:
        rank = await FakeRank.connect(group, 0)
        await group.wait_attached()
        jobs = [group.submit_nowait(group.spec(Direction.LOAD, [i], range(T))) for i in range(2)]
        with pytest.raises(asyncio.QueueFull):
            group.submit_nowait(group.spec(Direction.LOAD, [2], range(T)))
        third = asyncio.create_task(group.submit(group.spec(Direction.LOAD, [2], range(T))))
        first = await rank.next_spec()
        await rank.next_spec()
        assert not third.done()
        rank.report(first.job_id)
        job3 = await third
        assert group.jobs.in_flight == 2
        for job in (jobs[1], job3):
            spec = await rank.next_spec() if job is job3 else None
            rank.report(job.id if spec is None else spec.job_id)
            assert (await job).ok
        with pytest.raises(ValueError, match="epoch"):
            group.submit_nowait(TransferSpec.build(99, Direction.LOAD, group.epoch + 1, T, [0], range(T)))
        with pytest.raises(ValueError, match="pool has 16"):
            group.submit_nowait(group.spec(Direction.LOAD, [16], range(T)))
        assert group.jobs.in_flight == 0 and group.statistics().jobs.succeeded == 3
        await rank.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("ending", ["reports", "closes"])
async def test_aclose_fences_a_rank_owing_a_report_and_removes_its_directory(
    pool: PagePool, tmp_path: Path, ending: str
) -> None:
    # Past close_timeout_s the close no longer fails a job a live rank may still be copying: it
    # half-closes that rank's connection (the fence) and waits for its report or its end.
    config = TPConfig(close_timeout_s=0.05)
    group = RankGroup(LAYOUT, 1, pool.name, pool.num_pages, config, tmp_path / "c")
    await group.start()
    address = group.address
    assert stat.S_IMODE(os.stat(address.parent).st_mode) == 0o700
    rank = await FakeRank.connect(group, 0)
    await group.wait_attached()
    job = group.submit_nowait(group.spec(Direction.LOAD, [0], range(T)))
    spec = await rank.next_spec()
    closing = asyncio.create_task(group.aclose())
    second = asyncio.create_task(group.aclose())  # a second call waits for the same close
    async with asyncio.timeout(30):
        assert await rank.reader.read() == b""  # the fence: EOF, after close_timeout_s
    assert group.statistics().fenced == 1
    assert not job.done() and not closing.done() and not second.done()
    if ending == "reports":
        rank.report(spec.job_id)  # the copy ended: reported over the half-closed connection
        async with asyncio.timeout(30):
            assert (await job).ok
        assert not closing.done()  # the rank has not ended its connection yet
    await rank.close()
    async with asyncio.timeout(30):
        await closing
        await second
    if ending == "closes":
        assert [f.status for f in job.outcome().failures] == [RankStatus.RANK_LOST]
    assert not address.exists() and not address.parent.exists()
    late = group.submit_nowait(group.spec(Direction.LOAD, [0], range(T)))
    assert [f.status for f in late.outcome().failures] == [RankStatus.GROUP_CLOSED]
    assert group.jobs.in_flight == 0
    with pytest.raises(RuntimeError, match="closed"):
        await group.wait_attached()


@pytest.mark.asyncio
async def test_aclose_lets_a_rank_owing_nothing_go_at_once(tmp_path: Path) -> None:
    # A rank that owes no report is not waited for (a fake that never answers holds nothing). MLA:
    # rank 0 alone writes, so rank 1 never gets the offload's spec.
    mla = KVLayout.mla(2, 16, torch.float16, page_tokens=T)
    pool = await new_pool(mla.for_tp(2), 4)
    try:
        group = RankGroup(mla, 2, pool.name, pool.num_pages, TPConfig(close_timeout_s=0.05), tmp_path / "c")
        await group.start()
        ranks = [await FakeRank.connect(group, r) for r in range(2)]
        await group.wait_attached()
        job = group.submit_nowait(group.spec(Direction.OFFLOAD, [0], range(T)))
        assert job.ranks == {0}
        spec = await ranks[0].next_spec()
        closing = asyncio.create_task(group.aclose())
        async with asyncio.timeout(30):
            assert await ranks[0].reader.read() == b""  # fenced
        assert group.statistics().fenced == 1  # rank 1 owed nothing: not fenced, not waited for
        ranks[0].report(spec.job_id)
        await ranks[0].close()
        async with asyncio.timeout(30):
            await closing
        assert (await job).ok
        assert await ranks[1].reader.read() == b""  # its connection was simply closed
        await ranks[1].close()
    finally:
        await pool.aclose()


@pytest.mark.asyncio
async def test_a_broken_link_of_a_rank_owing_a_report_is_fenced_not_aborted(group: RankGroup) -> None:
    # A malformed frame from a serving rank with a job in flight: failing the job at once would hand
    # the engine slots the rank may still copy into. The link is fenced (EOF) and its later frames
    # ignored; the job fails when the rank ends its connection.
    ranks = [await FakeRank.connect(group, r) for r in range(2)]
    await group.wait_attached()
    job = group.submit_nowait(group.spec(Direction.LOAD, [0], range(T)))
    spec = await ranks[1].next_spec()
    ranks[1].writer.write(frame(FrameKind.HELLO, b"not now"))  # unexpected while serving
    async with asyncio.timeout(30):
        assert await ranks[1].reader.read() == b""  # fenced: EOF, not a reset
    assert not job.done()
    assert group.statistics().fenced == 1 and group.statistics().link_errors == 1
    ranks[1].report(spec.job_id)  # ignored: the link is broken
    ranks[0].report((await ranks[0].next_spec()).job_id)
    await ranks[1].close()
    async with asyncio.timeout(30):
        outcome = await job
    assert [(f.rank, f.status) for f in outcome.failures] == [(1, RankStatus.RANK_LOST)]
    await ranks[0].close()


@pytest.mark.asyncio
async def test_executor_on_an_engine_channel(pool: PagePool) -> None:
    # An engine that carries specs itself drives RankExecutor directly on each rank.
    from aiokv.cuda import CompletionBridge
    from aiokv.layout import KVBuffer, TPSlice

    full = full_kv(LAYOUT, 2)
    tp = TPSlice.of(LAYOUT, 1, 2)
    bridge = CompletionBridge()
    kv = KVBuffer.wrap(LAYOUT, rank_kv(full, LAYOUT, 1, 2), tp)
    with pytest.raises(ValueError, match="rank-major parts"):  # a pool of whole-row pages does not fit
        RankExecutor(kv, PagePool.attach(pool.name, LAYOUT), epoch=5, bridge=bridge)
    executor = RankExecutor(kv, PagePool.attach(pool.name, PAGES), epoch=5, bridge=bridge)
    pool.pages.zero_()
    ok = await executor.execute(TransferSpec.build(1, Direction.OFFLOAD, 5, T, [3], range(T)))
    assert ok.status is RankStatus.OK
    # Page 3 is [2 parts, L, T, 4 rows, D]: rank 1 wrote its K heads 2-3 and V heads 2-3 as part 1.
    assert torch.equal(pool.pages[3][1], expected_page(full, range(T), PAGES)[1])
    assert not pool.pages[3][0].any(), "rank 1 wrote rank 0's part"
    assert not pool.pages[:3].any() and not pool.pages[4:].any(), "rank 1 wrote another page"
    stale = await executor.execute(TransferSpec.build(2, Direction.OFFLOAD, 6, T, [3], range(T)))
    assert stale.status is RankStatus.STALE_EPOCH
    bad = await executor.execute(TransferSpec.build(3, Direction.LOAD, 5, T, [3], range(1000, 1000 + T)))
    assert bad.status is RankStatus.BAD_SPEC and "out of range" in bad.text
    await executor.aclose()
    closed = await executor.execute(TransferSpec.build(4, Direction.LOAD, 5, T, [3], range(T)))
    assert closed.status is RankStatus.WORKER_CLOSING
    assert executor.memory.segment.closed
    await asyncio.to_thread(bridge.close)


@pytest.mark.asyncio
async def test_workers_reattach_to_a_restarted_manager(pool: PagePool, tmp_path: Path) -> None:
    full = full_kv(LAYOUT, 4)
    directory = tmp_path / "restart"
    workers = [RankWorker(directory / "manager.sock", r, 2, LAYOUT, rank_kv(full, LAYOUT, r, 2), FAST) for r in (0, 1)]
    async with workers[0], workers[1]:
        async with RankGroup(LAYOUT, 2, pool.name, pool.num_pages, FAST, directory) as first:
            await first.wait_attached()
            assert (await first.submit_nowait(first.spec(Direction.OFFLOAD, [0], range(T)))).ok
        for worker in workers:
            await worker.wait_detached()
        second_pool = await new_pool(PAGES, 8)
        try:
            async with RankGroup(LAYOUT, 2, second_pool.name, second_pool.num_pages, FAST, directory) as second:
                await second.wait_attached()
                assert [await w.wait_attached() for w in workers] == [second.epoch, second.epoch]
                assert (await second.submit_nowait(second.spec(Direction.OFFLOAD, [7], range(T, 2 * T)))).ok
                assert torch.equal(second_pool.pages[7], expected_page(full, range(T, 2 * T), PAGES))
                assert [w.statistics().sessions for w in workers] == [2, 2]
                assert second.jobs.in_flight == 0
        finally:
            await second_pool.aclose()


def test_private_directory_rules(tmp_path: Path) -> None:
    made = private_directory(tmp_path / "new")
    assert made.created and stat.S_IMODE(os.stat(made.directory).st_mode) == 0o700
    assert not private_directory(tmp_path / "new").created
    (tmp_path / "open").mkdir(mode=0o755)
    os.chmod(tmp_path / "open", 0o755)
    with pytest.raises(PermissionError, match="0700"):
        private_directory(tmp_path / "open")
    (tmp_path / "link").symlink_to(tmp_path / "new")
    with pytest.raises(PermissionError, match="symlink"):
        private_directory(tmp_path / "link")
    with pytest.raises(ValueError, match="choose a shorter"):
        private_directory(tmp_path / ("x" * 120))
    (tmp_path / "new" / "manager.sock").write_text("not a socket")
    with pytest.raises(PermissionError, match="not a socket"):
        clear_stale_socket(made.socket_path)


@pytest.mark.asyncio
async def test_a_second_manager_on_a_live_directory_is_refused(pool: PagePool, group: RankGroup) -> None:
    with pytest.raises(RuntimeError, match="another manager"):
        await RankGroup(LAYOUT, 2, pool.name, pool.num_pages, FAST, group.address.parent).start()


async def _wait_ranks(group: RankGroup, ranks: set[int]) -> None:
    while group.attached != ranks:
        await group.wait_change()


@pytest.mark.asyncio
async def test_the_ranks_device_kind_comes_from_their_hellos(pool: PagePool, tmp_path: Path) -> None:
    # What a TPCache labels its learned rates by (it was "cpu" whatever the ranks copied on).
    seen: list[str] = []
    async with RankGroup(LAYOUT, 2, pool.name, pool.num_pages, FAST, tmp_path / "dev",
                         on_all_attached=seen.append) as group:
        first = await FakeRank.connect(group, 0, device="cuda")
        await _wait_ranks(group, {0})
        assert group.device_kind is None and seen == []  # not known while a rank is missing
        second = await FakeRank.connect(group, 1, device="cuda")
        await group.wait_attached()
        assert group.device_kind == "cuda" and seen == ["cuda"]
        await second.close()
        await _wait_ranks(group, {0})
        assert group.device_kind is None
        other = await FakeRank.connect(group, 1, device="cpu")
        await group.wait_attached()
        assert group.device_kind == "cpu+cuda" and seen == ["cuda", "cpu+cuda"]
        for fake in (first, other):
            await fake.close()
        await _wait_ranks(group, set())
        full = full_kv(LAYOUT, 1)
        k0, k1 = rank_kv(full, LAYOUT, 0, 2), rank_kv(full, LAYOUT, 1, 2)
        async with RankWorker(group.address, 0, 2, LAYOUT, k0, FAST), RankWorker(group.address, 1, 2, LAYOUT, k1, FAST):
            await group.wait_attached()
            assert group.device_kind == "cpu" and seen[-1] == "cpu"  # real workers name their buffer's device
