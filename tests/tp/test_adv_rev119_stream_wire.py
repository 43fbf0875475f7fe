"""Review 119: the load streams' wire (STREAM_BEGINS frames, version-2 specs naming a stream).

- A group whose stream ids ran out (u64) must still start loads: the stream gets no id (its copies
  are ordered at their launch, as before marks), never a ``struct.error`` out of ``start_load``.
- A hostile manager's STREAM_BEGINS frames (before the welcome, malformed, id 0, repeated, after a
  spec of the stream) and specs naming streams never announced: each malformed frame ends only the
  session (counted; the worker attaches again), a spec of an unknown stream is run ordered at its
  launch (counted ``stream_marks_missed``), and nothing reaches the loop's exception handler.
- A hostile worker that sends the manager a STREAM_BEGINS: its link is ended (counted), the real
  ranks that attach after it load bit-exact.
- Version-2 spec bytes mutated at random: ``from_bytes`` raises ``ValueError`` or returns a spec
  that encodes back to the same bytes, never another exception.
"""

from __future__ import annotations

import asyncio
import random
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from loop_probes import no_loop_reports
from test_adv_rev107_hostile_manager import BOUND_S, EPOCH, FAST, PAGES, SLOTS, FakeManager, done
from tp_helpers import CONFIG, full_kv, new_pool, rank_kv, threads_off_loop

from aiokv import CacheConfig, KVLayout
from aiokv.pool import PagePool
from aiokv.tp import Direction, RankStatus, RankWorker, RankWorkerThread, TPCache, TransferSpec
from aiokv.tp.wire import (
    PROTOCOL_VERSION,
    Attached,
    FrameKind,
    Hello,
    StreamBegins,
    Welcome,
    frame,
    read_frame,
)

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
NUM_PAGES = 8
N = 4 * T
TOKENS = list(range(9100, 9100 + N))
TARGET = torch.arange(40, 40 + N)
U64_MAX = 2**64 - 1


def _begins(stream: int) -> bytes:
    return frame(FrameKind.STREAM_BEGINS, StreamBegins(stream).encode())


def _load(job: int, stream: int, pages: list[int], first_slot: int) -> bytes:
    spec = TransferSpec.build(job, Direction.LOAD, EPOCH, T, pages, range(first_slot, first_slot + len(pages) * T),
                              stream=stream)
    return frame(FrameKind.SPEC, spec.to_bytes())


async def _ended(reader: asyncio.StreamReader) -> None:
    """Read until the worker closes its end (it does once the session ended)."""
    async with asyncio.timeout(BOUND_S):
        while await reader.read(4096):
            pass


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[PagePool]:
    pool = await new_pool(PAGES, NUM_PAGES)
    gen = torch.Generator().manual_seed(19)
    pool.pages.copy_(torch.randn(pool.pages.shape, generator=gen).to(LAYOUT.dtype))
    yield pool
    await pool.aclose()


@pytest.mark.asyncio
async def test_a_group_whose_stream_ids_ran_out_still_starts_loads_ordered_at_launch(tmp_path: Path) -> None:
    config = CacheConfig(cpu_bytes=32 * LAYOUT.page_bytes, disk=None, namespace="tp-rev119-ids",
                         pool_chunk_bytes=8 * LAYOUT.page_bytes)
    kv = [rank_kv(full_kv(LAYOUT, 23, SLOTS), LAYOUT, r, 2) for r in range(2)]
    want = [k[:, :N].clone() for k in kv]
    async with (
        TPCache(config, LAYOUT, tp_size=2, num_slots=SLOTS, tp_config=CONFIG,
                directory=tmp_path / "sock") as cache,
        threads_off_loop(RankWorkerThread(cache.address, 1, 2, LAYOUT, kv[1], CONFIG)) as (thread,),
        RankWorker(cache.address, 0, 2, LAYOUT, kv[0], CONFIG) as worker,
    ):
        async with asyncio.timeout(BOUND_S):
            await cache.wait_ranks()
        assert (await cache.offload(TOKENS, torch.arange(N))).stored == N // T
        cache.group._next_stream = U64_MAX  # as after 2**64 - 2 streams
        for round_ in range(2):
            for k in kv:
                k[:, TARGET] = 0
            # The last id there is, then none: start_load must not raise (before the fix,
            # the second round raised struct.error out of StreamBegins.encode).
            stream = cache.start_load(await cache.match(TOKENS), TARGET)
            async with asyncio.timeout(BOUND_S):
                result = await stream.finish()
            assert result.tokens == N and result.loaded_from == 0, (round_, result)
            for rank in range(2):
                assert torch.equal(kv[rank][:, TARGET], want[rank]), f"round {round_}: rank {rank}"
        assert cache.group.begin_stream() == 0, "ids ran out: no stream id, no frame"
        stats = [worker.statistics(), await asyncio.to_thread(thread.statistics)]
        for s in stats:
            # One mark (the last id); the id-less stream's specs name no stream: not missed.
            assert (s.stream_marks, s.stream_marks_failed, s.stream_marks_missed) == (1, 0, 0), s
        assert cache.group.jobs.in_flight == 0
        assert cache.stats().pool_referenced == 0 and cache.stats().pool_reserved == 0


@pytest.mark.asyncio
async def test_stream_frames_from_a_hostile_manager_end_only_the_session(tmp_path: Path, pool: PagePool) -> None:
    kv = rank_kv(full_kv(LAYOUT, 3, SLOTS), LAYOUT, 0, 2)
    part = pool.pages[:, 0]  # rank 0's part of each page: [pages, L, T, rows/2, D]
    async with no_loop_reports(), FakeManager(tmp_path / "m") as manager, manager.worker(kv, FAST) as worker:
        # A STREAM_BEGINS instead of the welcome: the handshake fails, the worker comes back.
        reader, writer = await manager.hello()
        writer.write(_begins(1))
        await _ended(reader)
        assert worker.statistics().link_errors == 1, worker.statistics()

        # Attached: streams announced (one twice), specs of them, and one of a stream announced
        # only after it ran: every spec runs and lands; the early one at its launch (missed).
        reader, writer, attached = await manager.welcome(pool.name)
        assert attached.ok, attached
        writer.write(_begins(5) + _begins(5) + _load(1, 5, [0, 1], 8))
        assert (await done(reader)).status is RankStatus.OK
        writer.write(_load(2, 77, [2], 16))
        assert (await done(reader)).status is RankStatus.OK
        writer.write(_begins(77) + _load(3, 77, [3], 20))
        assert (await done(reader)).status is RankStatus.OK
        got = kv[:, 8:24].reshape(LAYOUT.num_layers, 4, T, -1, LAYOUT.head_dim).transpose(0, 1)
        assert torch.equal(got, part[:4]), "a stream's spec landed wrong bytes"
        stats = worker.statistics()
        # Streams 5 (announced twice: one stream, before the fix counted twice) and 77; job 2
        # named 77 before it was announced: ordered at its launch, counted missed.
        assert (stats.stream_marks, stats.stream_marks_failed, stats.stream_marks_missed) == (2, 0, 1), stats

        # Malformed STREAM_BEGINS frames (and a spec with the STREAM flag and id 0) each end
        # the session only; the KV buffer is left as it was.
        writer.close()  # the manager ends this session (EOF): the worker comes back
        await _ended(reader)
        snapshot = kv.clone()
        zero_stream = bytearray(TransferSpec.build(9, Direction.LOAD, EPOCH, T, [0], range(T), stream=1)
                                .to_bytes())
        struct.pack_into("<Q", zero_stream, 40, 0)
        bad_frames = [
            frame(FrameKind.STREAM_BEGINS, b""),
            frame(FrameKind.STREAM_BEGINS, b"\1" * 7),
            frame(FrameKind.STREAM_BEGINS, struct.pack("<QB", 3, 0)),
            frame(FrameKind.STREAM_BEGINS, struct.pack("<Q", 0)),
            frame(FrameKind.SPEC, bytes(zero_stream)),
            # A good announcement, then a bad one in the same write: the link still ends.
            _begins(6) + frame(FrameKind.STREAM_BEGINS, struct.pack("<Q", 0)),
        ]
        for bad in bad_frames:
            reader, writer, attached = await manager.welcome(pool.name)
            assert attached.ok
            writer.write(bad)
            await _ended(reader)
        assert torch.equal(kv, snapshot), "a malformed frame changed the KV buffer"
        # The worker still serves: a fresh session's stream loads, counted in that session only
        # (each malformed frame's session counted as it ended, before the next connection).
        reader, writer, attached = await manager.welcome(pool.name)
        assert worker.statistics().link_errors == 1 + len(bad_frames), worker.statistics()
        writer.write(_begins(1) + _load(1, 1, [5], 28))
        assert (await done(reader)).status is RankStatus.OK
        got = kv[:, 28:32].reshape(LAYOUT.num_layers, 1, T, -1, LAYOUT.head_dim).transpose(0, 1)
        assert torch.equal(got, part[5:6])
        stats = worker.statistics()
        assert (stats.stream_marks, stats.stream_marks_missed) == (1, 0), stats


@pytest.mark.asyncio
async def test_a_worker_that_sends_stream_begins_is_cut_off_and_real_ranks_load(tmp_path: Path) -> None:
    config = CacheConfig(cpu_bytes=32 * LAYOUT.page_bytes, disk=None, namespace="tp-rev119-hostile-worker",
                         pool_chunk_bytes=8 * LAYOUT.page_bytes)
    kv = [rank_kv(full_kv(LAYOUT, 29, SLOTS), LAYOUT, r, 2) for r in range(2)]
    want = [k[:, :N].clone() for k in kv]
    async with TPCache(config, LAYOUT, tp_size=2, num_slots=SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "sock") as cache:
        async with RankWorker(cache.address, 0, 2, LAYOUT, kv[0], CONFIG):
            # Rank 1 is a fake: it attaches (without mapping anything), then sends a STREAM_BEGINS.
            reader, writer = await asyncio.open_unix_connection(cache.address)
            hello = Hello(PROTOCOL_VERSION, 1, 2, cache.group.page_layout.fingerprint, "cpu")
            writer.write(frame(FrameKind.HELLO, hello.encode()))
            async with asyncio.timeout(BOUND_S):
                kind, payload = await read_frame(reader, 1 << 20)
                assert kind is FrameKind.WELCOME, kind
                welcome = Welcome.decode(payload)
                writer.write(frame(FrameKind.ATTACHED, Attached(welcome.epoch, True).encode()))
                await cache.wait_ranks()
                before = cache.group_statistics()
                writer.write(_begins(1))
                while await reader.read(4096):  # the manager ends the link
                    pass
            writer.close()
            after = cache.group_statistics()
            assert after.link_errors == before.link_errors + 1, (before, after)
            assert 1 not in after.attached, after
            async with threads_off_loop(RankWorkerThread(cache.address, 1, 2, LAYOUT, kv[1], CONFIG)):
                async with asyncio.timeout(BOUND_S):
                    await cache.wait_ranks()
                assert (await cache.offload(TOKENS, torch.arange(N))).stored == N // T
                for k in kv:
                    k[:, TARGET] = 0
                stream = cache.start_load(await cache.match(TOKENS), TARGET)
                async with asyncio.timeout(BOUND_S):
                    result = await stream.finish()
                assert result.tokens == N and result.loaded_from == 0, result
                for rank in range(2):
                    assert torch.equal(kv[rank][:, TARGET], want[rank]), rank
        assert cache.group.jobs.in_flight == 0 and cache.stats().pool_referenced == 0


def test_mutated_v2_specs_raise_value_error_or_round_trip() -> None:
    rng = random.Random(119)
    seeds = [
        TransferSpec.build(3, Direction.LOAD, 7, 4, [3, 5], torch.arange(6), 2, stream=9),
        TransferSpec.build(4, Direction.LOAD, 7, 4, [1], range(4), layered=True, stream=U64_MAX),
        TransferSpec.build(5, Direction.OFFLOAD, 7, 4, [0, 2], range(8)),
        TransferSpec.build(6, Direction.LOAD, 7, 4, [6], torch.arange(4, dtype=torch.int32), stream=1),
    ]
    accepted = refused = 0
    for _ in range(4000):
        raw = bytearray(rng.choice(seeds).to_bytes())
        how = rng.randrange(5)
        if how == 0:  # flip bytes anywhere
            for _ in range(rng.randrange(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
        elif how == 1:  # every flag combination
            raw[7] = rng.randrange(256)
        elif how == 2:  # truncated or extended
            raw = raw[: rng.randrange(len(raw))] if rng.random() < 0.5 else raw + bytes(rng.randrange(1, 12))
        elif how == 3:  # the counts and the stream field
            offset = rng.choice([32, 36, 40])
            struct.pack_into("<I", raw, offset, rng.choice([0, 1, 2, 7, 2**31, 2**32 - 1]))
        else:  # the header's small fields (version, direction, width, flags)
            raw[rng.randrange(4, 8)] = rng.randrange(256)
        try:
            spec = TransferSpec.from_bytes(bytes(raw))
        except ValueError:
            refused += 1
            continue
        accepted += 1
        assert spec.to_bytes() == bytes(raw), spec
        assert not spec.stream or spec.direction is Direction.LOAD, spec
    assert refused > 1000 and accepted > 100, (accepted, refused)
