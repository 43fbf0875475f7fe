"""Adversarial: a `TPCache` closed while many tasks' calls are in flight, its rank processes alive,
then a new `TPCache` on the same directories that those live ranks re-attach to.

Checked through the public API with spawned rank processes and the prefix oracle (adv_helpers):
every call in flight ends within a bound (it returns or raises; never a hang), the close is not
held by idle ranks, once ``aclose`` returned no rank writes into its buffer any more, nothing is
left (/dev/shm via conftest, threads, the socket directory), and the live ranks serve the new
cache bit-exact from its disk tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from pathlib import Path

import pytest
import torch
from adv_helpers import AdvRanks, idx, rank_prefix_kv
from tp_helpers import CONFIG

from aiokv import CacheConfig, KVLayout
from aiokv.pagetable import StaleHandleError
from aiokv.storage import DiskConfig
from aiokv.tp import TPCache

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
START_S = 120.0
PROMPTS = 24
PAGES = 4
NUM_SLOTS = 3 * PROMPTS * PAGES * T  # each prompt's own slots, then a load target per storm call


def _config(disk: Path) -> CacheConfig:
    return CacheConfig(cpu_bytes=64 * LAYOUT.page_bytes, namespace="tp-adv-close",
                       pool_chunk_bytes=8 * LAYOUT.page_bytes, launch_pages=1, launch_turn_s=0, close_timeout=20.0,
                       disk=DiskConfig(directory=disk, capacity_bytes=400 * (LAYOUT.page_bytes + 4096)))


def _prompt(i: int) -> list[int]:
    return [1000 * (i + 1) + j for j in range(PAGES * T)]


def _slots(i: int) -> torch.Tensor:
    return torch.arange(i * PAGES * T, (i + 1) * PAGES * T)


async def _write_all(ranks: AdvRanks) -> None:
    """The engine prefilled every prompt into its own slots on every rank."""
    for i in range(PROMPTS):
        for rank in range(ranks.tp_size):
            await ranks.write(rank, _slots(i).tolist(), rank_prefix_kv(LAYOUT, _prompt(i), 0, rank, ranks.tp_size))


async def _busy_call(cache: TPCache, i: int, call: int, rng: random.Random) -> tuple[int, torch.Tensor, int, int]:
    """One call the close may interrupt: an offload of prompt ``i``, or a load of it (an earlier
    round stored it) into slots of this call's own; returns ``(i, target, low, high)``: the load put
    tokens ``[low, high)`` of prompt ``i`` at ``target[low:high]`` (empty for an offload)."""
    target = _slots(PROMPTS + call)
    if rng.random() < 0.5:
        await cache.offload(_prompt(i), _slots(i))
        return i, target, 0, 0
    async with await cache.match(_prompt(i)) as match:  # released if the close refuses the load
        if rng.random() < 0.5:
            async with cache.start_load(match, target[: match.tokens], layered=rng.random() < 0.5) as stream:
                stream.claim(0)
                res = await stream.finish()
            return i, target, res.loaded_from, match.tokens
        result = await cache.load(match, target[: match.tokens])
        return i, target, 0, result.tokens


def _aiokv_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("aiokv")}


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [1, 2])
async def test_close_while_busy_then_live_ranks_serve_a_new_cache(tmp_path: Path, seed: int,
                                                                  ranks_left: list[AdvRanks]) -> None:
    rng = random.Random(seed)
    threads_before = _aiokv_threads()
    sock = tmp_path / "sock"
    first = TPCache(_config(tmp_path / "disk"), LAYOUT, tp_size=2, num_slots=NUM_SLOTS, tp_config=CONFIG,
                    directory=sock)
    await first.start()
    try:
        ranks = AdvRanks(first.address, LAYOUT, 2, NUM_SLOTS, CONFIG)
        ranks_left.append(ranks)
        ranks.start_all()
        async with asyncio.timeout(START_S):
            await first.wait_ranks()
        await _write_all(ranks)
        # Half the prompts cached before the storm, so the storm has loads to run too.
        for i in range(0, PROMPTS, 2):
            assert (await first.offload(_prompt(i), _slots(i))).stored == PAGES
        calls: list[asyncio.Task[tuple[int, torch.Tensor, int, int]]] = []
        for _storm in range(5):
            storm = [asyncio.create_task(_busy_call(first, c % PROMPTS, c, rng)) for c in range(2 * PROMPTS)]
            calls += storm
            for _ in range(rng.randrange(0, 30)):  # a random moment into the storm...
                if sum(not call.done() for call in storm) <= len(storm) // 2:
                    break  # ...but while it still runs (a fast host ended every call in 30 turns)
                await asyncio.sleep(0)
            if not all(call.done() for call in storm):
                break
            await asyncio.gather(*storm)  # all ended in one turn: a new storm (their slots are free)
        busy = sum(not call.done() for call in calls)
        assert busy, "every call ended before the close: the close was not tested while busy"
        loop = asyncio.get_running_loop()
        began = loop.time()
        async with asyncio.timeout(60):
            await first.aclose()
        took = loop.time() - began
        assert took < 15, f"the close was held {took:.1f} s by idle ranks"
        async with asyncio.timeout(60):  # every call ends: no hang
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
    finally:
        await first.aclose()
    checked = 0
    for outcome in outcomes:
        # A call either finished or was refused because the cache closed under it.
        if isinstance(outcome, BaseException):
            assert isinstance(outcome, (RuntimeError, StaleHandleError)), repr(outcome)
            continue
        # What a load reported landed is there, on every rank, also when the close cut it.
        i, target, low, high = outcome
        for rank in range(2):
            got = await ranks.read(rank, target[low:high].tolist())
            want = rank_prefix_kv(LAYOUT, _prompt(i), 0, rank, 2)[:, low:high]
            assert torch.equal(got, want), f"prompt {i}: rank {rank} was served wrong KV during the close"
        checked += high - low
    assert checked, "no load returned anything: nothing was checked"
    assert first.pool.closed
    assert not sock.exists() or not any(sock.iterdir()), f"the socket is left behind: {list(sock.iterdir())}"

    # After the close no rank touches its buffer: what it holds now stays.
    snapshot = [await ranks.read(rank, list(range(NUM_SLOTS))) for rank in range(2)]
    await asyncio.sleep(0.2)
    for rank in range(2):
        assert torch.equal(await ranks.read(rank, list(range(NUM_SLOTS))), snapshot[rank]), "a rank wrote after close"

    # A new manager on the same directories: the live ranks re-attach, and every prompt the disk
    # holds loads bit-exact into other slots.
    async with TPCache(_config(tmp_path / "disk"), LAYOUT, tp_size=2, num_slots=NUM_SLOTS, tp_config=CONFIG,
                       directory=sock) as second:
        async with asyncio.timeout(START_S):
            await second.wait_ranks()
        loaded = 0
        for i in range(PROMPTS):
            match = await second.match(_prompt(i))
            fresh = list(range(NUM_SLOTS - match.tokens, NUM_SLOTS))
            result = await second.load(match, idx(fresh))
            loaded += result.tokens
            for rank in range(2):
                got = await ranks.read(rank, fresh[: result.tokens])
                want = rank_prefix_kv(LAYOUT, _prompt(i), 0, rank, 2)[:, : result.tokens]
                assert torch.equal(got, want), f"prompt {i}: rank {rank} served wrong KV after the restart"
        assert loaded >= PROMPTS // 2 * PAGES * T, "the pages stored before the storm are not on disk"
        for rank in range(2):
            stats = await ranks.ask(rank, ("stats",))
            assert stats.sessions == 2 and stats.attached, stats
        await ranks.stop_all()
        stats = second.stats()
        assert stats.pool_reserved == 0 and stats.pool_referenced == 0
    for _ in range(500):
        if _aiokv_threads() <= threads_before:
            break
        await asyncio.sleep(0.01)
    assert _aiokv_threads() <= threads_before, f"threads left: {_aiokv_threads() - threads_before}"
    with contextlib.suppress(FileNotFoundError):
        assert not any(sock.iterdir()), f"socket directory not emptied: {list(sock.iterdir())}"
