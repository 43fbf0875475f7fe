"""Review 194: a page this tier deleted while it wrote is not indexed by its looks once it follows
another writer (it lost the lock), nor kept once it takes the directory over again.

Writer A deletes a key whose fan-out directory is away: remembered (88d2355 keeps it, after a lock
loss, as "a file no newer than the delete is the page deleted"). ``.lock`` is removed and writer B
starts: A follows B. The old directory is put back while A follows: A's look listed it and indexed
the deleted page (the looks never asked the remembered deletes), A served it, and, once B closed
and A took over, kept serving it (stale KV). Now a look leaves such a file out of the index, and
the take-over unlinks it.

Real renames of the fan-out directory, a real ``unlink`` of ``.lock``, a second writer."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import Looks, started
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _indexed, _on_disk, _settled
from test_adv_rev188_deletes_away import _served
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly

TAG = 0x3E


def _past_file_clock(probe: Path) -> None:
    """Until a file written now gets a modification time later than the wall clock at this call:
    file times come from a coarse clock (a tick behind ``time_ns``), and a page stored within that
    tick after a delete counts as the page deleted (a documented miss). Bounded."""
    now = time.time_ns()
    deadline = time.monotonic() + 5.0
    while True:
        probe.write_bytes(b"x")
        if probe.stat().st_mtime_ns > now:
            return
        assert time.monotonic() < deadline, "the file clock did not pass the wall clock in 5 s"


@pytest.mark.asyncio
async def test_a_page_deleted_before_the_lock_loss_is_not_indexed_by_the_looks(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    keys = [key_of(i, TAG) for i in range(3)]
    victim = keys[0]
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(DiskTier(cfg, layout, pool)) as a:
        checks = LockChecks(a)
        for key in keys:
            assert await a.write_from(key, memoryview(_bytes_of(key, size)))
        fan = a.files.layout_dir / f"{TAG:02x}"
        os.rename(fan, tmp_path / "away")
        await checks.next()  # retired
        await a.delete(victim)  # remembered: its old file is away
        os.unlink(a.files.layout_dir / ".lock")
        async with started(DiskTier(cfg, layout, pool)) as b:
            looks = Looks(a)
            assert b.read_only is None
            await checks.next()
            assert a.read_only is ReadOnly.LOCKED  # A follows B
            await looks.next()
            # The old directory comes back while A follows.
            if fan.exists():
                os.rmdir(fan)  # the one B made at its start (empty)
            os.rename(tmp_path / "away", fan)
            await looks.next()  # the descriptor of the one B made retired
            await looks.next()  # the old one opened and listed
            assert a.contains(keys[1]), "the look did not list the directory put back"
            assert not a.contains(victim), "a follower indexed a page it deleted while it wrote"
            assert not await _served(a, victim, size), "a follower served a page it deleted while it wrote"
            assert await _served(a, keys[1], size)
        await looks.next()  # B closed: A takes over
        assert a.read_only is None and a.statistics().took_over == 1
        await _settled(tier=a)
        assert not a.contains(victim), "the page deleted before the hand-over was indexed at the take-over"
        assert not await _served(a, victim, size)
        assert not (fan / victim.hex()).exists(), "the page deleted was left on disk outside the index"
        assert await _served(a, keys[2], size)
        assert _indexed(a) == _on_disk(a.files.layout_dir)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_follower_s_delete_stays_deleted_when_the_directory_comes_back(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """A follower's delete (it unlinks nothing: the writer keeps the file) was not remembered: its
    looks indexed the file again once the directory was moved away and put back (stale KV), and
    kept it after the take-over. A page the writer stores after the delete is still indexed."""
    size = layout.page_bytes
    keys = [key_of(i, TAG) for i in range(4)]
    victim, again = keys[0], keys[1]
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(DiskTier(cfg, layout, pool)) as b:
        for key in keys:
            assert await b.write_from(key, memoryview(_bytes_of(key, size)))
        async with started(DiskTier(cfg, layout, pool)) as a:
            looks = Looks(a)
            assert a.read_only is ReadOnly.LOCKED
            await looks.until(lambda: all(a.contains(key) for key in keys))
            await a.delete(victim)
            await a.delete(again)
            assert not a.contains(victim) and not a.contains(again)
            await b.delete(again)
            _past_file_clock(tmp_path / "probe")  # B's next file is newer than A's delete
            assert await b.write_from(again, memoryview(_bytes_of(again, size)))  # B's page, after A's delete
            fan = a.files.layout_dir / f"{TAG:02x}"
            checks = LockChecks(b)
            os.rename(fan, tmp_path / "away")
            await looks.next()  # A retires it
            await checks.next()  # B retires it
            os.rename(tmp_path / "away", fan)
            await looks.next()
            await looks.next()
            assert a.contains(keys[2]), "the look did not list the directory put back"
            assert a.contains(again), "the page the writer stored after the delete was not indexed"
            assert not a.contains(victim), "a follower indexed a page it deleted"
            assert not await _served(a, victim, size), "a follower served a page it deleted"
            await b.aclose()
            await looks.next()  # A takes over
            assert a.read_only is None and a.statistics().took_over == 1
            await _settled(tier=a)
            assert not a.contains(victim)
            assert not (fan / victim.hex()).exists(), "the page deleted was left on disk outside the index"
            assert await _served(a, again, size) and await _served(a, keys[3], size)
            assert _indexed(a) == _on_disk(a.files.layout_dir)
    assert_clean(pool)
