"""A `TPCache`'s learned rates are labelled by the device its ranks copy on, not by the scheduler's.

The ranks move the bytes, so the pool rate a TP group learns (and saves in ``.rates``) is theirs:
a CUDA group's rates must not serve a CPU group after a restart, nor the other way round. Before,
every TPCache labelled its rates ``cpu``. The ranks name their buffer's device in their hello; the
rates are read once every rank is attached and saved under that kind. Real rank workers on CPU
buffers (each on its own thread and loop); a rank on another device is a peer speaking the real
protocol over the real socket with another device kind in its hello (the GPU run of the same flow
is in ``test_tp_gpu.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch
from tp_helpers import CONFIG, SLOTS, full_kv, rank_kv, threads_off_loop

from aiokv import CacheConfig, KVLayout
from aiokv.costs import CostModel
from aiokv.manager import CacheManager
from aiokv.rates_file import RATE_BOUNDS, RATES_FILE, encode_rates, write_rates_file
from aiokv.storage import DiskConfig
from aiokv.tp import RankWorkerThread, TPCache
from aiokv.tp.wire import PROTOCOL_VERSION, Attached, FrameKind, Hello, Welcome, frame, read_frame

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
TP = 2
PAGES = LAYOUT.for_tp(TP)
T = LAYOUT.page_tokens


def _config(disk: Path) -> CacheConfig:
    tier = DiskConfig(directory=disk, capacity_bytes=64 * (PAGES.page_bytes + 4096))
    return CacheConfig(cpu_bytes=16 * PAGES.page_bytes, disk=tier, namespace="tp-rates",
                       pool_chunk_bytes=4 * PAGES.page_bytes)


def _layout_dir(root: Path) -> Path:
    return root / PAGES.fingerprint.hex()


def _save(root: Path, device: str, pool_rate: float) -> None:
    """A rates file as a cache whose ranks copied on ``device`` leaves it."""
    costs = CostModel()
    costs.pool.update(pool_rate, 1.0)
    _layout_dir(root).mkdir(parents=True, exist_ok=True)
    write_rates_file(_layout_dir(root), encode_rates(costs, PAGES.fingerprint.hex(), device))


def _saved(root: Path) -> dict[str, object]:
    doc = json.loads((_layout_dir(root) / RATES_FILE).read_bytes())
    assert isinstance(doc, dict)
    return doc


@asynccontextmanager
async def _cpu_ranks(cache: TPCache) -> AsyncIterator[None]:
    full = full_kv(LAYOUT, 5)
    runners = [RankWorkerThread(cache.address, rank, TP, LAYOUT, rank_kv(full, LAYOUT, rank, TP), CONFIG)
               for rank in range(TP)]
    async with threads_off_loop(*runners):
        yield


async def _peer(cache: TPCache, rank: int, device: str) -> asyncio.StreamWriter:
    """A rank speaking the real protocol whose hello names ``device`` (it attaches, copies nothing)."""
    reader, writer = await asyncio.open_unix_connection(cache.address)
    hello = Hello(PROTOCOL_VERSION, rank, TP, PAGES.fingerprint, device)
    writer.write(frame(FrameKind.HELLO, hello.encode()))
    kind, payload = await read_frame(reader, 1 << 20)
    assert kind is FrameKind.WELCOME
    writer.write(frame(FrameKind.ATTACHED, Attached(Welcome.decode(payload).epoch, True).encode()))
    return writer


@pytest.mark.asyncio
async def test_cpu_ranks_learn_and_save_cpu_rates_and_never_take_cuda_ones(tmp_path: Path) -> None:
    _save(tmp_path, "cuda", 5e9)  # left by the same deployment on GPUs
    tokens = list(range(7000, 7000 + 6 * T))
    async with TPCache(_config(tmp_path), LAYOUT, tp_size=TP, num_slots=SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "sock") as cache:
        manager = cache._manager
        assert manager.device_kind is None and manager.costs.pool.rate is None  # the ranks' device: unknown
        async with _cpu_ranks(cache):
            await cache.wait_ranks()
            assert manager.device_kind == "cpu" and cache.group.device_kind == "cpu"
            await cache.flush()  # the saved rates are read in the background
            assert manager.costs.pool.rate is None, "a CPU group took rates its ranks measured on a GPU"
            assert cache.stats().errors["rates_ignored"] == 1
            assert (await cache.offload(tokens, torch.arange(len(tokens)))).stored == 6
            loaded = await cache.load(await cache.match(tokens), torch.arange(40, 40 + len(tokens)))
            assert loaded.tokens == len(tokens)
            learned = manager.costs.pool.rate
            assert learned is not None
    doc = _saved(tmp_path)
    assert doc["device"] == "cpu"
    # A restarted CPU group reads them back once its ranks are attached.
    async with TPCache(_config(tmp_path), LAYOUT, tp_size=TP, num_slots=SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "sock") as cache, _cpu_ranks(cache):
        await cache.wait_ranks()
        await cache.flush()
        low, high = RATE_BOUNDS["pool"]  # tiny pages copy slower than a real rate's floor
        assert cache._manager.costs.pool.rate == pytest.approx(min(max(learned, low), high))
        assert "rates_ignored" not in cache.stats().errors


@pytest.mark.asyncio
async def test_a_group_of_cuda_ranks_reads_and_saves_its_rates_as_cuda(tmp_path: Path) -> None:
    # Regression: the scheduler labelled a CUDA group's rates "cpu", so it ignored the rates it had
    # saved itself (labelled "cpu"... and taken by a CPU group) and persisted GPU rates as CPU ones.
    _save(tmp_path, "cuda", 5e9)
    async with TPCache(_config(tmp_path), LAYOUT, tp_size=TP, num_slots=SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "sock") as cache:
        peers = [await _peer(cache, rank, "cuda") for rank in range(TP)]
        try:
            await cache.wait_ranks()
            await cache.flush()
            manager = cache._manager
            assert manager.device_kind == "cuda"
            assert manager.costs.pool.rate == pytest.approx(5e9) and not cache.stats().errors.get("rates_ignored")
            cache.note_prefill(1000, 0.5)  # something new to save
        finally:
            for writer in peers:
                writer.close()
                await writer.wait_closed()
    doc = _saved(tmp_path)
    assert doc["device"] == "cuda" and set(doc["rates"]) == {"pool", "prefill"}  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_ranks_on_another_device_forget_the_rates_of_the_first(tmp_path: Path) -> None:
    _save(tmp_path, "cuda", 5e9)
    async with TPCache(_config(tmp_path), LAYOUT, tp_size=TP, num_slots=SLOTS, tp_config=CONFIG,
                       directory=tmp_path / "sock") as cache:
        peers = [await _peer(cache, rank, "cuda") for rank in range(TP)]
        await cache.wait_ranks()
        await cache.flush()
        manager = cache._manager
        assert manager.costs.pool.rate == pytest.approx(5e9)
        for writer in peers:
            writer.close()
            await writer.wait_closed()
        while cache.group.attached:
            await cache.group.wait_change()
        async with _cpu_ranks(cache):  # the same deployment restarted its ranks on CPU buffers
            await cache.wait_ranks()
            await cache.flush()
            assert manager.device_kind == "cpu"
            assert manager.costs.pool.rate is None, "CPU ranks planned with rates measured on a GPU"
    assert _saved(tmp_path)["device"] == "cuda"  # nothing measured on the CPU ranks: the file stays
    assert os.stat(_layout_dir(tmp_path) / RATES_FILE).st_size > 0


@pytest.mark.asyncio
async def test_set_device_refuses_bad_kinds_and_changes_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="exclude"):
        CacheManager(_config(tmp_path), PAGES, device="cuda", device_later=True)
    manager = CacheManager(_config(tmp_path), PAGES, device_later=True)
    for bad, error in ((1, TypeError), (None, TypeError), ("", ValueError)):
        with pytest.raises(error):
            manager.set_device(bad)  # type: ignore[arg-type]
    assert manager.device_kind is None
