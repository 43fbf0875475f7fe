"""Review 181: fan-out directories put back under a writing tier (02f53ee, e6c0324, 6a6e6df, 0bdf672).

A fan-out directory the writer opens late is listed on a thread (``aiokv-disk-list``) while the
loop keeps writing, recycling, deleting and reading there. The listing's outcome is applied on the
loop: a key whose state changed meanwhile must not be taken from it. Deterministic cases hold the
listing (``_gated_listing``: before and after ``list_fanout`` runs) across one such change; the
seeded drive moves fan-out directories out of the cache and back (and copies backups back,
twice quickly, with planted entries) under reads, writes, deletes and evictions on a small budget.

Oracle: every byte served equals its key's payload; after quiescence every page file under the
layout directory is indexed (and every indexed key has its file), the index is within the budget,
nothing is written into a directory moved outside the cache after the check that retired it and
still there, a symlink's target never receives a file; no descriptor or thread is left after the
close. ``AIOKV_REV181_SEEDS`` (comma-separated) widens the seeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import started
from test_lock_replaced import LockChecks

from aiokv.keys import PageKey
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, followpath
from aiokv.storage.backends import IOOp
from aiokv.storage.pagefile import file_bytes

TAG = 0x3A
"""The fan-out directory put back."""
OTHER = 0x10
"""A fan-out directory left alone."""
SEEDS = [int(s) for s in os.environ.get("AIOKV_REV181_SEEDS", "1,2").split(",") if s.strip()]
HEX = re.compile(r"[0-9a-f]{32}")


def _bytes_of(key: bytes, size: int) -> bytearray:
    """The one content of ``key`` (a cache's pages never change under a key)."""
    return bytearray(random.Random(key).randbytes(size))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _on_disk(layout_dir: Path) -> set[str]:
    """Page-file names (key hex) in their own fan-out directory under ``layout_dir``."""
    found = set()
    for fan in layout_dir.iterdir():
        if re.fullmatch(r"[0-9a-f]{2}", fan.name) and fan.is_dir() and not fan.is_symlink():
            found |= {p.name for p in fan.iterdir() if HEX.fullmatch(p.name) and p.name[:2] == fan.name
                      and p.is_file() and not p.is_symlink()}
    return found


def _indexed(tier: DiskTier) -> set[str]:
    return {bytes.hex(key) for key in tier._index}


async def _settled(tier: DiskTier) -> None:
    """Until the tier's background tasks (listings, unlinks) ended."""
    async with asyncio.timeout(30):
        while pending := {task for task in tier._jobs if not task.done()}:
            await asyncio.wait(pending)


@contextlib.contextmanager
def _gated_listing(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event,
                                                                     threading.Event]]:
    """Listings of fan-out directories opened late wait (on their thread, bounded) for ``before``
    to be set, list, set ``listed``, then wait for ``after``."""
    before, listed, after = threading.Event(), threading.Event(), threading.Event()
    real = followpath.list_fanout

    def gated(*args: Any, **kwargs: Any) -> Any:
        assert before.wait(30.0), "listing gate never opened"
        listing = real(*args, **kwargs)
        listed.set()
        assert after.wait(30.0), "listing gate never opened"
        return listing

    monkeypatch.setattr(followpath, "list_fanout", gated)
    try:
        yield before, listed, after
    finally:
        before.set()
        after.set()


async def _write(tier: DiskTier, key: PageKey, size: int) -> bool:
    return await tier.write_from(key, memoryview(_bytes_of(key, size)))


async def _put_back(tier: DiskTier, checks: LockChecks, away: Path, keys: list[PageKey], size: int) -> None:
    """``keys`` written into ``TAG``, the directory moved to ``away`` (a check retires it) and back."""
    for key in keys:
        assert await _write(tier, key, size)
    fan = tier.files.layout_dir / f"{TAG:02x}"
    os.rename(fan, away)
    await checks.next()
    assert not any(tier.contains(key) for key in keys)
    os.rename(away, fan)


@pytest.mark.asyncio
async def test_a_recycled_victim_listed_before_its_move_is_not_indexed(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``3a`` put back; the write that opens it stores ``k10`` there; the listing sees ``k10``'s
    file; a full tier then recycles ``k10``'s file into another key's name before the listing
    ends. Before: the listing indexed ``k10`` (no longer being moved, not in the index) with no
    file under its name: counted in the budget, served as present until a read missed."""
    size = layout.page_bytes
    with _gated_listing(monkeypatch) as (before, listed, after):
        cfg = config(tmp_path / "disk", backend, 3 * file_bytes(layout), follow_interval_s=3600.0)
        async with started(DiskTier(cfg, layout, pool)) as tier:
            checks = LockChecks(tier)
            await _put_back(tier, checks, tmp_path / "elsewhere", [key_of(0, TAG)], size)
            assert await _write(tier, key_of(10, TAG), size)  # opens 3a: its listing waits
            for i in range(2):
                assert await _write(tier, key_of(i, OTHER), size)
            before.set()  # the listing sees k0 and k10
            assert await asyncio.to_thread(listed.wait, 30.0)
            assert await _write(tier, key_of(2, OTHER), size)  # recycles k10, the least recent
            for i in range(3):
                await tier.delete(key_of(i, OTHER))
            after.set()
            await _settled(tier)
            assert _indexed(tier) == _on_disk(tier.files.layout_dir), tier.statistics()
            assert not tier.contains(key_of(10, TAG))
            assert tier.contains(key_of(0, TAG))
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_write_in_flight_at_the_listing_that_fails_leaves_no_file_unindexed(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``3a`` put back holding ``k0``'s file; a write of ``k0`` is in flight when the listing ends
    (so the listing leaves ``k0`` to it) and then fails (a real EIO of its write, injected). Before:
    ``k0``'s old file stayed on disk, never indexed, counted or evicted (the budget exceeded by it)
    until a restart."""
    size = layout.page_bytes
    with _gated_listing(monkeypatch) as (before, _listed, after):
        cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
        async with started(DiskTier(cfg, layout, pool)) as tier:
            checks = LockChecks(tier)
            await _put_back(tier, checks, tmp_path / "elsewhere", [key_of(0, TAG)], size)
            assert await _write(tier, key_of(10, TAG), size)  # opens 3a: its listing waits
            held = asyncio.Event()
            real_claim = tier._claim

            def claim(job: Any) -> None:  # k0's write waits (in flight) until the listing ended
                if job.key != key_of(0, TAG):
                    real_claim(job)
                    return

                async def later() -> None:
                    await held.wait()
                    tier.backend.faults.inject(IOOp.WRITE, errno.EIO)
                    real_claim(job)

                tier._spawn(later())

            monkeypatch.setattr(tier, "_claim", claim)
            applied = asyncio.Event()
            real_index_listed = tier._index_listed

            def index_listed(*args: Any) -> None:
                real_index_listed(*args)
                applied.set()

            monkeypatch.setattr(tier, "_index_listed", index_listed)
            writing = asyncio.create_task(_write(tier, key_of(0, TAG), size))
            await asyncio.sleep(0)
            assert key_of(0, TAG) in tier._writing
            before.set()
            after.set()
            async with asyncio.timeout(30):
                await applied.wait()
            held.set()
            assert not await writing
            await _settled(tier)
            assert _indexed(tier) == _on_disk(tier.files.layout_dir), tier.statistics()
    assert_clean(pool)
