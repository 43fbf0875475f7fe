"""A caller's region larger than the free fixed-buffer slots allow at 8 MiB a piece is registered in
larger pieces, not refused whole.

The table keeps 4096 slots for callers' regions: cut at ~8 MiB, a region beyond ~32 GiB (an
engine's whole CPU KV buffer) asked for more slots than exist and got nothing registered (every
page through plain buffers, counted ``memory_unregistered``). Here the table keeps 3 slots and the
region is 40 MiB: the same arithmetic, pinned for real.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, backends
from aiokv.storage.backends import UringPageIO

SLOTS = 3
REGION_BYTES = 40 << 20


@pytest.mark.asyncio
async def test_a_region_beyond_the_slots_at_8_mib_is_registered_in_larger_pieces(
    disk_dir: Path, layout: KVLayout, pool: PagePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backends, "EXTERNAL_REGION_SLOTS", SLOTS)
    region = mmap.mmap(-1, REGION_BYTES)
    whole = memoryview(region)
    try:
        async with DiskTier(config(disk_dir, DiskBackend.AUTO), layout, pool) as tier:
            io = tier.backend
            if not isinstance(io, UringPageIO):
                pytest.skip("io_uring refused here: nothing is registered")
            await tier.wait_registered()
            if io.kind is not DiskBackend.URING_FIXED:
                pytest.skip("fixed buffers cannot be registered here")
            await tier.register_memory(whole)
            assert tier.statistics().memory_unregistered == 0
            pieces = sorted((r.address, r.length) for r in io._ext_regions)
            assert 1 <= len(pieces) <= SLOTS
            # Together they cover the region, overlapping by at least a page: every page-sized
            # buffer lies whole in one of them.
            base = memoryview_address(whole)
            assert pieces[0][0] == base and pieces[-1][0] + pieces[-1][1] == base + REGION_BYTES
            for (a, n), (b, _) in itertools.pairwise(pieces):
                assert b + layout.page_bytes <= a + n
            # A page at the far end round trips bit for bit.
            pb = layout.page_bytes
            last = REGION_BYTES // pb - 1
            sent = bytes((i * 37 + 11) & 0xFF for i in range(pb))
            whole[last * pb : (last + 1) * pb] = sent
            assert await tier.write_from(key_of(1), whole[last * pb : (last + 1) * pb])
            whole[0:pb] = b"\0" * pb
            assert await tier.read_into(key_of(1), whole[0:pb])
            assert bytes(whole[0:pb]) == sent
            assert not {k: v for k, v in tier.statistics().errors.items() if v}
        assert_clean(pool)
    finally:
        whole.release()
        region.close()


def memoryview_address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))
