"""The page-file chain's machinery: checksum thread, shared fault log, I/O slot hand-over, one-chain creates."""

from __future__ import annotations

import asyncio
import errno
import logging
import mmap
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from disk_helpers import assert_clean, config, fill, is_root, key_of, page_files, payload, reserve

from aiokv.faults import FaultLog
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind
from aiokv.storage import checksum as checksum_module
from aiokv.storage import uring as uring_module
from aiokv.storage.backends import IOOp, UringPageIO
from aiokv.storage.checksum import Checksums
from aiokv.storage.pagefile import PageFiles, payload_checksum
from aiokv.storage.uring import OP_OPENAT


@pytest.mark.asyncio
async def test_checksums_inline_and_threaded_agree() -> None:
    data = mmap.mmap(-1, 1 << 20)
    data.write(bytes(range(256)) * 4096)
    view = memoryview(data)
    sums = Checksums(inline_bytes=64 << 10, threads=1)
    try:
        small, large = await asyncio.gather(sums.checksum(view[: 32 << 10]), sums.checksum(view))
        assert small == payload_checksum(view[: 32 << 10])
        assert large == payload_checksum(view)
    finally:
        await sums.aclose()
        view.release()
        data.close()


@pytest.mark.asyncio
async def test_cancelled_checksum_waits_for_the_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancelled caller keeps the memory until the thread stopped reading it."""
    gate, entered = threading.Event(), threading.Event()
    real = checksum_module.payload_checksum

    def slow(view: memoryview) -> int:
        entered.set()
        gate.wait(10)
        return real(view)

    monkeypatch.setattr(checksum_module, "payload_checksum", slow)
    sums = Checksums(inline_bytes=0, threads=1)
    data = bytearray(8192)
    try:
        task = asyncio.create_task(sums.checksum(memoryview(data)))
        await asyncio.to_thread(entered.wait, 10)
        task.cancel()
        for _ in range(5):
            await asyncio.sleep(0)
        assert not task.done()  # the thread still hashes the caller's memory
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        gate.set()
        await sums.aclose()


@pytest.mark.asyncio
async def test_checksum_failure_reaches_the_caller() -> None:
    sums = Checksums(inline_bytes=0, threads=1)
    view = memoryview(bytearray(4096))
    view.release()  # hashing a released view raises in the thread
    try:
        with pytest.raises(ValueError, match="released"):
            await sums.checksum(view)
    finally:
        await sums.aclose()


@pytest.mark.asyncio
async def test_large_pages_verify_through_the_checksum_thread(disk_dir: Path, backend: DiskBackend,
                                                              layout: KVLayout, pool: PagePool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksum_module, "INLINE_CHECKSUM_BYTES", 0)  # every payload goes to the thread
    monkeypatch.setattr(checksum_module, "INLINE_WRITE_CHECKSUM_BYTES", 0)
    hashed_in: set[str] = set()
    real = checksum_module.payload_checksum

    def spy(view: memoryview) -> int:
        hashed_in.add(threading.current_thread().name)
        return real(view)

    monkeypatch.setattr(checksum_module, "payload_checksum", spy)
    async with DiskTier(config(disk_dir, backend), layout, pool) as tier:
        h = fill(pool, key_of(1), 1)
        expect = payload(pool, h)
        assert await tier.write(key_of(1), h)
        pool.table.release(h)
        into = reserve(pool, key_of(2))
        assert await tier.read(key_of(1), into)
        assert payload(pool, into).equal(expect)
        pool.table.abort(into)
    assert hashed_in == {"aiokv-checksum-0"}
    assert_clean(pool)


@pytest.mark.asyncio
async def test_shared_fault_log_counts_disk_faults_once_under_their_names(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    shared = FaultLog(logging.getLogger("test"))
    shared.record("pool_exhausted", "a manager fault")
    async with DiskTier(config(disk_dir, backend), layout, pool, faults=shared) as tier:
        tier.backend.faults.inject(IOOp.WRITE, errno.EIO)
        h = fill(pool, key_of(1), 1)
        assert not await tier.write(key_of(1), h)
        pool.table.release(h)
        assert tier.statistics().errors[ErrorKind.EIO] == 1
    assert dict(shared.counts()) == {"pool_exhausted": 1, "disk_eio": 1}
    assert_clean(pool)


def test_fault_log_must_be_a_fault_log(disk_dir: Path, layout: KVLayout, pool: PagePool) -> None:
    with pytest.raises(TypeError):
        DiskTier(config(disk_dir, DiskBackend.THREADS), layout, pool, faults=object())  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_more_pages_than_io_slots_all_complete(disk_dir: Path, backend: DiskBackend, layout: KVLayout,
                                                     pool: PagePool) -> None:
    """Slots are handed over in FIFO order when all are busy; a cancelled waiter hands its slot on."""
    async with DiskTier(config(disk_dir, backend, queue_depth=2), layout, pool) as tier:
        handles = [fill(pool, key_of(i), i) for i in range(12)]
        writes = [asyncio.create_task(tier.write(key_of(i), handles[i])) for i in range(12)]
        await asyncio.sleep(0)
        writes[5].cancel()  # the job goes on without its caller
        results = await asyncio.gather(*writes, return_exceptions=True)
        assert isinstance(results[5], asyncio.CancelledError)
        assert all(r is True for i, r in enumerate(results) if i != 5)
        await tier.flush()
        for h in handles:
            pool.table.release(h)
        assert tier.statistics().in_flight == 0
        assert tier.statistics().writes == 12
    assert_clean(pool)


@pytest.mark.asyncio
async def test_new_page_file_is_one_chain_with_its_open(disk_dir: Path, layout: KVLayout, pool: PagePool) -> None:
    """io_uring: a new file's OPENAT travels in the same submission as its writes (no round trip)."""
    async with DiskTier(config(disk_dir, DiskBackend.URING), layout, pool) as tier:
        io = tier.backend
        assert isinstance(io, UringPageIO)
        seen: list[int] = []
        io.engine.fault_hook = lambda opcode: seen.append(opcode) and None  # type: ignore[func-returns-value]
        h = fill(pool, key_of(1), 1)
        assert await tier.write(key_of(1), h)
        pool.table.release(h)
        assert seen[0] == OP_OPENAT and len(seen) == 4  # open, header+page (WRITEV), close, rename
    assert_clean(pool)


@pytest.mark.asyncio
async def test_planted_temp_name_fails_the_one_chain_create(disk_dir: Path, backend: DiskBackend,
                                                            layout: KVLayout, pool: PagePool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """O_EXCL meets something under the fresh temporary name: UNSAFE, nothing written through it."""
    async with DiskTier(config(disk_dir, backend), layout, pool) as tier:
        planted = "planted-temp"
        monkeypatch.setattr(tier.files, "temp_name", lambda key: planted)
        target = disk_dir / "elsewhere"
        target.write_bytes(b"keep")
        (disk_dir / layout.fingerprint.hex() / key_of(1).hex()[:2] / planted).symlink_to(target)
        h = fill(pool, key_of(1), 1)
        assert not await tier.write(key_of(1), h)
        pool.table.release(h)
        assert tier.statistics().errors[ErrorKind.UNSAFE] == 1
        assert target.read_bytes() == b"keep"
    assert_clean(pool)


@pytest.mark.asyncio
async def test_reads_and_new_file_writes_run_no_task_per_page(disk_dir: Path, backend: DiskBackend,
                                                              layout: KVLayout, pool: PagePool) -> None:
    """The common page jobs move on by completion callbacks: no asyncio task is created for them."""
    async with DiskTier(config(disk_dir, backend), layout, pool) as tier:
        loop = asyncio.get_running_loop()
        created: list[object] = []

        def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
            created.append(coro)
            return asyncio.Task(coro, loop=loop, **kwargs)

        handles = [fill(pool, key_of(i), i) for i in range(12)]
        loop.set_task_factory(counting)
        try:
            written = [tier.write(key_of(i), handles[i]) for i in range(12)]  # more than the 8 I/O slots
            assert all([await w for w in written])
            for h in handles:
                pool.table.release(h)
            pool.table.evict(64)
            into = [reserve(pool, key_of(100 + i)) for i in range(12)]
            reads = [tier.read(key_of(i), into[i]) for i in range(12)]
            assert all([await r for r in reads])
        finally:
            loop.set_task_factory(None)
        assert created == []
        for h in into:
            pool.table.abort(h)
        assert tier.statistics().in_flight == 0
    assert_clean(pool)


@pytest.mark.asyncio
async def test_cancelled_read_waiting_for_a_slot_leaves_at_once(disk_dir: Path, backend: DiskBackend,
                                                                layout: KVLayout, pool: PagePool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """With every I/O slot busy, a cancelled read has touched nothing: it need not wait for anyone."""
    async with DiskTier(config(disk_dir, backend, queue_depth=1), layout, pool) as tier:
        for i in (1, 2):
            h = fill(pool, key_of(i), i)
            assert await tier.write(key_of(i), h)
            pool.table.release(h)
        gate, entered = asyncio.Event(), asyncio.Event()
        real = tier.backend.start_load
        held: list[asyncio.Task[None]] = []

        def gated(*args: Any) -> None:
            entered.set()

            async def later() -> None:
                await gate.wait()
                real(*args)

            held.append(asyncio.create_task(later()))

        monkeypatch.setattr(tier.backend, "start_load", gated)
        first, second = reserve(pool, key_of(101)), reserve(pool, key_of(102))
        busy = asyncio.create_task(tier.read(key_of(1), first))
        await entered.wait()
        queued = asyncio.create_task(tier.read(key_of(2), second))
        await asyncio.sleep(0)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued  # returns although the only slot's I/O is still held
        assert not busy.done()
        pool.table.abort(second)
        gate.set()
        assert await busy
        pool.table.abort(first)
        stats = tier.statistics()
        assert (stats.reads, stats.hits, stats.in_flight) == (1, 1, 0)
    assert_clean(pool)


def _temp_names_in_child(files: PageFiles, out: Any) -> None:
    out.send([files.temp_name(key_of(1)) for _ in range(3)])


def test_temp_names_are_fresh_per_process_and_after_fork(disk_dir: Path, layout: KVLayout) -> None:
    """A per-process random tag and a counter: never repeated, not even by a forked child."""
    import multiprocessing

    files = PageFiles(disk_dir, layout)
    mine = [files.temp_name(key_of(1)) for _ in range(3)]
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_temp_names_in_child, args=(files, theirs))
    child.start()
    try:
        assert ours.poll(30)
        names = ours.recv()
    finally:
        child.join(30)
    assert len(set(mine)) == 3
    assert not set(names) & set(mine + [files.temp_name(key_of(1)) for _ in range(3)])
    tag = lambda name: name.rsplit("-", 1)[1][:16]  # noqa: E731
    assert {tag(n) for n in names} != {tag(n) for n in mine}


@pytest.mark.asyncio
async def test_fault_hook_is_armed_only_by_an_injection(disk_dir: Path, layout: KVLayout, pool: PagePool) -> None:
    """Ops pay no fault-hook call in service; the first injection arms it and the fault lands."""
    async with DiskTier(config(disk_dir, DiskBackend.URING), layout, pool) as tier:
        io = tier.backend
        assert isinstance(io, UringPageIO)
        h = fill(pool, key_of(1), 1)
        assert await tier.write(key_of(1), h)
        assert io.engine.fault_hook is None
        io.faults.inject(IOOp.WRITE, errno.EIO)
        assert io.engine.fault_hook is not None
        assert not await tier.write(key_of(2), h)
        pool.table.release(h)
        assert tier.statistics().errors[ErrorKind.EIO] == 1
    assert_clean(pool)


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["parse_header", "reject"])
async def test_an_unexpected_error_in_a_read_callback_returns_its_slot(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    # Regression: a read callback that raised ended the read as a counted miss but kept its I/O
    # slot; with one slot every later read and write, and close(), waited for ever.
    import aiokv.storage.readpath as readpath

    async with DiskTier(config(disk_dir, backend, queue_depth=1), layout, pool) as tier:
        h = fill(pool, key_of(1), 1)
        assert await tier.write(key_of(1), h)
        expect = payload(pool, h).clone()
        pool.table.release(h)

        def boom(*_args: object) -> Any:
            raise RuntimeError("injected")

        if where == "parse_header":
            monkeypatch.setattr(readpath, "parse_header", boom)
        else:  # a bad header, then the rejection itself fails
            monkeypatch.setattr(readpath, "parse_header", lambda *_a: ErrorKind.CORRUPT)
            monkeypatch.setattr(tier, "_reject", boom)
        into = reserve(pool, key_of(2))
        async with asyncio.timeout(10):
            assert not await tier.read(key_of(1), into)
        pool.table.abort(into)
        assert tier.statistics().errors[ErrorKind.OTHER] >= 1
        monkeypatch.undo()
        into = reserve(pool, key_of(3))
        async with asyncio.timeout(10):  # the one slot is free again
            assert await tier.read(key_of(1), into)
        assert payload(pool, into).equal(expect)
        pool.table.abort(into)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_without_a_fanout_fd_the_temporary_goes_beside_the_final_name(
        disk_dir: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: where a fan-out directory could not be opened at start, the temporary was
    # created in the layout directory (start-up never removes leftovers there). Such a directory is
    # now opened when first needed, and both names are in it, relative to its descriptor.
    async with DiskTier(config(disk_dir, backend), layout, pool) as tier:
        assert tier._dir is not None
        key = key_of(7)
        os.close(tier._dir.fanout[key[0]])
        tier._dir.fanout[key[0]] = -1  # as if opening that fan-out directory had failed at start
        published: list[tuple[int, str, str]] = []
        io = tier._io
        assert io is not None
        start = io.start_publish

        def recording(dir_fd: int, temp: str, final: str, *rest: Any) -> None:
            published.append((dir_fd, temp, final))
            start(dir_fd, temp, final, *rest)

        monkeypatch.setattr(io, "start_publish", recording)
        h = fill(pool, key, 7)
        assert await tier.write(key, h)
        pool.table.release(h)
        fan = tier._dir.fanout[key[0]]
        assert fan >= 0  # opened late
        assert published and all(d == fan and "/" not in t and f == key.hex() for d, t, f in published)
    assert_clean(pool)


def _counting_tasks(loop: asyncio.AbstractEventLoop, created: list[object]) -> None:
    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        created.append(coro)
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(counting)


@pytest.mark.asyncio
async def test_recycled_writes_run_no_task_per_page(disk_dir: Path, backend: DiskBackend, layout: KVLayout,
                                                    pool: PagePool) -> None:
    # Regression (#14): a write into a full tier (recycling an evicted file: the steady state of a
    # cache) ran as a coroutine task per page with three submissions.
    files = 6
    capacity = files * (layout.page_bytes + 4096)
    async with DiskTier(config(disk_dir, backend, capacity), layout, pool) as tier:
        handles = [fill(pool, key_of(i), i) for i in range(2 * files)]
        expect = [payload(pool, h) for h in handles]
        for i in range(files):
            assert await tier.write(key_of(i), handles[i])
        created: list[object] = []
        loop = asyncio.get_running_loop()
        _counting_tasks(loop, created)
        try:
            written = [tier.write(key_of(i), handles[i]) for i in range(files, 2 * files)]
            assert all([await w for w in written])
        finally:
            loop.set_task_factory(None)
        assert created == []
        stats = tier.statistics()
        assert (stats.recycled, stats.pages, stats.in_flight) == (files, files, 0)
        for h in handles:
            pool.table.release(h)
        pool.table.evict(64)
        for i in range(files, 2 * files):
            into = reserve(pool, key_of(100 + i))
            assert await tier.read(key_of(i), into)
            assert payload(pool, into).equal(expect[i])
            pool.table.abort(into)
    assert_clean(pool)


async def _recycle_chains(disk_dir: Path, layout: KVLayout, pool: PagePool, cold: bool) -> list[list[int]]:
    """The submissions of one recycled write (io_uring, plain buffers); ``cold``: the victim's name
    is first dropped from the kernel's lookup caches."""
    capacity = layout.page_bytes + 4096
    async with DiskTier(config(disk_dir, DiskBackend.URING, capacity), layout, pool) as tier:
        io = tier.backend
        assert isinstance(io, UringPageIO)
        h = fill(pool, key_of(1), 1)
        expect = payload(pool, h)
        assert await tier.write(key_of(1), h)
        chains: list[list[int]] = []
        real = io.engine.submit

        def spy(ops: list[uring_module.SqeFields], keep: object, callback: Any, future: Any = None,
            expect: Any = None) -> None:
            chains.append([op[0] for op in ops])
            real(ops, keep, callback, future, expect)

        if cold:  # unused dentries and inodes out of the kernel's caches
            await asyncio.to_thread(Path("/proc/sys/vm/drop_caches").write_text, "2")
        io.engine.submit = spy  # type: ignore[method-assign]
        assert await tier.write(key_of(2), h)
        io.engine.submit = real  # type: ignore[method-assign]
        pool.table.release(h)
        pool.table.evict(64)
        assert tier.statistics().recycled == 1
        assert not tier.contains(key_of(1))
        into = reserve(pool, key_of(50))
        assert await tier.read(key_of(2), into)
        assert payload(pool, into).equal(expect)
        pool.table.abort(into)
    assert_clean(pool)
    assert [p.name for p in page_files(disk_dir)] == [key_of(2).hex()]
    return chains


@pytest.mark.asyncio
async def test_recycled_file_is_one_chain(disk_dir: Path, layout: KVLayout, pool: PagePool) -> None:
    """io_uring: the victim (just written: its name is in the lookup caches) opens on the loop
    (openat2 RESOLVE_CACHED, checked), then one chain writes it, closes it and renames it to the
    final name: no temporary name, no second rename, no OPENAT round trip."""
    chains = await _recycle_chains(disk_dir, layout, pool, cold=False)
    assert chains == [[uring_module.OP_WRITEV, uring_module.OP_CLOSE, uring_module.OP_RENAMEAT]]


@pytest.mark.root
@pytest.mark.asyncio
async def test_recycled_file_not_in_the_caches_opens_through_the_ring(disk_dir: Path, layout: KVLayout,
                                                                      pool: PagePool) -> None:
    """A victim whose name left the kernel's lookup caches (dropped for real: needs root) is not
    opened on the loop (the lookup could read the disk): an OPENAT through the ring first."""
    if not is_root():
        pytest.skip("dropping the kernel's caches needs root")
    chains = await _recycle_chains(disk_dir, layout, pool, cold=True)
    assert chains == [[OP_OPENAT], [uring_module.OP_WRITEV, uring_module.OP_CLOSE, uring_module.OP_RENAMEAT]]


@pytest.mark.asyncio
async def test_payload_is_hashed_before_an_io_slot(disk_dir: Path, backend: DiskBackend, layout: KVLayout,
                                                   pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    # #14: a write waiting for an I/O slot hashes its payload meanwhile, so the slot is held only
    # for the I/O itself.
    async with DiskTier(config(disk_dir, backend, queue_depth=1), layout, pool) as tier:
        h = fill(pool, key_of(1), 1)
        assert await tier.write(key_of(1), h)
        gate, entered = asyncio.Event(), asyncio.Event()
        real = tier.backend.start_load
        held: list[asyncio.Task[None]] = []

        def gated(*args: Any) -> None:
            entered.set()

            async def later() -> None:
                await gate.wait()
                real(*args)

            held.append(asyncio.create_task(later()))

        monkeypatch.setattr(tier.backend, "start_load", gated)
        assert tier._checksums is not None
        hashed: list[int] = []
        hashing = asyncio.Event()
        start = tier._checksums.start

        def counting(view: memoryview, done: Any, writing: bool = False) -> None:
            hashed.append(len(view))
            hashing.set()
            start(view, done, writing)

        monkeypatch.setattr(tier._checksums, "start", counting)
        into = reserve(pool, key_of(100))
        reading = asyncio.create_task(tier.read(key_of(1), into))
        try:
            await entered.wait()  # the only slot is busy
            writing = asyncio.create_task(tier.write(key_of(2), h))
            # Until the hash starts (a bounded wait, not a count of loop turns: on the H200 host
            # five turns were not always enough), while the slot stays held.
            async with asyncio.timeout(10):
                await hashing.wait()
            assert hashed == [layout.payload_bytes] and not writing.done()
        finally:
            gate.set()  # never leave the slot held: closing waits for it
        assert await reading and await writing
        assert len(hashed) == 2, hashed  # and the read's verification
        pool.table.release(h)
        pool.table.abort(into)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_auto_registers_the_pool_whole_where_sparse_tables_are_refused(
        disk_dir: Path, layout: KVLayout, pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    # #14: kernels 5.15-5.18 answer EINVAL to a sparse buffer table; AUTO then ran on plain
    # buffers for good. Now it registers the pool in one call, as a forced URING_FIXED does.
    real = uring_module.io_uring_register
    refused: list[int] = []

    def old_kernel(fd: int, opcode: int, arg: object, nr: int) -> int:
        if opcode in (uring_module.IORING_REGISTER_BUFFERS2, uring_module.IORING_REGISTER_BUFFERS_UPDATE):
            refused.append(opcode)
            raise OSError(errno.EINVAL, "no sparse tables before 5.19 (injected)")
        return real(fd, opcode, arg, nr)  # type: ignore[arg-type]

    monkeypatch.setattr(uring_module, "io_uring_register", old_kernel)
    region = mmap.mmap(-1, 2 * layout.page_bytes)
    view = memoryview(region)
    try:
        async with DiskTier(config(disk_dir, DiskBackend.AUTO), layout, pool) as tier:
            io = tier.backend
            assert isinstance(io, UringPageIO)
            await io.wait_registered()
            assert refused == [uring_module.IORING_REGISTER_BUFFERS2]
            assert tier.statistics().backend is DiskBackend.URING_FIXED
            chains: list[int] = []
            real_submit = io.engine.submit

            def spy(ops: list[uring_module.SqeFields], keep: object, callback: Any, future: Any = None,
            expect: Any = None) -> None:
                chains.extend(op[0] for op in ops)
                real_submit(ops, keep, callback, future, expect)

            io.engine.submit = spy  # type: ignore[method-assign]
            h = fill(pool, key_of(1), 1)
            expect = payload(pool, h)
            assert await tier.write(key_of(1), h)
            pool.table.release(h)
            into = reserve(pool, key_of(2))
            assert await tier.read(key_of(1), into)
            assert payload(pool, into).equal(expect)
            pool.table.abort(into)
            assert uring_module.OP_WRITE_FIXED in chains and uring_module.OP_READ_FIXED in chains
            await tier.register_memory(view)  # no slot left for it: plain buffers, counted
            assert tier.statistics().memory_unregistered == 1
            view[: layout.page_bytes] = bytes(range(256)) * (layout.page_bytes // 256)
            assert await tier.write_from(key_of(3), view[: layout.page_bytes])
            assert await tier.read_into(key_of(3), view[layout.page_bytes :])
            assert view[layout.page_bytes :] == view[: layout.page_bytes]
    finally:
        view.release()
        region.close()
    assert_clean(pool)


@pytest.mark.asyncio
async def test_an_unexpected_failure_is_logged_once(disk_dir: Path, layout: KVLayout, pool: PagePool,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    # Regression (#14): the first unexpected failure was logged twice (the fault log's first-of-a-
    # kind warning, then the traceback).
    import aiokv.storage.writepath as writepath

    def boom(*_args: object) -> None:
        raise RuntimeError("injected bug")

    async with DiskTier(config(disk_dir, DiskBackend.THREADS), layout, pool) as tier:
        monkeypatch.setattr(writepath, "pack_header", boom)
        h = fill(pool, key_of(1), 1)
        with caplog.at_level(logging.WARNING):
            assert not await tier.write(key_of(1), h)
            first = [r for r in caplog.records if "unexpected failure" in r.getMessage()]
            assert len(first) == 1 and "RuntimeError: injected bug" in first[0].getMessage()
            caplog.clear()
            assert not await tier.write(key_of(2), h)
            later = [r for r in caplog.records if "unexpected failure" in r.getMessage()]
            assert len(later) == 1 and later[0].exc_info is not None
        pool.table.release(h)
        assert tier.statistics().errors[ErrorKind.OTHER] == 2
    assert_clean(pool)


@pytest.mark.asyncio
async def test_checksum_results_reach_the_loop_in_one_wake_up() -> None:
    # #14: each hash finished in the thread woke the loop on its own (a socket write, a poll and a
    # read per page); results finished meanwhile now share one wake-up.
    sums = Checksums(inline_bytes=0, threads=1)
    data = [bytes([i]) * 8192 for i in range(8)]
    got: list[int | BaseException] = []
    deliveries = 0
    deliver = sums._deliver

    def counting() -> None:
        nonlocal deliveries
        deliveries += 1
        deliver()

    sums._deliver = counting  # type: ignore[method-assign]
    try:
        for d in data:
            sums.start(memoryview(d), got.append)
        # Block the loop (as a busy loop would be) until the thread hashed all eight.
        for _ in range(10_000):
            if len(sums._results) == 8:
                break
            threading.Event().wait(0.001)
        assert len(sums._results) == 8
        for _ in range(3):
            await asyncio.sleep(0)
        assert got == [payload_checksum(memoryview(d)) for d in data]
        assert deliveries == 1
    finally:
        await sums.aclose()


@pytest.mark.asyncio
async def test_a_page_costs_one_completion_per_submission(disk_dir: Path, layout: KVLayout, pool: PagePool) -> None:
    # #14: every op of a page's chain posted a CQE (five per new file, six per recycled one), each
    # drained and matched in Python on the loop; now the successful ones stay silent but for a
    # transfer not right before the chain's last op (uring.LOUD_TRANSFERS: its completion wakes the
    # loop anyway), and a file whose name is in the kernel's lookup caches is opened on the loop
    # (no OPENAT round trip).
    async with DiskTier(config(disk_dir, DiskBackend.URING, layout.page_bytes + 4096), layout, pool) as tier:
        io = tier.backend
        assert isinstance(io, UringPageIO)
        if not io.engine.skip_success:
            pytest.skip("the kernel cannot skip CQEs of successful ops (before 5.17)")
        cqes: list[int] = []
        complete = io.engine._complete

        def counting(user_data: int, res: int) -> None:
            cqes.append(res)
            complete(user_data, res)

        io.engine._complete = counting  # type: ignore[method-assign]
        h = fill(pool, key_of(1), 1)
        expect = payload(pool, h)
        assert await tier.write(key_of(1), h)
        page = layout.page_bytes + 4096
        assert cqes == [page, 0]  # a new file: one chain, its transfer (header and page) and its rename
        cqes.clear()
        assert await tier.write(key_of(2), h)  # recycles key 1's file
        assert cqes == [page, 0] and tier.statistics().recycled == 1  # victim opened on the loop, one chain
        pool.table.release(h)
        cqes.clear()
        into = reserve(pool, key_of(3))
        assert await tier.read(key_of(2), into)
        assert len(cqes) == 1  # opened on the loop (its name is in the lookup caches), one chain
        assert payload(pool, into).equal(expect)
        pool.table.abort(into)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_checksum_threads_start_off_the_loop(disk_dir: Path, backend: DiskBackend, layout: KVLayout,
                                                   pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    # #11/#14: ``Thread.start`` waits until the new thread runs; started from the loop it held the
    # loop for ms on a loaded machine. The tier starts its checksum threads in its preparing thread.
    starts: list[tuple[str, int]] = []
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        starts.append((self.name, threading.get_ident()))
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    loop_thread = threading.get_ident()
    async with DiskTier(config(disk_dir, backend), layout, pool) as tier:
        monkeypatch.undo()
        hashers = [ident for name, ident in starts if name.startswith("aiokv-checksum")]
        assert hashers, starts
        assert loop_thread not in hashers
        h = fill(pool, key_of(1), 1)
        assert await tier.write(key_of(1), h)  # the threads serve
        pool.table.release(h)
    assert not [t for t in threading.enumerate() if t.name.startswith("aiokv-checksum")]
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_written_page_up_to_1_mib_is_hashed_on_the_loop(disk_dir: Path, backend: DiskBackend,
                                                                layout: KVLayout, pool: PagePool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # #14: the thread's hand-off cost a recycled 1 MiB write ~30% of its CPU: a written page up to
    # INLINE_WRITE_CHECKSUM_BYTES is hashed in the writer's call; a read's hash (in the completion
    # drain, possibly several pages at once) still goes to the thread above INLINE_CHECKSUM_BYTES.
    assert checksum_module.INLINE_WRITE_CHECKSUM_BYTES == 1 << 20
    monkeypatch.setattr(checksum_module, "INLINE_CHECKSUM_BYTES", 0)  # reads: the thread
    monkeypatch.setattr(checksum_module, "INLINE_WRITE_CHECKSUM_BYTES", layout.payload_bytes)
    hashed_in: list[str] = []
    real = checksum_module.payload_checksum

    def spy(view: memoryview) -> int:
        hashed_in.append(threading.current_thread().name)
        return real(view)

    monkeypatch.setattr(checksum_module, "payload_checksum", spy)
    async with DiskTier(config(disk_dir, backend), layout, pool) as tier:
        h = fill(pool, key_of(1), 1)
        expect = payload(pool, h)
        assert await tier.write(key_of(1), h)
        assert hashed_in == [threading.current_thread().name]  # the loop's
        pool.table.release(h)
        into = reserve(pool, key_of(2))
        assert await tier.read(key_of(1), into)
        assert hashed_in[1:] == ["aiokv-checksum-0"]
        assert payload(pool, into).equal(expect)
        pool.table.abort(into)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_inline_write_hashing_is_bounded_per_loop_turn(disk_dir: Path, backend: DiskBackend,
                                                            layout: KVLayout, pool: PagePool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # #14: 32 writes of 1 MiB started at once were all hashed inline in one turn of the loop and
    # held it 5-12 ms. At most INLINE_WRITE_BYTES_PER_TURN are hashed inline per turn, the rest in
    # the thread; the next turn has its budget again.
    monkeypatch.setattr(checksum_module, "INLINE_CHECKSUM_BYTES", 0)
    monkeypatch.setattr(checksum_module, "INLINE_WRITE_CHECKSUM_BYTES", layout.payload_bytes)
    monkeypatch.setattr(checksum_module, "INLINE_WRITE_BYTES_PER_TURN", 2 * layout.payload_bytes)
    # The byte budget alone decides here: a slow turn (the threads backend starting its first
    # thread) would otherwise leave the rest for the next turn (DELIVER_TURN_S, tested apart).
    monkeypatch.setattr(checksum_module, "DELIVER_TURN_S", 10.0)
    hashed_in: list[str] = []
    real = checksum_module.payload_checksum

    def spy(view: memoryview) -> int:
        hashed_in.append(threading.current_thread().name)
        return real(view)

    monkeypatch.setattr(checksum_module, "payload_checksum", spy)
    loop_thread = threading.current_thread().name
    async with DiskTier(config(disk_dir, backend), layout, pool) as tier:
        handles = [fill(pool, key_of(i), i) for i in range(6)]
        assert all(await asyncio.gather(*(tier.write(key_of(i), handles[i]) for i in range(5))))  # one turn
        assert sorted(hashed_in) == sorted([loop_thread] * 2 + ["aiokv-checksum-0"] * 3)
        hashed_in.clear()
        assert await tier.write(key_of(5), handles[5])  # a later turn: inline again
        assert hashed_in == [loop_thread]
        for h in handles:
            pool.table.release(h)
    assert_clean(pool)
