"""aiokv's disk tier inside vLLM 0.33's real TieringOffloadingManager (CPU; vLLM's own classes).

The manager is built the way vLLM's scheduler builds it: OffloadingSpecFactory -> TieringOffloadingSpec
-> get_manager(), with the aiokv tier named by module path. The tests play the scheduler's part: they
hold the manager lock for each call, step with on_schedule_end, and write/read the primary (CPU)
chunks where vLLM's GPU worker would.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm.v1.kv_offload.base import LookupResult, Medium, ReqContext
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm_helpers import (
    CHUNK_BYTES,
    CPU_CHUNKS,
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

from aiokv.adapters.store import page_file_bytes


def test_store_evict_lookup_load_bit_exact(tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    manager = make_manager(tmp_path)
    managers.append(manager)
    first, later = keys_of("a", CPU_CHUNKS), keys_of("b", CPU_CHUNKS)
    store(manager, "r1", first, range(CPU_CHUNKS))
    store(manager, "r2", later, range(100, 100 + CPU_CHUNKS))  # the CPU tier's LRU evicts all of `first`
    stats = tier_of(manager).statistics()
    assert stats["writes"] == 2 * CPU_CHUNKS
    ctx = ReqContext(req_id="r3")
    with manager.lock:
        manager.on_new_request(ctx)
        assert all(manager.primary_tier.lookup(k, ctx) is LookupResult.MISS for k in first)
        assert manager.lookup(first[0], ctx) is LookupResult.RETRY  # aiokv answers from its loop, next step
    assert lookup_all(manager, first, ctx) == [LookupResult.HIT] * CPU_CHUNKS  # promoted from disk
    assert load(manager, first, ctx) == [payload(s) for s in range(CPU_CHUNKS)]
    with manager.lock:
        manager.on_request_finished(ctx)
    step(manager)
    assert tier_of(manager).statistics()["hits"] == CPU_CHUNKS


def test_restart_over_the_same_directory_hits(tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    manager = make_manager(tmp_path)
    keys = keys_of("restart", 3)
    store(manager, "r1", keys, [7, 8, 9])
    manager.shutdown()
    again = make_manager(tmp_path)
    managers.append(again)
    ctx = ReqContext(req_id="r2")
    with again.lock:
        again.on_new_request(ctx)
    assert lookup_all(again, keys, ctx) == [LookupResult.HIT] * 3
    assert load(again, keys, ctx) == [payload(7), payload(8), payload(9)]
    with again.lock:
        again.on_request_finished(ctx)
    step(again)


def test_corrupt_file_is_a_miss_never_wrong_bytes(tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    manager = make_manager(tmp_path)
    keys = keys_of("corrupt", 2)
    store(manager, "r1", keys, [1, 2])
    manager.shutdown()
    files = page_files(tmp_path)
    assert len(files) == 2
    for path in files:  # flip one payload byte in both files
        raw = bytearray(path.read_bytes())
        raw[4096 + 1234] ^= 0x40
        path.write_bytes(bytes(raw))
    again = make_manager(tmp_path)
    managers.append(again)
    ctx = ReqContext(req_id="r2")
    with again.lock:
        again.on_new_request(ctx)
    assert lookup_all(again, keys, ctx) == [LookupResult.MISS] * 2  # promotion failed: recompute
    with again.lock:
        assert all(again.primary_tier.lookup(k, ctx) is LookupResult.MISS for k in keys)  # nothing served
        again.on_request_finished(ctx)
    step(again)
    stats = tier_of(again).statistics()
    assert stats["corrupt"] == 2
    again.shutdown()  # waits for the disk tier's unlinks, which run after the reads returned
    assert page_files(tmp_path) == []  # a corrupt file is deleted


def test_two_models_never_share_a_page_file(tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    a = make_manager(tmp_path, model="test/model-a")
    managers.append(a)
    keys = keys_of("shared-prompt", 2)
    store(a, "r1", keys, [5, 6])
    b = make_manager(tmp_path, model="test/model-b")  # same block hashes, other model
    managers.append(b)
    ctx = ReqContext(req_id="r2")
    with b.lock:
        b.on_new_request(ctx)
    assert lookup_all(b, keys, ctx) == [LookupResult.MISS] * 2
    with b.lock:
        b.on_request_finished(ctx)
    step(b)
    assert tier_of(a).statistics()["pages"] == 2
    assert tier_of(b).statistics()["pages"] == 0


def test_submit_does_not_wake_the_loop_and_reset_cache_drains_it(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    """A job submitted while the loop is parked stays queued (no wake-up system call in submit_*);
    vLLM's reset_cache, which calls drain_jobs and never on_schedule_end, still gets every result.
    (idle_poll_s=0: a parked loop sleeps until woken, so the job stays queued until drained.)"""
    manager = make_manager(tmp_path, options={"idle_poll_s": 0})
    managers.append(manager)
    tier = tier_of(manager)
    thread = tier._store.thread
    assert thread.parked  # nothing was posted since the tier started
    keys = keys_of("parked", 3)
    complete_stores(manager, "r1", keys, [1, 2, 3])
    assert thread.parked and thread.pending() == 1  # queued, the loop not woken
    assert tier.has_pending_work()
    with manager.lock:
        manager.reset_cache()  # drain_jobs, then vLLM asserts every job was reported
        manager.on_reset_flushed()
        assert not manager.has_pending_work()
    assert tier.statistics()["writes"] == 3
    with manager.lock:
        manager.on_request_finished(ReqContext(req_id="r1"))


def test_shutdown_without_a_step_end_finishes_submitted_stores(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    manager = make_manager(tmp_path, options={"idle_poll_s": 0})  # nothing but shutdown picks the job up
    keys = keys_of("unstepped", 2)
    complete_stores(manager, "r1", keys, [4, 5])
    assert tier_of(manager)._store.thread.pending() == 1
    manager.shutdown()  # never stepped: the job must still run, and shutdown must not hang
    again = make_manager(tmp_path)
    managers.append(again)
    ctx = ReqContext(req_id="r2")
    with again.lock:
        again.on_new_request(ctx)
    assert lookup_all(again, keys, ctx) == [LookupResult.HIT] * 2
    assert load(again, keys, ctx) == [payload(4), payload(5)]
    with again.lock:
        again.on_request_finished(ctx)
    step(again)


def test_load_with_one_corrupt_page_reports_the_others(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    """Partial success: a page found corrupt between the lookup's HIT and the load is reported
    failed (vLLM drops it, the request recomputes it); the other pages arrive bit-exact."""
    manager = make_manager(tmp_path)
    managers.append(manager)
    keys = keys_of("partial", 3)
    store(manager, "r1", keys, [20, 21, 22])
    store(manager, "r2", keys_of("evictor", CPU_CHUNKS), range(CPU_CHUNKS))  # evicts `keys` from the CPU tier
    tier = tier_of(manager)
    ctx = ReqContext(req_id="r3")
    with manager.lock:
        manager.on_new_request(ctx)
        assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * 3
    step(manager)  # the loop answers: all three on disk
    (victim,) = [p for p in page_files(tmp_path) if p.name == tier._store.key(keys[1]).hex()]
    with manager.lock:  # a disk hit: vLLM reserves CPU chunks and defers submit_load to the step end
        assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT_PENDING] * 3
    raw = bytearray(victim.read_bytes())
    raw[4096 + 99] ^= 0x10
    victim.write_bytes(bytes(raw))
    step(manager)  # submit_load, drained; the corrupt page fails its checksum
    with manager.lock:
        results = [manager.lookup(k, ctx) for k in keys]
    assert results == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]
    assert load(manager, [keys[0], keys[2]], ctx) == [payload(20), payload(22)]
    with manager.lock:
        manager.on_request_finished(ctx)
    step(manager)
    assert tier.statistics()["corrupt"] == 1


def test_a_parked_loop_finds_submitted_jobs_without_any_hand_over(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    """Default idle_poll_s: no call wakes the loop, yet the parked loop picks a submitted job up by
    itself (no step end, no drain); the next step reports it."""
    manager = make_manager(tmp_path)
    managers.append(manager)
    tier = tier_of(manager)
    thread = tier._store.thread
    assert thread.parked
    complete_stores(manager, "r1", keys_of("idle", 2), [6, 7])
    picked = threading.Event()
    for _ in range(1000):  # bounded: the parked loop looks every 10 ms
        if thread.pending() == 0:
            picked.set()
            break
        picked.wait(0.01)
    assert picked.is_set()
    step(manager)  # drained: the result is reported at the next step
    assert tier.statistics()["writes"] == 2
    with manager.lock:
        manager.on_request_finished(ReqContext(req_id="r1"))
    step(manager)
    assert not manager.has_pending_work()


@pytest.mark.parametrize("touched", [False, True], ids=["untouched", "touched"])
def test_touch_keeps_pages_on_disk_when_room_is_made(
        tmp_path: Path, managers: list[TieringOffloadingManager], touched: bool) -> None:
    """vLLM's manager.touch reaches the tier: the touched pages are the most recently used on disk,
    so the next writes evict the others (the disk holds 4 pages here)."""
    manager = make_manager(tmp_path, options={"disk_bytes": 4 * page_file_bytes(CHUNK_BYTES)})
    managers.append(manager)
    old, newer, newest = keys_of("old", 2), keys_of("newer", 2), keys_of("newest", 2)
    store(manager, "r1", old, [1, 2])
    store(manager, "r2", newer, [3, 4])
    assert on_disk(manager, old + newer) == [True] * 4
    if touched:
        with manager.lock:
            manager.touch(old, ReqContext(req_id="r3"))
        step(manager)
    store(manager, "r4", newest, [5, 6])  # two writes: two evictions
    assert on_disk(manager, newest) == [True, True]
    assert on_disk(manager, old) == [touched] * 2
    assert on_disk(manager, newer) == [not touched] * 2
    assert tier_of(manager).statistics()["evictions"] == 2


def test_touch_of_keys_not_on_disk_changes_nothing(tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    manager = make_manager(tmp_path)
    managers.append(manager)
    keys = keys_of("kept", 2)
    store(manager, "r1", keys, [1, 2])
    before = tier_of(manager).statistics()
    with manager.lock:
        manager.touch(keys_of("never-stored", 3), ReqContext(req_id="r2"))
    step(manager)
    after = tier_of(manager).statistics()
    assert (after["pages"], after["reads"], after["writes"]) == (before["pages"], before["reads"], before["writes"])
    assert on_disk(manager, keys_of("never-stored", 3)) == [False] * 3


def test_kv_events_for_stored_pages_and_pages_found_gone(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    manager = make_manager(tmp_path, options={"enable_kv_events": True}, kv_events=True)
    managers.append(manager)
    keys = keys_of("events", 2)
    store(manager, "r1", keys, [1, 2])
    with manager.lock:
        events = [e for e in manager.take_events() if e.medium is Medium.STORAGE]
    assert [(sorted(e.keys), e.removed) for e in events] == [(sorted(keys), False)]
    store(manager, "r2", keys_of("evictor", CPU_CHUNKS), range(CPU_CHUNKS))  # `keys` leave the CPU tier
    with manager.lock:
        list(manager.take_events())
    tier = tier_of(manager)
    (victim,) = [p for p in page_files(tmp_path) if p.name == tier._store.key(keys[0]).hex()]
    raw = bytearray(victim.read_bytes())
    raw[4096 + 7] ^= 0x01
    victim.write_bytes(bytes(raw))
    ctx = ReqContext(req_id="r3")
    with manager.lock:
        manager.on_new_request(ctx)
    assert lookup_all(manager, keys, ctx) == [LookupResult.MISS, LookupResult.HIT]
    with manager.lock:
        events = [e for e in manager.take_events() if e.medium is Medium.STORAGE]
        manager.on_request_finished(ctx)
    assert [(e.keys, e.removed) for e in events] == [([keys[0]], True)]  # the corrupt page was deleted
    step(manager)


def test_kv_events_for_pages_evicted_for_room(tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    """The disk holds 6 pages: storing 4, 4 more and 4 more evicts the oldest. Every page evicted
    gets one "removed" event after its "stored" one; no page still on disk does; a page stored again
    while on disk is recent again (it outlives pages stored after it the first time)."""
    file_bytes = CHUNK_BYTES + 4096
    manager = make_manager(tmp_path, options={"enable_kv_events": True, "disk_bytes": 6 * file_bytes},
                           kv_events=True)
    managers.append(manager)
    events: list[tuple[bytes, bool]] = []

    def collect() -> None:
        with manager.lock:
            events.extend((key, e.removed) for e in manager.take_events() if e.medium is Medium.STORAGE
                          for key in e.keys)

    a, b, c = keys_of("old", 4), keys_of("mid", 4), keys_of("new", 4)
    for req, keys, seed in (("ra", a, 0), ("rb", b, 10)):
        store(manager, req, keys, range(seed, seed + 4))
        collect()
    assert sorted(k for k, removed in events if not removed) == sorted(a + b)
    gone = [k for k, there in zip(a + b, on_disk(manager, a + b), strict=True) if not there]
    assert len(gone) == 2 and set(gone) <= set(a)
    assert sorted(k for k, removed in events if removed) == sorted(gone)
    survivor = next(k for k in a if k not in gone)
    tier = tier_of(manager)
    store_ = tier._store
    tier.touch([survivor], ReqContext(req_id="t"))  # vLLM's touch: the survivor is recent again
    step(manager)
    store(manager, "rc", c, range(20, 24))
    collect()
    keys = a + b + c
    there = dict(zip(keys, on_disk(manager, keys), strict=True))
    assert there[survivor]  # touched: outlived the pages of b stored after it
    for key in keys:
        history = [removed for k, removed in events if k == key]
        assert history[0] is False  # stored first
        assert history[-1] is (not there[key])  # removed exactly when no longer on disk
        assert history.count(True) <= 1
    evictions = store_.thread.call(lambda: store_.statistics().evictions).result()
    assert sum(removed for _, removed in events) == evictions == len(keys) - 6


def test_kv_events_stay_off_where_vllm_publishes_none(
        tmp_path: Path, managers: list[TieringOffloadingManager], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="aiokv.adapters.vllm"):
        manager = make_manager(tmp_path, options={"enable_kv_events": True}, kv_events=False)
    managers.append(manager)
    assert "KV cache events are off" in caplog.text
    store(manager, "r1", keys_of("quiet", 1), [1])
    with manager.lock:
        assert list(tier_of(manager).take_events()) == []


def store_counters(manager: TieringOffloadingManager) -> tuple[int, int]:
    """(pages moved in place, pages moved through a staging page) by the tier's store."""
    store = tier_of(manager)._store
    return store.thread.call(lambda: (store.direct_pages, store.staged_pages)).result()


def test_chunks_move_in_place_both_ways_and_the_region_is_let_go(
        tmp_path: Path, managers: list[TieringOffloadingManager], caplog: pytest.LogCaptureFixture) -> None:
    """Zero-copy: each chunk is written from and read into vLLM's region itself (registered with
    io_uring), bit-exact; at shutdown the tier lets go of the region so vLLM can unmap it."""
    manager = make_manager(tmp_path)
    keys = keys_of("in-place", CPU_CHUNKS)
    store(manager, "r1", keys, range(30, 30 + CPU_CHUNKS))
    store(manager, "r2", keys_of("evictor", CPU_CHUNKS), range(CPU_CHUNKS))
    ctx = ReqContext(req_id="r3")
    with manager.lock:
        manager.on_new_request(ctx)
    assert lookup_all(manager, keys, ctx) == [LookupResult.HIT] * CPU_CHUNKS
    assert load(manager, keys, ctx) == [payload(s) for s in range(30, 30 + CPU_CHUNKS)]
    with manager.lock:
        manager.on_request_finished(ctx)
    step(manager)
    assert store_counters(manager) == (3 * CPU_CHUNKS, 0)  # two requests stored, one loaded: no staging copy
    stats = tier_of(manager).statistics()
    assert stats["buffered_fallbacks"] == 0  # every chunk 4096-aligned: O_DIRECT where the tier uses it
    manager.shutdown()
    assert "still exported" not in caplog.text  # vLLM unmapped its region: nothing of ours holds it


def test_pages_written_in_place_read_back_through_staging_and_back(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    """The two paths write the same files: zero_copy is not part of the identity."""
    first = make_manager(tmp_path, options={"zero_copy": True})
    keys = keys_of("either", 2)
    store(first, "r1", keys, [41, 42])
    first.shutdown()
    staged = make_manager(tmp_path, options={"zero_copy": False})
    ctx = ReqContext(req_id="r2")
    with staged.lock:
        staged.on_new_request(ctx)
    assert lookup_all(staged, keys, ctx) == [LookupResult.HIT] * 2
    assert load(staged, keys, ctx) == [payload(41), payload(42)]
    more = keys_of("staged", 2)
    with staged.lock:
        staged.on_request_finished(ctx)
    store(staged, "r3", more, [43, 44])
    assert store_counters(staged) == (0, 4)
    staged.shutdown()
    again = make_manager(tmp_path)
    managers.append(again)
    ctx = ReqContext(req_id="r4")
    with again.lock:
        again.on_new_request(ctx)
    assert lookup_all(again, more, ctx) == [LookupResult.HIT] * 2
    assert load(again, more, ctx) == [payload(43), payload(44)]
    with again.lock:
        again.on_request_finished(ctx)
    step(again)
    assert store_counters(again)[1] == 0


def test_metrics_are_declared_to_vllm_and_reported_without_blocking(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    """vLLM's spec gathers the tier's metric definitions by module path; the manager's get_stats
    carries the disk tier's counters (as increases) and gauges, one step behind, never waiting."""
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    tier_config = {"type": "AiokvTier", "module_path": "aiokv.adapters.vllm"}
    definitions = TieringOffloadingSpec.build_metric_definitions(
        {"spec_name": "TieringOffloadingSpec", "secondary_tiers": [tier_config]})
    ours = {name for name in definitions if name.startswith("vllm:kv_offload_aiokv_")}
    assert ours == {f"vllm:kv_offload_aiokv_{n}" for n in (
        "corrupt_pages", "dropped_writes", "refused_writes", "evictions", "io_errors", "bytes_stored",
        "capacity_bytes", "read_only")}

    manager = make_manager(tmp_path)
    managers.append(manager)
    tier = tier_of(manager)

    def ours_in(stats: Any) -> dict[str, dict[tuple[str, ...], float]]:
        if stats is None:
            return {}
        _types, values = stats.metric_sections()
        return {k: dict(v) for k, v in values.items() if k.startswith("vllm:kv_offload_aiokv_")}

    keys = keys_of("metrics", 2)
    store(manager, "r1", keys, [1, 2])
    with manager.lock:
        ours_in(manager.get_stats())  # asks the loop for a snapshot
    step(manager)
    with manager.lock:
        first = ours_in(manager.get_stats())
    label = (tier.tier_type,)
    assert first["vllm:kv_offload_aiokv_bytes_stored"][label] == 2 * page_file_bytes(CHUNK_BYTES)
    assert first["vllm:kv_offload_aiokv_read_only"][label] == 0
    assert "vllm:kv_offload_aiokv_corrupt_pages" not in first
    # A corrupt page found at load: the counter goes up by one, once.
    store(manager, "r2", keys_of("evictor", CPU_CHUNKS), range(CPU_CHUNKS))
    (victim,) = [p for p in page_files(tmp_path) if p.name == tier._store.key(keys[0]).hex()]
    raw = bytearray(victim.read_bytes())
    raw[4096 + 3] ^= 0x01
    victim.write_bytes(bytes(raw))
    ctx = ReqContext(req_id="r3")
    with manager.lock:
        manager.on_new_request(ctx)
    assert lookup_all(manager, keys, ctx) == [LookupResult.MISS, LookupResult.HIT]
    with manager.lock:
        manager.on_request_finished(ctx)
        ours_in(manager.get_stats())
    step(manager)
    with manager.lock:
        second = ours_in(manager.get_stats())
    step(manager)
    with manager.lock:
        third = ours_in(manager.get_stats())
    assert second["vllm:kv_offload_aiokv_corrupt_pages"][label] == 1
    assert "vllm:kv_offload_aiokv_corrupt_pages" not in third  # reported once, as an increase
