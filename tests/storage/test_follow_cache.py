"""Through the cache: a ``KVCache`` whose disk tier starts over a directory another engine process
holds (the default ``disk_dir`` is per user) follows that process: a ``match`` made after the other
process offloaded a prompt finds its pages on disk and loads them bit for bit; once the other
process closes, this cache takes the directory over and what it offloads then is found by the next
cache over the directory. The follow interval is set through the one config tree
(``CacheConfig.disk``, a ``DiskConfig``)."""

from __future__ import annotations

import asyncio
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
from follow_helpers import Looks, child, receive

from aiokv import CacheConfig, KVCache, KVLayout
from aiokv.storage import DiskConfig, ReadOnly

LAYOUT = KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4)
SLOTS = 64
PAGES = 3


def _config(directory: Path, follow_interval_s: float = 2.0) -> CacheConfig:
    disk = DiskConfig(directory=directory, capacity_bytes=64 * (LAYOUT.page_bytes + 4096),
                      follow_interval_s=follow_interval_s)
    return CacheConfig(cpu_bytes=16 * LAYOUT.page_bytes, disk=disk, namespace="follow-test",
                       pool_chunk_bytes=4 * LAYOUT.page_bytes)


def _prompt(seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (PAGES * LAYOUT.page_tokens,), generator=gen).tolist()


def _kv_of(seed: int) -> torch.Tensor:
    """What the engine's KV buffer holds for prompt ``seed``, slots 0..n-1."""
    n = PAGES * LAYOUT.page_tokens
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(LAYOUT.num_layers, n, LAYOUT.rows, LAYOUT.head_dim, generator=gen).to(LAYOUT.dtype)


def _empty_kv() -> torch.Tensor:
    return torch.zeros(LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)


async def _offload(cache: KVCache, kv: torch.Tensor, seed: int) -> None:
    n = PAGES * LAYOUT.page_tokens
    kv[:, :n] = _kv_of(seed)
    result = await cache.offload(_prompt(seed), torch.arange(n))
    assert result.stored == PAGES, result
    await cache.flush()


async def _loads(cache: KVCache, kv: torch.Tensor, seed: int) -> int:
    """Disk pages of prompt ``seed`` matched; they load bit for bit into a zeroed buffer."""
    kv.zero_()
    match = await cache.match(_prompt(seed))
    disk_pages = match.disk_pages
    loaded = await cache.load(match, torch.arange(match.tokens))
    assert torch.equal(kv[:, : loaded.tokens], _kv_of(seed)[:, : loaded.tokens])
    return disk_pages if loaded.tokens == match.tokens else -1


def engine_child(directory: str, conn: Connection) -> None:
    """Another engine: holds the directory; ``("offload", seed)`` offloads prompt ``seed`` and
    answers ``"offloaded"`` once it is on disk; ``"close"`` closes the cache, answers ``"closed"``
    and waits for ``"exit"``."""

    async def main() -> None:
        kv = _empty_kv()
        async with KVCache(_config(Path(directory)), LAYOUT, kv) as cache:
            assert cache.disk is not None
            conn.send(("ready", cache.disk.read_only))
            while (message := await asyncio.to_thread(conn.recv)) != "close":
                await _offload(cache, kv, message[1])
                conn.send("offloaded")
        conn.send("closed")
        await asyncio.to_thread(conn.recv)

    asyncio.run(main())


@pytest.mark.asyncio
async def test_a_cache_over_a_held_directory_matches_the_holders_later_pages(tmp_path: Path) -> None:
    with child(engine_child, str(tmp_path)) as (conn, _proc):
        assert await receive(conn) == ("ready", None)
        conn.send(("offload", 1))
        assert await receive(conn) == "offloaded"
        kv = _empty_kv()
        async with KVCache(_config(tmp_path, follow_interval_s=0.2), LAYOUT, kv) as reader:
            disk = reader.disk
            assert disk is not None and disk.read_only is ReadOnly.LOCKED
            looks = Looks(disk)
            assert await _loads(reader, kv, 1) == PAGES  # found at start
            conn.send(("offload", 2))  # stored after this cache started
            assert await receive(conn) == "offloaded"
            keys = reader.keys(_prompt(2))
            await looks.until(lambda: all(disk.contains(k) for k in keys), limit_s=20, force=False)
            assert await _loads(reader, kv, 2) == PAGES
            assert disk.statistics().followed_in == PAGES
            conn.send("close")
            assert await receive(conn) == "closed"
            await looks.until(lambda: disk.read_only is None, limit_s=20, force=False)
            assert disk.statistics().took_over == 1
            await _offload(reader, kv, 3)  # written now: this cache holds the directory
            conn.send("exit")
    kv = _empty_kv()
    async with KVCache(_config(tmp_path), LAYOUT, kv) as after:
        assert after.disk is not None and after.disk.read_only is None
        for seed in (1, 2, 3):
            assert await _loads(after, kv, seed) == PAGES, seed
