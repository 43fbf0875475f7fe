"""Planted files under a page's name, read by the cold chain (OPENAT, header and page, FIXED_FD_INSTALL,
CLOSE, then the installed fd's fstat) on a real loop-mounted ext4: another key's valid page
file copied, hard-linked or renamed there, a file of the right key with another page's bytes after
its header, an oversized file whose first bytes are another key's page, a zero-length file, a
header alone, a directory, a hard link of another owner's valid file. Each read is a counted miss
that leaves the target page's bytes as they were (never the planted bytes), and the tier's next
reads in the same I/O slot are right."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from disk_helpers import assert_clean, config, is_root, key_of, payload, reserve, stored_page
from fs_helpers import loop_ext4

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind
from aiokv.storage.backends import UringPageIO
from aiokv.storage.pagefile import HEADER_BYTES

URING = [DiskBackend.URING_FIXED, DiskBackend.URING]


@pytest_asyncio.fixture(params=URING, ids=[b.value for b in URING])
async def cold_tier(request: pytest.FixtureRequest, tmp_path: Path, layout: KVLayout,
                    pool: PagePool) -> AsyncIterator[DiskTier]:
    with loop_ext4(tmp_path, 16) as mount:
        tier = DiskTier(config(mount / "disk", request.param, queue_depth=1, min_free_bytes=0), layout, pool)
        await tier.start()
        io = tier.backend
        assert isinstance(io, UringPageIO) and io.direct and io.chain_reads
        io._cached.available = False  # every read is the chain from its open
        try:
            yield tier
        finally:
            await tier.aclose()


def _exists(path: str) -> bool:
    return os.path.exists(path)



def _copy(src: str, dst: str) -> None:
    os.unlink(dst)
    shutil.copyfile(src, dst)


def _hardlink(src: str, dst: str) -> None:
    os.unlink(dst)
    os.link(src, dst)


def _rename(src: str, dst: str) -> None:
    os.rename(src, dst)


def _body_of(src: str, dst: str) -> None:
    # The right key's header (its checksum), another page's payload after it.
    with open(src, "rb") as f:
        f.seek(HEADER_BYTES)
        body = f.read()
    with open(dst, "r+b") as f:
        f.seek(HEADER_BYTES)
        f.write(body)


def _oversized(src: str, dst: str) -> None:
    os.unlink(dst)
    with open(src, "rb") as f, open(dst, "wb") as g:
        g.write(f.read() + os.urandom(3 * 4096))


def _empty(src: str, dst: str) -> None:
    del src
    os.truncate(dst, 0)


def _header_only(src: str, dst: str) -> None:
    del src
    os.truncate(dst, HEADER_BYTES)


def _directory(src: str, dst: str) -> None:
    del src
    os.unlink(dst)
    os.mkdir(dst, 0o700)


PLANTS: dict[str, tuple[Callable[[str, str], None], str]] = {
    # name: (plant(other's file, target's name), how it must be refused)
    "copy_of_other_key": (_copy, "corrupt"),
    "hardlink_of_other_key": (_hardlink, "corrupt"),
    "rename_of_other_key": (_rename, "corrupt"),
    "other_body_right_header": (_body_of, "corrupt"),
    "oversized_other_key": (_oversized, "corrupt"),
    "empty": (_empty, "corrupt"),
    "header_only": (_header_only, "corrupt"),
    "directory": (_directory, "unsafe"),
}


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("plant", list(PLANTS))
async def test_a_planted_file_is_a_counted_miss_never_its_bytes(cold_tier: DiskTier, pool: PagePool,
                                                                plant: str) -> None:
    tier = cold_tier
    await stored_page(tier, pool, 1)
    other = await stored_page(tier, pool, 2)
    good = await stored_page(tier, pool, 3)
    target, source = tier.files.path(key_of(1)), tier.files.path(key_of(2))
    how, kind = PLANTS[plant]
    how(source, target)
    into = reserve(pool, key_of(1))
    assert not await tier.read(key_of(1), into), f"a planted file ({plant}) was served"
    pool.table.abort(into)  # a refused read's bytes are scratch: the page is never committed
    stats = tier.statistics()
    assert stats.misses == 1
    if kind == "corrupt":
        assert stats.corrupt == 1, stats
    else:
        assert stats.errors[ErrorKind.UNSAFE] == 1, stats
    assert not tier.contains(key_of(1))
    # Key 1 is gone for good: no later read serves it, and the next chains in the slot read right.
    into = reserve(pool, key_of(1))
    assert not await tier.read(key_of(1), into)
    pool.table.abort(into)
    for i, data in ((3, good), (2, other)):
        into = reserve(pool, key_of(i))
        ok = await tier.read(key_of(i), into)
        if plant == "rename_of_other_key" and i == 2:
            assert not ok  # its file was moved away: a plain miss
        else:
            assert ok and torch.equal(payload(pool, into), data)
        pool.table.abort(into)
    assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_hard_link_of_another_owners_valid_file_is_refused(cold_tier: DiskTier, pool: PagePool) -> None:
    if not is_root():
        pytest.skip("giving a file away needs root")
    tier = cold_tier
    await stored_page(tier, pool, 1)
    good = await stored_page(tier, pool, 2)
    target = tier.files.path(key_of(1))
    forged = os.path.join(os.path.dirname(os.path.dirname(target)), "forged")
    shutil.copyfile(target, forged)  # key 1's own valid bytes, but another owner's file
    os.chown(forged, 12345, 12345)
    _hardlink(forged, target)
    into = reserve(pool, key_of(1))
    assert not await tier.read(key_of(1), into)
    pool.table.abort(into)
    stats = tier.statistics()
    assert (stats.misses, stats.errors[ErrorKind.UNSAFE]) == (1, 1)
    assert _exists(forged)  # the other owner's file is left alone (only our name removed)
    into = reserve(pool, key_of(2))
    assert await tier.read(key_of(2), into)
    assert torch.equal(payload(pool, into), good)
    pool.table.abort(into)
    assert_clean(pool)
