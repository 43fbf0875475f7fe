"""Review 193: a writer that lost its lock and took the directory over again does not apply its old
remembered deletes to what the other writer stored meanwhile, and still applies them to the old files.

Writer A deletes a key whose fan-out directory is away (remembered: every file of it is the page
deleted until A stores it again). ``.lock`` is removed; writer B starts and stores the key again
(a page to serve); B closes and A takes over. Later the directory is moved away and put back: A's
listing found the key's file, B's page, and unlinked it as the page A deleted (a lost page),
though B's store came after the delete. Now a tier that loses its lock keeps its deletes not yet
followed by a store of its own as "a file no newer than the delete is the page deleted" (the other
writer's stores are unknown to it): B's page stays, and the old directory's deleted pages are still
unlinked when it comes back.

Real renames of the fan-out directory, a real ``unlink`` of ``.lock``."""

from __future__ import annotations

import os
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

TAG = 0x3C


@pytest.mark.asyncio
async def test_a_page_the_other_writer_stored_after_a_delete_survives_the_take_over(
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
        await a.delete(keys[1])  # the same, never stored again
        assert victim in a._deleted_away and keys[1] in a._deleted_away
        os.unlink(a.files.layout_dir / ".lock")
        async with started(DiskTier(cfg, layout, pool)) as b:
            looks = Looks(a)
            assert b.read_only is None
            await checks.next()
            assert a.read_only is ReadOnly.LOCKED  # A follows B
            assert await b.write_from(victim, memoryview(_bytes_of(victim, size)))  # B's page, after the delete
        await looks.next()  # B closed: A takes over
        assert a.read_only is None and a.statistics().took_over == 1
        assert a.contains(victim)
        os.rename(fan, tmp_path / "moved")  # B's page goes away with its directory
        await checks.next()  # retired
        os.rename(tmp_path / "moved", fan)  # and comes back
        await checks.next()  # opened and listed
        await _settled(tier=a)
        assert (fan / victim.hex()).exists(), "the page stored after the delete was unlinked"
        assert a.contains(victim)
        assert await _served(a, victim, size)
        assert _indexed(a) == _on_disk(a.files.layout_dir)
        # The old directory, with both deleted pages (older than their deletes), comes back: still
        # deleted after the hand-over.
        os.rename(fan, tmp_path / "moved")
        await checks.next()  # retired
        os.rename(tmp_path / "away", fan)
        await checks.next()  # opened and listed
        await _settled(tier=a)
        for key in keys[:2]:
            assert not a.contains(key), "a page deleted before the hand-over was indexed from its old directory"
            assert not (fan / key.hex()).exists()
        assert await _served(a, keys[2], size)
        assert _indexed(a) == _on_disk(a.files.layout_dir)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_page_the_other_writer_stored_again_survives_a_delete_this_tier_stored_after(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """A deletes the key while its directory is away and stores it again (only that file is then
    the key's page); B, writing meanwhile, deletes and stores it once more. Before: A, back as
    the writer, unlinked B's file at the directory's listing (not the file A stored)."""
    size = layout.page_bytes
    keys = [key_of(i, TAG) for i in range(2)]
    victim = keys[0]
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(DiskTier(cfg, layout, pool)) as a:
        checks = LockChecks(a)
        for key in keys:
            assert await a.write_from(key, memoryview(_bytes_of(key, size)))
        fan = a.files.layout_dir / f"{TAG:02x}"
        os.rename(fan, tmp_path / "away")
        await checks.next()  # retired
        await a.delete(victim)  # remembered
        assert await a.write_from(victim, memoryview(_bytes_of(victim, size)))  # into the one made again
        os.unlink(a.files.layout_dir / ".lock")
        async with started(DiskTier(cfg, layout, pool)) as b:
            looks = Looks(a)
            await checks.next()
            assert a.read_only is ReadOnly.LOCKED
            await b.delete(victim)
            assert await b.write_from(victim, memoryview(_bytes_of(victim, size)))  # B's own file now
        await looks.next()  # A takes over
        assert a.read_only is None and a.contains(victim)
        os.rename(fan, tmp_path / "moved")
        await checks.next()  # retired
        os.rename(tmp_path / "moved", fan)
        await checks.next()  # opened and listed
        await _settled(tier=a)
        assert (fan / victim.hex()).exists(), "the page the other writer stored was unlinked"
        assert await _served(a, victim, size)
        # The old directory (the page deleted, older than the delete) still does not bring it back.
        os.rename(fan, tmp_path / "moved")
        await checks.next()
        os.rename(tmp_path / "away", fan)
        await checks.next()
        await _settled(tier=a)
        assert not a.contains(victim) and not (fan / victim.hex()).exists()
        assert await _served(a, keys[1], size)
        assert _indexed(a) == _on_disk(a.files.layout_dir)
    assert_clean(pool)
