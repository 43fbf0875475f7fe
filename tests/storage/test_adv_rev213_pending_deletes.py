"""Review 213: a delete whose unlink failed (EIO from a failing disk; EACCES, EBUSY alike) was
remembered only in memory (review 204): retried at lock checks, when writable again and at the
close. A process killed (SIGKILL) before a retry succeeded left the file, and the next start's scan
indexed and served the page its caller had deleted. The tier now keeps such deletes in a
pending-delete record in the layout directory (``.deletes``, :mod:`storage.deletelog`), on disk
before ``delete()`` returns; a start does not index a file of a key named there that is no newer
than its delete, and unlinks it when it holds the lock.

Also: the retried unlink counted a fault at every lock check (one failed delete inflated the
fault counter without bound): now once a delete.

Real faults: an ext4 on a loop device over a FUSE file whose bytes holding the fan-out directory's
block answer EIO (``test_adv_rev142_bad_blocks``' file system, as in
``test_adv_rev204_delete_unlink_eio``), the page cache dropped so the unlink's lookup reads that
block; the cache a process of its own, SIGKILLed after the failed delete; then a real restart of a
tier over the same directory. Root only (FUSE, loop device)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import glob
import itertools
import os
import shutil
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest
from child_procs import end_child, fork_context
from disk_helpers import assert_clean, config, key_of, small_layout
from follow_helpers import Looks, started
from test_adv_rev142_bad_blocks import BadBlocks, bad_block_ext4, device_ranges, drop_caches_until
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled
from test_adv_rev188_deletes_away import _served
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly
from aiokv.storage.deletelog import DELETES_NAME, load_deletes

TAG = 0x5B
VICTIM, OTHER = key_of(0, TAG), key_of(1, TAG)
WAIT_S = 60.0


def _drop_caches() -> None:
    """Written back, then the clean page cache and unused dentries dropped: the next lookup in the
    fan-out directory reads its block from the device (the bad one)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def _lookup_errno(path: Path) -> int:
    """What a plain lookup of ``path`` answers now (0: found)."""
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno or -1
    return 0


def _make_fanout_bad(bad: BadBlocks, fanout: Path, page: Path) -> None:
    """Every block of ``fanout`` answers EIO on read, and is no longer cached: a lookup there fails."""
    for start, end in device_ranges(str(fanout), 0, fanout.stat().st_size):
        bad.bad("read", start, end)
    why = drop_caches_until(fanout, lambda: _lookup_errno(page) != 0)
    if why is not None:
        pytest.fail(f"the fan-out directory's block was still cached: no EIO to inject ({why})")


def deleting_child(directory: str, backend: str, then: str, conn: Connection) -> None:
    """A cache in a process of its own: writes VICTIM and OTHER, sends ``"written"``; on
    ``"delete"`` deletes VICTIM and sends ``("deleted", fault counted, kept in the record)``;
    ``then == "stored_again"``: on ``"store"`` stores VICTIM again (once the file clock passed the
    delete's time) and sends ``"stored"``. Then waits to be killed."""

    async def main() -> None:
        layout = small_layout()
        size = layout.page_bytes
        pool = PagePool.create(layout, 16 * size, register_cuda=False, workers=1)
        pool.wait_ready_blocking()
        cfg = config(Path(directory), DiskBackend(backend), follow_interval_s=3600.0, min_free_bytes=0)
        tier = DiskTier(cfg, layout, pool)
        await tier.start()
        for key in (VICTIM, OTHER):
            assert await tier.write_from(key, memoryview(_bytes_of(key, size)))
        await _settled(tier)
        conn.send("written")
        assert await asyncio.to_thread(conn.recv) == "delete"
        errors = sum(tier.statistics().errors.values())
        await tier.delete(VICTIM)
        conn.send(("deleted", sum(tier.statistics().errors.values()) > errors, VICTIM in tier._deletes_kept))
        if then == "stored_again":
            assert await asyncio.to_thread(conn.recv) == "store"
            deleted_at = tier._deletes_kept[VICTIM]
            # The new file's time must be past the delete's by more than the file clock's granule
            # (within one it counts as the page deleted: a miss, by design): a wait for the clock
            # itself, not a synchronisation.
            await asyncio.sleep(max(0, deleted_at + 50_000_000 - time.time_ns()) / 1e9)  # (a jiffy at most)
            assert time.time_ns() > deleted_at + 50_000_000
            assert await tier.write_from(VICTIM, memoryview(_bytes_of(VICTIM, size)))
            conn.send("stored")
        await asyncio.to_thread(conn.recv)  # SIGKILLed here: no close, no retry

    asyncio.run(main())


_PROCS: dict[int, BaseProcess] = {}
"""The process of each :func:`_killed_child` connection (by the connection's id)."""


def conn_process(conn: Connection) -> BaseProcess:
    return _PROCS[id(conn)]


@contextlib.contextmanager
def _killed_child(*args: object) -> Iterator[Connection]:
    """``deleting_child(*args, conn)`` in a process of its own; SIGKILLed and reaped on exit, its
    pool's shared memory removed (a killed pool never unlinks it)."""
    ctx = fork_context()
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=deleting_child, args=(*args, theirs), daemon=True)
    proc.start()
    theirs.close()
    _PROCS[id(ours)] = proc
    try:
        yield ours
    finally:
        end_child(proc, WAIT_S)
        del _PROCS[id(ours)]
        ours.close()
        for path in glob.glob(f"/dev/shm/aiokv-{proc.pid}-*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    assert proc.exitcode == -9, f"the child ended by itself ({proc.exitcode}), not by the kill"


def _on_disk(layout_dir: Path) -> set[bytes]:
    fd = os.open(layout_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return set(load_deletes(fd))
    finally:
        os.close(fd)


async def _receive(conn: Connection) -> object:
    assert await asyncio.to_thread(conn.poll, WAIT_S), "the child did not answer"
    return conn.recv()


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("then", ["killed", "stored_again"])
async def test_a_page_whose_unlink_failed_is_never_served_after_a_sigkill(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, then: str) -> None:
    size = layout.page_bytes
    with bad_block_ext4(tmp_path, 32) as (mount, bad):
        directory = mount / "disk"
        cfg = config(directory, backend, follow_interval_s=3600.0, min_free_bytes=0)
        layout_dir = None
        with _killed_child(str(directory), backend.value, then) as conn:
            assert await _receive(conn) == "written"
            layout_dir = next(path for path in directory.iterdir() if path.is_dir())
            fanout = layout_dir / f"{TAG:02x}"
            page = fanout / VICTIM.hex()
            await asyncio.to_thread(_make_fanout_bad, bad, fanout, page)
            conn.send("delete")
            kind, counted, recorded = await _receive(conn)  # type: ignore[misc]
            bad.good()
            assert kind == "deleted" and counted, "the unlink's EIO was not counted"
            assert page.exists(), "the unlink did not fail: nothing to test"
            assert recorded, "the failed delete is not in the pending-delete record"
            assert VICTIM in _on_disk(layout_dir), "the pending delete was not on disk when delete() returned"
            if then == "stored_again":
                conn.send("store")
                assert await _receive(conn) == "stored"
        # Killed: the only retry left is the restart's.
        async with started(DiskTier(cfg, layout, pool)) as restarted:
            if then == "stored_again":
                assert await _served(restarted, VICTIM, size), "the page stored after the delete was lost"
            else:
                assert not restarted.contains(VICTIM), "a page its caller deleted was indexed after a SIGKILL"
                assert not await _served(restarted, VICTIM, size), \
                    "a page its caller deleted was served after a SIGKILL"
            assert await _served(restarted, OTHER, size)
            await _settled(restarted)
        assert page.exists() == (then == "stored_again"), "the restart left the deleted page on disk"
        assert not (layout_dir / DELETES_NAME).exists(), "the record outlived the delete carried out"
    assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_follower_drops_a_page_the_writer_could_not_unlink_and_its_take_over_removes_it(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """A follower (this process) indexed VICTIM from the writer's directory; the writer (a process
    of its own) deletes it and the unlink meets EIO: the file never changes, so the follower's
    looks kept it indexed and served it, and after the writer's SIGKILL its take-over kept it too.
    The looks now read the writer's pending-delete record."""
    size = layout.page_bytes
    with bad_block_ext4(tmp_path, 32) as (mount, bad):
        directory = mount / "disk"
        cfg = config(directory, backend, follow_interval_s=3600.0, min_free_bytes=0)
        with _killed_child(str(directory), backend.value, "killed") as conn:
            assert await _receive(conn) == "written"
            async with started(DiskTier(cfg, layout, pool)) as follower:
                assert follower.read_only is ReadOnly.LOCKED
                looks = Looks(follower)
                assert await _served(follower, VICTIM, size), "the follower did not index the page"
                fanout = follower.files.layout_dir / f"{TAG:02x}"
                page = fanout / VICTIM.hex()
                await asyncio.to_thread(_make_fanout_bad, bad, fanout, page)
                conn.send("delete")
                kind, counted, recorded = await _receive(conn)  # type: ignore[misc]
                bad.good()
                assert kind == "deleted" and counted and recorded and page.exists(), "the unlink did not fail"
                await looks.next()
                assert not follower.contains(VICTIM), "the follower kept a page its writer deleted indexed"
                assert not await _served(follower, VICTIM, size), "the follower served a page its writer deleted"
                assert await _served(follower, OTHER, size)
                end_child(conn_process(conn), WAIT_S)  # SIGKILL: the follower takes the directory over
                await looks.next()
                assert follower.read_only is None, "the follower did not take the directory over"
                assert not await _served(follower, VICTIM, size), "the take-over served a page deleted"
                await _settled(follower)
                assert not page.exists(), "the take-over left the page deleted on disk"
                assert await _served(follower, OTHER, size)
    assert_clean(pool)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_failed_delete_retried_at_every_lock_check_counts_one_fault(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """The disk keeps failing: each lock check retries the unlink and fails again. Before: one
    fault counted per check, without bound. Now: one for the delete."""
    size = layout.page_bytes
    with bad_block_ext4(tmp_path, 32) as (mount, bad):
        cfg = config(mount / "disk", backend, follow_interval_s=0.05, min_free_bytes=0)
        async with started(DiskTier(cfg, layout, pool)) as tier:
            for key in (VICTIM, OTHER):
                assert await tier.write_from(key, memoryview(_bytes_of(key, size)))
            await _settled(tier)
            fanout = tier.files.layout_dir / f"{TAG:02x}"
            page = fanout / VICTIM.hex()
            await asyncio.to_thread(_make_fanout_bad, bad, fanout, page)
            checks = LockChecks(tier)
            before = sum(tier.statistics().errors.values())
            await tier.delete(VICTIM)
            assert sum(tier.statistics().errors.values()) == before + 1, tier.statistics().errors
            retried = 0
            real_unlink = tier._io.unlink  # type: ignore[union-attr]

            async def unlink(dir_fd: int, name: str) -> None:
                nonlocal retried
                if name == VICTIM.hex():
                    retried += 1
                await real_unlink(dir_fd, name)

            tier._io.unlink = unlink  # type: ignore[union-attr,method-assign]
            for _ in range(4):
                await checks.next()
                await _settled(tier)
                await asyncio.to_thread(_drop_caches)  # each retry reads the bad block again
            assert retried >= 3, f"the unlink was retried {retried} times: nothing to test"
            assert _lookup_errno(page) == errno.EIO, "the disk answered again: the retries did not all fail"
            assert sum(tier.statistics().errors.values()) == before + 1, \
                f"one failed delete counted {sum(tier.statistics().errors.values()) - before} faults"
            bad.good()
            await asyncio.to_thread(_drop_caches)
            await checks.next()
            await _settled(tier)
            assert not page.exists(), "the retry once the disk answered did not unlink the page"
            assert not (tier.files.layout_dir / DELETES_NAME).exists(), "the record outlived the delete"
    assert_clean(pool)


@pytest.mark.asyncio
@pytest.mark.parametrize("planted", ["garbage", "symlink", "fifo"])
async def test_a_damaged_record_serves_no_page_it_may_name(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, planted: str) -> None:
    """A record that is not one the tier wrote (damaged, planted) names unknown deletes: a start
    serves none of the pages found (a miss each, never a page maybe deleted); the writer unlinks
    them and replaces the record; the next start serves what was stored since."""
    size = layout.page_bytes
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(DiskTier(cfg, layout, pool)) as tier:
        for key in (VICTIM, OTHER):
            assert await tier.write_from(key, memoryview(_bytes_of(key, size)))
        record = tier.files.layout_dir / DELETES_NAME
    target = tmp_path / "elsewhere"
    target.write_bytes(b"not ours")
    if planted == "garbage":
        record.write_bytes(b"AIOKVDL1" + os.urandom(64))
    elif planted == "symlink":
        record.symlink_to(target)
    else:
        os.mkfifo(record)  # opened without O_NONBLOCK, the start's read waited for a writer for good
    async with started(DiskTier(cfg, layout, pool)) as tier:
        assert sum(tier.statistics().errors.values()) >= 1, "the damaged record was not counted"
        for key in (VICTIM, OTHER):
            assert not tier.contains(key) and not await _served(tier, key, size)
        assert await tier.write_from(OTHER, memoryview(_bytes_of(OTHER, size)))
        await _settled(tier)
    assert target.read_bytes() == b"not ours", "the planted symlink's target was touched"
    assert not record.exists() and not record.is_symlink(), "the damaged record was not replaced"
    async with started(DiskTier(cfg, layout, pool)) as tier:
        assert await _served(tier, OTHER, size), "the page stored after the damaged record was lost"
        assert not tier.contains(VICTIM)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_damaged_record_while_following_counts_one_fault(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """The looks read the writer's record at each look: a damaged one (planted here) is counted
    once, not once a look (the fault counter grew without bound); while it is damaged the follower
    serves nothing (its deletes unknown, review 231), and once it reads again the looks go on."""
    size = layout.page_bytes
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(DiskTier(cfg, layout, pool)) as writer, started(DiskTier(cfg, layout, pool)) as follower:
        assert follower.read_only is ReadOnly.LOCKED
        looks = Looks(follower)
        (writer.files.layout_dir / DELETES_NAME).write_bytes(b"AIOKVDL1" + os.urandom(64))
        before = sum(follower.statistics().errors.values())
        assert await writer.write_from(OTHER, memoryview(_bytes_of(OTHER, size)))
        for _ in range(3):
            await looks.next()
        assert not follower.contains(OTHER) and not await _served(follower, OTHER, size), \
            "a follower served a page while its writer's record could not be read"
        assert sum(follower.statistics().errors.values()) == before + 1, follower.statistics().errors
        (writer.files.layout_dir / DELETES_NAME).unlink()  # no record: nothing deleted
        await looks.next()
        assert follower.contains(OTHER) and await _served(follower, OTHER, size), "the looks stopped following"
        assert sum(follower.statistics().errors.values()) == before + 1, follower.statistics().errors
    assert_clean(pool)


def _fill(path: Path) -> None:
    """Write ``path`` until the file system is full (root: its reserve too)."""
    chunk = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
        # The last blocks, until a write right after an fsync meets ENOSPC: delayed allocation
        # reserves more than the fsync then allocates, and what it gives back let the record be
        # saved on an H100 host's kernel (the test's premise, a full file system, was not met).
        for _ in range(64):
            wrote = 0
            try:
                while True:
                    f.write(b"\0" * 4096)
                    wrote += 1
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
            os.fsync(f.fileno())
            if not wrote:
                return
        raise AssertionError("the file system kept finding room after each fsync")


def _use_every_inode(directory: Path) -> None:
    """Empty files in ``directory`` until the file system has no inode left (real ENOSPC). A full
    data area alone did not always refuse the record's save: ext4 gives preallocated blocks back
    (the filler's close, a locality group's) after the fill, and the CI run's save found room."""
    directory.mkdir()
    for n in itertools.count():
        try:
            os.close(os.open(directory / str(n), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            return


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_record_that_cannot_be_saved_counts_one_fault_and_is_saved_later(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """The delete's unlink meets EIO and the file system is full (real ENOSPC): the record cannot
    be saved either. Each lock check retries both: one fault each, not one a check; once the disk
    answers and room is freed, the page is unlinked and nothing is left named."""
    size = layout.page_bytes
    with bad_block_ext4(tmp_path, 32) as (mount, bad):
        cfg = config(mount / "disk", backend, follow_interval_s=0.05, min_free_bytes=0)
        async with started(DiskTier(cfg, layout, pool)) as tier:
            for key in (VICTIM, OTHER):
                assert await tier.write_from(key, memoryview(_bytes_of(key, size)))
            await _settled(tier)
            filler, empties = mount / "filler", mount / "empties"
            filler.touch()  # its inode taken before there are none
            await asyncio.to_thread(_use_every_inode, empties)
            await asyncio.to_thread(_fill, filler)
            fanout = tier.files.layout_dir / f"{TAG:02x}"
            page = fanout / VICTIM.hex()
            await asyncio.to_thread(_make_fanout_bad, bad, fanout, page)
            checks = LockChecks(tier)
            before = tier.statistics().errors
            await tier.delete(VICTIM)
            after = tier.statistics().errors
            grown = {kind.value: after[kind] - before.get(kind, 0) for kind in after
                     if after[kind] != before.get(kind, 0)}
            assert grown == {"eio": 1, "enospc": 1}, f"not the faults injected: {grown}"
            assert tier._deletes_saved < tier._deletes_version, "the record was saved on a full file system"
            for _ in range(3):
                await checks.next()
                await _settled(tier)
                await asyncio.to_thread(_drop_caches)
            assert tier.statistics().errors == after, "the retries counted their faults again"
            assert _lookup_errno(page) == errno.EIO, "the disk answered again: the retries did not all fail"
            bad.good()
            filler.unlink()
            await asyncio.to_thread(shutil.rmtree, empties)
            await asyncio.to_thread(_drop_caches)
            await checks.next()
            await _settled(tier)
            assert not page.exists(), "the retry once the disk answered did not unlink the page"
            assert not tier._deletes_kept and not (tier.files.layout_dir / DELETES_NAME).exists()
        async with started(DiskTier(cfg, layout, pool)) as restarted:
            assert not await _served(restarted, VICTIM, size) and await _served(restarted, OTHER, size)
    assert_clean(pool)
