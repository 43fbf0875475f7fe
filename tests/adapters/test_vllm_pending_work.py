"""``has_pending_work`` of the aiokv tier through vLLM 0.33's real TieringOffloadingManager.

vLLM's engine keeps stepping while it is True (``Scheduler.has_requests`` -> the offloading
connector's ``has_pending_push_work`` -> ``manager.has_pending_work``): each True is one more
scheduler step with an empty batch sent to the workers, and an engine that is shutting down or
pausing waits for it to go False. So once the loop's answers are in, it must say False at once,
not one step later.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm_helpers import STEP, keys_of, lookup_all, make_manager, step, store, tier_of


def _asked(tmp_path: Path, managers: list[TieringOffloadingManager],
           options: dict[str, object] | None = None) -> tuple[TieringOffloadingManager, ReqContext, list[bytes]]:
    """A manager whose request asked the tier about two keys on disk (stored by an earlier manager)
    and two that are not, the lookups posted by a step end and not yet answered."""
    first = make_manager(tmp_path)
    on_disk = keys_of("disk", 2)
    store(first, "r0", on_disk, [1, 2])
    first.shutdown()
    manager = make_manager(tmp_path, options=options)
    managers.append(manager)
    ctx = ReqContext(req_id="r1")
    keys = [*on_disk, *keys_of("absent", 2)]
    with manager.lock:
        manager.on_new_request(ctx)
        assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * 4
        manager.on_schedule_end(STEP)  # posts the four lookups to the loop
        # Posted (one batch out). Not has_pending_work(): with idle_poll_s=0 the step end woke the
        # loop, which may have answered already, and has_pending_work takes those answers (the
        # full run failed once so).
        assert tier_of(manager)._lookups_out == 1
    return manager, ctx, keys


def _finish(manager: TieringOffloadingManager, ctx: ReqContext, keys: list[bytes]) -> None:
    assert lookup_all(manager, keys, ctx) == [LookupResult.HIT] * 2 + [LookupResult.MISS] * 2
    with manager.lock:
        manager.on_request_finished(ctx)
    step(manager)
    with manager.lock:
        assert not manager.has_pending_work()


def test_no_pending_work_once_drain_jobs_returned_the_answers(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    """Regression: answers the drain waited for were counted as taken only by the next lookup or
    step end, so the engine ran one more (empty) step before it saw False."""
    manager, ctx, keys = _asked(tmp_path, managers)
    tier_of(manager).drain_jobs()
    with manager.lock:
        assert not manager.has_pending_work()
    _finish(manager, ctx, keys)


def test_no_pending_work_after_reset_cache(tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    """vLLM's own drain caller: reset_cache (sleep, weight update) with lookups out."""
    manager, ctx, keys = _asked(tmp_path, managers)
    with manager.lock:
        manager.reset_cache()
        manager.on_reset_flushed()
        assert not manager.has_pending_work()
    _finish(manager, ctx, keys)


def test_has_pending_work_hands_nothing_to_the_loop(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    """It takes the answers the loop left (plain deque pops) and nothing else: no post, no wake
    (a system call), no wait for the loop."""
    manager, ctx, keys = _asked(tmp_path, managers, options={"idle_poll_s": 0})
    tier = tier_of(manager)
    tier.drain_jobs()
    thread = tier._store.thread
    touched: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        for name in ("post", "post_call", "call", "wake", "quiesce", "run"):
            mp.setattr(thread, name, lambda *args, name=name: touched.append(name))
        with manager.lock:
            assert not manager.has_pending_work()
    assert touched == []
    assert thread.pending() == 0
    _finish(manager, ctx, keys)


def test_no_pending_work_for_a_lookup_whose_only_asker_finished_before_the_step_end(
        tmp_path: Path, managers: list[TieringOffloadingManager]) -> None:
    """A request that asked and then finished (aborted) within one step: its keys, not posted yet,
    were still posted at the step end and kept the engine stepping until the loop answered them,
    answers nobody took. A later request asks afresh."""
    manager, ctx, keys = _asked(tmp_path, managers)  # r1's four lookups are out
    tier_of(manager).drain_jobs()
    late, other = ReqContext(req_id="r2"), ReqContext(req_id="r3")
    extra = keys_of("late", 2)
    with manager.lock:
        assert not manager.has_pending_work()
        manager.on_new_request(late)
        manager.on_new_request(other)
        assert [manager.lookup(k, late) for k in extra] == [LookupResult.RETRY] * 2
        assert manager.lookup(extra[1], other) == LookupResult.RETRY  # r3 still wants this one
        manager.on_request_finished(late)
        assert manager.has_pending_work()  # extra[1], for r3
        manager.on_request_finished(other)
        assert not manager.has_pending_work()
        manager.on_schedule_end(STEP)
        assert not manager.has_pending_work()  # nothing was posted
    again = ReqContext(req_id="r4")
    with manager.lock:
        manager.on_new_request(again)
    assert lookup_all(manager, extra, again) == [LookupResult.MISS] * 2
    with manager.lock:
        manager.on_request_finished(again)
    _finish(manager, ctx, keys)
