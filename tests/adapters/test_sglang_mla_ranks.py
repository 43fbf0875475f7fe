"""SGLang MLA with TP > 1: one directory for every rank, SGLang's storage writer writes, all ranks read.

MLA pages are the same on every TP rank; SGLang's cache controller lets only the storage writer
(``HiCacheStorageConfig.is_storage_writer``: rank 0) back pages up and has every rank prefetch
(then takes the minimum of the ranks' hits). Each rank here is a backend made by SGLang's real
factory over SGLang's real MLA host pool, several in one process standing for the ranks' processes
(the directory lock is an ``flock``, which conflicts between open files of one process as between
processes), and one test with rank 1 in a process of its own.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make test installs requirements-engines.txt)")

import torch
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang_helpers import host_pool, indices, mla_fill, mla_pool, page, storage_config

from aiokv.adapters.sglang import AiokvHiCacheStorage
from aiokv.adapters.store import PageFileStore, Sharing, StoreConfig
from aiokv.storage.config import DiskBackend, ReadOnly
from aiokv.storage.safefiles import UnsafeDirectoryError

MLA_FILE = 4096 + 32768  # header + one MLA page of the test pool


def rank(made: list[Any], disk_dir: Path, tp_rank: int, tp_size: int = 2, pool: Any = None,
         mla: bool = True, **options: object) -> AiokvHiCacheStorage:
    """One rank's backend as SGLang attaches it (factory, host pool, pools registered: files open)."""
    pool = pool if pool is not None else (mla_pool(8) if mla else host_pool(8))
    config = storage_config(disk_dir, True, mla=mla, tp_rank=tp_rank, tp_size=tp_size,
                            options={"reader_refresh_s": 0, **options})
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    made.append(backend)
    assert isinstance(backend, AiokvHiCacheStorage)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    backend.test_pool = pool
    return backend


def kv_store(backend: AiokvHiCacheStorage) -> PageFileStore:
    store = backend._pools["kv"].store
    assert store is not None
    return store


def pages_of(backend: AiokvHiCacheStorage, count: int, seed: int) -> list[torch.Tensor]:
    """Fill the first ``count`` host pages of ``backend``'s pool; their bytes."""
    for p in range(count):
        mla_fill(backend.test_pool, p, seed=seed + p)
    return [page(backend.test_pool, p) for p in range(count)]


def layout_dirs(root: Path) -> list[Path]:
    return sorted(lock.parent for lock in root.rglob(".lock"))


def wait_for_loop_time(store: PageFileStore, when: float) -> None:
    """Return once ``store``'s loop clock reads ``when`` or later (a wait on the clock the store
    itself compares with, not a guess at it); fails at once if ``when`` is more than 10 s away."""

    async def until() -> None:
        loop = asyncio.get_running_loop()
        assert when - loop.time() < 10, f"{when - loop.time():.1f} s to wait: the store's clock is not the one read"
        # 1 ms past it: asyncio runs a timer up to its clock's resolution early.
        await asyncio.sleep(max(0.0, when - loop.time()) + 0.001)
        assert loop.time() >= when

    store.thread.run(until(), timeout=15)


def test_one_directory_the_writer_rank_writes_every_rank_reads(tmp_path: Path, backends: list[Any]) -> None:
    """Ranks 1-3 start before rank 0 (SGLang starts them in any order): rank 0, the storage writer,
    still gets the directory; what it writes every other rank finds and reads bit-exact into its
    own host pool; a non-writer's write is refused; one directory, the same keys on every rank."""
    readers = [rank(backends, tmp_path, r, tp_size=4) for r in (3, 1, 2)]
    writer = rank(backends, tmp_path, 0, tp_size=4)
    assert [kv_store(b).sharing for b in (writer, *readers)] == [Sharing.WRITER] + [Sharing.READER] * 3
    assert writer.statistics()["read_only"] is None
    assert all(r.statistics()["read_only"] is ReadOnly.LOCKED for r in readers)
    assert len(layout_dirs(tmp_path)) == 1
    assert len({kv_store(b).key(b"k") for b in (writer, *readers)}) == 1  # no rank in MLA keys

    keys = [f"m{i}" for i in range(4)]
    expected = pages_of(writer, 4, seed=80)
    assert writer.batch_set_v1(keys, indices([0, 1, 2, 3])) == [True] * 4
    for reader in readers:
        assert reader.batch_exists(keys) == 4  # published after the reader started: found by a rescan
        assert reader.batch_get_v1(keys, indices([4, 5, 6, 7])) == [True] * 4
        assert all(torch.equal(page(reader.test_pool, 4 + p), expected[p]) for p in range(4))
        assert kv_store(reader).refreshes == 1
    # SGLang never asks a non-writer to back up (backup_skip); if something does, it is refused.
    pages_of(readers[0], 1, seed=90)
    assert readers[0].batch_set_v1(["from-rank-3"], indices([0])) == [False]
    assert readers[0].statistics()["writes_refused"] == 1
    assert writer.batch_exists(["from-rank-3"]) == 0
    assert writer.statistics()["pages"] == 4


def test_non_mla_ranks_and_dp_groups_keep_directories_of_their_own(tmp_path: Path, backends: list[Any]) -> None:
    """Non-MLA pages hold the rank's heads: each rank writes its own directory. With DP attention
    SGLang's tp_rank counts within the DP group: each group has its own directory (and writer)."""
    mha = [rank(backends, tmp_path / "mha", r, mla=False) for r in (0, 1)]
    assert [kv_store(b).sharing for b in mha] == [Sharing.ALONE] * 2
    assert kv_store(mha[0]).key(b"k") != kv_store(mha[1]).key(b"k")
    assert all(b.statistics()["read_only"] is None for b in mha)
    assert len(layout_dirs(tmp_path / "mha")) == 2

    groups = []
    for dp in (0, 1):
        pool = mla_pool(8)
        config = storage_config(tmp_path / "dp", True, mla=True, tp_rank=0, dp_rank=dp)
        backend = StorageBackendFactory.create_backend("dynamic", config, pool)
        backends.append(backend)
        backend.register_mem_pool_host(pool)
        backend.on_host_pools_registered()
        groups.append(backend)
    assert all(kv_store(b).sharing is Sharing.WRITER and b.statistics()["read_only"] is None for b in groups)
    assert len(layout_dirs(tmp_path / "dp")) == 2


def test_a_reader_never_takes_the_lock_even_with_no_writer_running(tmp_path: Path, backends: list[Any]) -> None:
    """A reader starts, rescans and clears while no writer runs: it never holds the directory, so
    the writer that starts next (or again) writes there."""
    reader = rank(backends, tmp_path, 1)
    assert reader.statistics()["read_only"] is ReadOnly.LOCKED  # its own start-up guard excluded its tier
    writer = rank(backends, tmp_path, 0)
    assert writer.statistics()["read_only"] is None
    expected = pages_of(writer, 1, seed=5)
    assert writer.batch_set_v1(["a"], indices([0])) == [True]
    writer.close()
    assert reader.batch_exists(["a"]) == 1  # a rescan with no writer running
    assert reader.clear() is True  # a reader forgets (rescans); the writer deletes
    assert kv_store(reader).refreshes == 2
    assert reader.statistics()["read_only"] is ReadOnly.LOCKED
    again = rank(backends, tmp_path, 0)
    assert again.statistics()["read_only"] is None
    assert reader.batch_get_v1(["a"], indices([3])) == [True]
    assert torch.equal(page(reader.test_pool, 3), expected[0])


def _hold_shared(lock: Path) -> int:
    fd = os.open(lock, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    return fd


def test_the_writer_waits_while_a_reader_starts(tmp_path: Path, backends: list[Any],
                                                caplog: pytest.LogCaptureFixture) -> None:
    """A reader holds the lock shared while its tier starts; a writer starting meanwhile waits for
    it (a real shared flock here, released after 0.3 s) and then writes. A lock never released
    within writer_wait_s: the writer serves read-only, says so, and its writes are refused."""
    rank(backends, tmp_path, 1)  # makes the directory and its lock file
    (layout,) = layout_dirs(tmp_path)
    guard = _hold_shared(layout / ".lock")
    threading.Timer(0.3, os.close, (guard,)).start()
    start = time.monotonic()
    writer = rank(backends, tmp_path, 0, writer_wait_s=30)
    assert time.monotonic() - start >= 0.25
    assert writer.statistics()["read_only"] is None
    writer.close()

    guard = _hold_shared(layout / ".lock")
    try:
        with caplog.at_level(logging.WARNING, logger="aiokv.adapters.store"):
            stuck = rank(backends, tmp_path, 0, writer_wait_s=0.3)
        assert stuck.statistics()["read_only"] is ReadOnly.LOCKED
        assert "serves it read-only" in caplog.text
        pages_of(stuck, 1, seed=1)
        assert stuck.batch_set_v1(["x"], indices([0])) == [False]
    finally:
        os.close(guard)


def test_a_reader_rank_refuses_a_fifo_at_the_lock_at_once(tmp_path: Path, backends: list[Any]) -> None:
    """Regression: a FIFO another user planted at the lock file's name (predictable, in a shared
    disk_dir such as /tmp/aiokv) hung an MLA reader rank's start for ever: its start-up guard opened
    the lock blocking, in a worker thread nothing can cancel, so SGLang never finished starting. The
    start now fails at once, saying what is there; nothing opened the FIFO for reading."""
    rank(backends, tmp_path, 0).close()  # the writer made the directory and its lock file
    (layout,) = layout_dirs(tmp_path)
    (layout / ".lock").unlink()
    os.mkfifo(layout / ".lock", 0o600)
    outcome: list[BaseException] = []

    def start() -> None:
        try:
            rank(backends, tmp_path, 1)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=start, name="reader-rank-start", daemon=True)
    thread.start()
    thread.join(20)
    if thread.is_alive():
        fd = os.open(layout / ".lock", os.O_RDWR | os.O_NONBLOCK)  # a writer lets the stuck open go
        thread.join(20)
        os.close(fd)
        pytest.fail("the reader rank's start hung on the FIFO at its lock file")
    (error,) = outcome
    assert isinstance(error, UnsafeDirectoryError)
    assert "is a FIFO" in str(error)


def test_reader_rescans_are_bounded_by_reader_refresh_s(tmp_path: Path, backends: list[Any]) -> None:
    """A reader whose last rescan is recent answers from its index (a page published since misses),
    then rescans once reader_refresh_s has passed; a miss with no file behind it never rescans."""
    slow = rank(backends, tmp_path, 1, tp_size=4, reader_refresh_s=0.5)
    fast = rank(backends, tmp_path, 2, tp_size=4)
    writer = rank(backends, tmp_path, 0, tp_size=4)
    assert fast.batch_exists(["nothing"]) == 0 and kv_store(fast).refreshes == 0  # no file: no rescan
    pages_of(writer, 1, seed=3)
    assert writer.batch_set_v1(["p"], indices([0])) == [True]
    assert fast.batch_exists(["p"]) == 1
    store = kv_store(slow)
    due = store._refreshed + store.config.reader_refresh_s  # the loop time _stale compares with
    found = slow.batch_exists(["p"])
    if store.thread.loop.time() < due:  # the whole call ran before its rescan was due
        assert found == 0 and store.refreshes == 0
    wait_for_loop_time(store, due)
    assert slow.batch_exists(["p"]) == 1
    assert store.refreshes == 1


def test_pages_the_writer_evicted_or_that_rotted_miss_on_readers(tmp_path: Path, backends: list[Any]) -> None:
    """A reader's index may still list a page the writer evicted since: the read misses (the file
    is gone), never wrong bytes. A corrupt file misses on the reader, which leaves it to the writer
    (a reader never deletes), and the writer's own read then removes it."""
    room = {"disk_bytes": 3 * MLA_FILE}
    reader = rank(backends, tmp_path, 1, **room)
    writer = rank(backends, tmp_path, 0, **room)
    expected = pages_of(writer, 4, seed=20)
    assert writer.batch_set_v1(["a", "b", "c"], indices([0, 1, 2])) == [True] * 3
    assert reader.batch_exists(["a", "b", "c"]) == 3
    assert writer.batch_set_v1(["d"], indices([3])) == [True]  # evicts the least recently used
    (evicted,) = [k for k in "abc" if writer.batch_exists([k]) == 0]
    kept = [k for k in "abc" if k != evicted]
    assert reader.batch_exists([evicted]) == 1  # its index still lists it
    before = page(reader.test_pool, 7)
    assert reader.batch_get_v1([evicted], indices([7])) == [False]
    assert torch.equal(page(reader.test_pool, 7), before)  # nothing was read: the file was gone
    assert reader.batch_exists([evicted]) == 0

    (victim,) = [p for p in tmp_path.rglob(kv_store(writer).key(kept[0].encode()).hex())]
    raw = bytearray(victim.read_bytes())
    raw[4096 + 7] ^= 0x04
    victim.write_bytes(bytes(raw))
    assert reader.batch_get_v1([kept[0]], indices([6])) == [False]
    assert reader.statistics()["corrupt"] == 1 and victim.exists()
    assert writer.batch_get_v1([kept[0]], indices([6])) == [False]
    assert writer.batch_exists([kept[0]]) == 0
    writer.close()  # waits for the writer's unlink of the corrupt file (it runs after the read returns)
    assert not victim.exists()
    assert reader.batch_exists([kept[1], "d"]) == 2  # "d" came after its last rescan: found by another
    # (the writer is closed: the reader's rescan still never takes the directory)
    assert reader.batch_get_v1([kept[1], "d"], indices([4, 5])) == [True, True]
    assert torch.equal(page(reader.test_pool, 4), expected["abc".index(kept[1])])
    assert torch.equal(page(reader.test_pool, 5), expected[3])


@pytest.mark.parametrize(("name", "value", "error"), [
    ("writer_wait_s", -1, ValueError), ("reader_refresh_s", float("nan"), ValueError),
    ("writer_wait_s", float("inf"), ValueError), ("reader_refresh_s", "1", TypeError),
    ("writer_wait_s", True, TypeError),
])
def test_sharing_options_are_checked(tmp_path: Path, name: str, value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=name):
        StoreConfig.from_options({"disk_dir": str(tmp_path), name: value})
    assert not list(tmp_path.iterdir())  # refused before anything was made


# -- the host pool's memory as io_uring fixed buffers -----------------------------------------------


def registered(backend: AiokvHiCacheStorage) -> tuple[int, int]:
    """(regions handed to the disk tier, regions it could not register), once registration is over."""
    store = kv_store(backend)
    store.thread.run(store.wait_registered())
    return store.registered_regions, int(backend.statistics()["memory_unregistered"])


@pytest.mark.parametrize("disk_backend", ["auto", "threads"])
def test_the_mla_host_pool_is_registered_and_pages_move_in_place(
        tmp_path: Path, backends: list[Any], disk_backend: str) -> None:
    """An MLA page is one buffer of SGLang's host pool: the pool's memory is registered with the
    disk tier (io_uring fixed buffers), and pages move in place, bit-exact, both ways. Where the
    tier cannot register it (the threads backend refuses), it says so and pages still move in place."""
    writer = rank(backends, tmp_path, 0, tp_size=1, disk_backend=disk_backend)
    assert kv_store(writer).sharing is Sharing.ALONE
    handed, refused = registered(writer)
    # io_uring (auto, where the kernel allows it) registers it; threads cannot.
    threads = writer.statistics()["backend"] is DiskBackend.THREADS
    assert handed == 1 and refused == (1 if threads else 0)
    assert threads == (disk_backend == "threads") or disk_backend == "auto"
    expected = pages_of(writer, 3, seed=40)
    assert writer.batch_set_v1(["a", "b", "c"], indices([0, 1, 2])) == [True] * 3
    assert writer.batch_get_v1(["a", "b", "c"], indices([5, 6, 7])) == [True] * 3
    assert all(torch.equal(page(writer.test_pool, 5 + p), expected[p]) for p in range(3))
    store = kv_store(writer)
    assert store.thread.call(lambda: (store.direct_pages, store.staged_pages)).result() == (6, 0)
    assert writer.statistics()["buffered_fallbacks"] == 0


def test_split_pages_and_readers_register_nothing(tmp_path: Path, backends: list[Any]) -> None:
    """MHA page_first pages are two buffers (K, V) that go through staging pages: registering the
    pool would only pin it. A reader's tier is replaced at each rescan: it does not register either."""
    mha = rank(backends, tmp_path / "mha", 0, mla=False)
    assert registered(mha) == (0, 0)
    reader = rank(backends, tmp_path / "mla", 1)
    writer = rank(backends, tmp_path / "mla", 0)
    assert registered(reader) == (0, 0) and registered(writer) == (1, 0)


_RANK_PROCESS = """
import sys
sys.path.insert(0, {helpers!r})
import torch
from sglang_helpers import indices, mla_fill, mla_pool, page, storage_config
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

pool = mla_pool(8)
config = storage_config({root!r}, True, mla=True, tp_rank=1, options={{"reader_refresh_s": 0}})
backend = StorageBackendFactory.create_backend("dynamic", config, pool)
backend.register_mem_pool_host(pool)
backend.on_host_pools_registered()
print("ready", backend.statistics()["read_only"], flush=True)
sys.stdin.readline()  # rank 0 stored its pages
keys = ["p0", "p1", "p2"]
found = backend.batch_exists(keys)
got = backend.batch_get_v1(keys, indices([4, 5, 6]))
expected = mla_pool(8)
for p in range(3):
    mla_fill(expected, p, seed=70 + p)
exact = all(torch.equal(page(pool, 4 + p), page(expected, p)) for p in range(3))
print("read", found, got, exact, flush=True)
backend.close()
"""


def test_a_reader_rank_in_another_process_reads_what_rank_0_writes(tmp_path: Path, backends: list[Any]) -> None:
    """Rank 1 in a process of its own, started first, and rank 0 here: rank 0 gets the directory,
    and rank 1 reads its pages bit-exact."""
    import subprocess
    import sys

    script = _RANK_PROCESS.format(helpers=str(Path(__file__).parent), root=str(tmp_path))
    with subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdin is not None
            ready = proc.stdout.readline()
            assert ready.strip() == "ready ReadOnly.LOCKED", ready
            writer = rank(backends, tmp_path, 0)
            assert writer.statistics()["read_only"] is None
            for p in range(3):
                mla_fill(writer.test_pool, p, seed=70 + p)
            assert writer.batch_set_v1(["p0", "p1", "p2"], indices([0, 1, 2])) == [True] * 3
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "read 3 [True, True, True] True"
            assert proc.wait(120) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
