"""Adversarial review 152 of following a locked directory (storage/follow.py, followpath.py).

A writer process stores, deletes, evicts and recycles pages of a small key space at random (seeded)
while a follower in this process reads all the time, each byte served checked against the key's
oracle; the writer is SIGKILLed at a random moment (after a SIGSTOP in some rounds: no take-over
while it is stopped), the follower takes over and must then hold the directory within its budget:
every page file on disk indexed, none left over, writes evicting down to ``capacity_bytes``.

Found: a page file the follower's read found gone (a plain miss: out of its index) whose name came
back under the same inode number before the next look (ext4 reuses a freed inode number at once: the
writer deleted or evicted the key and stored it again, or recycled its file away and another back)
was taken by the looks for the file they knew: never indexed again, a hit lost while following, and
after the take-over a page file the new writer neither counted in its budget nor ever evicted (seed
21 of 24 chaos rounds before the fix). Fixed: such keys' names are examined again at the next look
(``FollowState.forget``)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
from disk_helpers import config, fill, key_of, page_files, payload, reserve, seed_payload, small_layout
from follow_helpers import Looks, child, follow_config, follow_threads, open_fds, read_back, receive, store_page

from aiokv.keys import PageKey
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly, followpath
from aiokv.storage.pagefile import HEADER_BYTES

TAG = 7
KEYS = 40
"""Key space of the chaos writer: small, so that evicted keys are stored again (recycled names)."""
WRITER_FILES = 12
MISS_PAUSE_S = 0.001
"""A reader's pause after a miss, as an engine's next request comes later. Readers that missed in
a pure ``sleep(0)`` spin kept the loop thread holding the GIL: each system call of the look's
thread then waited up to the 5 ms switch interval for it back, and a look (256 fan-out
directories) took 5-50 s: a stopkill round timed out in CI (``docs/design.md``, follower looks)."""


def chaos_writer(directory: str, backend: str, seed: int, conn: Connection) -> None:
    """Stores ``key_of(i, TAG)`` (seed ``i``), three at a time, for random ``i`` below :data:`KEYS`,
    and deletes one now and then, into a budget of :data:`WRITER_FILES` files (evicting and
    recycling), until SIGKILLed. Sends ``("ready", read_only)``, then ``"warm"`` after 20 rounds."""

    async def main() -> None:
        layout = small_layout()
        pool = PagePool.create(layout, 16 * layout.page_bytes, register_cuda=False, workers=1)
        pool.wait_ready_blocking()
        capacity = WRITER_FILES * (layout.page_bytes + HEADER_BYTES)
        tier = DiskTier(config(Path(directory), DiskBackend(backend), capacity), layout, pool)
        await tier.start()
        conn.send(("ready", tier.read_only))
        rng = random.Random(seed)

        async def store(i: int) -> None:
            key = key_of(i, TAG)
            handle = fill(pool, key, i)
            try:
                await tier.write(key, handle)
            finally:
                pool.table.release(handle)
                pool.table.discard(key)

        rounds = 0
        while True:
            if rng.random() < 0.1:
                await tier.delete(key_of(rng.randrange(KEYS), TAG))
                continue
            await asyncio.gather(*(store(i) for i in rng.sample(range(KEYS), 3)))
            if tier.read_only is not None:  # it follows: writes are refused at once
                await asyncio.sleep(0.005)
            rounds += 1
            if rounds == 20:
                conn.send("warm")

    asyncio.run(main())


class Oracle:
    """Expected payload of ``key_of(i, TAG)``, built once per ``i``."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.known: dict[int, torch.Tensor] = {}

    def __call__(self, i: int) -> torch.Tensor:
        if i not in self.known:
            self.known[i] = seed_payload(self.pool, i, 98)
        return self.known[i]


async def _unlinks_done(tier: DiskTier) -> None:
    while tier._moving:
        await asyncio.wait(set(tier._moving.values()))


def _disk_keys(directory: Path) -> set[PageKey]:
    return {bytes.fromhex(p.name) for p in page_files(directory) if not p.name.startswith(".")}


async def _chaos_round(seed: int, backend: DiskBackend, directory: Path) -> str:
    """One round (see the module docstring). Modes: ``kill`` (SIGKILL at a random moment),
    ``stopkill`` (SIGSTOP first: two looks must not take over), ``restart`` (a new writer process
    started right after the kill races the follower for the lock: exactly one of them writes),
    ``close`` (the follower closed a random moment after the kill: mid-look or mid-take-over)."""
    rng = random.Random(seed)
    layout = small_layout()
    per_file = layout.page_bytes + HEADER_BYTES
    capacity_files = rng.choice([6, 12, 20])
    mode = rng.choice(["kill", "stopkill", "restart", "close"])
    pool = PagePool.create(layout, 64 * layout.page_bytes, register_cuda=False, workers=1)
    pool.wait_ready_blocking()
    oracle = Oracle(pool)
    try:
        with child(chaos_writer, str(directory), backend.value, seed) as (conn, proc):
            assert await receive(conn) == ("ready", None)
            follower = DiskTier(follow_config(directory, backend, capacity=capacity_files * per_file, interval=0.03),
                                layout, pool)
            await follower.start()
            try:
                looks = Looks(follower)
                assert follower.read_only is ReadOnly.LOCKED
                served, stop = [0], asyncio.Event()

                async def reader(r: int) -> None:
                    pick = random.Random(seed * 100 + r)
                    while not stop.is_set():
                        i = pick.randrange(KEYS)
                        into = reserve(pool, key_of(1000 + r, 99))
                        hit = False
                        try:
                            if hit := await follower.read(key_of(i, TAG), into):
                                served[0] += 1
                                assert torch.equal(payload(pool, into), oracle(i)), f"seed {seed}: page {i} wrong bytes"
                        finally:
                            pool.table.abort(into)
                        await asyncio.sleep(0 if hit else MISS_PAUSE_S)

                readers = [asyncio.create_task(reader(r)) for r in range(3)]
                assert await receive(conn) == "warm"
                await asyncio.sleep(rng.uniform(0.05, 0.6))  # a random moment of the writer's work
                assert proc.pid is not None
                if mode == "stopkill":
                    os.kill(proc.pid, signal.SIGSTOP)
                    await looks.next()
                    await looks.next()
                    assert follower.read_only is ReadOnly.LOCKED, "took the directory over from a stopped writer"
                os.kill(proc.pid, signal.SIGKILL)
                proc.join()
                if mode == "close":
                    await asyncio.sleep(rng.uniform(0, 0.08))
                    stop.set()
                    await asyncio.gather(*readers)
                    await follower.aclose()
                    return await _after_close(seed, directory, backend, layout, pool)
                if mode == "restart":
                    with child(chaos_writer, str(directory), backend.value, seed + 1000) as (conn2, proc2):
                        (_ready, second) = await receive(conn2)
                        await looks.next()
                        mode += " (new writer won)" if second is None else " (follower won)"
                        writers = [follower.read_only is None, second is None]
                        assert writers.count(True) <= 1, "two writers"
                        if second is None:  # it won: the follower follows it, then takes over at its death
                            assert await receive(conn2) == "warm"
                            assert follower.read_only is ReadOnly.LOCKED
                            assert proc2.pid is not None
                            os.kill(proc2.pid, signal.SIGKILL)
                        await looks.until(lambda: follower.statistics().took_over == 1)
                        await _within_budget(seed, follower, pool, directory, capacity_files, stop, readers)
                else:
                    await looks.until(lambda: follower.statistics().took_over == 1)
                    await _within_budget(seed, follower, pool, directory, capacity_files, stop, readers)
                stats = follower.statistics()
            finally:
                await follower.aclose()
        return (f"seed {seed} {backend.value} {mode} files {capacity_files}: served {served[0]}, "
                f"corrupt {stats.corrupt}, follow_raced {stats.follow_raced}, "
                f"errors {[(k.value, n) for k, n in stats.errors.items() if n]}, "
                f"in {stats.followed_in} out {stats.followed_out} looks {stats.follow_looks}")
    finally:
        pool.close()


async def _within_budget(seed: int, follower: DiskTier, pool: PagePool, directory: Path, capacity_files: int,
                         stop: asyncio.Event, readers: list[asyncio.Task[None]]) -> None:
    """After the take-over: no temporary file left, every page file indexed, and writes keep the
    files on disk within the new writer's budget."""
    stop.set()
    await asyncio.gather(*readers)
    await _unlinks_done(follower)
    stats = follower.statistics()
    assert follower.read_only is None
    # Pages the writer evicted or recycled under the follower's reads: plain misses or checksum
    # refusals (counted corrupt, documented), never an I/O fault.
    assert not any(stats.errors.values()), stats
    assert not [p for p in page_files(directory) if p.name.startswith(".")], "temporary files left"
    on_disk = _disk_keys(directory)
    assert on_disk <= set(follower._index), f"seed {seed}: page files on disk the new writer does not index"
    assert stats.bytes_stored <= stats.effective_capacity_bytes
    for i in range(KEYS, KEYS + 2 * capacity_files):
        assert await store_page(follower, pool, i, TAG)
    await _unlinks_done(follower)
    on_disk = _disk_keys(directory)
    assert len(on_disk) <= capacity_files, (len(on_disk), capacity_files)
    assert on_disk == set(follower._index)


async def _after_close(seed: int, directory: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> str:
    """The follower closed mid-look or mid-take-over: its look thread ended and the lock is free
    (a new tier takes the directory over and finds every page file)."""
    assert follow_threads() == []
    async with DiskTier(config(directory, backend, capacity=1 << 30), layout, pool) as fresh:
        assert fresh.read_only is None, f"seed {seed}: the closed follower kept the lock"
        assert _disk_keys(directory) == set(fresh._index)
    return f"seed {seed} {backend.value} close"


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["renamed", "stored_again"])
async def test_page_gone_when_read_then_back_under_its_inode_is_followed_and_taken_over(
        how: str, disk_dir: Path, backend: DiskBackend, pool: PagePool) -> None:
    """The writer's file of K is gone when the follower reads K (a plain miss: out of the index),
    then K's name is back under the same inode number before the follower's next look: moved back
    (as recycling K's file away and another file back to K does), or K deleted and stored again (ext4
    hands the freed inode number to the new file). Before: the look knew that name and inode, took it
    for the file it had seen and never indexed it again: a hit lost while following, and after the
    take-over a page file the new writer neither counted in its budget nor ever evicted."""
    layout = small_layout()
    writer = DiskTier(config(disk_dir, backend), layout, pool)
    await writer.start()
    try:
        for i in range(3):
            assert await store_page(writer, pool, i, TAG)
        follower = DiskTier(follow_config(disk_dir, backend), layout, pool)
        await follower.start()
        try:
            looks = Looks(follower)
            assert follower.read_only is ReadOnly.LOCKED and follower.contains(key_of(1, TAG))
            path = Path(writer.files.path(key_of(1, TAG)))
            inode = os.stat(path).st_ino
            if how == "renamed":
                os.rename(path, path.with_name("parked"))
            else:
                await writer.delete(key_of(1, TAG))
            assert not await read_back(follower, pool, 1, TAG)  # gone: a plain miss
            if how == "renamed":
                os.rename(path.with_name("parked"), path)
            else:
                assert await store_page(writer, pool, 1, TAG)
            reused = os.stat(path).st_ino == inode
            await looks.next()
            assert follower.contains(key_of(1, TAG)), f"not followed (same inode: {reused})"
            assert await read_back(follower, pool, 1, TAG)
            await writer.aclose()
            await looks.until(lambda: follower.statistics().took_over == 1)
            assert _disk_keys(disk_dir) == set(follower._index) == {key_of(i, TAG) for i in range(3)}
            stats = follower.statistics()
            assert stats.corrupt == 0 and not any(stats.errors.values()), stats
        finally:
            await follower.aclose()
    finally:
        await writer.aclose()


@pytest.mark.asyncio
async def test_page_gone_when_read_during_the_take_over_look_then_back_leaves_no_file_outside_the_index(
        disk_dir: Path, backend: DiskBackend, pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, but the read that finds K's file gone lands after the look that takes the
    directory over began (it asked the looks to examine K's name again before they started): that
    look knew K's name and inode, took the file back under them for the one it had seen, and the
    take-over left it on disk outside the new writer's index and budget, never evicted. A miss the
    chaos drive's readers meet there when the loop runs late (the read's completion applied after
    the look started) left that file behind. The take-over now unlinks such names."""
    layout = small_layout()
    writer = DiskTier(config(disk_dir, backend), layout, pool)
    await writer.start()
    try:
        for i in range(3):
            assert await store_page(writer, pool, i, TAG)
        follower = DiskTier(follow_config(disk_dir, backend), layout, pool)
        await follower.start()
        try:
            looks = Looks(follower)
            assert follower.read_only is ReadOnly.LOCKED and follower.contains(key_of(1, TAG))
            path = Path(writer.files.path(key_of(1, TAG)))
            await writer.aclose()  # the lock is free: the next look takes the directory over
            entered, go, real = threading.Event(), threading.Event(), followpath.look

            def held(*args: object) -> object:  # the look's thread, its forget step done
                entered.set()
                go.wait(30)
                return real(*args)  # type: ignore[arg-type]

            monkeypatch.setattr(followpath, "look", held)
            take_over = asyncio.ensure_future(looks.next())
            try:
                assert await asyncio.to_thread(entered.wait, 30)
                os.rename(path, path.with_name("parked"))
                assert not await read_back(follower, pool, 1, TAG)  # gone: a plain miss
                os.rename(path.with_name("parked"), path)  # back under its inode, before the listing
            finally:
                go.set()
                await take_over
            assert follower.statistics().took_over == 1 and follower.read_only is None
            await _unlinks_done(follower)
            assert _disk_keys(disk_dir) <= set(follower._index), "a page file the new writer does not index"
            for i in range(3, 6):
                assert await store_page(follower, pool, i, TAG)
            await _unlinks_done(follower)
            assert _disk_keys(disk_dir) == set(follower._index)
            stats = follower.statistics()
            assert stats.corrupt == 0 and not any(stats.errors.values()), stats
        finally:
            await follower.aclose()
    finally:
        await writer.aclose()


CHAOS_SEEDS = list(range(int(os.environ.get("REV152_SEEDS", "12"))))
"""Seeds run (REV152_SEEDS=60 for a longer sweep: 60 passed, ~48 s on the 2-vCPU VM)."""


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", CHAOS_SEEDS)
async def test_chaos_writer_killed_follower_takes_over_within_budget(seed: int, tmp_path: Path) -> None:
    fds = open_fds()
    backend = [DiskBackend.THREADS, DiskBackend.URING, DiskBackend.URING_FIXED][seed % 3]
    print(await _chaos_round(seed, backend, tmp_path / "disk"))
    assert follow_threads() == []
    # The fork server's pipes stay (started by the first child); nothing of the tier may.
    extra = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in open_fds() - fds}
    assert not {fd: what for fd, what in extra.items() if not what.startswith("pipe:")}, extra
