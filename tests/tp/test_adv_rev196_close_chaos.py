"""Review 196: a rank's engine closes its worker (protocol 10's CLOSED) at seeded random points of a
stream of specs, with an oracle on the bytes every copy moved.

Real rank processes (even rank: the thread runner, copies on its loop; odd: the async runner, copies
on its copy thread), each copy slowed by a seeded random sleep so copies run across the close. The
test plays the manager's engine: it builds every spec first and submits them in a shuffled order
(job ids do not follow the order sent), some layered, while rank ``closer`` closes its worker and
its process lives on; with some seeds that process is SIGKILLed during the close.

The oracle, per job and target rank, once every job ended and the closing rank's copies are over
(its worker closed, or its process dead): a part reported OK moved exactly its bytes (an offload's
part of the page, a load's rows of the slots); a part that failed moved nothing (the page part
still holds its sentinel, the slots their old values) unless its process was killed (its copy may
have been cut halfway: a failed part is never trusted). A part failed while its copy still ran
would land after the failure: a wrong byte here. Every job ends within a bound (no hang), the rank
is freed without being held, the counters agree.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing.connection
import os
import random
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from adv_helpers import _slow_copies
from child_procs import end_child, fork_context
from tp_helpers import CONFIG, full_kv, rank_kv

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.tp import Direction, Job, JobOutcome, RankGroup, RankStatus, RankWorker, RankWorkerThread, TPConfig

MHA = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
PAGES_LAYOUT = MHA.for_tp(2)
T = MHA.page_tokens
TP = 2
JOBS = 20
SLOTS = 2 * JOBS * T  # offload sources below JOBS * T, load targets above
PAGES = 2 * JOBS
BOUND_S = 60.0
SENTINEL = 0x5A
# Async runner: copies on its copy thread. A closed worker waits 0.5 s at most for the manager's end
# (a stalled manager's seeds block the manager's loop past it).
RANK_CONFIG = dataclasses.replace(CONFIG, inline_copy_bytes=0, handshake_timeout_s=0.5)


def _rank_main(ctrl: multiprocessing.connection.Connection, address: str, rank: int, seed: int,
               slow_s: float, config: TPConfig) -> None:
    """A rank process: its slice of ``full_kv(seed)``; ``"close"`` closes its worker (the process
    lives on) and answers ``("closed", error)``; ``"dump"`` answers the buffer's bytes."""
    torch.set_num_threads(1)
    _slow_copies(slow_s)
    kv = rank_kv(full_kv(MHA, seed, SLOTS), MHA, rank, TP)

    def dump() -> bytes:
        return bytes(kv.contiguous().view(torch.uint8).numpy().tobytes())

    if rank % 2 == 0:
        runner = RankWorkerThread(address, rank, TP, MHA, kv, config)
        runner.start()
        ctrl.send(("started", os.getpid()))
        while (command := ctrl.recv()) in ("close", "dump"):
            if command == "close":
                runner.close(120)
                ctrl.send(("closed", runner.error))
            else:
                ctrl.send(dump())
        runner.close(120)
        return

    async def main() -> None:
        worker = RankWorker(address, rank, TP, MHA, kv, config)
        run = asyncio.create_task(worker.run())
        await asyncio.to_thread(ctrl.send, ("started", os.getpid()))
        while (command := await asyncio.to_thread(ctrl.recv)) in ("close", "dump"):
            if command == "close":
                await worker.aclose()  # the engine closes its worker; the process goes on
                await asyncio.wait({run})
                error = None if run.cancelled() else run.exception()
                await asyncio.to_thread(ctrl.send, ("closed", error))
            else:
                await asyncio.to_thread(ctrl.send, dump())
        await worker.aclose()

    asyncio.run(main())


class _Ranks:
    def __init__(self, address: Path, seed: int, slow_s: float) -> None:
        ctx = fork_context()
        self.procs: dict[int, Any] = {}
        self.ctrl: dict[int, multiprocessing.connection.Connection] = {}
        for rank in range(TP):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(child, os.fspath(address), rank, seed, slow_s, RANK_CONFIG),
                               daemon=True)
            proc.start()
            child.close()
            self.procs[rank], self.ctrl[rank] = proc, parent

    async def recv(self, rank: int) -> Any:
        async with asyncio.timeout(BOUND_S):
            reply = await asyncio.to_thread(self.ctrl[rank].recv)
            while isinstance(reply, tuple) and reply[0] == "started":
                reply = await asyncio.to_thread(self.ctrl[rank].recv)
        return reply

    async def dump(self, rank: int) -> torch.Tensor:
        self.ctrl[rank].send("dump")
        raw = await self.recv(rank)
        shape = (MHA.num_layers, SLOTS, MHA.rows // TP, MHA.head_dim)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(MHA.dtype).view(shape)

    def end(self) -> None:
        for proc in self.procs.values():
            end_child(proc, 30)


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[PagePool]:
    pool = PagePool.create(PAGES_LAYOUT, PAGES * PAGES_LAYOUT.page_bytes, register_cuda=False)
    await pool.wait_ready()
    yield pool
    await pool.aclose()


def _part(pool: PagePool, page: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of pool page ``page``: ``[L, T, rows / TP, D]``."""
    return pool.pages[page].reshape(TP, MHA.num_layers, T, MHA.rows // TP, MHA.head_dim)[rank]


async def _ended(jobs: list[Job], seed: int) -> list[JobOutcome]:
    waits = [asyncio.ensure_future(j.wait()) for j in jobs]
    _, pending = await asyncio.wait(waits, timeout=BOUND_S)
    for w in pending:
        w.cancel()
    hung = [j.id for j, w in zip(jobs, waits, strict=True) if w in pending]
    assert not hung, f"seed {seed}: jobs {hung} still wait after {BOUND_S} s"
    return [w.result() for w in waits]


async def _one_round(tmp_path: Path, pool: PagePool, seed: int) -> None:
    rng = random.Random(seed)
    closer = rng.randrange(TP)
    stall = rng.random() < 0.2  # the manager's loop blocked through the worker's whole close
    kill = not stall and rng.random() < 0.25
    slow_s = rng.choice([0.0, 0.01, 0.03])
    group_close = rng.random() < 0.3  # the manager's close too, fencing what still copies
    flat = pool.pages.view(torch.uint8).view(PAGES, -1)
    flat.fill_(SENTINEL)
    for page in range(JOBS, PAGES):  # load sources: bytes no slot holds
        gen = torch.Generator().manual_seed(seed * 1000 + page)
        flat[page] = torch.randint(0, 256, (flat.shape[1],), generator=gen, dtype=torch.uint8)
    full = rank_kv(full_kv(MHA, seed, SLOTS), MHA, 0, 1)  # every head, for the expected pages
    ranks: _Ranks | None = None
    config = dataclasses.replace(CONFIG, close_timeout_s=0.02)
    async with RankGroup(MHA, TP, pool.name, PAGES, config, tmp_path / f"m{seed}") as group:
        try:
            ranks = _Ranks(group.address, seed, slow_s)
            async with asyncio.timeout(120):
                await group.wait_attached()
            specs = []
            for i in range(JOBS):
                if rng.random() < 0.5:
                    specs.append(group.spec(Direction.OFFLOAD, [i], torch.arange(i * T, (i + 1) * T)))
                else:
                    layered = rng.random() < 0.5
                    at = torch.arange((JOBS + i) * T, (JOBS + i + 1) * T)
                    specs.append(group.spec(Direction.LOAD, [JOBS + i], at, layered=layered))
            order = list(range(JOBS))
            rng.shuffle(order)
            close_at = rng.randrange(1, JOBS)
            group_close_at = rng.randrange(close_at, JOBS + 1) if group_close else -1
            closing: asyncio.Task[None] | None = None
            jobs: dict[int, Job] = {}
            killed = False
            stalled_reply: Any = None
            unsent: set[int] = set()
            for n, i in enumerate(order):
                if n == close_at:
                    ranks.ctrl[closer].send("close")
                    if stall:  # blocked on the loop until the close ended: the next spec is written unread
                        while stalled_reply is None or stalled_reply[0] == "started":
                            assert ranks.ctrl[closer].poll(BOUND_S), f"seed {seed}: the close never ended"
                            stalled_reply = ranks.ctrl[closer].recv()
                if n == group_close_at:
                    closing = asyncio.create_task(group.aclose())
                if n > close_at and kill and not killed and rng.random() < 0.3:
                    os.kill(ranks.procs[closer].pid, signal.SIGKILL)
                    killed = True
                jobs[i] = group.submit_nowait(specs[i])
                if jobs[i].done():  # failed before anything was sent (a rank not attached): ran nowhere
                    unsent.add(i)
                if jobs and rng.random() < 0.3:  # let some of the earlier ones run first
                    some = rng.choice(list(jobs.values()))
                    await asyncio.wait({asyncio.ensure_future(some.wait())}, timeout=BOUND_S)
            if group_close and closing is None:
                closing = asyncio.create_task(group.aclose())
            outcomes = await _ended([jobs[i] for i in range(JOBS)], seed)
            if closing is not None:
                async with asyncio.timeout(BOUND_S):
                    await closing
            if not killed:
                reply = stalled_reply if stall else await ranks.recv(closer)
                assert reply == ("closed", None), f"seed {seed}: {reply}"
            else:
                await asyncio.to_thread(ranks.procs[closer].join, BOUND_S)
            stats = group.statistics()
            assert stats.held_ranks == 0 and stats.jobs.in_flight == 0, f"seed {seed}: {stats}"
            assert stats.jobs.stray_reports == 0, f"seed {seed}: {stats}"  # no report after a part ended
            if not group_close:
                assert closer not in group.attached and (1 - closer) in group.attached, f"seed {seed}: {stats}"
                if not killed:
                    assert stats.worker_closes == 1, f"seed {seed}: {stats}"
            buffers = {r: await ranks.dump(r) for r in range(TP) if not (killed and r == closer)}
            for i, outcome in enumerate(outcomes):
                spec = specs[i]
                failed = set(range(TP)) if i in unsent else {f.rank for f in outcome.failures}
                stopped = {f.rank for f in outcome.failures if "stopped between two layers" in f.text}
                targets = range(TP)  # MHA: every rank writes its part
                for rank in targets:
                    if killed and rank == closer:
                        continue
                    what = f"seed {seed}: job {spec.job_id} ({spec.direction.name}, sent #{order.index(i)}, " \
                           f"close at #{close_at}) rank {rank}: {outcome}"
                    if spec.direction is Direction.OFFLOAD:
                        part = _part(pool, i, rank)
                        want = rank_kv(full[:, i * T:(i + 1) * T], MHA, rank, TP)
                        if rank in failed:
                            assert bool((part.view(torch.uint8) == SENTINEL).all()), f"{what}: a failed part wrote"
                        else:
                            assert torch.equal(part.view(torch.uint8), want.contiguous().view(torch.uint8)), what
                    else:
                        slots = slice((JOBS + i) * T, (JOBS + i + 1) * T)
                        got = buffers[rank][:, slots].contiguous().view(torch.uint8)
                        before = rank_kv(full[:, slots], MHA, rank, TP).contiguous().view(torch.uint8)
                        landed = _part(pool, JOBS + i, rank).contiguous().view(torch.uint8)
                        if rank in stopped:  # the rank reported it cut between layers: a prefix of them landed
                            got_layers = [torch.equal(got[layer], landed[layer]) for layer in range(MHA.num_layers)]
                            kept = [torch.equal(got[layer], before[layer]) for layer in range(MHA.num_layers)]
                            n = got_layers.index(False) if False in got_layers else MHA.num_layers
                            assert all(kept[n:]), f"{what}: layers past the cut landed"
                        elif rank in failed:
                            assert torch.equal(got, before), f"{what}: a failed part landed"
                        else:
                            assert torch.equal(got, landed), what
            assert all(s in (RankStatus.WORKER_CLOSING, RankStatus.RANK_LOST, RankStatus.NOT_ATTACHED,
                             RankStatus.GROUP_CLOSED)
                       for o in outcomes for s in (f.status for f in o.failures)), f"seed {seed}: {outcomes}"
        finally:
            if ranks is not None:
                ranks.end()


SEEDS = [int(s) for s in os.environ.get("REV196_SEEDS", "1,2,3,4,5,6").split(",")]


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", SEEDS)
async def test_engine_closes_worker_mid_stream_kv_oracle(tmp_path: Path, pool: PagePool, seed: int) -> None:
    await _one_round(tmp_path, pool, seed)
