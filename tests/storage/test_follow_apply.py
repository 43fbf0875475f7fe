"""A look that finds many new page files is applied in bounded steps: the loop changes at most
``APPLY_PER_TURN`` index entries per turn (a directory of a million pages never stalls it for the
whole look), and nothing of the look runs on the loop but that."""

from __future__ import annotations

import asyncio
import itertools
import os
from pathlib import Path

import pytest
import torch
from disk_helpers import assert_clean, fill, key_of, payload, reserve
from follow_helpers import Looks, follow_config, started

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage import followpath as followpath_module

NEW = 10_000


def _link_many(source: Path, layout_dir: Path) -> None:
    """``NEW`` hard links of ``source`` under key names spread over the fan-out directories (the
    scan indexes a hard link as any page file; a read refuses it by its header's key)."""
    for i in range(NEW):
        key = i.to_bytes(2, "little") + bytes([0xA5]) * 14
        os.link(source, layout_dir / key.hex()[:2] / key.hex())


@pytest.mark.asyncio
async def test_a_large_look_is_applied_a_bounded_step_per_loop_turn(
        disk_dir: Path, layout: KVLayout, pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(followpath_module, "APPLY_PER_TURN", 1000)
    backend = DiskBackend.THREADS
    async with started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as writer:
        h = fill(pool, key_of(1), 1)
        want = payload(pool, h)
        assert await writer.write(key_of(1), h)
        pool.table.release(h)
        pool.table.evict(pool.num_pages)
        async with started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as follower:
            looks = Looks(follower)
            source = follower.files.layout_dir / key_of(1).hex()[:2] / key_of(1).hex()
            await asyncio.to_thread(_link_many, source, follower.files.layout_dir)
            sizes: list[int] = []
            stop = asyncio.Event()

            async def ticker() -> None:  # the index's size at every loop turn
                while not stop.is_set():
                    sizes.append(len(follower._index))
                    await asyncio.sleep(0)

            ticking = asyncio.ensure_future(ticker())
            try:
                await looks.next(limit_s=120)
            finally:
                stop.set()
                await ticking
            assert follower.statistics().pages == NEW + 1
            steps = [b - a for a, b in itertools.pairwise(sizes) if b != a]
            assert sum(steps) == NEW and max(steps) <= 1000, steps
            into = reserve(pool, key_of(2))
            assert await follower.read(key_of(1), into)
            assert torch.equal(payload(pool, into), want)
            pool.table.abort(into)
    assert_clean(pool)
