"""Lookup verdicts of the aiokv tier against stores that complete between lookups, and lookups out
for requests that finished, through vLLM 0.33's real ``TieringOffloadingManager``.

The tier keeps one verdict per key while some request asks about it. A MISS that a store of the
key made stale (another request's cascade put it on disk) was still handed to a second request
asking meanwhile: a lost hit (vLLM recomputes the block), never wrong KV. Now a store the loop
completed makes the key's verdict a HIT, in the loop's order: a lookup the loop answered before the
store completed is applied first.

A lookup posted for a request that finished before the loop answered it kept ``has_pending_work``
True until the answer came (vLLM steps the engine, empty steps, while it is True): it no longer
counts; a request asking the key again makes it count again.

The tests call the tier's ``lookup`` directly where the manager would on a primary (CPU) miss: the
CPU tier still holds the stored chunks here and would answer first."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm_helpers import STEP, complete_stores, keys_of, make_manager, on_disk, step, store, tier_of

BOUND_S = 30.0


def _asked_miss(manager: TieringOffloadingManager, ctx: ReqContext, key: bytes) -> None:
    """``ctx`` asks the tier about ``key``, not on disk, and gets the loop's MISS."""
    tier = tier_of(manager)
    with manager.lock:
        manager.on_new_request(ctx)
        assert tier.lookup(key, ctx) is LookupResult.RETRY
        manager.on_schedule_end(STEP)
    tier.drain_jobs()
    with manager.lock:
        assert tier.lookup(key, ctx) is LookupResult.MISS


def test_a_store_completed_after_a_miss_turns_the_verdict_into_a_hit(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    managers.append(manager := make_manager(tmp_path))
    tier = tier_of(manager)
    (key,) = keys_of("later", 1)
    a, b = ReqContext(req_id="a"), ReqContext(req_id="b")
    _asked_miss(manager, a, key)
    store(manager, "writer", [key], [7])  # another request's cascade puts the key on disk
    assert on_disk(manager, [key]) == [True]
    with manager.lock:
        manager.on_new_request(b)
        assert tier.lookup(key, b) is LookupResult.HIT  # was a's stale MISS while a still asked
        assert tier.lookup(key, a) is LookupResult.HIT
        manager.on_request_finished(a)
        manager.on_request_finished(b)
    step(manager)
    with manager.lock:
        assert not manager.has_pending_work()
        assert (tier._wanted, tier._verdicts, tier._asked) == ({}, {}, set())


def test_a_lookup_answered_before_the_store_completed_does_not_undo_its_hit(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    """Ordering: the lookup is posted first and answered MISS on the loop, then the store job runs;
    vLLM's thread takes both afterwards. The verdict is the store's HIT, not the older MISS."""
    managers.append(manager := make_manager(tmp_path))
    tier = tier_of(manager)
    (key,) = keys_of("raced", 1)
    a, b = ReqContext(req_id="a"), ReqContext(req_id="b")
    with manager.lock:
        manager.on_new_request(a)
        assert tier.lookup(key, a) is LookupResult.RETRY
        manager.on_schedule_end(STEP)  # the lookup, queued for the loop before the store job
    complete_stores(manager, "writer", [key], [8])  # the cascade's store job, queued behind it
    tier.drain_jobs()  # the loop answers the lookup (MISS), then completes the store
    assert on_disk(manager, [key]) == [True]
    with manager.lock:
        manager.on_new_request(b)
        assert tier.lookup(key, b) is LookupResult.HIT
        assert tier.lookup(key, a) is LookupResult.HIT
        manager.on_request_finished(a)
        manager.on_request_finished(b)
        manager.on_request_finished(ReqContext(req_id="writer"))
    step(manager)
    step(manager)
    with manager.lock:
        assert not manager.has_pending_work()


def test_a_lookup_out_for_a_finished_request_is_not_pending_work(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    managers.append(manager := make_manager(tmp_path))
    tier = tier_of(manager)
    thread = tier._store.thread
    keys = keys_of("gone", 2)
    a, c = ReqContext(req_id="a"), ReqContext(req_id="c")
    held, release = threading.Event(), threading.Event()

    def hold() -> None:  # the loop is busy until the test lets it go: the lookups stay unanswered
        held.set()
        release.wait(BOUND_S)

    try:
        thread.call(hold)
        assert held.wait(BOUND_S)
        with manager.lock:
            manager.on_new_request(a)
            assert [tier.lookup(k, a) for k in keys] == [LookupResult.RETRY] * 2
            manager.on_schedule_end(STEP)  # posted, not answered (the loop is held)
            assert tier._lookups_out == 1 and tier.has_pending_work()
            manager.on_request_finished(a)
            assert not tier.has_pending_work()  # nobody will take the answer: no empty steps for it
            assert not manager.has_pending_work()
            manager.on_new_request(c)
            assert tier.lookup(keys[1], c) is LookupResult.RETRY  # asked again: the posted lookup answers it
            assert not tier._queued and tier.has_pending_work()
    finally:
        release.set()
    tier.drain_jobs()
    with manager.lock:
        assert tier.lookup(keys[1], c) is LookupResult.MISS
        assert not tier.has_pending_work()
        manager.on_request_finished(c)
        assert (tier._wanted, tier._verdicts, tier._asked, tier._lookups_out) == ({}, {}, set(), 0)

