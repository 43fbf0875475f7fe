"""A write that fails unexpectedly after claiming room gives the room back: ``bytes_stored`` keeps
matching the files indexed, and the capacity does not shrink for good."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from disk_helpers import assert_clean, config, stored_page, write_page

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.pagefile import file_bytes


def _consistent(tier: DiskTier, layout: KVLayout) -> None:
    stats = tier.statistics()
    assert stats.bytes_stored == stats.pages * file_bytes(layout), stats


def _once(real: Any) -> Any:
    """``real``, raising (a bug) after its first call has done its work."""
    calls = [0]

    def wrapper(*args: Any) -> Any:
        result = real(*args)
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected bug")
        return result

    return wrapper


@pytest.mark.asyncio
async def test_claim_failing_after_room_gives_it_back(tier: DiskTier, pool: PagePool, layout: KVLayout,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # ``_claim`` raising after the index counted the room (here: the slot queue, after the claim).
    def take(*_args: Any) -> None:
        raise RuntimeError("injected bug")

    monkeypatch.setattr(tier._io_slots, "take", take)
    assert not (await write_page(tier, pool, 1))[0]
    _consistent(tier, layout)
    assert tier.statistics().bytes_stored == 0
    monkeypatch.undo()
    await stored_page(tier, pool, 2)
    _consistent(tier, layout)
    assert tier.statistics().in_flight == 0
    assert_clean(pool)


@pytest.mark.asyncio
async def test_recycle_failing_unexpectedly_gives_room_back(disk_dir: Path, backend: DiskBackend,
                                                            layout: KVLayout, pool: PagePool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # Room for two files, recycling on: the third write overwrites the oldest file, and its
    # completion (``_recycled_done``) raises unexpectedly.
    async with DiskTier(config(disk_dir, backend, capacity=2 * file_bytes(layout), recycle_files=True),
                        layout, pool) as tier:
        await stored_page(tier, pool, 1)
        await stored_page(tier, pool, 2)
        _consistent(tier, layout)
        monkeypatch.setattr(tier, "_victim_moved", _once(tier._victim_moved))
        assert not (await write_page(tier, pool, 3))[0]
        _consistent(tier, layout)
        monkeypatch.undo()
        # The full capacity is still there: two more pages fit.
        await stored_page(tier, pool, 4)
        await stored_page(tier, pool, 5)
        assert tier.statistics().pages == 2
        _consistent(tier, layout)
    assert_clean(pool)
