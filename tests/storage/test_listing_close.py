"""A close while a fan-out directory is being listed ends that listing at its next batch of
entries (``layoutdir.STOP_EVERY``), not after the whole directory: the start's listing and the
listing of a directory put back late (``aiokv-disk-list``).

The fault is real: the directory's blocks are read through a FUSE file under an ext4
(``listing_fs.py``); block 20 of ``3a`` is held so the listing thread waits inside ``getdents``
mid-directory, and block 45 stays held for good. Once the close began, block 20 is answered: a
listing that checks no stop flag goes on to block 45 and waits there, and so does the close (before:
it never ended while the block was held; a large or slow directory held the close as long as its
listing). Now the close ends at once, the held block 45 is never asked for, nothing from the
listing is indexed, no thread or descriptor is left, and a restart indexes every file.
Root only (FUSE, loop device)."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import started
from gate_helpers import BOUND_S
from listing_fs import ListingFs, listing_ext4
from loop_probes import until, until_thread
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier

TAG = 0x3A
FILES = 6000
"""Key-named files in ``3a``: about 60 blocks of a directory without an index."""
HELD, LATER = 20, 45
"""The block the listing waits at when the close begins, and one it must never reach."""
CLOSE_S = 10.0
"""The close must end within this once the first held block is answered (seconds)."""


def _make_files(directory: Path) -> None:
    """``FILES`` empty regular files of ours under page-file names of ``3a`` (listed as page files:
    only their names and kinds matter to a listing)."""
    directory.mkdir(mode=0o700, exist_ok=True)
    for i in range(FILES):
        os.close(os.open(directory / key_of(i, TAG).hex(), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _threads(prefix: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


async def _close_while_listing(tier: DiskTier, fs: ListingFs, directory: Path,
                               also: asyncio.Task[None] | None = None) -> None:
    """With the listing waiting at block ``HELD``: hold ``LATER``, begin the close, answer ``HELD``;
    the close must end within ``CLOSE_S`` and ``LATER`` never be asked for."""
    await asyncio.to_thread(fs.wait_held)
    fs.hold_block(directory, LATER)
    closing = asyncio.create_task(tier.aclose())
    await until(lambda: tier._close_task is not None)
    try:
        fs.free_block(directory, HELD)
        done, _ = await asyncio.wait({closing}, timeout=CLOSE_S)
        assert done, f"the close still waited for the listing {CLOSE_S} s after its block was read"
        assert fs.held() == 0, "the listing went on past the close to a later block"
    finally:
        fs.release()
        async with asyncio.timeout(BOUND_S):
            await asyncio.wait({closing, *([also] if also is not None else [])})
    closing.result()


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_close_during_the_start_ends_its_listing(tmp_path: Path, backend: DiskBackend, layout: KVLayout,
                                                         pool: PagePool) -> None:
    with listing_ext4(tmp_path, 64) as fs:
        cfg = config(fs.mount / "disk", backend, follow_interval_s=0.0)
        async with started(DiskTier(cfg, layout, pool)) as tier:
            fan = tier.files.layout_dir / f"{TAG:02x}"
        _make_files(fan)
        fs.cold()
        fs.hold_block(fan, HELD)
        fds = _fds()
        tier = DiskTier(cfg, layout, pool)
        starting = asyncio.create_task(tier.start())
        await _close_while_listing(tier, fs, fan, starting)
        with pytest.raises(RuntimeError, match="closed while it was starting"):
            starting.result()
        assert tier.statistics().pages == 0
        assert _fds() == fds
        # The thread has handed its result over and is ending: a bounded wait for its end (on a
        # host running 16 test workers it was still alive one line after the result arrived).
        await until_thread(lambda: not _threads("aiokv-disk-start"), "the start's thread ending", BOUND_S)
        async with started(DiskTier(cfg, layout, pool)) as again:
            assert again.statistics().pages == FILES
    assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_close_ends_the_listing_of_a_directory_put_back(tmp_path: Path, backend: DiskBackend,
                                                               layout: KVLayout, pool: PagePool) -> None:
    with listing_ext4(tmp_path, 64) as fs:
        cfg = config(fs.mount / "disk", backend, follow_interval_s=3600.0)
        fds = _fds()
        tier = DiskTier(cfg, layout, pool)
        await tier.start()
        try:
            checks = LockChecks(tier)
            fan = tier.files.layout_dir / f"{TAG:02x}"
            away = fs.mount / "away"
            os.rename(fan, away)
            await checks.next()  # retired
            _make_files(away)
            fs.cold()
            fs.hold_block(away, HELD)
            os.rename(away, fan)
            await checks.next()  # opened again: listed on its thread, which waits at block HELD
            assert tier._listings == {TAG: 1}
            await _close_while_listing(tier, fs, fan)
            assert tier.statistics().pages == 0
        finally:
            fs.release()
            await tier.aclose()
        assert _fds() == fds
        # As the start's (above): a bounded wait for the thread's end once its result arrived (one
        # line after the close it was still alive once under make test's parallel pass).
        await until_thread(lambda: not _threads("aiokv-disk-list"), "the listing's thread ending", BOUND_S)
        async with started(DiskTier(cfg, layout, pool)) as again:
            assert again.statistics().pages == FILES
    assert_clean(pool)
