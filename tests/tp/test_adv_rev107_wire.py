"""Adversarial (review 107): hostile or confused frames from an ATTACHED rank on the manager's socket.

A rank that passed the handshake is trusted to copy, not to speak well: reports for jobs it was
never sent, replays of reports, layer reports for whole (non-layered) jobs, layer counts beyond
the layers, and malformed frames. Checked: wrong ids and replays are counted as stray reports and
change nothing (the job still waits for its true report); a malformed frame fences the link (EOF,
never an abort) and the job ends only when that rank's connection ends; nothing reaches the loop's
exception handler (the conftest fails a test that leaves one there).
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from tp_helpers import new_pool

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.tp import Direction, RankGroup, RankStatus, TPConfig, TransferSpec
from aiokv.tp.wire import PROTOCOL_VERSION, Attached, Done, FrameKind, Hello, Layers, Welcome, frame, read_frame

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
BOUND_S = 10.0


class Rank:
    """A worker speaking raw frames (attached; it reports only what the test says)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def attach(cls, group: RankGroup, rank: int) -> Rank:
        reader, writer = await asyncio.open_unix_connection(os.fspath(group.address))
        hello = Hello(PROTOCOL_VERSION, rank, group.tp_size, group.page_layout.fingerprint, "cpu")
        writer.write(frame(FrameKind.HELLO, hello.encode()))
        kind, payload = await read_frame(reader, 1 << 20)
        assert kind is FrameKind.WELCOME
        writer.write(frame(FrameKind.ATTACHED, Attached(Welcome.decode(payload).epoch, True).encode()))
        return cls(reader, writer)

    async def next_spec(self) -> TransferSpec:
        kind, payload = await read_frame(self.reader, 1 << 20)
        assert kind is FrameKind.SPEC
        return TransferSpec.from_bytes(payload)

    def send(self, kind: FrameKind, payload: bytes) -> None:
        self.writer.write(frame(kind, payload))

    def done(self, job_id: int, status: RankStatus = RankStatus.OK) -> None:
        self.send(FrameKind.DONE, Done(job_id, status).encode())

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[PagePool]:
    pool = await new_pool(LAYOUT.for_tp(2), 8)
    yield pool
    await pool.aclose()


@pytest_asyncio.fixture
async def group(pool: PagePool, tmp_path: Path) -> AsyncIterator[RankGroup]:
    config = TPConfig(reconnect_initial_s=0.001, reconnect_max_s=0.05)
    async with RankGroup(LAYOUT, 2, pool.name, pool.num_pages, config, tmp_path / "mgr") as group:
        yield group
        assert group.jobs.in_flight == 0, "a test left jobs in flight"


@pytest_asyncio.fixture
async def ranks(group: RankGroup) -> AsyncIterator[list[Rank]]:
    """Two attached raw ranks; their connections end before the group closes (a test that failed
    half-way would otherwise hold the close, which waits for ranks owing reports)."""
    attached = [await Rank.attach(group, r) for r in range(2)]
    async with asyncio.timeout(BOUND_S):
        await group.wait_attached()
    yield attached
    for rank in attached:
        if not rank.writer.is_closing():
            await rank.close()


async def _settled(group: RankGroup, stray: int) -> None:
    """Wait (bounded) until the manager counted ``stray`` stray reports: the frames were read."""
    async with asyncio.timeout(BOUND_S):
        while group.statistics().jobs.stray_reports < stray:  # noqa: ASYNC110 (a counter, no event)
            await asyncio.sleep(0.005)


@pytest.mark.asyncio
async def test_wrong_ids_and_replays_from_an_attached_rank_are_stray_and_change_nothing(group: RankGroup,
                                                                                      ranks: list[Rank]) -> None:
    whole = group.submit_nowait(group.spec(Direction.LOAD, [0, 1], range(2 * T)))
    layered = group.submit_nowait(group.spec(Direction.LOAD, [2], range(T), layered=True))
    for rank in ranks:
        assert (await rank.next_spec()).job_id == whole.id
        assert (await rank.next_spec()).job_id == layered.id
    hostile = ranks[1]
    hostile.done(whole.id + 1000)  # a job never sent
    hostile.send(FrameKind.LAYERS, Layers(whole.id, 1).encode())  # layers of a whole (non-layered) job
    hostile.send(FrameKind.LAYERS, Layers(whole.id, 2**32 - 1).encode())
    hostile.send(FrameKind.LAYERS, Layers(layered.id, LAYOUT.num_layers + 1).encode())  # beyond the layers
    hostile.send(FrameKind.LAYERS, Layers(layered.id + 1000, 1).encode())
    await _settled(group, 5)
    assert not whole.done() and not layered.done()
    assert group.statistics().attached == frozenset({0, 1}) and group.statistics().fenced == 0
    # The true reports still count, and a replay of one is stray.
    hostile.done(whole.id)
    hostile.done(whole.id)
    await _settled(group, 6)
    assert not whole.done()  # rank 0 has not reported
    ranks[0].done(whole.id)
    async with asyncio.timeout(BOUND_S):
        assert (await whole).ok
    for rank in ranks:
        rank.done(layered.id)
    async with asyncio.timeout(BOUND_S):
        assert (await layered).ok
        assert all([await f for f in layered.layer_futures])
    assert group.statistics().link_errors == 0


MALFORMED = {
    "layers of none": frame(FrameKind.LAYERS, Layers(1, 1).encode()[:8] + struct.pack("<I", 0)),
    "layers truncated": frame(FrameKind.LAYERS, b"\x01\x00"),
    "done of a manager-side status": frame(FrameKind.DONE, struct.pack("<QB", 1, RankStatus.RANK_LOST.value)),
    "done with text not UTF-8": frame(FrameKind.DONE, struct.pack("<QB", 1, 0) + b"\xff\xfe"),
    "attached again": frame(FrameKind.ATTACHED, Attached(1, True).encode()),
    "a spec back": frame(FrameKind.SPEC, b"AKVS"),
    "unknown kind": struct.pack("<IB", 1, 99),
    "a length beyond the limit": struct.pack("<IB", 0xFFFFFFFF, FrameKind.DONE.value),
    "a zero length": struct.pack("<IB", 0, FrameKind.DONE.value),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("what", sorted(MALFORMED))
async def test_a_malformed_frame_fences_the_rank_and_its_job_waits_for_its_end(group: RankGroup, ranks: list[Rank],
                                                                                what: str) -> None:
    job = group.submit_nowait(group.spec(Direction.LOAD, [0], range(T)))
    for rank in ranks:
        await rank.next_spec()
    ranks[1].writer.write(MALFORMED[what])
    async with asyncio.timeout(BOUND_S):
        assert await ranks[1].reader.read() == b""  # fenced: EOF, the link stays open our way
    stats = group.statistics()
    assert (stats.fenced, stats.link_errors, stats.attached) == (1, 1, frozenset({0}))
    ranks[1].done(job.id)  # after the fence: ignored
    ranks[0].done(job.id)
    async with asyncio.timeout(BOUND_S):
        while group.jobs.pending_ranks(job.id) != frozenset({1}):  # noqa: ASYNC110 (rank 0's report read)
            await asyncio.sleep(0.005)
    assert not job.done(), "a fenced rank's job ended before its connection did"
    await ranks[1].close()
    async with asyncio.timeout(BOUND_S):
        outcome = await job
    assert [(f.rank, f.status) for f in outcome.failures] == [(1, RankStatus.RANK_LOST)]


@pytest.mark.asyncio
async def test_a_frame_the_manager_fails_to_handle_fences_the_rank_not_aborts_it(
        group: RankGroup, ranks: list[Rank], monkeypatch: pytest.MonkeyPatch) -> None:
    # A bug in handling a well-formed frame (injected: the table's layer bookkeeping raises). Escaping
    # the read callback, asyncio aborted the link and its end failed the rank's jobs while it copied.
    job = group.submit_nowait(group.spec(Direction.LOAD, [0], range(T), layered=True))
    for rank in ranks:
        await rank.next_spec()

    def broken(*_: object) -> bool:
        raise RuntimeError("injected bookkeeping bug")

    monkeypatch.setattr(group.jobs, "report_layers", broken)
    ranks[1].send(FrameKind.LAYERS, Layers(job.id, 1).encode())
    async with asyncio.timeout(BOUND_S):
        assert await ranks[1].reader.read() == b""  # fenced (EOF), not reset
    assert not job.done() and group.statistics().fenced == 1
    ranks[0].done(job.id)
    await ranks[1].close()
    async with asyncio.timeout(BOUND_S):
        outcome = await job
    assert [(f.rank, f.status) for f in outcome.failures] == [(1, RankStatus.RANK_LOST)]


VANISH_POINTS = ("hello sent", "welcome read", "attached sent", "spec read", "half a report", "layers sent")


@pytest.mark.asyncio
async def test_a_rank_that_vanishes_at_any_point_frees_its_rank_and_fails_only_its_part(group: RankGroup) -> None:
    # Rank 0 stays; rank 1's connection ends (reset, no flush) at each point of its session in turn,
    # then a fresh rank 1 attaches: a vanished rank never holds its rank number, and a job sent to it
    # fails for that rank only, once, when its connection ends.
    steady = await Rank.attach(group, 0)
    try:
        for point in VANISH_POINTS:
            reader, writer = await asyncio.open_unix_connection(os.fspath(group.address))
            hello = Hello(PROTOCOL_VERSION, 1, 2, group.page_layout.fingerprint, "cpu")
            writer.write(frame(FrameKind.HELLO, hello.encode()))
            job = None
            if point != "hello sent":
                kind, payload = await read_frame(reader, 1 << 20)
                assert kind is FrameKind.WELCOME, (point, kind)
                if point != "welcome read":
                    writer.write(frame(FrameKind.ATTACHED, Attached(Welcome.decode(payload).epoch, True).encode()))
                    async with asyncio.timeout(BOUND_S):
                        await group.wait_attached()
                    if point != "attached sent":
                        job = group.submit_nowait(group.spec(Direction.LOAD, [1], range(T), layered=True))
                        vanishing = Rank(reader, writer)
                        await vanishing.next_spec()
                        await steady.next_spec()
                        steady.done(job.id)
                        if point == "half a report":
                            writer.write(frame(FrameKind.DONE, Done(job.id, RankStatus.OK).encode())[:6])
                        elif point == "layers sent":
                            writer.write(frame(FrameKind.LAYERS, Layers(job.id, 1).encode()))
                        await writer.drain()
            writer.transport.abort()
            if job is not None:
                async with asyncio.timeout(BOUND_S):
                    outcome = await job
                assert [(f.rank, f.status) for f in outcome.failures] == [(1, RankStatus.RANK_LOST)], point
                landed = 1 if point == "layers sent" else 0  # both ranks had layer 0 before rank 1 vanished
                want = [True] * landed + [False] * (LAYOUT.num_layers - landed)
                assert [f.result() for f in job.layer_futures] == want, point
            # A fresh rank 1 takes the rank (within the bound: the vanished one is noticed).
            async with asyncio.timeout(BOUND_S):
                while 1 in group._ranks:  # noqa: ASYNC110 (the claim ends with the connection's end)
                    await asyncio.sleep(0.005)
            fresh = await Rank.attach(group, 1)
            async with asyncio.timeout(BOUND_S):
                await group.wait_attached()
            await fresh.close()
            async with asyncio.timeout(BOUND_S):
                while 1 in group._ranks:  # noqa: ASYNC110
                    await asyncio.sleep(0.005)
    finally:
        await steady.close()
