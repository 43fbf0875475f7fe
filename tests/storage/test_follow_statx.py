"""A look examines the 256 fan-out directories in one io_uring batch of ``statx``
(:mod:`aiokv.storage.statxring`) rather than one ``fstat`` each: what it finds is the same (a
directory another process changes under the looks, a directory removed between two looks, an
error on one descriptor), and where io_uring or its STATX op is refused the looks ``fstat``."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import pytest
from disk_helpers import key_of
from follow_helpers import WRITER_TAG, Looks, child, follow_config, open_fds, receive, started, writer_child

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly, follow, statxring, uring
from aiokv.storage.layoutdir import FANOUT, FollowSeed, file_identity

ROUNDS = 6
PER_ROUND = 5
FILES = 12
"""The writer's budget in page files: later rounds recycle the oldest (names gone, inodes reused)."""


def _state(tier: DiskTier) -> follow.FollowState:
    state = tier._follow_state
    assert state is not None
    return state


def _same(a: os.stat_result | OSError, b: os.stat_result | OSError) -> bool:
    if isinstance(a, OSError) or isinstance(b, OSError):
        return isinstance(a, OSError) and isinstance(b, OSError) and (type(a), a.errno) == (type(b), b.errno)
    return (tuple(a), a.st_mtime_ns, a.st_ctime_ns, a.st_atime_ns) == (tuple(b), b.st_mtime_ns, b.st_ctime_ns,
                                                                      b.st_atime_ns)


def test_a_batch_gives_what_fstat_gives(tmp_path: Path) -> None:
    """Directories (one removed: st_nlink 0), a file, a closed descriptor (EBADF), and names
    (a missing one: ENOENT; a symlink, not followed) over more than one ring's worth."""
    (tmp_path / "file").write_bytes(b"x" * 100)
    (tmp_path / "link").symlink_to("file")
    for name in ("a", "gone"):
        (tmp_path / name).mkdir()
    fds = [os.open(tmp_path / name, os.O_RDONLY) for name in ("a", "gone", "file")]
    fds.append(os.open(tmp_path / "a", os.O_PATH | os.O_DIRECTORY))
    (tmp_path / "gone").rmdir()
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    closed = 1 << 20  # no descriptor of ours (the ring's own takes the lowest free number)
    ring = statxring.open_ring(8)
    try:
        wanted = [*fds, closed] * 3  # 15: two submissions of the 8-entry ring
        got = ring.stat_fds(wanted)
        for fd, result in zip(wanted, got, strict=True):
            try:
                expected: os.stat_result | OSError = os.fstat(fd)
            except OSError as exc:
                expected = exc
            assert _same(result, expected), (fd, result, expected)
        assert not isinstance(got[1], OSError) and got[1].st_nlink == 0
        assert isinstance(got[4], OSError) and got[4].errno == errno.EBADF
        names = ["file", "link", "a", "missing"]
        for name, result in zip(names, ring.stat_names(dir_fd, names), strict=True):
            try:
                expected = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError as exc:
                expected = exc
            assert _same(result, expected), (name, result, expected)
        assert ring.batches == 3
    finally:
        ring.close()
        ring.close()
        for fd in [*fds, dir_fd]:
            os.close(fd)
    with pytest.raises(statxring.StatxRefused):
        ring.stat_fds([0])


@pytest.mark.parametrize("batched", [True, False], ids=["statx", "fstat"])
def test_a_directory_removed_between_looks_is_retired(tmp_path: Path, batched: bool) -> None:
    """Its descriptor open, the directory gone (st_nlink 0): its pages dropped, the fault
    recorded, the descriptor retired, the same way whether it was examined in the batch or not."""
    index = 7
    sub = tmp_path / f"{index:02x}"
    sub.mkdir()
    fd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY)
    key = key_of(1, index)
    seed = FollowSeed()
    seed.entries[index] = {key: file_identity(5, os.fstat(fd))}
    seed.stamps[index] = (1, 1)
    state = follow.FollowState(seed)
    if not batched:
        state.statx_refused = statxring.StatxRefused(errno.EPERM, "this test")
    sub.rmdir()
    fanout = [-1] * FANOUT
    fanout[index] = fd
    try:
        stats = follow._stat_batch(state, fanout)
        assert (stats is not None) is batched
        result = follow.Look()
        assert not follow._relist(state, result, {}, index, fd, tmp_path, remove_temps=False, always=False,
                                  stats=stats)
        assert result.removed == [key] and result.retired == [(index, fd)]
        assert [type(fault) for fault, _what in result.faults] == [FileNotFoundError]
        assert state.entries[index] is None and state.stamps[index] is None
    finally:
        state.close_ring()
        os.close(fd)
    assert state.ring is None


def _on_disk(tier: DiskTier, keys: list[bytes]) -> list[bool]:
    return [os.path.exists(tier.files.path(key)) for key in keys]


@pytest.mark.asyncio
async def test_batched_and_fstat_looks_find_the_same_while_a_writer_changes_the_directory(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """Two followers of one writer process, one batching (the ring), one ``fstat``ing (as where
    io_uring is refused), looking while the writer stores and recycles: once it is done, each
    look indexes exactly the writer's files; the ring is closed once the batching one took the
    directory over, and no descriptor is left."""
    with child(writer_child, str(disk_dir), backend.value, FILES) as (conn, _proc):
        assert await receive(conn) == ("ready", None)
        conn.send(("write", [0, 1, 2]))
        assert await receive(conn) == ("written", [True] * 3)
        before = open_fds()
        async with (started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as batching,
                    started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as plain):
            assert batching.read_only is plain.read_only is ReadOnly.LOCKED
            _state(plain).statx_refused = statxring.StatxRefused(errno.EPERM, "this test")
            looks_b, looks_p = Looks(batching), Looks(plain)
            keys = [key_of(i, WRITER_TAG) for i in range(3 + ROUNDS * PER_ROUND)]
            written = 3
            for _ in range(ROUNDS):
                batch = list(range(written, written + PER_ROUND))
                conn.send(("write", batch))
                while not conn.poll():  # looks while the writer stores and recycles
                    await asyncio.gather(looks_b.next(), looks_p.next())
                assert await receive(conn) == ("written", [True] * PER_ROUND)
                written += PER_ROUND
                await asyncio.gather(looks_b.next(), looks_p.next())
                on_disk = _on_disk(batching, keys)
                assert 0 < sum(on_disk) <= FILES
                assert [batching.contains(key) for key in keys] == on_disk
                assert [plain.contains(key) for key in keys] == on_disk
            assert sum(_on_disk(batching, keys)) < written  # the writer recycled some: names gone
            ring = _state(batching).ring
            assert ring is not None and ring.batches >= ROUNDS and _state(plain).ring is None
            for tier in (batching, plain):
                stats = tier.statistics()
                assert stats.corrupt == 0 and not any(stats.errors.values()), stats
            conn.send("close")
            assert await receive(conn) == "closed"
            await looks_b.until(lambda: batching.read_only is None)  # took the directory over
            assert _state(batching).ring is None and ring.closed
            await looks_p.next()  # follows the new writer, still with fstat
            assert _state(plain).ring is None
        assert open_fds() <= before
        conn.send("exit")


def _refuse_setup(entries: int, params: object) -> int:
    raise OSError(errno.EPERM, os.strerror(errno.EPERM))  # io_uring_disabled, a seccomp filter


@pytest.mark.asyncio
@pytest.mark.parametrize("refusal", ["setup", "statx"])
async def test_refused_io_uring_falls_back_to_fstat(
        disk_dir: Path, layout: KVLayout, pool: PagePool, monkeypatch: pytest.MonkeyPatch, refusal: str) -> None:
    """``setup``: io_uring_setup answers EPERM. ``statx``: the kernel answers EINVAL to the op (an
    opcode it does not know, as kernels before 5.6 answer STATX). Either way the looks go on with
    ``fstat`` (refused for good, no ring kept) and index the writer's pages."""
    backend = DiskBackend.THREADS  # the tier's own I/O needs no io_uring
    with child(writer_child, str(disk_dir), backend.value, 64) as (conn, _proc):
        assert await receive(conn) == ("ready", None)
        if refusal == "setup":
            monkeypatch.setattr(uring, "io_uring_setup", _refuse_setup)
        else:
            monkeypatch.setattr(uring, "OP_STATX", 255)
        async with started(DiskTier(follow_config(disk_dir, backend), layout, pool)) as tier:
            looks = Looks(tier)
            conn.send(("write", [0, 1]))
            assert await receive(conn) == ("written", [True, True])
            await looks.next()
            state = _state(tier)
            assert state.statx_refused is not None and state.ring is None
            assert state.statx_refused.errno == (errno.EPERM if refusal == "setup" else errno.EINVAL)
            assert all(tier.contains(key_of(i, WRITER_TAG)) for i in (0, 1))
            conn.send(("write", [2]))
            assert await receive(conn) == ("written", [True])
            await looks.next()
            assert tier.contains(key_of(2, WRITER_TAG)) and state.ring is None
            stats = tier.statistics()
            assert stats.corrupt == 0 and not any(stats.errors.values()), stats
        conn.send("close")
        assert await receive(conn) == "closed"
        conn.send("exit")
