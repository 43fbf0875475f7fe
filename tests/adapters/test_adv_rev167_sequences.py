"""A seeded random drive of the vLLM tier's engine-facing calls against an oracle, real faults
underneath (review 167).

The driver plays vLLM's ``TieringOffloadingManager`` toward its secondary tier: under the manager
lock it interleaves ``lookup`` (asking again after RETRY), ``submit_store`` of chunks whose bytes
are a function of the key, ``submit_load`` of keys a lookup found into free chunks, polling with
``get_finished_jobs``, ``drain_jobs``, ``on_schedule_end``, ``touch``, requests that start and end,
the same key stored twice (also by two jobs in flight at once), loads of keys evicted meanwhile (a
disk budget of a few pages), and a shutdown with jobs in flight followed by a tier over the same
directory. Under it the page files are damaged behind the tier's back (a flipped bit, cut short,
unlinked, swapped for another page's file), and on a loop-mounted ext4 (root) the file system
fills up, is remounted read-only and back, and at the end fails every operation with EIO.

The oracle, checked after every call:

- a chunk a load reports as arrived holds exactly the bytes stored under its key;
- every chunk holds what the engine last wrote into it, except the chunks of a load in flight: no
  chunk changes behind the engine's back, none after its load is reported (the engine wrote a
  sentinel there at once), and the chunks of a store in flight are only read;
- every job is reported exactly once, within ``JOB_BOUND_S``; ``drain_jobs`` returns within
  ``DRAIN_BOUND_S`` and every job is reported by the next poll; a lookup asked before a step end
  is answered after the drain;
- a HIT is only ever answered for a key some store job named; without faults and within the disk
  budget every key stored is a HIT and loads back; the tier counts no corrupt page file that the
  test did not damage;
- no call raises.

``AIOKV_REV167_SEEDS=N`` drives N seeds per kind instead of the default few.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm_helpers import CHUNK_BYTES, STEP, make_manager, page_files, tier_of

from aiokv.adapters.store import page_file_bytes

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))  # the storage suite's file-system helpers
from fs_helpers import fill_up, loop_ext4, remount, shut_down_ext4

JOB_BOUND_S = 20.0
"""A job not reported this long after it was submitted is lost."""
DRAIN_BOUND_S = 20.0
CHUNKS = 12
KEYS = 18
ROUNDS = int(os.environ.get("AIOKV_REV167_ROUNDS", "600"))
EXTRA = int(os.environ.get("AIOKV_REV167_SEEDS", "0"))


def seeds(default: list[int]) -> list[int]:
    return default if not EXTRA else list(range(1000, 1000 + EXTRA))


def content(key: bytes) -> bytes:
    """The bytes stored under ``key`` (a function of it: any load can be checked)."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, CHUNK_BYTES, dtype=np.uint8).tobytes()


@dataclasses.dataclass
class Job:
    kind: str  # "store" or "load"
    keys: list[bytes]
    chunks: list[int]
    submitted: float


@dataclasses.dataclass
class Request:
    ctx: ReqContext
    hits: set[bytes] = dataclasses.field(default_factory=set)
    retried: set[bytes] = dataclasses.field(default_factory=set)
    """Keys answered RETRY and not answered since."""
    posted: set[bytes] = dataclasses.field(default_factory=set)
    """Of those, the ones a step end has handed to the loop since."""


class Drive:
    """One tier, driven as vLLM's manager drives it, and the oracle's model of it."""

    def __init__(self, manager: TieringOffloadingManager, rng: random.Random, universe: list[bytes],
                 submitted_stores: set[bytes], next_job: int) -> None:
        self.manager, self.tier, self.rng = manager, tier_of(manager), rng
        self.universe = universe
        self.submitted_stores = submitted_stores  # keys some store job named (a HIT needs one)
        self.expected: list[bytes | None] = [None] * CHUNKS
        self.busy: set[int] = set()
        self.jobs: dict[int, Job] = {}
        self.reported: set[int] = set()
        self.next_job = next_job
        self.requests: list[Request] = []
        self.serial = 0
        self.loaded = self.load_failures = self.stored_ok = 0
        self.failed_loads: list[bytes] = []
        self.stored_keys: set[bytes] = set()
        self.damaged_before = 0
        """Page files damaged under an earlier tier of the directory."""
        self.counted: dict[str, float] = {}
        """Counter increases get_stats reported, by metric and label."""
        for chunk in range(CHUNKS):
            self.sentinel(chunk)
        self.check_region()

    # -- the engine's memory --------------------------------------------------------------------

    def region(self) -> list[bytes]:
        with self.manager.primary_tier.get_kv_memoryview().cast("B") as flat:
            data = bytes(flat[: CHUNKS * CHUNK_BYTES])
        return [data[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES] for i in range(CHUNKS)]

    def write(self, chunk: int, data: bytes) -> None:
        with self.manager.primary_tier.get_kv_memoryview().cast("B") as flat:
            flat[chunk * CHUNK_BYTES : (chunk + 1) * CHUNK_BYTES] = data
        self.expected[chunk] = data

    def sentinel(self, chunk: int) -> None:
        """The engine reuses the chunk: new bytes of its own, which nothing else may change."""
        self.serial += 1
        mark = f"[sentinel {chunk} {self.serial}]".encode()
        self.write(chunk, (mark * (CHUNK_BYTES // len(mark) + 1))[:CHUNK_BYTES])

    def check_region(self) -> None:
        now = self.region()
        for chunk, want in enumerate(self.expected):
            if want is not None:
                assert now[chunk] == want, f"chunk {chunk} changed behind the engine's back ({self.where(chunk)})"

    def where(self, chunk: int) -> str:
        owners = [(i, j.kind) for i, j in self.jobs.items() if chunk in j.chunks and i not in self.reported]
        return f"jobs holding it: {owners}"

    def free_chunks(self) -> list[int]:
        return [c for c in range(CHUNKS) if c not in self.busy]

    # -- calls ----------------------------------------------------------------------------------

    def request(self) -> Request:
        if not self.requests or (len(self.requests) < 3 and self.rng.random() < 0.2):
            self.serial += 1
            req = Request(ReqContext(req_id=f"req-{self.serial}"))
            self.tier.on_new_request(req.ctx)
            self.requests.append(req)
        return self.rng.choice(self.requests)

    def lookup(self) -> None:
        req = self.request()
        key = self.rng.choice(self.universe)
        with self.manager.lock:
            found = self.tier.lookup(key, req.ctx)
        assert found in (LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY)
        if found is LookupResult.RETRY:
            req.retried.add(key)
            return
        req.retried.discard(key)
        req.posted.discard(key)
        if found is LookupResult.HIT:
            assert key in self.submitted_stores, "a HIT for a key no store job named"
            req.hits.add(key)
        else:
            req.hits.discard(key)

    def finish_request(self) -> None:
        if not self.requests:
            return
        req = self.requests.pop(self.rng.randrange(len(self.requests)))
        with self.manager.lock:
            self.tier.on_request_finished(req.ctx)

    def store(self) -> None:
        free = self.free_chunks()
        if not free:
            return
        count = self.rng.randint(1, min(self.rng.choice((3, 8)), len(free)))
        keys = self.rng.sample(self.universe, count)
        chunks = self.rng.sample(free, count)
        for key, chunk in zip(keys, chunks, strict=True):
            self.write(chunk, content(key))  # the GPU -> CPU copy
        self.submit("store", keys, chunks, self.request())

    def load(self) -> None:
        candidates = [(req, key) for req in self.requests for key in sorted(req.hits)]
        free = self.free_chunks()
        if not candidates or not free:
            return
        req, _ = self.rng.choice(candidates)
        most = self.rng.choice((3, 8))
        keys = self.rng.sample(sorted(req.hits), self.rng.randint(1, min(most, len(req.hits), len(free))))
        chunks = self.rng.sample(free, len(keys))
        for chunk in chunks:
            self.expected[chunk] = None  # the load's to write until it is reported
        self.submit("load", keys, chunks, req)

    def submit(self, kind: str, keys: list[bytes], chunks: list[int], req: Request) -> None:
        job_id, self.next_job = self.next_job, self.next_job + 1
        self.jobs[job_id] = Job(kind, keys, chunks, time.monotonic())
        self.busy.update(chunks)
        if kind == "store":
            self.submitted_stores.update(keys)
        job = TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(chunks, dtype=np.int64),
                          is_promotion=kind == "load", req_context=req.ctx)
        with self.manager.lock:
            (self.tier.submit_store if kind == "store" else self.tier.submit_load)(job)

    def poll(self) -> None:
        with self.manager.lock:
            results = list(self.tier.get_finished_jobs())
        for result in results:
            self.finished(result)
        self.check_region()
        now = time.monotonic()
        late = {i: j for i, j in self.jobs.items() if i not in self.reported and now - j.submitted > JOB_BOUND_S}
        assert not late, f"jobs not reported within {JOB_BOUND_S} s: {late}"

    def finished(self, result: JobResult) -> None:
        assert result.job_id in self.jobs, f"a result for a job never submitted: {result}"
        assert result.job_id not in self.reported, f"job {result.job_id} reported twice"
        self.reported.add(result.job_id)
        job = self.jobs[result.job_id]
        if job.kind == "load":
            now = self.region()
            if result.successful_keys is not None:
                assert not result.success
                arrived = set(result.successful_keys)
                assert arrived and arrived <= set(job.keys), (result, job)
            else:
                arrived = set(job.keys) if result.success else set()
            for key, chunk in zip(job.keys, job.chunks, strict=True):
                if key in arrived:
                    assert now[chunk] == content(key), f"job {result.job_id}: chunk {chunk} holds wrong bytes"
                    self.loaded += 1
                else:
                    self.load_failures += 1
                    self.failed_loads.append(key)
            assert result.transfer_bytes in (None, len(arrived) * CHUNK_BYTES), result
        else:
            if result.success:
                self.stored_ok += len(job.keys)
                self.stored_keys.update(job.keys)
        for chunk in job.chunks:
            self.busy.discard(chunk)
            if job.kind == "load" or self.rng.random() < 0.7:
                self.sentinel(chunk)  # reused at once (a failed load's chunk holds undefined bytes)

    def step(self) -> None:
        with self.manager.lock:
            self.tier.on_schedule_end(STEP)
        for req in self.requests:
            req.posted |= req.retried

    def touch(self) -> None:
        req = self.request()
        keys = self.rng.sample(self.universe, 3)
        with self.manager.lock:
            self.tier.touch(keys, req.ctx)

    def stats(self) -> None:
        """vLLM's metrics call: counters are increases (never negative), gauges plain figures."""
        with self.manager.lock:
            stats = self.tier.get_stats()
        if stats is None:
            return
        types, values = stats.metric_sections()
        for name, by_label in values.items():
            for label, value in dict(by_label).items():
                if types[name] == "counter":
                    assert value > 0, (name, label, value)
                    self.counted[f"{name}{label}"] = self.counted.get(f"{name}{label}", 0) + value
                else:
                    assert value >= 0, (name, label, value)

    def events(self) -> None:
        """KV events: pages stored are keys some store job named."""
        with self.manager.lock:
            events = list(self.tier.take_events())
        for event in events:
            assert set(event.keys) <= self.submitted_stores, event

    def drain(self) -> None:
        """``drain_jobs`` within a bound; every job is reported by the next poll, every lookup a
        step end handed over is answered."""
        done = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                with self.manager.lock:
                    self.tier.drain_jobs()
            except BaseException as exc:  # handed to the test's thread
                failure.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, daemon=True, name="rev167-drain").start()
        assert done.wait(DRAIN_BOUND_S), f"drain_jobs did not return within {DRAIN_BOUND_S} s"
        assert not failure, failure
        self.poll()
        outstanding = sorted(set(self.jobs) - self.reported)
        assert not outstanding, f"jobs not reported after drain_jobs: {outstanding}"
        for req in self.requests:
            for key in sorted(req.posted):
                with self.manager.lock:
                    found = self.tier.lookup(key, req.ctx)
                assert found is not LookupResult.RETRY, f"{key!r} still RETRY after a step end and a drain"
                if found is LookupResult.HIT:
                    assert key in self.submitted_stores
                    req.hits.add(key)
                else:
                    req.hits.discard(key)
                req.retried.discard(key)
            req.posted.clear()

    def settle(self) -> None:
        """The engine steps while the tier has pending work and no new call comes: within a few
        steps (each drained) it has none."""
        for _ in range(3):
            with self.manager.lock:
                if not self.tier.has_pending_work():
                    return
            self.step()
            self.drain()
        with self.manager.lock:
            assert not self.tier.has_pending_work(), "pending work after three steps with no new call"

    def pause(self) -> None:
        """Time passes between two scheduler steps (the engine's forward pass), for the loop's
        work to overlap the next calls; a modelled step, no synchronization."""
        threading.Event().wait(self.rng.choice((0.0005, 0.002, 0.005)))

    def finish(self) -> None:
        """End every request and drain."""
        self.step()
        self.drain()
        while self.requests:
            self.finish_request()
        self.settle()

    def audit(self, strict: bool) -> dict[str, int]:
        """A new request looks every key up and loads the hits, checked bit-exact; ``strict``: no
        fault and no eviction could have lost one, so every key a store reported is a HIT."""
        req = Request(ReqContext(req_id=f"audit-{self.next_job}"))
        with self.manager.lock:
            self.tier.on_new_request(req.ctx)
        self.requests.append(req)
        verdicts: dict[bytes, LookupResult] = {}
        for _ in range(3):
            with self.manager.lock:
                verdicts = {key: self.tier.lookup(key, req.ctx) for key in self.universe}
            if LookupResult.RETRY not in verdicts.values():
                break
            self.step()
            self.drain()
        assert LookupResult.RETRY not in verdicts.values()
        hits = [key for key, v in verdicts.items() if v is LookupResult.HIT]
        assert set(hits) <= self.submitted_stores
        req.hits = set(hits)
        if strict:
            assert self.stored_keys <= set(hits), "a key a store reported is not a HIT with no fault injected"
        for start in range(0, len(hits), CHUNKS):
            batch = hits[start : start + CHUNKS]
            chunks = self.free_chunks()[: len(batch)]
            for chunk in chunks:
                self.expected[chunk] = None
            before = self.loaded
            self.submit("load", batch, chunks, req)
            self.drain()
            if strict:
                assert self.loaded - before == len(batch), "a HIT failed to load with no fault injected"
        self.finish()
        return {"hits": len(hits), "keys": len(self.universe)}


@dataclasses.dataclass
class Faults:
    """Damage done behind the tier's back, and the file system's state (a loop-mounted ext4)."""

    root: Path
    ext4: bool = False
    damaged: set[str] = dataclasses.field(default_factory=set)
    """Names (page key hex) of the files flipped, cut or overwritten."""
    unlinked: int = 0
    full: bool = False
    read_only: bool = False
    damage_rate: float = 0.03

    def remount(self, mode: str) -> None:
        remount(self.root, mode)
        self.read_only = mode == "ro"

    def files(self) -> list[Path]:
        return [p for p in page_files(self.root) if len(p.name) == 32]

    def damage(self, rng: random.Random) -> None:
        files = self.files()
        if not files:
            return
        path = rng.choice(files)
        how = rng.choice(("flip", "truncate", "unlink", "swap"))
        try:
            if how == "flip":
                raw = bytearray(path.read_bytes())
                if len(raw) <= 4096:
                    return
                raw[rng.randrange(4096, len(raw))] ^= 1 << rng.randrange(8)
                path.write_bytes(bytes(raw))
            elif how == "truncate":
                os.truncate(path, rng.choice((0, 100, 4096, 4096 + CHUNK_BYTES // 2)))
            elif how == "unlink":
                path.unlink()
                self.unlinked += 1
                return
            else:
                other = rng.choice(files)
                if other == path:
                    return
                path.write_bytes(other.read_bytes())
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOSPC):  # evicted meanwhile; the disk is full
                self.damaged.add(path.name)  # (a write may have cut it)
                return
            if exc.errno == errno.EROFS:  # mounted read-only: nothing changed
                return
            raise
        self.damaged.add(path.name)

    def fill_or_free(self) -> None:
        if not self.full:
            fill_up(self.root / "filler", leave=0)
        else:
            (self.root / "filler").unlink()
        self.full = not self.full


def run_rounds(d: Drive, faults: Faults, rounds: int, remount_rw_at: int | None = None) -> None:
    ops = [(d.lookup, 20), (d.store, 14), (d.load, 14), (d.poll, 16), (d.step, 10), (d.pause, 8),
           (d.drain, 2), (d.settle, 1), (d.finish_request, 3), (d.touch, 2), (d.stats, 3), (d.events, 2)]
    calls, weights = zip(*ops, strict=True)
    for i in range(rounds):
        d.rng.choices(calls, weights)[0]()
        if d.rng.random() < faults.damage_rate:
            faults.damage(d.rng)
        if faults.ext4 and remount_rw_at is None and d.rng.random() < 0.01:
            faults.fill_or_free()
        if i == remount_rw_at:
            faults.remount("rw")  # writable again under the running tier


def check_counters(d: Drive, faults: Faults) -> None:
    """No corrupt file the test did not damage: at most one per failed read of a damaged file."""
    stats = d.tier.statistics()
    if os.environ.get("AIOKV_REV167_SHOW"):
        shown = ("corrupt", "errors", "evictions", "dropped", "writes_refused", "hits", "misses")
        print(f"\njobs {len(d.jobs)} loaded {d.loaded} load failures {d.load_failures} stored {d.stored_ok} "
              f"damaged {len(faults.damaged)} unlinked {faults.unlinked}: { {k: stats[k] for k in shown} }")
    damaged_reads = sum(d.tier._store.key(key).hex() in faults.damaged for key in d.failed_loads)
    # A tier started over files damaged under an earlier one may refuse them at its start-up scan.
    assert stats["corrupt"] <= damaged_reads + d.damaged_before, (stats, faults, damaged_reads)
    if not faults.ext4:  # a file unlinked or cut behind the tier may fail its recycling
        assert sum(stats["errors"].values()) <= len(faults.damaged) + faults.unlinked, (stats, faults)


def close_mid_jobs(d: Drive, manager: TieringOffloadingManager, fail: bool = False) -> None:
    """Jobs in flight when vLLM shuts the tier down: each is reported once, no chunk changes after
    (``fail``: the ext4 fails every operation with EIO under them first)."""
    d.request()
    for _ in range(8):
        d.rng.choice((d.store, d.load, d.lookup, d.step))()
    if fail:
        shut_down_ext4(d.tier._store.config.directory)
    with manager.lock:
        d.tier.shutdown()  # as vLLM's manager does first; the region is still mapped here
        late = list(d.tier.get_finished_jobs())
    for result in late:
        d.finished(result)
    d.check_region()
    assert set(d.jobs) == d.reported, f"jobs never reported: {sorted(set(d.jobs) - d.reported)}"


def options_of(seed: int, rng: random.Random) -> dict[str, object]:
    return {"zero_copy": bool(seed % 2), "disk_bytes": 8 * page_file_bytes(CHUNK_BYTES),
            "enable_kv_events": seed % 4 < 2, "idle_poll_s": rng.choice((0.0, 0.01)), "close_timeout": 15.0}


def universe_of(name: str) -> list[bytes]:
    return [make_offload_key(f"rev167-{name}-{i}".encode().ljust(32, b"."), 0) for i in range(KEYS)]


@pytest.mark.parametrize("seed", seeds([1, 2, 3, 4]))
def test_random_call_sequences_over_damaged_page_files(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    options, universe, submitted = options_of(seed, rng), universe_of(str(seed)), set[bytes]()
    faults = Faults(tmp_path)
    manager = make_manager(tmp_path, options=options, cpu_chunks=CHUNKS, kv_events=True)
    try:
        d = Drive(manager, rng, universe, submitted, next_job=1)
        run_rounds(d, faults, ROUNDS)
        d.finish()
        check_counters(d, faults)
        close_mid_jobs(d, manager)
    finally:
        manager.shutdown()
    # A tier over the same directory serves the pages: bit-exact, or a miss.
    again = make_manager(tmp_path, options=options, cpu_chunks=CHUNKS, kv_events=True)
    try:
        Drive(again, rng, universe, submitted, next_job=d.next_job).audit(strict=False)
    finally:
        again.shutdown()


@pytest.mark.root
@pytest.mark.parametrize("seed", seeds([5, 6]))
def test_random_call_sequences_over_a_full_read_only_and_failing_ext4(tmp_path: Path, seed: int) -> None:
    """A full file system and damaged files under the first tier; a second tier starts on the
    file system mounted read-only, which becomes writable under it; seeds divisible by 3 end with
    the file system failing with EIO under jobs in flight, the others with a third tier's audit.
    (A running tier's files keep the file system from being remounted read-only: it is remounted
    between two tiers.)"""
    rng = random.Random(seed)
    options, universe, submitted = options_of(seed, rng), universe_of(f"ext4-{seed}"), set[bytes]()
    with loop_ext4(tmp_path, 320) as mount:
        faults = Faults(mount, ext4=True)
        first = make_manager(mount, options=options, cpu_chunks=CHUNKS, kv_events=True)
        try:
            d = Drive(first, rng, universe, submitted, next_job=1)
            run_rounds(d, faults, ROUNDS // 2)
            d.finish()
            check_counters(d, faults)
            close_mid_jobs(d, first)
        finally:
            first.shutdown()
        if faults.full:
            faults.fill_or_free()
        faults.remount("ro")
        try:
            second = make_manager(mount, options=options, cpu_chunks=CHUNKS, kv_events=True)
            try:
                e = Drive(second, rng, universe, submitted, next_job=d.next_job)
                e.damaged_before = len(faults.damaged)
                run_rounds(e, faults, ROUNDS // 2, remount_rw_at=ROUNDS // 4)
                e.finish()
                check_counters(e, faults)
                close_mid_jobs(e, second, fail=seed % 3 == 0)
            finally:
                second.shutdown()
        finally:
            if faults.read_only:
                faults.remount("rw")
        if seed % 3 == 0:
            return
        third = make_manager(mount, options=options, cpu_chunks=CHUNKS, kv_events=True)
        try:
            Drive(third, rng, universe, submitted, next_job=e.next_job).audit(strict=False)
        finally:
            third.shutdown()


@pytest.mark.parametrize("seed", seeds([7, 8]))
def test_random_call_sequences_without_faults_keep_every_page(tmp_path: Path, seed: int) -> None:
    """Within the disk budget and with no fault, every key a store reported loads back."""
    rng = random.Random(seed)
    universe, submitted = universe_of(f"clean-{seed}"), set[bytes]()
    options = {**options_of(seed, rng), "disk_bytes": 4 * KEYS * page_file_bytes(CHUNK_BYTES)}
    manager = make_manager(tmp_path, options=options, cpu_chunks=CHUNKS, kv_events=True)
    try:
        d = Drive(manager, rng, universe, submitted, next_job=1)
        run_rounds(d, Faults(tmp_path, damage_rate=0.0), ROUNDS)
        d.finish()
        assert d.load_failures == 0, d.failed_loads
        d.audit(strict=True)
        stats = d.tier.statistics()
        faults = (stats["corrupt"], sum(stats["errors"].values()), stats["dropped"], stats["evictions"])
        assert faults == (0, 0, 0, 0), stats
        assert d.loaded and d.stored_ok
    finally:
        manager.shutdown()
