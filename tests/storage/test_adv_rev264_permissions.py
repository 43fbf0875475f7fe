"""Review 264: permission faults under a running tier, for real: the tier in a process without
``CAP_DAC_OVERRIDE`` (permission bits bind it as any user, root included), every backend. While it
runs, a fan-out directory is made 0500 (no file can be made or removed there), a page file 000 and
back to 0600, and a key of the read-only fan-out directory is deleted (its unlink answers EACCES);
the process then closes and a tier with all capabilities starts over the same directory.

What must hold, each page served checked bit for bit against the bytes written for its key: a
write into the read-only directory is refused, counted; pages there still read; the 000 file is a
counted miss, never other bytes, and once readable again is served or a miss; the deleted key is
never served again — not by the running tier, and not after the restart (its failed unlink is in the
pending-delete record, which the next start honours), while every other page still is."""

from __future__ import annotations

import asyncio
import os
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
from disk_helpers import assert_clean, config, is_root, key_of, small_layout
from follow_helpers import child, drop_dac_capabilities, read_back, receive, started, store_page

from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier

A, B, C = 0x10, 0x11, 0x12
STORED = [(0, A), (1, A), (0, B), (0, C)]


def _child(directory: str, backend: str, conn: Connection) -> None:
    drop_dac_capabilities()  # first: every thread started later inherits it

    async def main() -> dict[str, Any]:
        layout = small_layout()
        pool = PagePool.create(layout, 16 * layout.page_bytes, register_cuda=False, workers=1)
        out: dict[str, Any] = {}
        try:
            pool.wait_ready_blocking()
            cfg = config(Path(directory), DiskBackend(backend), follow_interval_s=3600.0)
            async with started(DiskTier(cfg, layout, pool)) as tier:
                for i, tag in STORED:
                    assert await store_page(tier, pool, i, tag)
                fan_a = tier.files.layout_dir / f"{A:02x}"
                page_b = tier.files.layout_dir / f"{B:02x}" / key_of(0, B).hex()
                os.chmod(fan_a, 0o500)
                out["write_into_0500"] = await store_page(tier, pool, 2, A)
                out["read_in_0500"] = await read_back(tier, pool, 0, A)
                os.chmod(page_b, 0)
                out["read_000"] = await read_back(tier, pool, 0, B)
                os.chmod(page_b, 0o600)
                out["read_000_restored"] = await read_back(tier, pool, 0, B)
                await tier.delete(key_of(1, A))
                out["deleted_contains"] = tier.contains(key_of(1, A))
                out["deleted_read"] = await read_back(tier, pool, 1, A)
                out["deleted_file_left"] = (fan_a / key_of(1, A).hex()).exists()
                out["others"] = [await read_back(tier, pool, 0, C), await read_back(tier, pool, 0, A)]
                out["errors"] = {k.value: n for k, n in tier.statistics().errors.items()}
                # Closed with the fan-out directory still 0500: the close's retry of the unlink fails too.
            return out
        finally:
            pool.close()

    conn.send(asyncio.run(main()))


@pytest.mark.root
@pytest.mark.asyncio
async def test_permission_faults_mid_run_serve_only_right_bytes_and_a_failed_delete_stays_deleted(
        tmp_path: Path, backend: DiskBackend, pool: PagePool) -> None:
    if not is_root():
        pytest.skip("dropping capabilities to have permission bits bind root")
    directory = tmp_path / "disk"
    with child(_child, str(directory), backend.value) as (conn, _proc):
        out = await receive(conn)
    assert not out["write_into_0500"], "a write into a directory we may not write reported stored"
    assert out["read_in_0500"], "a page of a read-only directory was not served"
    assert not out["read_000"], "a mode-000 file was served"
    assert not out["deleted_contains"] and not out["deleted_read"], "a deleted page was served"
    assert out["deleted_file_left"], "the unlink in a 0500 directory should have failed (is DAC dropped?)"
    assert out["others"] == [True, True]
    assert out["errors"]["eperm"] >= 2, out["errors"]  # the create and the 000 open, at least
    fan_a = next(directory.glob(f"*/{A:02x}"))
    os.chmod(fan_a, 0o700)
    async with started(DiskTier(config(directory, backend, follow_interval_s=3600.0), pool.layout, pool)) as tier:
        assert not tier.contains(key_of(1, A)) and not await read_back(tier, pool, 1, A), (
            "a page deleted while its unlink failed was served after the restart")
        assert await read_back(tier, pool, 0, A) and await read_back(tier, pool, 0, C)
        assert not tier.contains(key_of(2, A))
        served_b = await read_back(tier, pool, 0, B)
        assert served_b or not out["read_000_restored"]
    assert not (fan_a / key_of(1, A).hex()).exists(), "the deleted page's file was left after the restart"
    assert_clean(pool)
