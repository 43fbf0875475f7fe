"""A start over a lowered budget unlinks the files beyond it on one thread, not a loop task each.

Review 181 noticed the start's trim (and the trim when the file system turns writable again) made
one unlink task per evicted file: 20,000 files over a budget of 100 held the loop 0.73 s on the
2-vCPU VM (28 ms now). Here the tier restarts with a budget of a tenth of its files: the oldest
leave the index and the disk, through one unlink job; the newest stay, served; a new write of an
evicted key waits for that job and is stored."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
from disk_helpers import config, fill, key_of, page_files, payload, reserve, seed_payload

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.pagefile import HEADER_BYTES
from aiokv.storage.tierbase import BULK_UNLINK_KEYS

FILES = 400
KEPT = 40


@pytest.mark.asyncio
async def test_a_start_over_a_lowered_budget_unlinks_the_rest_in_one_job(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    assert FILES - KEPT >= BULK_UNLINK_KEYS
    per_file = layout.page_bytes + HEADER_BYTES
    writer = DiskTier(config(disk_dir, backend, FILES * per_file), layout, pool)
    await writer.start()
    try:
        for i in range(FILES):
            h = fill(pool, key_of(i, i % 256), i)
            try:
                assert await writer.write(key_of(i, i % 256), h)
            finally:
                pool.table.release(h)
                pool.table.discard(key_of(i, i % 256))
            if i == FILES - KEPT - 1:
                await asyncio.sleep(0.02)  # the kept files are newer (the start orders by mtime)
    finally:
        await writer.aclose()
    # The newest KEPT files a distinct mtime from the rest, whatever the file system's granularity.
    for i in range(FILES - KEPT, FILES):
        path = writer.files.layout_dir / key_of(i, i % 256).hex()[:2] / key_of(i, i % 256).hex()
        os.utime(path, ns=(2**62, 2**62 + i))
    tier = DiskTier(config(disk_dir, backend, KEPT * per_file), layout, pool)
    await tier.start()
    try:
        jobs = set(tier._moving.values())
        assert len(jobs) <= 1, f"{len(jobs)} unlink jobs for {FILES - KEPT} evicted files"
        evicted = key_of(0, 0)
        h = fill(pool, evicted, 7)
        try:
            assert await tier.write(evicted, h)  # waits for the job's unlink of its old file
        finally:
            pool.table.release(h)
            pool.table.discard(evicted)
        while tier._moving:
            await asyncio.wait(set(tier._moving.values()))
        stats = tier.statistics()
        assert stats.pages == KEPT and not any(stats.errors.values()), stats
        on_disk = {bytes.fromhex(p.name) for p in page_files(disk_dir)}
        assert on_disk == set(tier._index), "files on disk and the index differ"
        assert evicted in on_disk
        for i in range(FILES - KEPT + 1, FILES):  # the newest (one made room for the new write)
            into = reserve(pool, key_of(9999, 99))
            try:
                assert await tier.read(key_of(i, i % 256), into)
                assert torch.equal(payload(pool, into), seed_payload(pool, i, 98))
            finally:
                pool.table.abort(into)
    finally:
        await tier.aclose()
