"""A recycling victim whose open answers EACCES (someone made it mode 000), for real.

A full tier recycles its least recently used page file: opened, checked, overwritten, renamed.
A victim made 0000 under the tier (``chmod 000``) answered the open with EACCES, and the write
failed (counted ``EPERM``): the page was not stored. Now a victim the open could not take (a
fault other than EROFS) is counted, unlinked (its key is out of the index already; the directory
is ours, so its mode does not keep it) and the page goes into a new file, as for a victim gone or
not ours. The tier runs in a process without ``CAP_DAC_OVERRIDE`` (permission bits bind it as any
user, root included), every backend.
"""

from __future__ import annotations

import asyncio
import os
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from disk_helpers import config, key_of, small_layout
from follow_helpers import child, drop_dac_capabilities, read_back, receive, started, store_page

from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.pagefile import file_bytes

TAG = 0x3A
PAGES = 3


def _recycling_child(directory: str, backend: str, conn: Connection) -> None:
    """Fills a tier of ``PAGES`` files, makes the least recently used one 0000, writes one more
    page and sends ``(stored, read back, victim still there, errors by kind, pages, recycled)``."""
    drop_dac_capabilities()  # first: every thread started later inherits it

    async def main() -> None:
        layout = small_layout()
        pool = PagePool.create(layout, 16 * layout.page_bytes, register_cuda=False, workers=1)
        try:
            pool.wait_ready_blocking()
            cfg = config(Path(directory), DiskBackend(backend), PAGES * file_bytes(layout))
            async with started(DiskTier(cfg, layout, pool)) as tier:
                for i in range(PAGES):
                    assert await store_page(tier, pool, i, TAG)
                victim = tier.files.layout_dir / f"{TAG:02x}" / bytes.hex(key_of(0, TAG))
                os.chmod(victim, 0)
                stored = await store_page(tier, pool, PAGES, TAG)
                back = await read_back(tier, pool, PAGES, TAG)
                others = [await read_back(tier, pool, i, TAG) for i in range(1, PAGES)]
                while pending := {task for task in tier._jobs if not task.done()}:
                    await asyncio.wait(pending)
                stats = tier.statistics()
                conn.send((stored, back, others, victim.exists(), {k.value: n for k, n in stats.errors.items()},
                           stats.pages))
        finally:
            pool.close()

    asyncio.run(main())


@pytest.mark.asyncio
async def test_a_victim_made_mode_000_is_replaced_by_a_new_file(tmp_path: Path, backend: DiskBackend) -> None:
    with child(_recycling_child, str(tmp_path / "disk"), backend.value) as (conn, _proc):
        stored, back, others, victim_there, errors, pages = await receive(conn)
    assert stored, f"the write failed on the victim's EACCES: {errors}"
    assert back and others == [True] * (PAGES - 1)
    assert not victim_there, "the victim's file (out of the index) was left on disk"
    assert errors["eperm"] == 1 and sum(errors.values()) == 1, errors
    assert pages == PAGES
