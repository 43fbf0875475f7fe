"""Adversarial: strangers on a `TPCache`'s rank socket while its real rank processes serve.

Connections that send garbage, a frame length beyond any limit, half a frame, a hello for a rank
that is taken, or nothing at all, a hundred at once, while loads and offloads run between the
manager and two spawned rank processes. Checked: each stranger is cut off within a bound (the
handshake timeout at most), counted (``refused``/``link_errors``), and nothing else changes: the
ranks stay attached, every transfer succeeds bit-exact on every rank (the prefix oracle), the
close is not held.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import struct
from pathlib import Path

import pytest
import torch
from adv_helpers import START_S, AdvRanks, idx, rank_prefix_kv
from tp_helpers import CONFIG

from aiokv import CacheConfig, KVLayout
from aiokv.tp import TPCache
from aiokv.tp.wire import PROTOCOL_VERSION, FrameKind, Hello, frame

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
NUM_SLOTS = 256
HANDSHAKE_S = 1.0
PAGES = 4


async def _cut_off(payload: bytes, address: str) -> bool:
    """Connect, send ``payload``, then read until the manager ends the connection (True) or the
    bound passes (False). What the manager answers (a refusal) is read and dropped."""
    reader, writer = await asyncio.open_unix_connection(address)
    try:
        async with asyncio.timeout(HANDSHAKE_S + 10):
            if payload:
                writer.write(payload)
                await writer.drain()
            while await reader.read(4096):
                pass
        return True
    except TimeoutError:
        return False
    except OSError:  # reset, broken pipe, not connected: the manager ended it first
        return True
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def _strangers(cache: TPCache, rng: random.Random) -> list[bytes]:
    taken = Hello(PROTOCOL_VERSION, 0, 2, cache.group.page_layout.fingerprint, "cpu")
    return [
        bytes(rng.randrange(256) for _ in range(64)),  # garbage
        struct.pack("<IB", 0xFFFFFFFF, FrameKind.HELLO.value),  # a length beyond any limit
        struct.pack("<IB", 100, FrameKind.HELLO.value) + b"x" * 10,  # half a frame, then silence
        b"",  # nothing at all: the handshake timeout
        frame(FrameKind.HELLO, taken.encode()),  # rank 0 is taken: refused
        frame(FrameKind.DONE, b"\0" * 9),  # a report before any hello
        frame(FrameKind.HELLO, b"AKV?" + b"\0" * 40),  # not a hello
    ]


async def _traffic(cache: TPCache, ranks: AdvRanks, rounds: int) -> int:
    """Offload prompts and load them back into other slots; every loaded token checked on every rank."""
    checked = 0
    for r in range(rounds):
        tokens = [100_000 * (r + 1) + j for j in range(PAGES * T)]
        source = list(range(PAGES * T))
        for rank in range(2):
            await ranks.write(rank, source, rank_prefix_kv(LAYOUT, tokens, 0, rank, 2))
        result = await cache.offload(tokens, idx(source))
        assert (result.stored, result.dropped) == (PAGES, 0), result
        match = await cache.match(tokens)
        target = list(range(NUM_SLOTS - PAGES * T, NUM_SLOTS))
        loaded = await cache.load(match, idx(target))
        assert loaded.tokens == PAGES * T, loaded
        for rank in range(2):
            got = await ranks.read(rank, target)
            assert torch.equal(got, rank_prefix_kv(LAYOUT, tokens, 0, rank, 2)), f"rank {rank}: wrong KV"
        checked += PAGES * T
    return checked


@pytest.mark.slow
@pytest.mark.asyncio
async def test_strangers_on_the_socket_are_cut_off_and_change_nothing(tmp_path: Path,
                                                                      ranks_left: list[AdvRanks]) -> None:
    rng = random.Random(11)
    config = CacheConfig(cpu_bytes=128 * LAYOUT.page_bytes, disk=None, namespace="tp-adv-socket",
                         pool_chunk_bytes=16 * LAYOUT.page_bytes)
    manager_config = dataclasses.replace(CONFIG, handshake_timeout_s=HANDSHAKE_S)
    async with TPCache(config, LAYOUT, tp_size=2, num_slots=NUM_SLOTS, tp_config=manager_config,
                       directory=tmp_path / "sock") as cache:
        ranks = AdvRanks(cache.address, LAYOUT, 2, NUM_SLOTS, CONFIG)
        ranks_left.append(ranks)
        ranks.start_all()
        async with asyncio.timeout(START_S):
            await cache.wait_ranks()
        before = cache.group_statistics()
        strangers = _strangers(cache, rng) * 12  # 84 connections at once (within the listen backlog, 100)
        loop = asyncio.get_running_loop()
        began = loop.time()
        traffic = asyncio.create_task(_traffic(cache, ranks, 6))
        cut = await asyncio.gather(*(_cut_off(p, cache.address) for p in strangers))
        took = loop.time() - began
        async with asyncio.timeout(60):
            checked = await traffic
        assert all(cut), f"{cut.count(False)} of {len(cut)} strangers were never cut off"
        assert took < HANDSHAKE_S + 10, f"cutting strangers off took {took:.1f} s"
        assert checked == 6 * PAGES * T
        after = cache.group_statistics()
        assert after.attached == {0, 1} and after.disconnects == before.disconnects, after
        assert after.connections - before.connections == len(strangers), after
        # Each stranger counted once: refused (its hello) or a link error (the rest).
        counted = (after.refused - before.refused) + (after.link_errors - before.link_errors)
        assert counted == len(strangers), (before, after)
        assert after.jobs.failed == before.jobs.failed and after.jobs.in_flight == 0, after
        for rank in range(2):
            stats = await ranks.ask(rank, ("stats",))
            assert stats.sessions == 1 and stats.link_errors == 0, stats
        await ranks.stop_all()
        stats = cache.stats()
        assert stats.errors.get("copy_failed", 0) == 0 and stats.pool_reserved == 0 and stats.pool_referenced == 0
