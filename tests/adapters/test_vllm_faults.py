"""Every failure path of the vLLM tier, the fault injected for real, through vLLM's real manager.

Stores that fail part-way (a fan-out directory made immutable, a full file system), loads of page
files corrupted, truncated, deleted or swapped for a link behind the tier's back, a read-only file
system, the tier's loop thread dying with jobs in flight, shutdown with jobs in flight, and bad
options. Each test checks what vLLM is told per job (``JobResult``) and that no wrong byte reaches
its CPU region: a chunk changes only when its load is reported good.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm_helpers import (
    CHUNK_BYTES,
    CPU_CHUNKS,
    STEP,
    complete_stores,
    keys_of,
    load,
    lookup_all,
    make_manager,
    on_disk,
    page_files,
    payload,
    step,
    store,
    tier_of,
)

from aiokv.adapters.loopthread import LoopDied
from aiokv.adapters.vllm import AiokvTier

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))  # the storage suite's file-system helpers
from fs_helpers import fill_up, loop_ext4, remount


def record_results(tier: AiokvTier) -> list[JobResult]:
    """Every JobResult the tier hands vLLM from now on (vLLM's manager still gets each one)."""
    seen: list[JobResult] = []
    original = tier.get_finished_jobs

    def recording() -> list[JobResult]:
        results = list(original())
        seen.extend(results)
        return results

    tier.get_finished_jobs = recording  # type: ignore[method-assign]
    return seen


def region(manager: TieringOffloadingManager) -> bytes:
    with manager.primary_tier.get_kv_memoryview().cast("B") as flat:
        return bytes(flat)


def chunks_of(data: bytes) -> list[bytes]:
    return [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]


def evict_from_cpu(manager: TieringOffloadingManager, req: str, chunks: int = CPU_CHUNKS) -> None:
    """Store ``chunks`` (the CPU tier's size) other chunks: its LRU evicts everything stored before."""
    store(manager, req, keys_of(f"evictor-{req}", chunks), range(1000, 1000 + chunks))


def distinct_fanout_keys(tier: AiokvTier, name: str, count: int) -> list[bytes]:
    """``count`` engine keys whose page files live in ``count`` different fan-out directories."""
    keys, prefixes = [], set()
    for candidate in keys_of(name, 64):
        prefix = tier._store.key(candidate).hex()[:2]
        if prefix not in prefixes:
            prefixes.add(prefix)
            keys.append(candidate)
        if len(keys) == count:
            return keys
    raise AssertionError("not enough distinct fan-out directories")


def fanout_dir(tier: AiokvTier, key: bytes) -> Path:
    store = tier._store
    return store.directory / store.layout.fingerprint.hex() / store.key(key).hex()[:2]


@pytest.fixture
def immutable() -> Iterator[Callable[[Path], None]]:
    """``chattr +i`` a directory (no file can be created in it, not even by root), undone at the end."""
    made: list[Path] = []

    def make(path: Path) -> None:
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            pytest.skip(f"chattr +i is not possible here: {done.stderr.strip()}")
        made.append(path)

    yield make
    for path in made:
        subprocess.run(["chattr", "-i", str(path)], check=True)


# -- stores ---------------------------------------------------------------------------------------


@pytest.mark.root
def test_a_store_failing_part_way_reports_the_job_failed_and_keeps_the_rest(
        tmp_path: Path, managers: list[TieringOffloadingManager], immutable: Callable[[Path], None]) -> None:
    manager = make_manager(tmp_path)
    managers.append(manager)
    tier = tier_of(manager)
    results = record_results(tier)
    keys = distinct_fanout_keys(tier, "part", 3)
    immutable(fanout_dir(tier, keys[1]))  # the middle page's file cannot be created: EPERM
    store(manager, "r1", keys, [1, 2, 3])
    (result,) = [r for r in results if r.transfer_bytes is not None]
    assert result.success is False
    assert result.transfer_bytes == 2 * CHUNK_BYTES  # the two pages that did reach the disk
    assert on_disk(manager, keys) == [True, False, True]
    assert tier.statistics()["errors"]  # the fault is counted
    evict_from_cpu(manager, "r2")
    ctx = ReqContext(req_id="r3")
    with manager.lock:
        manager.on_new_request(ctx)
    assert lookup_all(manager, keys, ctx) == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]
    assert load(manager, [keys[0], keys[2]], ctx) == [payload(1), payload(3)]
    with manager.lock:
        manager.on_request_finished(ctx)
    step(manager)


@pytest.mark.root
def test_a_full_file_system_fails_stores_and_keeps_serving_reads(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    with loop_ext4(tmp_path, 320) as mount:  # room above the disk tier's 256 MiB free-space floor
        manager = make_manager(mount)
        try:
            tier = tier_of(manager)
            results = record_results(tier)
            before = keys_of("before-full", 2)
            store(manager, "r1", before, [1, 2])
            fill_up(mount / "filler", leave=0)  # another program fills the disk
            after = keys_of("after-full", 2)
            store(manager, "r2", after, [3, 4])
            first_job, full_job = [r for r in results if r.transfer_bytes is not None]
            assert first_job.success is True
            stats = tier.statistics()
            assert stats["dropped"] or stats["errors"]  # ENOSPC seen, or no room left to claim
            everything = before + after
            there = on_disk(manager, everything)
            assert sum(there) <= 2  # no more than the disk has room for (older pages may have made room)
            # What the job reported is what reached the disk (the newest pages are not the ones evicted).
            assert full_job.transfer_bytes == CHUNK_BYTES * sum(there[2:])
            assert full_job.success is all(there[2:])
            # Whatever is on disk reads back bit-exact; what is not is a miss (never other bytes).
            evict_from_cpu(manager, "r3")  # (its pages compete for the same full disk)
            ctx = ReqContext(req_id="r4")
            with manager.lock:
                manager.on_new_request(ctx)
            there = on_disk(manager, everything)
            found = lookup_all(manager, everything, ctx)
            assert found == [LookupResult.HIT if t else LookupResult.MISS for t in there]
            hits = [k for k, t in zip(everything, there, strict=True) if t]
            seeds = dict(zip(everything, [1, 2, 3, 4], strict=True))
            assert load(manager, hits, ctx) == [payload(seeds[k]) for k in hits]
            with manager.lock:
                manager.on_request_finished(ctx)
            step(manager)
        finally:
            manager.shutdown()


@pytest.mark.root
def test_a_read_only_file_system_refuses_stores_and_serves_what_it_has(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    with loop_ext4(tmp_path, 320) as mount:
        first = make_manager(mount)
        kept = keys_of("kept", 2)
        store(first, "r1", kept, [5, 6])
        first.shutdown()
        remount(mount, "ro")
        try:
            manager = make_manager(mount)
            try:
                tier = tier_of(manager)
                results = record_results(tier)
                refused = keys_of("refused", 2)
                store(manager, "r2", refused, [7, 8])
                (result,) = [r for r in results if r.transfer_bytes is not None]
                assert (result.success, result.transfer_bytes) == (False, 0)
                assert tier.statistics()["writes_refused"] == 2
                evict_from_cpu(manager, "r3")
                ctx = ReqContext(req_id="r4")
                with manager.lock:
                    manager.on_new_request(ctx)
                assert lookup_all(manager, kept + refused, ctx) == [LookupResult.HIT] * 2 + [LookupResult.MISS] * 2
                assert load(manager, kept, ctx) == [payload(5), payload(6)]
                with manager.lock:
                    manager.on_request_finished(ctx)
                step(manager)
            finally:
                manager.shutdown()
        finally:
            remount(mount, "rw")


# -- loads ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("zero_copy", [True, False], ids=["in-place", "staged"])
def test_a_load_of_damaged_files_reports_the_good_keys_and_writes_no_other_chunk(
        tmp_path: Path, managers: list[TieringOffloadingManager], zero_copy: bool) -> None:
    """Between the lookup's HIT and the load, page files are damaged behind the tier's back: one
    bit flipped, cut after its header, deleted, and replaced by a link to another good page file.
    The job reports only the intact key in successful_keys; the others become misses. No chunk
    outside the job's own changes; read in place, a failed page's chunk (vLLM's, reserved for
    this job, freed unused) may hold the bytes read; through staging pages it is untouched."""
    manager = make_manager(tmp_path, cpu_chunks=8, options={"zero_copy": zero_copy})
    managers.append(manager)
    tier = tier_of(manager)
    keys = keys_of("damaged", 5)
    store(manager, "r1", keys, range(10, 15))
    evict_from_cpu(manager, "r2", chunks=8)
    results = record_results(tier)
    submitted: list[TransferJob] = []
    submit_load = tier.submit_load

    def recording_submit_load(job: TransferJob) -> None:
        submitted.append(job)
        submit_load(job)

    tier.submit_load = recording_submit_load  # type: ignore[method-assign]
    ctx = ReqContext(req_id="r3")
    with manager.lock:
        manager.on_new_request(ctx)
        assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * 5
    step(manager)  # the loop answers: all five on disk
    with manager.lock:  # vLLM reserves CPU chunks; submit_load follows at the step end
        assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT_PENDING] * 5
    files = {p.name: p for p in page_files(tmp_path)}
    path = [files[tier._store.key(k).hex()] for k in keys]
    raw = bytearray(path[1].read_bytes())
    raw[4096 + 4321] ^= 0x08
    path[1].write_bytes(bytes(raw))
    os.truncate(path[2], 4096)
    path[3].unlink()
    path[4].unlink()
    path[4].symlink_to(path[0])
    snapshot = chunks_of(region(manager))
    step(manager)  # submit_load, drained
    with manager.lock:
        found = [manager.lookup(k, ctx) for k in keys]
    assert found == [LookupResult.HIT] + [LookupResult.MISS] * 4
    (result,) = results
    assert result.success is False
    assert list(result.successful_keys or ()) == [keys[0]]
    assert result.transfer_bytes == CHUNK_BYTES
    with manager.lock:
        (good_chunk,) = [int(c) for c in manager.prepare_load([keys[0]], ctx).chunk_ids]
        manager.complete_load([keys[0]], ctx)
    now = chunks_of(region(manager))
    assert now[good_chunk] == payload(10)
    (job,) = submitted
    assert good_chunk in job.chunk_ids
    changed = {i for i, (a, b) in enumerate(zip(snapshot, now, strict=True)) if a != b}
    assert changed <= ({int(c) for c in job.chunk_ids} if zero_copy else {good_chunk})
    assert tier._store.thread.call(lambda: tier._store.direct_pages > 0).result() is zero_copy
    assert on_disk(manager, keys) == [True, False, False, False, False]  # damaged files are forgotten
    assert path[0].read_bytes()[4096:] == payload(10)  # the link was not followed to harm its target
    assert tier_of(manager).statistics()["corrupt"] >= 1
    with manager.lock:
        manager.on_request_finished(ctx)
    step(manager)


# -- the loop thread dying -------------------------------------------------------------------------


def die() -> None:
    """A posted call letting SystemExit out: the loop's run_forever ends with it (as it would for
    any BaseException a library lets escape on that thread)."""
    raise SystemExit("injected: the loop thread ends")


def test_the_loop_dying_with_jobs_in_flight_reports_every_job_and_never_hangs(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    manager = make_manager(tmp_path, options={"idle_poll_s": 0})  # queued jobs wait for a hand-over
    managers.append(manager)
    tier = tier_of(manager)
    results = record_results(tier)
    thread = tier._store.thread
    keys = keys_of("dying", 3)
    complete_stores(manager, "r1", keys, [1, 2, 3])  # one cascade job, queued
    thread.post_call(die)
    with manager.lock:
        manager.reset_cache()  # drain_jobs runs the queue, meets the SystemExit, must still return
        manager.on_reset_flushed()
        assert not manager.has_pending_work()  # every job was reported (reset_cache asserts it too)
    assert thread.dead and isinstance(thread.died, LoopDied)
    assert len(results) == 1  # the one job: finished before the loop died, or reported failed
    # Afterwards nothing waits for the dead loop: lookups miss, jobs fail at once, steps go on.
    ctx = ReqContext(req_id="r2")
    with manager.lock:
        manager.on_new_request(ctx)
        assert tier.lookup(keys_of("unknown", 1)[0], ctx) is LookupResult.MISS
        tier.submit_store(TransferJob(job_id=10_001, keys=keys[:1], chunk_ids=_chunks([0]), is_promotion=False,
                                      req_context=ctx))
        assert list(tier.get_finished_jobs()) == [JobResult(job_id=10_001, success=False)]
        tier.touch(keys, ctx)
        tier.drain_jobs()
        manager.on_schedule_end(STEP)
        manager.on_request_finished(ctx)
    with pytest.raises(LoopDied):
        tier.statistics()
    manager.shutdown()  # closes without the loop (the dying thread closed the disk tier itself)
    managers.remove(manager)
    # The files it completed are intact: a new manager serves each bit-exact, or misses.
    again = make_manager(tmp_path)
    managers.append(again)
    ctx = ReqContext(req_id="r3")
    with again.lock:
        again.on_new_request(ctx)
    found = lookup_all(again, keys, ctx)
    hits = [k for k, f in zip(keys, found, strict=True) if f is LookupResult.HIT]
    seeds = dict(zip(keys, [1, 2, 3], strict=True))
    assert load(again, hits, ctx) == [payload(seeds[k]) for k in hits]
    with again.lock:
        again.on_request_finished(ctx)
    step(again)


def test_the_loop_dying_while_lookups_are_out_answers_them_as_misses(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    manager = make_manager(tmp_path, options={"idle_poll_s": 0})
    managers.append(manager)
    tier = tier_of(manager)
    thread = tier._store.thread
    keys = keys_of("asked", 2)
    ctx = ReqContext(req_id="r1")
    with manager.lock:
        manager.on_new_request(ctx)
        assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * 2
    thread.post_call(die)  # ahead of the step's lookup batch
    with manager.lock:
        manager.on_schedule_end(STEP)  # posts the lookups behind the fatal call, and wakes the loop
    thread.wake()
    thread.close()  # joins the dying thread (the owner would, at shutdown)
    with manager.lock:
        assert not tier.has_pending_work()  # the unanswered lookups are answered for
        assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 2
        manager.on_request_finished(ctx)


def _chunks(ids: list[int]) -> Any:
    import numpy as np

    return np.array(ids, dtype=np.int64)


# -- shutdown with jobs in flight -----------------------------------------------------------------


def test_shutdown_with_jobs_in_flight_waits_for_them(tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    """vLLM shuts the tier down right after a cascade was picked up by the loop: shutdown waits
    for the writes (vLLM unmaps its region next) and every file is whole afterwards."""
    manager = make_manager(tmp_path)
    tier = tier_of(manager)
    thread = tier._store.thread
    keys = keys_of("in-flight", CPU_CHUNKS)
    complete_stores(manager, "r1", keys, range(20, 20 + CPU_CHUNKS))
    picked = threading.Event()
    for _ in range(1000):  # bounded: the parked loop looks every 10 ms
        if thread.pending() == 0:
            picked.set()
            break
        picked.wait(0.01)
    assert picked.is_set()
    manager.shutdown()
    again = make_manager(tmp_path)
    managers.append(again)
    ctx = ReqContext(req_id="r2")
    with again.lock:
        again.on_new_request(ctx)
    assert lookup_all(again, keys, ctx) == [LookupResult.HIT] * CPU_CHUNKS
    assert load(again, keys, ctx) == [payload(s) for s in range(20, 20 + CPU_CHUNKS)]
    with again.lock:
        again.on_request_finished(ctx)
    step(again)


# -- bad configuration ----------------------------------------------------------------------------


def _aiokv_threads() -> set[threading.Thread]:
    """The tiers' loop threads (joined when a tier fails to start; the staging pool's idle workers
    exit by themselves a moment later and are not counted)."""
    return {t for t in threading.enumerate() if t.name == "aiokv-vllm"}


@pytest.mark.parametrize(("options", "error", "match"), [
    ({"no_such_option": 1}, TypeError, "no_such_option"),
    ({"disk_bytes": 0}, ValueError, "disk_bytes must be at least 1"),  # the option named (review 276)
    ({"disk_bytes": "1G"}, TypeError, "disk_bytes"),
    ({"queue_depth": -1}, ValueError, "queue_depth must be positive"),
    ({"disk_backend": "bogus"}, ValueError, "bogus"),
    ({"direct_io": "yes"}, TypeError, "direct_io"),
    ({"poll_s": float("nan")}, ValueError, "poll_s must be finite"),
    ({"linger_s": -1}, ValueError, "linger_s"),
    ({"locality": "nowhere"}, ValueError, "nowhere"),
    ({"enable_kv_events": "yes"}, TypeError, "enable_kv_events"),
    ({"namespace": 7}, TypeError, "namespace"),
])
def test_bad_options_fail_the_tier_at_start_and_leave_nothing_running(
        tmp_path: Path, options: dict[str, object], error: type[Exception], match: str) -> None:
    before = _aiokv_threads()
    with pytest.raises(error, match=match):
        make_manager(tmp_path, options=options)
    assert _aiokv_threads() == before


def test_a_disk_dir_that_is_a_file_fails_at_start_holding_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Regression: the tier took its views of vLLM's region before starting the disk tier, so a
    start that failed left them exported (vLLM then kept the region mapped: "buffers are still
    exported to native users")."""
    before = _aiokv_threads()
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"x")
    with pytest.raises(NotADirectoryError):
        make_manager(not_a_dir)
    assert _aiokv_threads() == before
    assert "still exported" not in caplog.text


@pytest.mark.root
def test_a_directory_swapped_for_a_link_to_somebody_elses_is_refused(tmp_path: Path) -> None:
    before = _aiokv_threads()
    first = make_manager(tmp_path / "cache")
    identity = tier_of(first)._store.directory
    first.shutdown()
    elsewhere = tmp_path / "elsewhere"
    identity.rename(elsewhere)
    os.chown(elsewhere, 65534, 65534)
    identity.symlink_to(elsewhere)
    inside = sorted(elsewhere.rglob("*"))
    # Refused as a link (a store's directory is never followed), before its target's owner matters.
    with pytest.raises(OSError, match=r"is not a directory \(a symlink"):
        make_manager(tmp_path / "cache")
    assert sorted(elsewhere.rglob("*")) == inside
    assert _aiokv_threads() == before


def test_a_job_vllm_describes_wrongly_is_refused_at_submit(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    manager = make_manager(tmp_path)
    managers.append(manager)
    tier = tier_of(manager)
    ctx = ReqContext(req_id="r1")
    keys = keys_of("bad-job", 2)
    with pytest.raises(ValueError, match="2 keys but 1 chunk ids"):
        tier.submit_store(TransferJob(job_id=1, keys=keys, chunk_ids=_chunks([0]), is_promotion=False,
                                      req_context=ctx))
    with pytest.raises(ValueError, match="outside"):
        tier.submit_load(TransferJob(job_id=2, keys=keys, chunk_ids=_chunks([0, 10_000]), is_promotion=True,
                                     req_context=ctx))
    assert not tier.has_pending_work()  # nothing was queued for either
