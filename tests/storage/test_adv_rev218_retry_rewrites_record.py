"""Review 218: a retried unlink that failed again (review 204's retries: each lock check, once
writable, the close) named its key in the pending-delete record anew (:mod:`storage.deletelog`)
with the time of the retry, so every retry rewrote the whole record: a thread, a temp file, two
fsyncs and a rename at each lock check, for as long as the disk kept failing, and the delete's
time moved on at each. A retry's failure changes nothing on disk now: the key stays named with
the time of its delete. A new delete of a key stored again since is a new delete (counted, its
own time).

Real: the page file made immutable (``chattr +i``: the unlink answers EPERM, for root too) on the
test's own file system; the tier's own lock checks retry it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import started
from take_over_helpers import chattr, exists, mutable_again, record_deletes
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.deletelog import DELETES_NAME

TAG = 0x5D
CHECKS = 3


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_retry_that_fails_again_leaves_the_record_as_it_is(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    victim = key_of(0, TAG)
    cfg = config(tmp_path / "disk", backend, follow_interval_s=0.05, min_free_bytes=0)
    page: Path | None = None
    try:
        async with started(DiskTier(cfg, layout, pool)) as a:
            assert await a.write_from(victim, memoryview(_bytes_of(victim, size)))
            await _settled(a)
            page = Path(a.files.path(victim))
            record = a.files.layout_dir / DELETES_NAME
            chattr("+i", page)
            checks = LockChecks(a)
            await a.delete(victim)  # EPERM: the file stays, named in the record before this returns
            await _settled(a)
            assert exists(page) and exists(record), "the unlink did not fail: nothing to test"
            faults = sum(a.statistics().errors.values())
            first = os.stat(record).st_ino, record_deletes(a.files.layout_dir)
            assert set(first[1]) == {victim}
            for _ in range(CHECKS):
                await checks.next()  # its retry fails again (EPERM)
                await _settled(a)
            assert exists(page), "the retries unlinked an immutable file?"
            now = os.stat(record).st_ino, record_deletes(a.files.layout_dir)
            assert now == first, f"{CHECKS} failed retries rewrote the pending-delete record: {first} -> {now}"
            assert sum(a.statistics().errors.values()) == faults, "a retry that failed again was counted"
            chattr("-i", page)
            await checks.next()  # the disk answers: the retry unlinks it, and the record goes
            await _settled(a)
            assert not exists(page) and not exists(record), "the retry did not carry the delete out"
    finally:
        mutable_again(page)
    assert_clean(pool)
