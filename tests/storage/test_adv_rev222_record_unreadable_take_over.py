"""Review 222: a follower's look reads the writer's pending-delete record (``.deletes``,
:mod:`storage.deletelog`) before its listings; one it could not read (EIO, a damaged record) left
the look's deletes empty, a fault counted, and the look went on. When that same look took the
directory over (the writer closed or died), the take-over kept every page indexed, including one
the writer had deleted whose unlink failed (the file still there, named only in the record): the
new writer served that page for good (stale KV). A start treats such a record as naming unknown
deletes (no page found is served); the take-over now reads the record once it holds the lock (then
it is final) and, when it cannot, does the same.

Real faults: the deleted page's file made immutable (``chattr +i``: the writer's unlink answers
EPERM, for root too) so it stays on disk named in the record; the record then made unreadable for
real: its block answering EIO (an ext4 on a loop device over a FUSE file,
``test_adv_rev142_bad_blocks``, the page cache dropped), or a byte of it flipped on disk (it fails
its checksum). The writer, a second tier over the directory, closes; the follower's real look takes
the directory over. Root only (FUSE, loop device, chattr)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import threading
from pathlib import Path

import pytest
from disk_helpers import assert_clean, key_of
from take_over_helpers import (
    delete_left_on_disk,
    exists,
    flip_last_byte,
    follower_indexed,
    mutable_again,
    record_errno,
    take_over_config,
    took_over,
)
from test_adv_rev142_bad_blocks import BadBlocks, bad_block_ext4, device_ranges, drop_caches_until
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, ErrorKind
from aiokv.storage import follow as follow_module
from aiokv.storage.deletelog import DELETES_NAME

TAG = 0x6E
VICTIM, OTHER = key_of(0, TAG), key_of(1, TAG)


def _read_errno(layout_dir: Path) -> int:
    """What reading the record answers now (0: read, and it names VICTIM)."""
    return record_errno(layout_dir, naming=VICTIM)


def _drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def _make_unreadable(how: str, record: Path, bad: BadBlocks) -> None:
    """The record, naming VICTIM, made unreadable for real: its blocks answer EIO, or its last byte
    (its checksum's) is flipped on disk."""
    if how == "damaged":
        flip_last_byte(record)
        assert _read_errno(record.parent) == errno.EBADMSG, "the flipped byte left the record readable"
        return
    for start, end in device_ranges(str(record), 0, record.stat().st_size):
        bad.bad("read", start, end)
    why = drop_caches_until(record, lambda: _read_errno(record.parent) == errno.EIO)
    if why is not None:
        pytest.fail(f"the record's block was still cached: no EIO to inject ({why})")


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["eio", "damaged"])
async def test_a_take_over_that_cannot_read_the_record_never_serves_a_page_it_names(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, how: str) -> None:
    size = layout.page_bytes
    page: Path | None = None
    with bad_block_ext4(tmp_path, 32) as (mount, bad):
        cfg = take_over_config(mount / "disk", backend)
        try:
            async with contextlib.AsyncExitStack() as stack:
                writer, follower, looks = await follower_indexed(stack, cfg, layout, pool, (VICTIM, OTHER))
                page = Path(writer.files.path(VICTIM))
                other_page = Path(writer.files.path(OTHER))
                record = writer.files.layout_dir / DELETES_NAME
                await delete_left_on_disk(writer, VICTIM, page)  # EPERM: the file stays, named in the record
                assert exists(page) and _read_errno(record.parent) == 0, "the unlink did not fail: no test"
                await asyncio.to_thread(_make_unreadable, how, record, bad)
                await writer.aclose()  # lets the lock go: the next look takes the directory over
                errors = follower.statistics().errors
                before = sum(errors.values())
                await took_over(looks)
                assert not follower.contains(VICTIM), \
                    f"the take-over kept indexed a page its writer deleted (record {how})"
                assert not await _served(follower, VICTIM, size), \
                    f"the take-over served a page its writer deleted (record {how})"
                after = follower.statistics().errors
                assert sum(after.values()) > before, "the unreadable record was not counted"
                if how == "eio":
                    assert after.get(ErrorKind.EIO, 0) > errors.get(ErrorKind.EIO, 0), after
                # As at a start: the deletes are unknown, so no page found there is served (the
                # take-over unlinks them); what is stored from now on is.
                assert not follower.contains(OTHER) and not await _served(follower, OTHER, size)
                await _settled(follower)
                assert not exists(other_page), "the take-over left a page it does not serve on disk"
                assert await follower.write_from(OTHER, memoryview(_bytes_of(OTHER, size)))
                assert await _served(follower, OTHER, size)
                bad.good()
        finally:
            mutable_again(page)
    assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_delete_recorded_just_before_the_writer_lets_go_is_honoured_by_the_take_over(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The look read the record before it tried the lock: a delete the writer recorded between the
    two (then closed, or died) was unknown to the take-over, which kept the page indexed and served
    it. With the lock the record is final: it is read then. The look is held (on its thread) just
    before it tries the lock while the writer deletes for real (EPERM: the file stays) and closes."""
    size = layout.page_bytes
    cfg = take_over_config(tmp_path / "disk", backend)
    paused, go = threading.Event(), threading.Event()
    real_try_lock = follow_module._try_lock

    def held_try_lock(dir_fd: int, shown: Path, faults: list[tuple[OSError, str]]) -> int | None:
        if not paused.is_set():
            paused.set()
            assert go.wait(30), "the test did not let the look go on"
        return real_try_lock(dir_fd, shown, faults)

    page: Path | None = None
    try:
        async with contextlib.AsyncExitStack() as stack:
            writer, follower, looks = await follower_indexed(stack, cfg, layout, pool, (VICTIM, OTHER))
            page = Path(writer.files.path(VICTIM))
            monkeypatch.setattr(follow_module, "_try_lock", held_try_lock)
            look = asyncio.create_task(looks.next())
            try:
                assert await asyncio.to_thread(paused.wait, 30), "no look came to the lock"
                await delete_left_on_disk(writer, VICTIM, page)  # EPERM: the file stays, named in the record
                assert exists(page) and _read_errno(page.parent.parent) == 0, "the unlink did not fail: no test"
                await writer.aclose()
            finally:
                go.set()
                await look
            assert follower.read_only is None, "the follower did not take the directory over"
            assert not follower.contains(VICTIM), "the take-over kept indexed a page deleted as the writer let go"
            assert not await _served(follower, VICTIM, size), "the take-over served a page its writer deleted"
            assert await _served(follower, OTHER, size), "the take-over lost a page nobody deleted"
    finally:
        mutable_again(page)
    assert_clean(pool)
