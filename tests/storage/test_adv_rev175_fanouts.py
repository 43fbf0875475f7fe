"""Review 175: fan-out directories removed, moved, replaced and restored under a busy writing tier.

3747302 retires a fan-out descriptor after an ENOENT; f084194/5383cab retire one the writer's
periodic check finds no longer named (moved away, removed with its files, replaced). Here a thread
does the damage with real renames, removals, symlinks and files, while writes, reads, deletes and
write-behind run on a small budget (recycling) with spare files on; checks are triggered
(``LockChecks``), tiers closed mid-way and started again over the same directory.

Invariants: no file appears in a directory moved out of the layout directory from a write started
after the check that followed the move, and a symlink's target never receives a file; every read
that succeeds is bit-exact for its key; after the last check every key the tier says it holds is
read back; no descriptor is left open after a close; no wait is unbounded; statistics are never
negative and the spare stock matches the spare files in the layout directory; a restart indexes
the page files there. ``AIOKV_REV175_SEEDS`` (comma-separated) widens the seeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import started
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, tierbase
from aiokv.storage.spares import SPARE_PREFIX

TAGS = (0x00, 0x01, 0x02, 0x03)
"""The fan-out directories the damage hits (spares are made round robin from ``00``)."""
KEYS = 10
"""Keys per fan-out directory."""
SEEDS = [int(s) for s in os.environ.get("AIOKV_REV175_SEEDS", "1").split(",") if s.strip()]
HEX = re.compile(r"[0-9a-f]{32}")


def _bytes_of(key: bytes, size: int) -> bytearray:
    """The one content of ``key`` (a cache's pages never change under a key)."""
    return bytearray(random.Random(key).randbytes(size))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _listing(directory: Path) -> set[str]:
    try:
        return set(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return set()


def _spares_inside(layout_dir: Path) -> int:
    return sum(1 for p in layout_dir.glob(f"*/{SPARE_PREFIX}*") if p.parent.is_dir() and not p.parent.is_symlink()
               and re.fullmatch(r"[0-9a-f]{2}", p.parent.name))


def _check_statistics(tier: DiskTier) -> None:
    stats, spares = tier.statistics(), tier.spare_statistics()
    for name, value in vars(stats).items():
        if isinstance(value, int):
            assert value >= 0, (name, stats)
    assert all(v >= 0 for v in stats.errors.values()), stats.errors
    assert all(v >= 0 for v in vars(spares).values()), spares
    assert spares.stock <= spares.target, spares
    assert spares.made >= spares.taken + spares.stock - 0, spares


@contextlib.contextmanager
def _gated_spares(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Spare batches wait (on their own thread, bounded) until the test opens the gate."""
    entered, gate = threading.Event(), threading.Event()
    real = tierbase.make_spares

    def gated(batch, file_bytes):  # type: ignore[no-untyped-def]
        entered.set()
        assert gate.wait(30.0), "spare gate never opened"
        return real(batch, file_bytes)

    monkeypatch.setattr(tierbase, "make_spares", gated)
    try:
        yield entered, gate
    finally:
        gate.set()


@pytest.mark.asyncio
async def test_spares_of_a_batch_in_flight_in_a_moved_directory_never_enter_the_stock(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A spare batch planned over fan-out ``01``; ``mv 01`` out of the cache while the batch runs;
    the check retires ``01`` (its stock has none of the batch yet); the batch lands. Before: its
    spares in the moved directory went into stock with the retired descriptor, so a new page was
    written into a file outside the cache (then renamed in), and the stock counted files that are
    not in the layout directory."""
    disk_dir, outside = tmp_path / "disk", tmp_path / "outside"
    size = layout.page_bytes
    with _gated_spares(monkeypatch) as (entered, gate):
        async with started(DiskTier(config(disk_dir, backend, follow_interval_s=3600.0), layout, pool,
                                    spare_files=8)) as tier:
            checks = LockChecks(tier)
            assert await tier.write_from(key_of(0, 0x10), memoryview(_bytes_of(key_of(0, 0x10), size)))
            assert await asyncio.to_thread(entered.wait, 30.0)
            os.rename(tier.files.layout_dir / "01", outside)
            await checks.next()
            assert tier._dir is not None and len(tier._dir.retired) == 1
            retired = tier._dir.retired[0]
            gate.set()
            refill = tier._refill
            if refill is not None:
                async with asyncio.timeout(30):
                    await asyncio.wait({refill})
            assert all(spare.dir_fd != retired for spare in tier._spares._stock)
            assert tier.spare_statistics().stock == _spares_inside(tier.files.layout_dir)
    assert not any(name.startswith(SPARE_PREFIX) for name in _listing(outside)), _listing(outside)
    assert_clean(pool)
