"""`TPCache` end to end: one manager, rank workers in their own (spawned) processes, one pool.

Each rank holds only its heads; pages are whole (every rank writes its slice of the same page),
so after an offload fresh rank processes load their own heads back bit-exact, from the pool and
after a restart from disk. A rank that is gone fails the transfer: nothing partial is served.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from tp_helpers import CONFIG, SLOTS, RankProcesses, full_kv, rank_kv

from aiokv import CacheConfig, KVLayout
from aiokv.kernels import TransferPath
from aiokv.storage import DiskConfig
from aiokv.tp import TPCache

MHA = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
MLA = KVLayout.mla(2, 16, torch.bfloat16, page_tokens=4)


def _config(layout: KVLayout, disk: Path | None) -> CacheConfig:
    tier = None if disk is None else DiskConfig(directory=disk, capacity_bytes=64 * (layout.page_bytes + 4096))
    return CacheConfig(
        cpu_bytes=16 * layout.page_bytes, disk=tier, namespace="tp-test", pool_chunk_bytes=4 * layout.page_bytes,
    )


async def _check_ranks(ranks: RankProcesses, layout: KVLayout, seed: int, source: torch.Tensor,
                       target: torch.Tensor) -> None:
    """Every rank's buffer holds, at ``target``, its own heads of the tokens that were at ``source``."""
    full = full_kv(layout, seed)
    for rank in range(ranks.tp_size):
        got = await ranks.dump(rank)
        want = rank_kv(full, layout, rank, ranks.tp_size)[:, source]
        assert torch.equal(got[:, target], want), f"rank {rank} holds bytes that are not its heads"


@pytest.mark.slow(seconds=14)
@pytest.mark.asyncio
@pytest.mark.parametrize(("layout", "tp_size"), [(MHA, 2), (MHA, 4), (MLA, 2)], ids=["mha-tp2", "mha-tp4", "mla-tp2"])
async def test_offload_then_fresh_ranks_load_their_heads_from_pool_and_disk(
    tmp_path: Path, layout: KVLayout, tp_size: int
) -> None:
    t = layout.page_tokens
    n = 6 * t
    tokens = list(range(5000, 5000 + n))
    source = torch.arange(n)
    target = torch.arange(40, 40 + n - 3)
    async with TPCache(_config(layout, tmp_path), layout, tp_size=tp_size, num_slots=SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "sock") as cache:
        writers = RankProcesses(Path(cache.address), layout, tp_size, seed=3, fill=True)
        writers.start_all()
        try:
            await cache.wait_ranks()
            result = await cache.offload(tokens, source)
            assert (result.stored, result.dropped) == (6, 0)
        finally:
            await writers.stop_all()
        readers = RankProcesses(Path(cache.address), layout, tp_size, seed=3, fill=False)
        readers.start_all()
        try:
            await cache.wait_ranks()
            match = await cache.match(tokens)
            assert match.pool_pages == 6
            loaded = await cache.load(match, target, from_token=3)  # a partly needed first page too
            assert loaded.tokens == n
            await _check_ranks(readers, layout, 3, source[3:], target)
            await cache.flush()
        finally:
            await readers.stop_all()
    # A restarted manager serves the pages from disk to fresh ranks.
    async with TPCache(_config(layout, tmp_path), layout, tp_size=tp_size, num_slots=SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "sock") as cache:
        readers = RankProcesses(Path(cache.address), layout, tp_size, seed=3, fill=False)
        readers.start_all()
        try:
            await cache.wait_ranks()
            match = await cache.match(tokens)
            assert (match.pool_pages, match.disk_pages) == (0, 6)
            loaded = await cache.load(match, torch.arange(n))
            assert loaded.tokens == n
            await _check_ranks(readers, layout, 3, source, torch.arange(n))
        finally:
            await readers.stop_all()


@pytest.mark.asyncio
async def test_a_missing_rank_fails_the_transfer_and_nothing_partial_is_served(tmp_path: Path) -> None:
    layout, tp_size = MHA, 2
    t = layout.page_tokens
    tokens = list(range(7000, 7000 + 4 * t))
    async with TPCache(_config(layout, None), layout, tp_size=tp_size, num_slots=SLOTS, tp_config=CONFIG) as cache:
        ranks = RankProcesses(Path(cache.address), layout, tp_size, seed=4, fill=True)
        ranks.start_all()
        try:
            await cache.wait_ranks()
            ranks.kill(1)
            await ranks.reap(1)
            # Rank 1 is gone: its heads cannot be stored, so no page is committed.
            result = await cache.offload(tokens, torch.arange(4 * t))
            assert result.stored == 0 and result.dropped == 4
            assert (await cache.match(tokens)).tokens == 0
            ranks.start(1)  # a restarted rank attaches again and the cache serves
            await cache.wait_ranks()
            assert (await cache.offload(tokens, torch.arange(4 * t))).stored == 4
            ranks.kill(0)
            await ranks.reap(0)
            loaded = await cache.load(await cache.match(tokens), torch.arange(50, 50 + 4 * t))
            assert loaded.tokens == 0  # one rank cannot load: a miss for all, never half the heads
            assert cache.stats().errors["copy_failed"] >= 2
        finally:
            await ranks.kill_all()
        cache.pool.table.check_invariants()
        assert cache.stats().pool_reserved == 0 and cache.stats().pool_referenced == 0


@pytest.mark.asyncio
async def test_bad_arguments_are_refused_before_anything_changes() -> None:
    with pytest.raises(ValueError, match="tp_size"):
        TPCache(CacheConfig(cpu_bytes=1 << 20, disk_dir=None, tp_size=2), MHA, tp_size=2, num_slots=8)
    with pytest.raises(ValueError, match="divisible"):
        TPCache(CacheConfig(cpu_bytes=1 << 20, disk_dir=None), MHA, tp_size=3, num_slots=8)
    with pytest.raises(ValueError, match="num_slots"):
        TPCache(CacheConfig(cpu_bytes=1 << 20, disk_dir=None), MHA, tp_size=2, num_slots=0)
    # Copy settings belong to the ranks: given to the manager they were silently ignored.
    with pytest.raises(ValueError, match=r"transfer_path is not used by a TPCache.*RankWorker"):
        TPCache(CacheConfig(cpu_bytes=1 << 20, disk=None, transfer_path=TransferPath.DIRECT), MHA, tp_size=2,
                num_slots=8)
    with pytest.raises(ValueError, match="staging_pages is not used by a TPCache"):
        TPCache(CacheConfig(cpu_bytes=1 << 20, disk=None, staging_pages=3), MHA, tp_size=2, num_slots=8)
    async with TPCache(_config(MHA, None), MHA, tp_size=2, num_slots=SLOTS, tp_config=CONFIG) as cache:
        t = MHA.page_tokens
        with pytest.raises(ValueError, match="out of range"):
            await cache.offload(list(range(2 * t)), torch.arange(SLOTS, SLOTS + 2 * t))
        with pytest.raises(ValueError, match="duplicated"):
            await cache.offload(list(range(2 * t)), torch.zeros(2 * t, dtype=torch.long))
        with pytest.raises(TypeError):
            await cache.offload(list(range(2 * t)), list(range(2 * t)))  # type: ignore[arg-type]
        assert cache.stats().pool_reserved == 0 and cache.stats().pages_stored == 0


@pytest.mark.asyncio
async def test_a_cancelled_close_finishes_without_a_retry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: TPCache.aclose cancelled while the manager closed returned with the rank group's
    # socket and the pool still open, freed only if the engine called it again.
    import threading

    import aiokv.manager as manager_module
    from aiokv.rates_file import write_rates_file

    loop = asyncio.get_running_loop()
    entered: asyncio.Future[None] = loop.create_future()
    release = threading.Event()

    def held(directory: Path, data: bytes, fd: int | None = None) -> bool:
        loop.call_soon_threadsafe(lambda: entered.done() or entered.set_result(None))
        assert release.wait(30), "the test never released the rates write"
        return write_rates_file(directory, data, fd)

    monkeypatch.setattr(manager_module, "write_rates_file", held)
    cache = TPCache(_config(MHA, tmp_path), MHA, tp_size=2, num_slots=SLOTS, tp_config=CONFIG)
    await cache.start()
    cache.manager.set_device("cpu")  # as the group reports once its ranks attached: rates are saved
    cache.manager.costs.pool.update(1e9, 1.0)  # a rate changed: the close writes it (held)
    first = asyncio.create_task(cache.aclose())
    await entered
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    release.set()
    for _ in range(2000):  # no second aclose(): the close goes on by itself
        if cache.pool.closed:
            break
        await asyncio.sleep(0.005)
    assert cache.pool.closed
    assert cache.group._close_task is not None and cache.group._close_task.done()  # the group closed too
    await cache.aclose()  # idempotent
