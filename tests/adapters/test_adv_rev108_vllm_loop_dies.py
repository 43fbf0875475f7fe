"""The tier's loop thread dying between a vLLM call's check and its hand-over (review 108).

vLLM's scheduler thread calls ``on_schedule_end``, ``touch`` and ``get_stats``; each checks that
the loop is alive, does its own bookkeeping, then posts work to the loop. A loop that died in
between (a ``SystemExit`` let out on it, as the fault tests inject) made ``post_call`` raise
``LoopDied`` into vLLM's scheduler: the engine's step failed. Now the call goes on as after a death
found at the check: lookups of the step answer MISS, the touch and the figures are dropped.

The death is real (a ``SystemExit`` escaping a callback on the loop thread); the tests only choose
its moment, from inside the call's bookkeeping, and wait for the loop thread to have ended."""

from __future__ import annotations

import collections
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm_helpers import STEP, keys_of, make_manager, tier_of

from aiokv.adapters.vllm import AiokvTier


def _die() -> None:
    raise SystemExit("injected: the loop thread ends")


def _kill_loop(tier: AiokvTier) -> None:
    """End the tier's loop thread for real (a callback lets SystemExit out) and wait until it ended."""
    thread = tier._store.thread
    thread.loop.call_soon_threadsafe(_die)
    thread._thread.join(10.0)
    assert thread.dead, "the loop thread did not end"


def _kill_on_first_key(tier: AiokvTier, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Kill the loop the first time vLLM's thread converts a key (after the call's liveness check,
    before its hand-over)."""
    store, caller, fired = tier._store, threading.current_thread(), []
    real_key = store.key

    def key(engine_key: bytes) -> bytes:
        if threading.current_thread() is caller and not fired:
            fired.append(True)
            _kill_loop(tier)
        return real_key(engine_key)

    monkeypatch.setattr(store, "key", key)
    return fired


def test_the_loop_dying_inside_on_schedule_end_answers_the_steps_lookups_miss(
        tmp_path: Path, managers: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    managers.append(manager := make_manager(tmp_path))
    tier = tier_of(manager)
    ctx = ReqContext(req_id="r1")
    keys = keys_of("asked", 3)
    with manager.lock:
        manager.on_new_request(ctx)
        assert [tier.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * 3
    fired = _kill_on_first_key(tier, monkeypatch)
    with manager.lock:
        tier.on_schedule_end(STEP)  # raised LoopDied into the scheduler
    assert fired
    with manager.lock:
        assert not tier.has_pending_work()
        assert [tier.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 3
        manager.on_request_finished(ctx)


def test_the_loop_dying_inside_touch_drops_the_touch(
        tmp_path: Path, managers: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    managers.append(manager := make_manager(tmp_path))
    tier = tier_of(manager)
    ctx = ReqContext(req_id="r1")
    fired = _kill_on_first_key(tier, monkeypatch)
    with manager.lock:
        tier.touch(keys_of("touched", 2), ctx)  # raised LoopDied into the scheduler
        assert fired
        assert tier.lookup(keys_of("touched", 1)[0], ctx) is LookupResult.MISS
        assert not tier.has_pending_work()


class _DyingDeque(collections.deque[Any]):
    """The tier's snapshot deque: the first emptiness test from vLLM's thread ends the loop first."""

    def __init__(self, tier: AiokvTier) -> None:
        super().__init__()
        self.tier, self.caller, self.fired = tier, threading.current_thread(), False

    def __len__(self) -> int:
        if threading.current_thread() is self.caller and not self.fired:
            self.fired = True
            _kill_loop(self.tier)
        return super().__len__()


def test_the_loop_dying_inside_get_stats_reports_nothing(tmp_path: Path, managers: list[Any]) -> None:
    managers.append(manager := make_manager(tmp_path))
    tier = tier_of(manager)
    dying = _DyingDeque(tier)
    tier._snapshots = dying
    with manager.lock:
        assert tier.get_stats() is None  # raised LoopDied into the scheduler
    assert dying.fired
    with manager.lock:
        assert tier.get_stats() is None
        assert not tier.has_pending_work()
