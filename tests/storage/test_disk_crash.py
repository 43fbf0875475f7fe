"""SIGKILL a process that streams page writes, at random moments; restart and verify everything served."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch
from disk_helpers import (
    BACKENDS,
    assert_clean,
    config,
    crash_child,
    fill,
    key_of,
    payload,
    reserve,
    seed_of,
    sigkilled_child,
    temp_files,
)

from aiokv.keys import PageKey
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskTier

ROUNDS = 21


def _round(directory: Path, backend: str, capacity_files: int, acks: int) -> tuple[set[PageKey], int]:
    acked: set[PageKey] = set()
    # Killed with writes in flight: up to 4 temp files left behind.
    with sigkilled_child(crash_child, str(directory), backend, capacity_files) as conn:
        kind, removed = conn.recv()
        assert kind == "ready"
        while len(acked) < acks:
            kind, key = conn.recv()
            acked.add(key)
    return acked, removed


async def _verify(directory: Path, layout: KVLayout, pool: PagePool, must_have: set[PageKey],
                  torn_ok: bool = False) -> tuple[int, int]:
    """Restart on ``directory``: every page served has the bytes the child wrote for its key.
    ``torn_ok``: a full tier overwrites recycled files under their old names, so a kill mid-write
    leaves a torn file there: its read must fail verification (counted corrupt, file removed).
    Returns (temporary files removed at start, files refused on read)."""
    async with DiskTier(config(directory, BACKENDS[0]), layout, pool) as tier:
        assert temp_files(directory) == []
        keys = list(tier._index)
        assert must_have <= set(keys)
        refused = 0
        for key in keys:
            into = reserve(pool, key)
            ok = await tier.read(key, into)
            got = payload(pool, into)
            pool.table.abort(into)
            if not ok:
                assert torn_ok, "a served page failed verification"
                refused += 1
                assert tier.statistics().corrupt == refused  # refused by a checksum, not a fault
                assert not tier.contains(key)
                continue
            scratch = fill(pool, key, seed_of(key))  # the bytes the child wrote for this key
            assert torch.equal(got, payload(pool, scratch))
            pool.table.release(scratch)
            pool.table.discard(key)
        stats = tier.statistics()
        assert stats.corrupt == refused
        return stats.temp_files_removed, refused


@pytest.mark.slow
@pytest.mark.asyncio
async def test_sigkill_during_writes_never_serves_a_bad_page(disk_dir: Path, layout: KVLayout,
                                                             pool: PagePool) -> None:
    rng = random.Random(1234)
    acked_all: set[PageKey] = set()
    removed_total = 0
    for r in range(ROUNDS):
        backend = BACKENDS[r % len(BACKENDS)].value
        if r % 2:
            # A full tier of 24 files: writes recycle evicted files (acknowledged pages get evicted).
            await asyncio.to_thread(_round, disk_dir / "full", backend, 24, rng.randint(0, 40))
            removed_total += (await _verify(disk_dir / "full", layout, pool, set(), torn_ok=True))[0]
            continue
        acked, _ = await asyncio.to_thread(_round, disk_dir / "open", backend, 1 << 20, rng.randint(0, 12))
        acked_all |= acked
        removed_total += (await _verify(disk_dir / "open", layout, pool, acked_all))[0]
    assert len(acked_all) > ROUNDS // 2
    # Kills land with writes in flight: some rounds must have left temp files for the restart to clean.
    assert removed_total > 0
    assert_clean(pool)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_sigkill_mid_overwrite_leaves_a_torn_file_that_is_refused(disk_dir: Path, layout: KVLayout,
                                                                      pool: PagePool) -> None:
    # A recycled file is written under its old (evicted) name, then renamed: SIGKILL lands in the
    # middle of such overwrites (a tier of 2 files, every write recycles). The restart indexes a
    # torn file under the old name; its read must fail the header's key check or the payload
    # checksum (counted corrupt, file removed), never serve its bytes. Kills land mid-overwrite in
    # a few rounds in a hundred, fewer on a loaded machine, so the torn state is also built below
    # from real page files, byte for byte what such a kill leaves.
    rng = random.Random(99)
    for r in range(24):
        backend = BACKENDS[r % len(BACKENDS)].value
        await asyncio.to_thread(_round, disk_dir / "killed", backend, 2, rng.randint(2, 30))
        await _verify(disk_dir / "killed", layout, pool, set(), torn_ok=True)  # nothing wrong served
    # The torn states: key b's header and all or part of its payload written over key a's file,
    # which still has a's name (the kill came before the rename).
    torn = disk_dir / "torn"
    async with DiskTier(config(torn, BACKENDS[0]), layout, pool) as tier:
        for i in range(4):
            h = fill(pool, key_of(i), i)
            assert await tier.write(key_of(i), h)
            pool.table.release(h)
            pool.table.discard(key_of(i))
        paths = {i: Path(tier.files.path(key_of(i))) for i in range(4)}
    new_bytes = {i: await asyncio.to_thread(paths[i].read_bytes) for i in (1, 3)}
    for victim, source, keep in ((0, 1, None), (2, 3, len(new_bytes[3]) // 2)):
        data = new_bytes[source] if keep is None else new_bytes[source][:keep]
        with open(paths[victim], "r+b") as f:  # noqa: ASYNC230 (a few KiB, set-up)
            f.write(data)
    async with DiskTier(config(torn, BACKENDS[0]), layout, pool) as tier:
        for victim in (0, 2):
            into = reserve(pool, key_of(victim))
            assert not await tier.read(key_of(victim), into), "a torn file was served"
            pool.table.abort(into)
            assert not tier.contains(key_of(victim))
        for kept in (1, 3):  # the source files themselves are intact
            into = reserve(pool, key_of(kept))
            assert await tier.read(key_of(kept), into)
            scratch = fill(pool, key_of(kept, 1), kept)
            assert torch.equal(payload(pool, into), payload(pool, scratch))
            pool.table.abort(into)
            pool.table.release(scratch)
            pool.table.discard(key_of(kept, 1))
        assert tier.statistics().corrupt == 2
    assert_clean(pool)
