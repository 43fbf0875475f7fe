"""A key that is a ``bytes`` subclass (the edge checks accept one, #14's fast path included) never
names a file by its own methods: its ``hex`` may say ``../../../victim``. Before the fix a read of
such a key opened that file outside the cache, refused it (not a page file of ours) and deleted it;
a write or delete could name it too. Every backend."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from disk_helpers import assert_clean, config, fill, key_of, page_files, payload, reserve

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier

PRECIOUS = b"precious" * 1000


class _LyingKey(bytes):
    """16 bytes, as a key must be; its ``hex`` names a file outside the cache directory."""

    def hex(self, *args: object) -> str:
        return "../../../victim"


def _real(path: str) -> str:
    return os.path.realpath(path)


def _is_file(path: str) -> bool:
    return os.path.isfile(path)


@pytest.mark.asyncio
async def test_a_bytes_subclass_key_never_names_a_file_outside_the_cache(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    disk_dir = tmp_path / "disk"
    victim = tmp_path / "victim"  # where "<fan-out dir>/../../../victim" lands
    victim.write_bytes(PRECIOUS)
    async with DiskTier(config(disk_dir, backend), layout, pool) as tier:
        assert _real(os.path.join(tier.files.layout_dir, "00", "../../../victim")) == _real(str(victim))
        h = fill(pool, key_of(1), 1)
        want = payload(pool, h)
        assert await tier.write(key_of(1), h)
        pool.table.release(h)
        # A read by the lying key reads key 1's own file (the key's bytes are key 1's).
        into = reserve(pool, key_of(100))
        assert await tier.read(_LyingKey(key_of(1)), into)
        assert torch.equal(payload(pool, into), want)
        pool.table.abort(into)
        # A write by a lying key stores its page under its bytes' name, inside the cache.
        h = fill(pool, key_of(2), 2)
        want2 = payload(pool, h)
        assert await tier.write(_LyingKey(key_of(2)), h)
        pool.table.release(h)
        pool.table.evict(pool.num_pages)
        assert _is_file(tier.files.path(key_of(2)))
        into = reserve(pool, key_of(101))
        assert await tier.read(key_of(2), into)
        assert torch.equal(payload(pool, into), want2)
        pool.table.abort(into)
        # A delete by a lying key removes its bytes' file only.
        await tier.delete(_LyingKey(key_of(1)))
        assert not tier.contains(key_of(1))
    assert victim.read_bytes() == PRECIOUS  # never read as a page, never removed, never written
    names = {p.name for p in page_files(disk_dir)}
    assert names == {key_of(2).hex()}
    assert sorted(os.listdir(tmp_path)) == ["disk", "victim"]
    assert_clean(pool)


class _EqualsAll(bytes):
    """16 bytes; equal to (and never unequal to) anything, hashed as its bytes."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    def __hash__(self) -> int:
        return bytes.__hash__(self)


@pytest.mark.asyncio
async def test_a_key_that_equals_everything_never_passes_another_keys_file_off(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    # The header check compares the file's key with the caller's: a subclass's own __ne__ ran
    # there, so another key's file renamed over this key's name was served as this key's page.
    # The tier now works on the key's bytes as exact bytes.
    disk_dir = tmp_path / "disk"
    async with DiskTier(config(disk_dir, backend), layout, pool) as tier:
        for i in (1, 2):
            h = fill(pool, key_of(i), i)
            assert await tier.write(key_of(i), h)
            pool.table.release(h)
        pool.table.evict(pool.num_pages)
        os.replace(tier.files.path(key_of(2)), tier.files.path(key_of(1)))  # key 2's file under key 1's name
        into = reserve(pool, key_of(100))
        assert not await tier.read(_EqualsAll(key_of(1)), into)  # a counted miss, not key 2's bytes
        pool.table.abort(into)
        assert tier.statistics().corrupt == 1
    assert_clean(pool)
