"""A directory planted under a page file's name (empty, or with something in it) is what is not
ours: its read is refused (``disk_unsafe``), and what fails on it afterwards — the unlink of the
refused name (unlinkat answers EISDIR) and every later write of that key (the rename onto it
answers EISDIR) — is counted ``disk_unsafe`` too, never ``disk_other`` (a bug's kind, logged with
"unlink failed" at the first). The directory is left alone (nothing inside it is touched) and no
write ever lands in it. Found by helper-138: before, the read counted unsafe, and the unlink and
each later write of the key other."""

from __future__ import annotations

import asyncio
import os
import stat

import pytest
from disk_helpers import assert_clean, key_of, read_page, stored_page, write_page

from aiokv.pool import PagePool
from aiokv.storage import DiskTier, ErrorKind


async def _settled(tier: DiskTier) -> None:
    """Until the tier's unlinks in flight have ended (bounded: fails rather than hangs)."""
    for _ in range(1000):
        if not tier._moving:
            return
        await asyncio.wait(set(tier._moving.values()), timeout=0.01)
    raise AssertionError("unlinks still in flight")


@pytest.mark.asyncio
@pytest.mark.parametrize("inside", [False, True], ids=["empty", "not_empty"])
async def test_a_planted_directory_is_counted_unsafe_at_every_step(tier: DiskTier, pool: PagePool,
                                                                   inside: bool) -> None:
    await stored_page(tier, pool, 0)
    path = tier.files.path(key_of(0))
    os.unlink(path)
    os.mkdir(path, 0o700)
    if inside:
        fd = os.open(os.path.join(path, "theirs"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
    assert await read_page(tier, pool, 0) is None
    await _settled(tier)
    for _ in range(2):
        ok, _ = await write_page(tier, pool, 0)
        assert not ok
        await _settled(tier)
    stats = tier.statistics()
    assert stats.errors[ErrorKind.OTHER] == 0, stats.errors
    assert stats.errors[ErrorKind.UNSAFE] >= 3, stats.errors  # the read, then each write at least
    assert stat.S_ISDIR(os.lstat(path).st_mode)
    assert sorted(os.listdir(path)) == (["theirs"] if inside else [])
    assert not tier.contains(key_of(0))
    assert_clean(pool)
