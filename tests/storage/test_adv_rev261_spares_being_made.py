"""The free-room estimate of review 261 (:meth:`~aiokv.storage.writepath.WritePath._short_of_room`)
left out the spare files of a batch being made at a free-space look: their room was in ``used``
already (reserved when the batch was planned), their blocks not yet allocated, so the look counted
them free too (twice), as it did the tier's new files in flight before review 261. A later first
try that evicted for a new file then went at once where it needed its unlink's blocks: an ENOSPC,
a second page evicted for the retry (lost for nothing), and the retry.

The faults are real: a small ext4 on a loop device (no root reserve), filled by another file (root
only), which then frees some of it. The batch is held by a gate on the real
:func:`~aiokv.storage.spares.make_spares` until the look is over; the eviction's unlink is held
until the write that needs its room ended or met ENOSPC, unless it waits for it."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from disk_helpers import BIG, PER_FILE, assert_clean, config, ready_pool, write_page
from fs_helpers import loop_ext4
from loop_probes import until_thread
from test_adv_rev261_in_flight_estimate import (
    _enospc,
    _first_try_of,
    _hold_unlinks,
    _ten_pages_then_filled,
    _until_needed,
)
from test_disk_spares import Gate

import aiokv.storage.tierbase as tierbase
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.layoutdir import FreeSpace

BOUND_S = 30.0
"""How long the look's thread waits for the batch to land (a bound for a broken test, never reached)."""


@pytest.fixture
def big_pool() -> Iterator[PagePool]:
    with ready_pool(BIG, 8) as pool:
        yield pool


def _land_within_the_look(tier: DiskTier, gate: Gate, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier's next free-space look opens ``gate`` once its statvfs returned, and returns only
    once the batch in flight landed (its callback ran on the loop, which awaits the look)."""
    refill = tier._refill
    assert refill is not None
    landed = threading.Event()
    # Callbacks run in the order added: this one after the tier's own (its spares in stock).
    refill.add_done_callback(lambda _: landed.set())
    really_look = tierbase.free_space

    def look_then_land(dir_fd: int) -> FreeSpace:
        space = really_look(dir_fd)
        gate.open()
        assert landed.wait(BOUND_S), "the batch did not land"
        return space

    monkeypatch.setattr(tierbase, "free_space", look_then_land)


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("landed_in_look", [False, True], ids=["made_after_the_look", "landed_while_it_ran"])
async def test_spares_being_made_at_a_look_are_not_free(
        tmp_path: Path, backend: DiskBackend, big_pool: PagePool, monkeypatch: pytest.MonkeyPatch,
        landed_in_look: bool) -> None:
    # Ten pages stored, a budget of 13, the disk filled to 2.5 files free: the budget in force is
    # 12.5 files, and the start plans a batch of two spares into that room (held at the gate, no
    # block allocated). Another program frees 3/4 of a file (3.25 free). Write A looks (the tier is
    # below its budget): 13 files in force, the look counts the spares' 2 files free.
    # - made_after_the_look: A takes room for a new file (2.25 free), then the spares are made (0.25
    #   free). B and C take them.
    # - landed_while_it_ran: the gate opens once the look's statvfs returned, and the batch lands
    #   before the look ends (0.25 + 1 free). A takes a spare, which plans a batch of one into the
    #   free room (0.25 free); B and C take the other two.
    # D evicts page 0 for a new file: before, the estimate said 3.25 + 12 - 13 = 2.25 files free,
    # less 1 for its own unlink >= 1 file, so D went at once and met ENOSPC (the unlink held), then
    # evicted page 1 for the retry: (ENOSPC, evictions, pages) = (1, 2, 12). Now the spares being
    # made (or landed while the look ran) count as taken at the look (0.25 free): D waits for its
    # unlink, (0, 1, 13).
    with loop_ext4(tmp_path, 24, reserved_percent=0) as mount:
        cfg = config(mount / "disk", backend, capacity=13 * PER_FILE, min_free_bytes=0,
                     free_space_recheck_s=0.0, recycle_files=False)
        await _ten_pages_then_filled(cfg, big_pool, mount, leave=2 * PER_FILE + PER_FILE // 2)
        gate = Gate(monkeypatch)
        try:
            async with DiskTier(cfg, BIG, big_pool, spare_files=2) as tier:
                try:
                    await until_thread(gate.entered.is_set, "the start's batch of spares")
                    assert tier._spares.making == 2
                    assert tier.statistics().effective_capacity_bytes < 13 * PER_FILE  # a write looks
                    ballast = mount / "ballast"
                    os.truncate(ballast, ballast.stat().st_size - 3 * PER_FILE // 4)
                    if landed_in_look:
                        _land_within_the_look(tier, gate, monkeypatch)
                    ok, _ = await write_page(tier, big_pool, 10)
                    assert ok
                    # A's look ran before the spares were made: the budget in force is the whole budget now.
                    assert tier.statistics().effective_capacity_bytes == 13 * PER_FILE
                    if landed_in_look:
                        # A took a spare; a batch of one followed.
                        assert tier._spares.taken == 1 and tier._spares.made + tier._spares.making == 3
                    else:
                        assert tier._spares.making == 2 and not len(tier._spares)
                finally:
                    gate.open()
                await until_thread(lambda: len(tier._spares) == 2 and not tier._spares.making, "two spares in stock")
                for i in (11, 12):
                    ok, _ = await write_page(tier, big_pool, i)
                    assert ok
                assert tier._spares.taken == (3 if landed_in_look else 2)
                assert tier.statistics().evictions == 0

                def hold(name: str) -> Callable[[], bool] | None:
                    job = _first_try_of(tier, 13)
                    return None if job is None else _until_needed(tier, job)

                _hold_unlinks(tier, monkeypatch, hold)
                ok, _ = await write_page(tier, big_pool, 13)
                assert ok
                stats = tier.statistics()
                # Before: (1, 2, 12): an ENOSPC, a second page evicted for the retry.
                assert (_enospc(tier), stats.evictions, stats.pages) == (0, 1, 13), stats.errors
                assert sum(stats.errors.values()) == 0, stats.errors
        finally:
            gate.open()  # never leave the batch's thread waiting
    assert_clean(big_pool)
