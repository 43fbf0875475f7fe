"""Review 168: the writer's check of its ``.lock`` name (e14166c, ``storage/lockwatch.py``) under
real faults, seeded.

Two tiers in this process and one cache in a child process share a layout directory on a loop
ext4; between writes and reads through all of them, at random: ``rm .lock``, ``mv`` of a fresh
file onto it, a symlink planted there then removed, the child SIGKILLed, SIGSTOPped and
SIGCONTed, closed and started again, tiers here closed and started again, the file system
remounted ``ro`` then ``rw``. Budgets of :data:`FILES` page files, so eviction runs all along.

Oracles: every page read back is bit-exact for its key (all caches store seed ``i``'s bytes under
``key_of(i, TAG)``); once the faults stop, within a bound, exactly one cache writes and the others
are ``LOCKED``, and stay so past another check and look; the writer's next eviction keeps the
directory within its budget plus the files outside its index (the documented window's writes by
a cache that lost the lock), and once it hands over (its close), the next writer's take-over scan
leaves at most :data:`FILES` files; no file is written outside the directory (the symlink's
target stays empty); every close returns within a bound and leaves no lock or look thread, no
descriptor, no reference. ``lock_retaken + lock_lost`` never exceeds the name changes injected.

Defect found (fixed in ``storage/follow.py``): ``rm .lock`` and then the writer closed or died
before its next check: nobody made the file again, and the followers stayed read-only for good
(a follower never created ``.lock``). ``AIOKV_REV168_SEEDS=N`` (or ``A-B``) widens the seeds."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import threading
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
from child_procs import end_child, fork_context
from disk_helpers import assert_clean, config
from follow_helpers import Looks, open_fds, read_back, receive, started, store_page
from fs_helpers import freeze, loop_ext4, remount, thaw
from rev168_children import TAG, cache_child
from test_lock_replaced import LockChecks

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ErrorKind, ReadOnly
from aiokv.storage.layoutdir import UnsafeDirectoryError
from aiokv.storage.pagefile import HEADER_BYTES, TEMP_PREFIX

INTERVAL_S = 0.05
"""``follow_interval_s`` of every cache: checks and looks every 50 ms."""
FILES = 6
"""Each cache's budget, in page files."""
KEYS = 40
"""Seeds of the pages the rounds write and read."""
ROUNDS = 24
BOUND_S = 20.0
"""Longest any wait of these tests may take (a hang fails the test)."""
BACKENDS = [DiskBackend.THREADS, DiskBackend.URING, DiskBackend.URING_FIXED]


def _seeds() -> list[int]:
    wide = os.environ.get("AIOKV_REV168_SEEDS", "")
    if "-" in wide:
        first, last = wide.split("-")
        return list(range(int(first), int(last) + 1))
    return list(range(int(wide))) if wide else [0, 1, 2]


def _capacity(layout: KVLayout) -> int:
    return FILES * (HEADER_BYTES + layout.page_bytes)


def _conf(disk_dir: Path, backend: DiskBackend, layout: KVLayout, interval: float = INTERVAL_S) -> Any:
    return config(disk_dir, backend, _capacity(layout), follow_interval_s=interval, min_free_bytes=0,
                  free_space_recheck_s=0.01)


def _lock_threads(limit_s: float = 5.0) -> list[str]:
    """Lock-check and look threads still running ``limit_s`` seconds on."""
    names = ("aiokv-disk-lock", "aiokv-disk-follow")
    for thread in threading.enumerate():
        if thread.name.startswith(names):
            thread.join(limit_s)
    return [t.name for t in threading.enumerate() if t.name.startswith(names)]


class Child:
    """:func:`cache_child` in a process of its own: started, SIGSTOPped, SIGCONTed, killed."""

    def __init__(self, disk_dir: Path, backend: DiskBackend, layout: KVLayout) -> None:
        self.args = (str(disk_dir), backend.value, _capacity(layout), INTERVAL_S)
        self.proc: Any = None
        self.pid = 0
        self.conn: Connection | None = None
        self.stopped = False
        self.last: tuple[Any, ...] = (None, 0, 0, 0, 0)
        self.seen_changes = 0
        """``lock_retaken + lock_lost`` of the children that ended (their last status)."""

    @property
    def alive(self) -> bool:
        return self.proc is not None

    async def start(self) -> bool:
        """A new child; False when its start refused the directory (it ended)."""
        ctx = fork_context()
        parent, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=cache_child, args=(*self.args, theirs), daemon=True)
        self.proc.start()
        self.pid = self.proc.pid
        theirs.close()
        self.conn = parent
        answer = await receive(parent, BOUND_S)
        if answer[0] == "refused":
            self.end()
            return False
        self.last = (answer[1], 0, 0, 0, 0)
        return True

    async def ask(self, message: object) -> Any:
        assert self.conn is not None and not self.stopped
        self.conn.send(message)
        return await receive(self.conn, BOUND_S)

    async def status(self) -> tuple[Any, ...]:
        self.last = await self.ask("status")
        return self.last

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.proc.pid, sig)
        self.stopped = sig is signal.SIGSTOP

    def end(self) -> None:
        """SIGKILL (if still running) and reap."""
        if self.proc is None:
            return
        self.seen_changes += self.last[1] + self.last[2]
        end_child(self.proc, BOUND_S)
        self.proc.close()  # its sentinel
        assert self.conn is not None
        self.conn.close()
        pid, self.proc, self.conn, self.stopped = self.pid, None, None, False
        for name in os.listdir("/dev/shm"):  # a killed pool never unlinks its segment
            if name.startswith(f"aiokv-{pid}-"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"/dev/shm/{name}")

    async def close(self) -> None:
        assert await self.ask("close") == "closed"
        self.end()


class Rig:
    """Two tiers here (``None`` while closed or refused) and the child, over one directory."""

    def __init__(self, rng: random.Random, mount: Path, backend: DiskBackend, layout: KVLayout,
                 pool: PagePool) -> None:
        self.rng, self.mount, self.backend, self.layout, self.pool = rng, mount, backend, layout, pool
        self.disk_dir = mount / "disk"
        self.tiers: list[DiskTier | None] = [None, None]
        self.child = Child(self.disk_dir, BACKENDS[(BACKENDS.index(backend) + 1) % 3], layout)
        self.lock = DiskTier(_conf(self.disk_dir, backend, layout), layout, pool).files.layout_dir / ".lock"
        self.target = mount / "elsewhere"  # what a planted symlink names: nobody may write there
        self.target.write_bytes(b"")
        self.planted = False
        self.read_only_fs = False
        self.name_changes = 0
        self.closed_changes = 0  # lock_retaken + lock_lost of tiers here that closed
        self.done: dict[str, int] = {}

    async def start_tier(self, slot: int) -> None:
        tier = DiskTier(_conf(self.disk_dir, self.backend, self.layout), self.layout, self.pool)
        try:
            async with asyncio.timeout(BOUND_S):
                await tier.start()
        except UnsafeDirectoryError:
            assert self.planted, "a start refused the directory with nothing planted"
            await tier.aclose()
            return
        self.tiers[slot] = tier

    async def close_tier(self, slot: int) -> None:
        tier = self.tiers[slot]
        if tier is None:
            return
        self.tiers[slot] = None
        stats = tier.statistics()
        self.closed_changes += stats.lock_retaken + stats.lock_lost
        assert await tier.close_within(BOUND_S), "a close took longer than the bound"

    # -- the faults ----------------------------------------------------------------------------

    def rm(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.lock)
            self.name_changes += 1
            self.planted = False

    def mv(self) -> None:
        fresh = self.lock.with_name("lock.new")
        fresh.write_bytes(b"")
        os.rename(fresh, self.lock)
        self.name_changes += 1
        self.planted = False

    def plant(self) -> None:
        self.rm()
        with contextlib.suppress(FileExistsError):  # made again since (a check, a start, a look)
            os.symlink(self.target, self.lock)
            self.name_changes += 1
            self.planted = True

    def unplant(self) -> None:
        if self.planted:
            self.rm()

    async def remount_ro(self) -> bool:
        """``remount,ro``, retried while files are open for writing (EBUSY) for up to 2 s."""
        async with asyncio.timeout(BOUND_S):
            for _ in range(400):
                try:
                    await asyncio.to_thread(remount, self.mount, "ro")
                except AssertionError as exc:
                    if "busy" not in str(exc):
                        raise
                    await asyncio.sleep(0.005)
                    continue
                self.read_only_fs = True
                return True
        return False

    async def remount_rw(self) -> None:
        if self.read_only_fs:
            await asyncio.to_thread(remount, self.mount, "rw")
            self.read_only_fs = False

    async def fault(self) -> None:
        child = self.child
        what = self.rng.choice(["rm", "rm", "mv", "mv", "plant", "unplant", "kill", "stop", "cont", "close_child",
                                "start_child", "restart_0", "restart_1", "close_0", "remount", "nothing"])
        if what == "rm":
            self.rm()
        elif what == "mv":
            self.mv()
        elif what == "plant":
            self.plant()
        elif what == "unplant":
            self.unplant()
        elif what == "kill" and child.alive:
            child.end()
        elif what == "stop" and child.alive and not child.stopped:
            child.signal(signal.SIGSTOP)
        elif what == "cont" and child.alive and child.stopped:
            child.signal(signal.SIGCONT)
        elif what == "close_child" and child.alive and not child.stopped:
            await child.close()
        elif what == "start_child" and not child.alive:
            await child.start()
        elif what.startswith("restart_"):
            slot = int(what[-1])
            await self.close_tier(slot)
            await self.start_tier(slot)
        elif what == "close_0":
            await self.close_tier(0)
        elif what == "remount":
            if not await self.remount_ro():
                what = "remount_busy"
            else:
                await self.work()  # writes and reads meet EROFS
                await self.remount_rw()
        self.done[what] = self.done.get(what, 0) + 1

    # -- the work ------------------------------------------------------------------------------

    async def work(self) -> None:
        """Writes and reads through every cache running; a hit must be bit-exact."""
        rng = self.rng
        async with asyncio.timeout(BOUND_S):
            for tier in self.tiers:
                if tier is None:
                    continue
                for i in rng.sample(range(KEYS), 2):
                    await store_page(tier, self.pool, i, TAG)
                for i in rng.sample(range(KEYS), 3):
                    await read_back(tier, self.pool, i, TAG)  # other bytes fail the test there
            child = self.child
            if child.alive and not child.stopped:
                await child.ask(("write", rng.sample(range(KEYS), 2)))
                answers = await child.ask(("read", rng.sample(range(KEYS), 3)))
                assert "wrong" not in answers, answers
        if rng.random() < 0.5:
            # Time passes (not a synchronisation): the checks and looks race the next fault.
            await asyncio.sleep(rng.uniform(0, 2 * INTERVAL_S))

    # -- after the faults ----------------------------------------------------------------------

    async def states(self) -> list[ReadOnly | None]:
        """Every running cache's ``read_only``, each asked to check and look at once."""
        found: list[ReadOnly | None] = []
        for tier in self.tiers:
            if tier is not None:
                tier._check_lock_soon()
                tier._look_soon()
                found.append(tier.read_only)
        if self.child.alive:
            found.append((await self.child.status())[0])
        return found

    async def one_writer(self) -> list[ReadOnly | None]:
        """Polls (every ``follow_interval_s``, within :data:`BOUND_S`) until exactly one cache writes
        and the others are ``LOCKED``."""
        states: list[ReadOnly | None] = []
        try:
            async with asyncio.timeout(BOUND_S):
                while True:
                    states = await self.states()
                    if states.count(None) == 1 and states.count(ReadOnly.LOCKED) == len(states) - 1:
                        return states
                    await asyncio.sleep(INTERVAL_S)
        except TimeoutError:
            raise AssertionError(f"no single writer {BOUND_S} s after the faults stopped: {states}") from None

    def changes_seen(self) -> int:
        seen = self.closed_changes + self.child.seen_changes + self.child.last[1] + self.child.last[2]
        return seen + sum(t.statistics().lock_retaken + t.statistics().lock_lost for t in self.tiers if t)


def _files(layout_dir: Path) -> tuple[list[Path], list[Path]]:
    """(page and spare files, temporary files) under the layout directory."""
    every = [p for p in layout_dir.rglob("*") if p.is_file() and p.name not in (".lock",)]
    temps = [p for p in every if p.name.startswith(TEMP_PREFIX)]
    return [p for p in every if p not in temps], temps


def _stray_keys(writer: DiskTier, layout_dir: Path) -> int:
    """Page files the writer has not indexed (written by a cache that lost the lock)."""
    pages, _ = _files(layout_dir)
    return sum(1 for p in pages if not p.name.startswith(".") and not writer.contains(bytes.fromhex(p.name)))


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("seed", _seeds())
async def test_lock_faults_leave_one_writer_and_right_bytes(
        seed: int, tmp_path: Path, layout: KVLayout, pool: PagePool) -> None:
    rng = random.Random(seed)
    backend = BACKENDS[seed % 3]
    fork_context()
    forkserver.ensure_running()  # its pipes stay open for the session: not this test's
    fds = open_fds()
    with loop_ext4(tmp_path, 24) as mount:
        rig = Rig(rng, mount, backend, layout, pool)
        try:
            await rig.start_tier(0)
            assert await rig.child.start()
            await rig.start_tier(1)
            for _ in range(ROUNDS):
                await rig.fault()
                await rig.work()
            # The faults stop: the name is a file again, the child runs, the file system is rw.
            rig.unplant()
            await rig.remount_rw()
            if rig.child.stopped:
                rig.child.signal(signal.SIGCONT)
            if not rig.child.alive:
                assert await rig.child.start()
            for slot in (0, 1):
                if rig.tiers[slot] is None:
                    await rig.start_tier(slot)
            await rig.one_writer()
            await asyncio.sleep(2 * INTERVAL_S)  # a check and a look later (time passing, not a wait for an event)
            states = await rig.one_writer()
            assert rig.changes_seen() <= rig.name_changes, (rig.changes_seen(), rig.name_changes, rig.done)
            print(f"rev168 seed {seed}: {rig.done} name changes {rig.name_changes} seen {rig.changes_seen()}")

            # The writer alone stores, evicting by its budget; every cache serves right bytes.
            writer_slot = states.index(None)
            fresh = list(range(100, 100 + FILES))
            if writer_slot < 2:
                writer = rig.tiers[writer_slot]
                assert writer is not None
                for i in fresh:
                    assert await store_page(writer, pool, i, TAG), (i, writer.statistics())
                for i in fresh:
                    assert await read_back(writer, pool, i, TAG), i
                pages, _ = _files(rig.lock.parent)
                strays = _stray_keys(writer, rig.lock.parent)
                assert len(pages) <= FILES + strays, (len(pages), strays)
                await rig.close_tier(writer_slot)
            else:
                assert await rig.child.ask(("write", fresh)) == [True] * FILES
                assert await rig.child.ask(("read", fresh)) == [True] * FILES
                await rig.child.close()
            # Handed over: the next writer's take-over scan trims the directory to its budget.
            states = await rig.one_writer()
            pages, temps = _files(rig.lock.parent)
            assert len(pages) + len(temps) <= FILES, ([p.name for p in pages], [p.name for p in temps], rig.done)
            for tier in rig.tiers:
                if tier is not None:
                    for i in rng.sample(fresh, 3):
                        await read_back(tier, pool, i, TAG)
            assert rig.target.stat().st_size == 0, "a cache wrote through the planted symlink"
            assert sorted(os.listdir(mount)) == ["disk", "elsewhere", "lost+found"], os.listdir(mount)
        finally:
            await rig.remount_rw()
            for slot in (0, 1):
                await rig.close_tier(slot)
            if rig.child.alive and not rig.child.stopped:
                await rig.child.close()
            rig.child.end()
    assert _lock_threads() == []
    assert open_fds() <= fds, {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in open_fds() - fds}
    assert_clean(pool)


# -- the defect: a .lock removed, and its writer gone before its check -----------------------


@pytest.mark.asyncio
async def test_a_lock_removed_before_its_writer_closed_is_taken_over(
        disk_dir: Path, layout: KVLayout, pool: PagePool) -> None:
    """``rm .lock``, then the writer closes before its next check: before, the followers never
    took over (none made the file again). Now a look makes it and the next look takes it."""
    backend = DiskBackend.THREADS
    a = DiskTier(_conf(disk_dir, backend, layout, interval=3600.0), layout, pool)
    await a.start()
    try:
        assert await store_page(a, pool, 0, TAG)
        async with started(DiskTier(_conf(disk_dir, backend, layout, interval=3600.0), layout, pool)) as f:
            looks = Looks(f)
            os.unlink(a.files.layout_dir / ".lock")
            await a.aclose()
            await looks.next()  # makes .lock again
            await looks.next()  # takes it
            stats = f.statistics()
            assert (stats.read_only, stats.took_over) == (None, 1), stats
            assert not any(stats.errors.values()), stats.errors
            assert await read_back(f, pool, 0, TAG)
            assert await store_page(f, pool, 1, TAG)
    finally:
        await a.aclose()
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_lock_removed_before_its_writer_was_killed_is_taken_over(
        disk_dir: Path, layout: KVLayout, pool: PagePool) -> None:
    """As above with the writer a process SIGKILLed (nothing it could do at a close)."""
    child = Child(disk_dir, DiskBackend.THREADS, layout)
    child.args = (*child.args[:3], 3600.0)  # its check never comes
    try:
        assert await child.start()
        assert await child.ask(("write", [0])) == [True]
        async with started(DiskTier(_conf(disk_dir, DiskBackend.THREADS, layout, interval=3600.0), layout,
                                    pool)) as f:
            looks = Looks(f)
            assert f.read_only is ReadOnly.LOCKED
            os.unlink(f.files.layout_dir / ".lock")
            child.end()
            await looks.next()
            await looks.next()
            assert (f.read_only, f.statistics().took_over) == (None, 1)
            assert await read_back(f, pool, 0, TAG)
    finally:
        child.end()
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_follower_never_makes_the_lock_before_a_running_writer_checks(
        disk_dir: Path, layout: KVLayout, pool: PagePool) -> None:
    """The follower's look makes a removed ``.lock`` but does not lock it: the running writer's next
    check takes it (``lock_retaken``), and the follower's next look finds it held."""
    backend = DiskBackend.THREADS
    async with started(DiskTier(_conf(disk_dir, backend, layout, interval=3600.0), layout, pool)) as a:
        checks = LockChecks(a)
        async with started(DiskTier(_conf(disk_dir, backend, layout, interval=3600.0), layout, pool)) as f:
            looks = Looks(f)
            os.unlink(a.files.layout_dir / ".lock")
            await looks.next()
            assert (a.files.layout_dir / ".lock").exists() and f.read_only is ReadOnly.LOCKED
            await checks.next()
            await looks.next()
            assert (a.read_only, a.statistics().lock_retaken, a.statistics().lock_lost) == (None, 1, 0)
            assert (f.read_only, f.statistics().took_over) == (ReadOnly.LOCKED, 0)
    assert_clean(pool)


# -- counters, where deterministic ------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", _seeds())
async def test_counters_match_the_name_changes(seed: int, disk_dir: Path, layout: KVLayout, pool: PagePool) -> None:
    """A seeded sequence of name changes under a writer, each followed by one check: ``rm`` and
    ``mv`` each count one ``lock_retaken``; a symlink counts one UNSAFE per check and nothing else;
    its removal one ``lock_retaken``; ``rm`` then a cache started in another process: one
    ``lock_lost`` and the writer follows it, taking over once that process is killed."""
    rng = random.Random(seed)
    backend = BACKENDS[seed % 3]
    lock_dir = DiskTier(_conf(disk_dir, backend, layout), layout, pool).files.layout_dir
    lock, target = lock_dir / ".lock", disk_dir.parent / "elsewhere"
    target.write_bytes(b"")
    want = {"retaken": 0, "lost": 0, "unsafe": 0, "took_over": 0}
    async with started(DiskTier(_conf(disk_dir, backend, layout, interval=3600.0), layout, pool)) as a:
        checks, looks = LockChecks(a), Looks(a)
        for step in range(8):
            what = rng.choice(["rm", "mv", "plant", "other"])
            if what == "rm":
                os.unlink(lock)
                want["retaken"] += 1
            elif what == "mv":
                lock.with_name("lock.new").write_bytes(b"")
                os.rename(lock.with_name("lock.new"), lock)
                want["retaken"] += 1
            elif what == "plant":
                os.unlink(lock)
                os.symlink(target, lock)
                for _ in range(rng.randint(1, 3)):
                    await checks.next()
                    want["unsafe"] += 1
                os.unlink(lock)
                want["retaken"] += 1
            else:
                os.unlink(lock)
                child = Child(disk_dir, DiskBackend.THREADS, layout)
                try:
                    assert await child.start()
                    assert child.last[0] is None  # it made and took the name
                    await checks.next()
                    want["lost"] += 1
                    assert a.read_only is ReadOnly.LOCKED
                    assert not await store_page(a, pool, 50 + step, TAG)
                finally:
                    child.end()
                await looks.until(lambda: a.read_only is None)
                want["took_over"] += 1
            await checks.next()
            stats = a.statistics()
            got = {"retaken": stats.lock_retaken, "lost": stats.lock_lost,
                   "unsafe": stats.errors.get(ErrorKind.UNSAFE, 0), "took_over": stats.took_over}
            assert got == want, (step, what, got, want)
            assert stats.read_only is None
            assert await store_page(a, pool, step, TAG) and await read_back(a, pool, step, TAG)
    assert target.stat().st_size == 0
    assert_clean(pool)


# -- a close while the check is stuck in the kernel -------------------------------------------


def _thread_state(native_id: int) -> str:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_close_while_the_check_is_stuck_on_a_frozen_file_system_is_bounded(
        tmp_path: Path, layout: KVLayout, pool: PagePool) -> None:
    """``rm .lock``, then the file system frozen (``fsfreeze``): the writer's check blocks in the
    kernel making ``.lock`` again. ``close_within`` returns False within its bound; once thawed the
    close ends (``io_ended``), the check's thread with it, and nothing is left open."""
    fds = open_fds()
    with loop_ext4(tmp_path, 24) as mount:
        tier = DiskTier(_conf(mount / "disk", DiskBackend.THREADS, layout, interval=3600.0), layout, pool)
        await tier.start()
        frozen = False
        try:
            assert await store_page(tier, pool, 0, TAG)
            os.unlink(tier.files.layout_dir / ".lock")
            await asyncio.to_thread(freeze, mount)
            frozen = True
            tier._check_lock_soon()
            async with asyncio.timeout(BOUND_S):  # polled: the check's thread, asleep in the kernel
                while True:
                    if any(t.name.startswith("aiokv-disk-lock") and t.native_id is not None
                           and _thread_state(t.native_id) == "D" for t in threading.enumerate()):
                        break
                    await asyncio.sleep(0.01)
            loop = asyncio.get_running_loop()
            began = loop.time()
            assert not await tier.close_within(0.5)
            assert loop.time() - began < 2.0
            await asyncio.to_thread(thaw, mount)
            frozen = False
            async with asyncio.timeout(BOUND_S):
                await tier.io_ended
            assert _lock_threads() == []
        finally:
            if frozen:
                await asyncio.to_thread(thaw, mount)
            await tier.aclose()
    assert open_fds() <= fds
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_close_racing_checks_leaves_nothing(disk_dir: Path, layout: KVLayout, pool: PagePool) -> None:
    """Closes at random moments of checks that find the name gone (each would take it again):
    every close returns within the bound; no thread, descriptor or lock is left (a new cache
    writes there at once)."""
    rng = random.Random(168)
    fds = open_fds()
    for _ in range(20):
        tier = DiskTier(_conf(disk_dir, DiskBackend.THREADS, layout, interval=0.001), layout, pool)
        await tier.start()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tier.files.layout_dir / ".lock")
        for _ in range(rng.randint(0, 30)):
            await asyncio.sleep(0)
        assert await tier.close_within(BOUND_S)
        assert _lock_threads() == []
    assert open_fds() <= fds
    async with started(DiskTier(_conf(disk_dir, DiskBackend.THREADS, layout), layout, pool)) as last:
        assert last.read_only is None
    assert_clean(pool)

