"""Review 199: a take-over that left a key to this tier's own write in flight since before the lock
was lost (review 198, c4ebb16: ``_listed_under_write``) unlinked the key's name when that write
ended unstored (a real ENOSPC on a full loop ext4): the name still held the page the other writer
had stored (the write never published), a valid page the take-over's scan had found, so that page
was lost. It is indexed now, unless the caller deleted the key meanwhile (then unlinked, not served).

The write is held in the kernel by a real ``fsfreeze`` across the loss, the other writer's close
and the take-over look (which only reads); the file system is full (filled for real) before it, so
the write answers ENOSPC once thawed. Root only."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from disk_helpers import assert_clean, key_of
from fs_helpers import loop_ext4
from held_write import (
    fill,
    full_fs_config,
    needs_fsfreeze,
    second_writer,
    take_over_under_write,
    write_held_over_loss,
    writer,
)
from held_write import fill_rest as _fill_rest  # noqa: F401 (test_adv_rev202_second_lock_loss imports it from here)
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier

TAG = 0x5B


@asynccontextmanager
async def _take_over_during_failed_write(mount: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
                                         delete_after: bool) -> AsyncIterator[tuple[DiskTier, Path, bool]]:
    """A stores nothing of ``victim``; B (a second writer on A's unlinked lock) stores it; the file
    system is filled; A's write of the key is held by a freeze while A loses the lock, B closes and
    A's look takes the directory over; thawed, the write fails ENOSPC. ``delete_after``: A's caller
    deletes the key after the take-over, before the write ends. Yields A (closed at exit), the
    key's file and what the write answered."""
    size = layout.page_bytes
    victim = key_of(0, TAG)
    cfg = full_fs_config(mount, backend, size, 64)
    async with writer(cfg, layout, pool, TAG) as (a, checks, fan):
        async with second_writer(a, cfg, layout, pool) as b:
            assert await b.write_from(victim, memoryview(_bytes_of(victim, size)))
            fill(mount)
            async with write_held_over_loss(mount, a, checks, victim) as store:
                await take_over_under_write(a, b, victim, listed=True)
                if delete_after:
                    await a.delete(victim)
        stored = await asyncio.wait_for(store, 10.0)
        await _settled(a)
        yield a, fan / victim.hex(), stored


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_take_over_keeps_the_other_writer_s_page_when_the_write_left_to_it_fails(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    needs_fsfreeze()
    size = layout.page_bytes
    with loop_ext4(tmp_path, 24) as mount:
        async with _take_over_during_failed_write(mount, backend, layout, pool,
                                                  delete_after=False) as (a, path, stored):
            assert not stored, "the write was to fail (ENOSPC)"
            assert path.exists(), "the other writer's page, found by the take-over, was unlinked at the write's end"
            assert a.contains(key_of(0, TAG)), "the other writer's page was not indexed"
            assert await _served(a, key_of(0, TAG), size)
    assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_take_over_does_not_index_a_page_deleted_while_the_write_left_to_it_fails(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """The same, the key deleted by A's caller after the take-over: the page under its name is the
    one deleted (unlinked, never served)."""
    needs_fsfreeze()
    size = layout.page_bytes
    with loop_ext4(tmp_path, 24) as mount:
        async with _take_over_during_failed_write(mount, backend, layout, pool,
                                                  delete_after=True) as (a, path, stored):
            assert not stored
            assert not a.contains(key_of(0, TAG)), "a page deleted by the caller was indexed"
            assert not await _served(a, key_of(0, TAG), size), "a page deleted by the caller was served"
            assert not path.exists(), "a page deleted by the caller stayed on disk"
    assert_clean(pool)
