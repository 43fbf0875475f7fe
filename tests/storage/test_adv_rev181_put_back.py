"""Review 181: fan-out directories put back under a writing tier (02f53ee, e6c0324, 6a6e6df, 0bdf672).

A fan-out directory the writer opens late is listed on a thread (``aiokv-disk-list``) while the
loop keeps writing, recycling, deleting and reading there. The listing's outcome is applied on the
loop: a key whose state changed meanwhile must not be taken from it. Deterministic cases hold the
listing (``_gated_listing``: before and after ``list_fanout`` runs) across one such change; the
seeded drive moves fan-out directories out of the cache and back (and copies backups back,
twice quickly, with planted entries) under reads, writes, deletes and evictions on a small budget.

Oracle: every byte served equals its key's payload; after quiescence every page file under the
layout directory is indexed (and every indexed key has its file), the index is within the budget,
nothing is written into a directory moved outside the cache after the check that retired it and
still there, a symlink's target never receives a file; no descriptor or thread is left after the
close. ``AIOKV_REV181_SEEDS`` (comma-separated) widens the seeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import started
from test_adv_rev175_fanouts import _bytes_of, _fds
from test_lock_replaced import LockChecks

from aiokv.keys import PageKey
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, followpath
from aiokv.storage.backends import IOOp
from aiokv.storage.pagefile import file_bytes

TAG = 0x3A
"""The fan-out directory put back."""
OTHER = 0x10
"""A fan-out directory left alone."""
SEEDS = [int(s) for s in os.environ.get("AIOKV_REV181_SEEDS", "1,2").split(",") if s.strip()]
HEX = re.compile(r"[0-9a-f]{32}")


def _on_disk(layout_dir: Path) -> set[str]:
    """Page-file names (key hex) in their own fan-out directory under ``layout_dir``."""
    found = set()
    for fan in layout_dir.iterdir():
        if re.fullmatch(r"[0-9a-f]{2}", fan.name) and fan.is_dir() and not fan.is_symlink():
            found |= {p.name for p in fan.iterdir() if HEX.fullmatch(p.name) and p.name[:2] == fan.name
                      and p.is_file() and not p.is_symlink()}
    return found


def _indexed(tier: DiskTier) -> set[str]:
    return {bytes.hex(key) for key in tier._index}


async def _settled(tier: DiskTier) -> None:
    """Until the tier's background tasks (listings, unlinks) ended."""
    async with asyncio.timeout(30):
        while pending := {task for task in tier._jobs if not task.done()}:
            await asyncio.wait(pending)


@contextlib.contextmanager
def _gated_listing(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event,
                                                                     threading.Event]]:
    """Listings of fan-out directories opened late wait (on their thread, bounded) for ``before``
    to be set, list, set ``listed``, then wait for ``after``."""
    before, listed, after = threading.Event(), threading.Event(), threading.Event()
    real = followpath.list_fanout

    def gated(*args: Any, **kwargs: Any) -> Any:
        assert before.wait(30.0), "listing gate never opened"
        listing = real(*args, **kwargs)
        listed.set()
        assert after.wait(30.0), "listing gate never opened"
        return listing

    monkeypatch.setattr(followpath, "list_fanout", gated)
    try:
        yield before, listed, after
    finally:
        before.set()
        after.set()


async def _write(tier: DiskTier, key: PageKey, size: int) -> bool:
    return await tier.write_from(key, memoryview(_bytes_of(key, size)))


async def _put_back(tier: DiskTier, checks: LockChecks, away: Path, keys: list[PageKey], size: int) -> None:
    """``keys`` written into ``TAG``, the directory moved to ``away`` (a check retires it) and back."""
    for key in keys:
        assert await _write(tier, key, size)
    fan = tier.files.layout_dir / f"{TAG:02x}"
    os.rename(fan, away)
    await checks.next()
    assert not any(tier.contains(key) for key in keys)
    os.rename(away, fan)


@pytest.mark.asyncio
async def test_a_recycled_victim_listed_before_its_move_is_not_indexed(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``3a`` put back; the write that opens it stores ``k10`` there; the listing sees ``k10``'s
    file; a full tier then recycles ``k10``'s file into another key's name before the listing
    ends. Before: the listing indexed ``k10`` (no longer being moved, not in the index) with no
    file under its name: counted in the budget, served as present until a read missed."""
    size = layout.page_bytes
    with _gated_listing(monkeypatch) as (before, listed, after):
        cfg = config(tmp_path / "disk", backend, 3 * file_bytes(layout), follow_interval_s=3600.0)
        async with started(DiskTier(cfg, layout, pool)) as tier:
            checks = LockChecks(tier)
            await _put_back(tier, checks, tmp_path / "elsewhere", [key_of(0, TAG)], size)
            assert await _write(tier, key_of(10, TAG), size)  # opens 3a: its listing waits
            for i in range(2):
                assert await _write(tier, key_of(i, OTHER), size)
            before.set()  # the listing sees k0 and k10
            assert await asyncio.to_thread(listed.wait, 30.0)
            assert await _write(tier, key_of(2, OTHER), size)  # recycles k10, the least recent
            for i in range(3):
                await tier.delete(key_of(i, OTHER))
            after.set()
            await _settled(tier)
            assert _indexed(tier) == _on_disk(tier.files.layout_dir), tier.statistics()
            assert not tier.contains(key_of(10, TAG))
            assert tier.contains(key_of(0, TAG))
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_write_in_flight_at_the_listing_that_fails_leaves_no_file_unindexed(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``3a`` put back holding ``k0``'s file; a write of ``k0`` is in flight when the listing ends
    (so the listing leaves ``k0`` to it) and then fails (a real EIO of its write, injected). Before:
    ``k0``'s old file stayed on disk, never indexed, counted or evicted (the budget exceeded by it)
    until a restart."""
    size = layout.page_bytes
    with _gated_listing(monkeypatch) as (before, _listed, after):
        cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
        async with started(DiskTier(cfg, layout, pool)) as tier:
            checks = LockChecks(tier)
            await _put_back(tier, checks, tmp_path / "elsewhere", [key_of(0, TAG)], size)
            assert await _write(tier, key_of(10, TAG), size)  # opens 3a: its listing waits
            held = asyncio.Event()
            real_claim = tier._claim

            def claim(job: Any) -> None:  # k0's write waits (in flight) until the listing ended
                if job.key != key_of(0, TAG):
                    real_claim(job)
                    return

                async def later() -> None:
                    await held.wait()
                    tier.backend.faults.inject(IOOp.WRITE, errno.EIO)
                    real_claim(job)

                tier._spawn(later())

            monkeypatch.setattr(tier, "_claim", claim)
            applied = asyncio.Event()
            real_index_listed = tier._index_listed

            def index_listed(*args: Any) -> None:
                real_index_listed(*args)
                applied.set()

            monkeypatch.setattr(tier, "_index_listed", index_listed)
            writing = asyncio.create_task(_write(tier, key_of(0, TAG), size))
            await asyncio.sleep(0)
            assert key_of(0, TAG) in tier._writing
            before.set()
            after.set()
            async with asyncio.timeout(30):
                await applied.wait()
            held.set()
            assert not await writing
            await _settled(tier)
            assert _indexed(tier) == _on_disk(tier.files.layout_dir), tier.statistics()
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_large_directory_put_back_over_the_budget_never_holds_the_loop(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """``3a`` put back holding 30,000 page files (empty: the listing looks at names and owners)
    on a budget of 8. Before: all were indexed and then evicted in one turn of the loop, an unlink
    task each: the loop stood still 1-3 s (50,000 files: 3.4 s); a ticker's gap now stays far
    below that, and the files beyond the budget are gone."""
    size = layout.page_bytes
    cfg = config(tmp_path / "disk", backend, 8 * file_bytes(layout), follow_interval_s=3600.0)
    async with started(DiskTier(cfg, layout, pool)) as tier:
        checks = LockChecks(tier)
        away = tmp_path / "elsewhere"
        await _put_back(tier, checks, away, [], size)
        fan = tier.files.layout_dir / f"{TAG:02x}"
        os.rename(fan, away)
        await checks.next()

        def fill() -> None:
            for i in range(30_000):
                os.close(os.open(away / bytes.hex(key_of(i, TAG)), os.O_CREAT | os.O_WRONLY, 0o600))

        await asyncio.to_thread(fill)
        os.rename(away, fan)
        worst = 0.0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal worst
            loop = asyncio.get_running_loop()
            last = loop.time()
            while not stop.is_set():
                await asyncio.sleep(0.001)  # (a measurement of the loop's gaps, no synchronisation)
                now = loop.time()
                worst, last = max(worst, now - last), now

        ticking = asyncio.create_task(ticker())
        await checks.next()  # opens 3a: listed
        await _settled(tier)
        stop.set()
        await ticking
        assert worst < 0.4, worst
        assert _indexed(tier) == _on_disk(tier.files.layout_dir) and len(_indexed(tier)) == 8
        assert tier.statistics().pages == 8
    assert_clean(pool)


TAGS = (0x3A, 0x3B)
"""The fan-out directories the seeded drive moves out and puts back."""
KEYS = 8
"""Keys per fan-out directory (two more untouched ones take writes too)."""
STRANGER = 54321
"""Another user's uid (files of another owner are never indexed)."""


class _PutBacks:
    """Real moves of the fan-out directories ``TAGS`` out of the cache and back, one seeded step at
    a time (on a thread): ``mv`` out, ``mv`` back (over a directory the tier made again meanwhile),
    a backup copied out and the directory removed, a backup copied back, out and back twice with no
    check between, and entries planted in a directory before it goes back.

    Entries are planted only in a directory the tier no longer holds: a copy, or one moved out with
    a check since (:meth:`checked`). One moved out and back with no check between is, to the tier,
    a directory that never left (the same inode as its descriptor: nothing to retire or list; the
    documented limit of the check), so entries planted in it are as if planted in place behind the
    tier, which no listing examines: a hard link there stayed unindexed for good and failed the
    quiescence oracle (seeds 85 and 96, about one run in three)."""

    def __init__(self, rng: random.Random, layout_dir: Path, outside: Path, page: int) -> None:
        self.rng, self.layout_dir, self.outside, self.page = rng, layout_dir, outside, page
        self.away: list[Path] = []  # directories out of the cache, each to be put back maybe
        self.targets: dict[Path, bytes] = {}  # files outside the cache planted as links: never changed
        self.n = 0
        self.held: set[Path] = set()  # moved out with no check since: still the tier's own directory

    def checked(self) -> None:
        """A check ran (or a tier started): every directory out of the cache is retired."""
        self.held.clear()

    def _plant(self, into: Path, tag: int) -> None:
        """A symlink, a hard link to a file outside the cache, another user's file, a page of
        another fan-out's key, leftover temporary and spare files of another process; nothing in a
        directory the tier still holds (see the class docstring; the draw is made all the same)."""
        n = self.n
        what = self.rng.choice(["symlink", "hardlink", "stranger", "foreign", "leftovers"])
        if into in self.held:
            return
        target = self.outside / f"target{n}"
        target.write_bytes(b"t" * self.page)
        self.targets[target] = b"t" * self.page
        name = into / bytes.hex(key_of(100 + n, tag))
        if what == "symlink":
            os.symlink(target, name)
        elif what == "hardlink":
            os.link(target, name)
        elif what == "stranger":
            name.write_bytes(b"s" * self.page)
            os.chown(name, STRANGER, STRANGER)
        elif what == "foreign":
            (into / bytes.hex(key_of(100 + n, OTHER))).write_bytes(b"f" * self.page)
        else:
            (into / f".tmp-{bytes.hex(key_of(100 + n, tag))}-00000000000000ff{n}").write_bytes(b"")
            (into / f".spare-00000000000000ff{n}").write_bytes(b"")

    def step(self) -> str:
        self.n += 1
        tag = self.rng.choice(TAGS)
        name = self.layout_dir / f"{tag:02x}"
        op = self.rng.choice(["mv_out", "backup", "mv_back", "mv_back", "twice", "plant_back"])
        try:
            if op == "mv_out":
                to = self.outside / f"m{self.n}-{tag:02x}"
                os.rename(name, to)
                self.away.append(to)
                self.held.add(to)
            elif op == "backup":  # taken of the directory moved aside, which is then removed
                aside, to = self.outside / f"x{self.n}", self.outside / f"b{self.n}-{tag:02x}"
                os.rename(name, aside)
                shutil.copytree(aside, to, symlinks=True)
                shutil.rmtree(aside, ignore_errors=True)  # (a write in flight may land meanwhile)
                self.away.append(to)
            elif op in ("mv_back", "plant_back") and self.away:
                back = self.away.pop(self.rng.randrange(len(self.away)))
                name = self.layout_dir / back.name[-2:]
                if op == "plant_back":
                    self._plant(back, int(back.name[-2:], 16))
                if name.is_dir():  # made again by the tier meanwhile: moved aside whole, removed
                    aside = self.outside / f"x{self.n}"
                    os.rename(name, aside)
                    shutil.rmtree(aside, ignore_errors=True)
                os.rename(back, name)
                self.held.discard(back)
            elif op == "twice":  # out and back, twice, between two checks
                for i in range(2):
                    to = self.outside / f"t{self.n}-{i}"
                    os.rename(name, to)
                    os.rename(to, name)
        except OSError as exc:
            return f"{op}: {exc.strerror}"
        return op


def _outside_keys(directory: Path) -> set[str]:
    """Names under ``directory`` that a write of ours makes: page files and temporary files (not
    the entries :meth:`_PutBacks._plant` made, keys 100 and up)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return set()
    return {name for name in names if (found := HEX.search(name)) is not None and found.start() in (0, 5)
            and int.from_bytes(bytes.fromhex(found.group())[1:], "little") < 100}


def _owned_on_disk(layout_dir: Path) -> set[str]:
    """:func:`_on_disk`, but only our files (another user's is never indexed)."""
    uid = os.geteuid()
    return {name for name in _on_disk(layout_dir)
            if (layout_dir / name[:2] / name).lstat().st_uid == uid}


async def _drive(tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, seed: int,
                 monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    size = layout.page_bytes
    disk_dir, outside = tmp_path / "disk", tmp_path / "outside"
    outside.mkdir()
    keys = [key_of(i, tag) for tag in (*TAGS, OTHER, OTHER + 1) for i in range(KEYS)]
    bad: list[str] = []
    real = followpath.list_fanout
    delays = random.Random(seed + 1)
    lock = threading.Lock()

    def slow(*args: Any, **kwargs: Any) -> Any:  # listings take a while, so the loop acts meanwhile
        with lock:
            pause, then = delays.random() * 0.05, delays.random() * 0.05
        threading.Event().wait(pause)
        listing = real(*args, **kwargs)
        threading.Event().wait(then)  # what it saw may change meanwhile
        return listing

    monkeypatch.setattr(followpath, "list_fanout", slow)
    damage: _PutBacks | None = None
    names = {f"{i:02x}" for i in range(256)}
    for rnd in range(2):
        fds = _fds()
        capacity = 12 * file_bytes(layout)
        tier = DiskTier(config(disk_dir, backend, capacity, follow_interval_s=3600.0), layout, pool,
                        spare_files=rng.choice([0, 4]))
        await tier.start()
        if damage is None:
            damage = _PutBacks(rng, tier.files.layout_dir, outside, size)
        damage.checked()  # a new tier holds none of the directories out of the cache
        checks = LockChecks(tier)
        stop = asyncio.Event()
        closing = {"now": False}
        retired_at: dict[Path, set[str]] = {}  # a directory outside at a check -> its names then

        async def worker(wrng: random.Random, tier: DiskTier = tier, stop: asyncio.Event = stop,
                         closing: dict[str, bool] = closing) -> None:
            buf = bytearray(size)
            while not stop.is_set():
                key = wrng.choice(keys)
                op = wrng.random()
                try:
                    if op < 0.45:
                        await tier.write_from(key, memoryview(_bytes_of(key, size)))
                    elif op < 0.85:
                        if await tier.read_into(key, memoryview(buf)) and buf != _bytes_of(key, size):
                            bad.append(f"read of {key.hex()} not bit-exact")
                    elif op < 0.95:
                        await tier.delete(key)
                    else:
                        tier.touch([key])
                except RuntimeError:
                    if not closing["now"]:
                        raise
                    return
                await asyncio.sleep(0)  # a turn for the others (no synchronisation rests on it)

        workers = [asyncio.create_task(worker(random.Random(seed * 100 + rnd * 10 + w))) for w in range(2)]
        try:
            async with asyncio.timeout(60):
                for _ in range(14):
                    await asyncio.to_thread(damage.step)
                    if rng.random() < 0.75:
                        await checks.next()
                        damage.checked()
                        for away in damage.away:
                            if away not in retired_at and away.exists():
                                retired_at[away] = _outside_keys(away)
                    index = tier._index
                    if index.used > index.capacity:
                        bad.append(f"round {rnd}: used {index.used} over capacity {index.capacity}")
                if rnd == 1:  # closed under the workers, listings maybe in flight
                    closing["now"] = True
                    await tier.aclose()
                stop.set()
                await asyncio.gather(*workers)
                if rnd == 0:
                    await tier.flush()
                    await checks.next()  # directories put back since the last check: opened, listed
                    await _settled(tier)
                    indexed, there = _indexed(tier), _owned_on_disk(tier.files.layout_dir)
                    if indexed != there:  # before any read: a read of a key without its file drops it
                        bad.append(f"round {rnd}: indexed, no file {sorted(indexed - there)}; file, not indexed "
                                   f"{sorted(there - indexed)}")
                    buf = bytearray(size)
                    for key in list(tier._index):
                        if await tier.read_into(key, memoryview(buf)):
                            if buf != _bytes_of(key, size):
                                bad.append(f"{key.hex()} not bit-exact at quiescence")
                        elif tier.contains(key):
                            bad.append(f"{key.hex()} still indexed after its read missed")
                    await _settled(tier)
                    indexed, there = _indexed(tier), _owned_on_disk(tier.files.layout_dir)
                    if indexed != there:
                        bad.append(f"round {rnd}: indexed, no file {sorted(indexed - there)}; file, not indexed "
                                   f"{sorted(there - indexed)}")
                    if tier._refill is not None:
                        async with asyncio.timeout(30):
                            await asyncio.wait({tier._refill})
                    spares = [p for p in tier.files.layout_dir.glob("*/.spare-*") if p.parent.name in names]
                    if tier.spare_statistics().stock != len(spares):
                        bad.append(f"round {rnd}: spare stock {tier.spare_statistics()} vs {len(spares)} files")
                    index = tier._index
                    if index.used > index.capacity or tier.statistics().bytes_stored > capacity:
                        bad.append(f"round {rnd}: over budget {index.used} > {index.capacity}")
                    await tier.aclose()
        finally:
            stop.set()
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            await tier.aclose()
        assert _fds() == fds, "descriptors left open after the close"
        listing_threads = [t.name for t in threading.enumerate() if t.name.startswith("aiokv-disk-list")]
        assert not listing_threads, listing_threads
        for away, before in retired_at.items():
            if away.exists():
                new = _outside_keys(away) - before
                if new:
                    bad.append(f"round {rnd}: written into {away.name} after the check that retired it: {sorted(new)}")
        for target, content in damage.targets.items():
            if target.read_bytes() != content:
                bad.append(f"{target} changed")
            if target.is_dir():
                bad.append(f"{target} became a directory")
    assert not bad, bad
    pool.table.evict(pool.num_pages)
    assert_clean(pool)


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", SEEDS)
async def test_put_back_under_load(tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
                                   seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    await _drive(tmp_path, backend, layout, pool, seed, monkeypatch)


@pytest.mark.asyncio
async def test_a_follower_sees_a_directory_put_back_and_takes_over_within_the_budget(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """A second cache follows the writer while ``3a`` (6 pages) goes out of the cache and back
    onto a writer whose budget (8) is full of other pages: the follower serves what the writer
    kept, bit for bit, never a page the writer evicted; after the writer closes it takes over with
    its index equal to the page files there, within its budget."""
    from follow_helpers import Looks

    size = layout.page_bytes
    disk_dir = tmp_path / "disk"
    cfg = config(disk_dir, backend, 8 * file_bytes(layout), follow_interval_s=3600.0)
    writer = DiskTier(cfg, layout, pool)
    await writer.start()
    try:
        checks = LockChecks(writer)
        keys = [key_of(i, TAG) for i in range(6)]
        for key in keys:
            assert await _write(writer, key, size)
        async with started(DiskTier(cfg, layout, pool)) as follower:
            assert follower.read_only is not None
            looks = Looks(follower)
            away = tmp_path / "elsewhere"
            os.rename(writer.files.layout_dir / f"{TAG:02x}", away)
            await checks.next()
            await looks.next()
            assert not any(follower.contains(key) for key in keys)
            for i in range(6):
                assert await _write(writer, key_of(i, OTHER), size)
            os.rename(away, writer.files.layout_dir / f"{TAG:02x}")
            await checks.next()
            await _settled(writer)
            assert _indexed(writer) == _on_disk(writer.files.layout_dir)
            assert len(_indexed(writer)) == 8
            await looks.next()
            await looks.next()
            buf = bytearray(size)
            for key in [*keys, *(key_of(i, OTHER) for i in range(6))]:
                if follower.contains(key):
                    assert writer.contains(key), key.hex()
                    assert await follower.read_into(key, memoryview(buf)) and buf == _bytes_of(key, size)
            assert {bytes.hex(key) for key in follower._index} == _indexed(writer)
            await writer.aclose()
            await looks.until(lambda: follower.read_only is None)
            await _settled(follower)
            assert _indexed(follower) == _on_disk(follower.files.layout_dir)
            assert follower._index.used <= follower._index.capacity
    finally:
        await writer.aclose()
    assert_clean(pool)


@pytest.mark.asyncio
async def test_copies_of_this_tiers_spare_files_restored_are_removed(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """A backup of ``00`` taken while it held spare files of this tier, ``00`` removed (a check
    retires it: its spares leave the stock), the backup restored. The copies bear this tier's
    spare names but no stock holds them. Before: the listing kept them as maybe in flight, so
    they stayed (page-sized, outside the budget and the stock) until a restart."""
    from aiokv.storage.spares import SPARE_PREFIX

    size = layout.page_bytes
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(DiskTier(cfg, layout, pool, spare_files=2)) as tier:
        checks = LockChecks(tier)
        assert await _write(tier, key_of(0, 0x00), size)
        if tier._refill is not None:
            async with asyncio.timeout(30):
                await asyncio.wait({tier._refill})
        fan, backup = tier.files.layout_dir / "00", tmp_path / "backup"
        assert any(name.startswith(SPARE_PREFIX) for name in os.listdir(fan)), os.listdir(fan)
        shutil.copytree(fan, backup)
        shutil.rmtree(fan)
        await checks.next()
        os.rename(backup, fan)
        await checks.next()
        await _settled(tier)
        if tier._refill is not None:
            async with asyncio.timeout(30):
                await asyncio.wait({tier._refill})
        layout_dir = tier.files.layout_dir
        inside = [p for p in layout_dir.glob(f"*/{SPARE_PREFIX}*")]
        assert tier.spare_statistics().stock == len(inside), (tier.spare_statistics(), inside)
        assert tier.contains(key_of(0, 0x00))
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_close_while_a_listing_runs_waits_for_it_and_leaves_nothing(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier closed while the listing of ``3a`` put back is held on its thread: the close ends
    only after the thread (which uses the tier's descriptor), indexes nothing from it, and leaves
    no descriptor or thread; a restart serves the pages there."""
    size = layout.page_bytes
    fds = _fds()
    with _gated_listing(monkeypatch) as (before, listed, after):
        cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
        tier = DiskTier(cfg, layout, pool)
        await tier.start()
        try:
            checks = LockChecks(tier)
            await _put_back(tier, checks, tmp_path / "elsewhere", [key_of(i, TAG) for i in range(3)], size)
            await checks.next()  # opens 3a: its listing waits
            before.set()
            assert await asyncio.to_thread(listed.wait, 30.0)
            closing = asyncio.create_task(tier.aclose())
            done, _ = await asyncio.wait({closing}, timeout=0.2)
            assert not done, "the close did not wait for the listing's thread"
            after.set()
            async with asyncio.timeout(30):
                await closing
            assert tier.statistics().pages == 0
        finally:
            after.set()
            await tier.aclose()
    assert _fds() == fds
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("aiokv-disk-list", "aiokv-disk-unlink"))]
    async with started(DiskTier(cfg, layout, pool)) as again:
        buf = bytearray(size)
        for i in range(3):
            assert await again.read_into(key_of(i, TAG), memoryview(buf)) and buf == _bytes_of(key_of(i, TAG), size)
    assert_clean(pool)


@pytest.mark.asyncio
async def test_a_directory_moved_out_again_while_listed_is_neither_indexed_nor_touched(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``3a`` put back onto a full tier (so its listing would evict), then moved out of the cache
    again while the listing is held: a check retires it; the listing ends. Nothing is indexed from
    it, and nothing in it is written, unlinked or changed (it is outside the cache now)."""
    size = layout.page_bytes
    with _gated_listing(monkeypatch) as (before, listed, after):
        cfg = config(tmp_path / "disk", backend, 4 * file_bytes(layout), follow_interval_s=3600.0)
        async with started(DiskTier(cfg, layout, pool)) as tier:
            checks = LockChecks(tier)
            await _put_back(tier, checks, tmp_path / "elsewhere", [key_of(i, TAG) for i in range(3)], size)
            for i in range(4):
                assert await _write(tier, key_of(i, OTHER), size)
            await checks.next()  # opens 3a: its listing waits
            before.set()
            assert await asyncio.to_thread(listed.wait, 30.0)
            gone = tmp_path / "gone"
            os.rename(tier.files.layout_dir / f"{TAG:02x}", gone)
            await checks.next()
            then = {name: (gone / name).read_bytes() for name in os.listdir(gone)}
            after.set()
            await _settled(tier)
            assert not any(tier.contains(key_of(i, TAG)) for i in range(3))
            assert {name: (gone / name).read_bytes() for name in os.listdir(gone)} == then
            assert _indexed(tier) == _on_disk(tier.files.layout_dir)
            assert tier.statistics().pages == 4
    assert_clean(pool)
