"""Adversarial (review 297): a ``req_context`` that is not vLLM's ``ReqContext``, and out-of-range
chunk ids after ``shutdown``, given to aiokv's vLLM tier.

vLLM 0.33 always passes its ``ReqContext`` to ``lookup``, ``touch`` and ``on_request_finished``
(its scheduler's, or one a tier of its own makes; never None), and chunk ids inside the region it
gave the tier, in every state. Anything else is a caller's error: refused by name (``TypeError``
naming ``req_context``; ``ValueError`` naming the chunk ids), before anything changes (the tier's
lookup bookkeeping, its answers not taken yet, the disk tier's LRU order as the tier mirrors it,
its statistics, no work queued, nothing finished, the page files), in every state, after
``shutdown`` too. Afterwards valid calls are bit-exact. vLLM's real manager and tier
(vllm_helpers.py), real page files.

Before the fix: ``lookup`` took the loop's answers and then raised ``AttributeError`` ("'NoneType'
object has no attribute 'req_id'"), as did ``on_request_finished``; ``touch`` queued the touch
(a bad context went unnoticed); after shutdown ``lookup`` answered MISS and ``touch`` returned
for any context, and a job whose chunk ids were outside the region was taken and reported failed,
its ids never checked.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm_helpers import (
    CPU_CHUNKS,
    STEP,
    keys_of,
    load,
    lookup_all,
    make_manager,
    page_files,
    payload,
    store,
    tier_of,
)

from aiokv.adapters.vllm import AiokvTier

BAD_CONTEXTS = (None, "a", {"req_id": "a"}, 7)
NOT_A_CONTEXT = r"req_context must be vLLM's ReqContext, not "


def _job(job_id: int, keys: list[bytes], chunks: list[int]) -> TransferJob:
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(chunks, dtype=np.int32), is_promotion=False,
                       req_context=ReqContext(req_id="r"))


def _bookkeeping(tier: AiokvTier) -> tuple[object, ...]:
    """The tier's lookup bookkeeping, the loop's answers not taken yet, and its mirror of the disk
    tier's LRU order (copies)."""
    assert tier._mirror is not None
    return (dict(tier._verdicts), {k: set(v) for k, v in tier._wanted.items()},
            {r: set(v) for r, v in tier._req_keys.items()}, dict(tier._queued), set(tier._asked),
            tier._lookups_out, list(tier._answers), list(tier._mirror.values()))


def test_a_req_context_that_is_not_vllms_is_refused_by_name(tmp_path: Path, managers: list[Any]) -> None:
    managers.append(manager := make_manager(tmp_path, options={"enable_kv_events": True}, kv_events=True))
    keys = keys_of("k", 2)
    store(manager, "w", keys, [1, 2])  # through vLLM's manager: chunks to the CPU tier, cascaded to disk
    tier = tier_of(manager)
    ctx = ReqContext(req_id="a")
    assert tier.lookup(keys[0], ctx) == LookupResult.RETRY
    tier.on_schedule_end(STEP)
    tier.drain_jobs()  # the loop's answer waits, not taken yet
    # The pool's io_uring registration ends in the background (backend uring -> uring_fixed).
    tier._store.thread.run(tier._store._started()[1].wait_registered(), 60)
    before, statistics = _bookkeeping(tier), dict(tier.statistics())
    assert before[6] and before[7] == keys
    for bad in BAD_CONTEXTS:
        name = type(bad).__name__
        with pytest.raises(TypeError, match=NOT_A_CONTEXT + name):  # was AttributeError, answers taken
            tier.lookup(keys[0], bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=NOT_A_CONTEXT + name):  # was AttributeError
            tier.on_request_finished(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=NOT_A_CONTEXT + name):  # was queued
            tier.touch([keys[0]], bad)  # type: ignore[arg-type]
    tier.drain_jobs()  # a touch queued would have run by now
    assert _bookkeeping(tier) == before and dict(tier.statistics()) == statistics
    assert tier.has_pending_work() is False and list(tier.get_finished_jobs()) == []
    # Afterwards: the valid calls answer, touch, forget and load bit-exact.
    assert tier.lookup(keys[0], ctx) == LookupResult.HIT
    tier.touch([keys[0]], ctx)
    tier.drain_jobs()
    assert tier._mirror is not None and list(tier._mirror.values()) == [keys[1], keys[0]]  # the touch ran
    tier.on_request_finished(ctx)
    assert not tier._req_keys and not tier._wanted and not tier._verdicts
    tier.submit_load(_job(9, keys, [3, 2]))
    tier.on_schedule_end(STEP)
    tier.drain_jobs()
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(9, True)]
    assert tier._region[3].numpy().tobytes() == payload(1) and tier._region[2].numpy().tobytes() == payload(2)


def test_bad_input_after_shutdown_is_refused_by_name(tmp_path: Path, managers: list[Any]) -> None:
    """vLLM submits nothing after a tier's shutdown (its manager shuts the tiers down last, then
    the CPU tier whose chunk ids it hands out), and never ids outside the region: bad input is
    refused as before the shutdown, a valid job is still reported failed."""
    managers.append(manager := make_manager(tmp_path))
    keys = keys_of("k", 2)
    store(manager, "w", keys, [1, 2])
    tier = tier_of(manager)
    files = {path: path.read_bytes() for path in page_files(tmp_path)}
    assert len(files) == 2
    tier.shutdown()
    for submit in (tier.submit_load, tier.submit_store):
        for job_id, (chunks, bad) in enumerate((([CPU_CHUNKS, 0], [CPU_CHUNKS]), ([-1, 0], [-1]),
                                                ([0, 99], [99])), start=2):
            with pytest.raises(ValueError, match=re.escape(f"chunk ids {bad} outside [0, {CPU_CHUNKS})")):
                submit(_job(job_id, keys, chunks))  # was taken and reported failed
    with pytest.raises(ValueError, match=re.escape("a load names chunk ids [1] more than once")):
        tier.submit_load(_job(5, keys, [1, 1]))
    for bad in BAD_CONTEXTS:
        name = type(bad).__name__
        with pytest.raises(TypeError, match=NOT_A_CONTEXT + name):  # was MISS
            tier.lookup(keys[0], bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=NOT_A_CONTEXT + name):  # was returned
            tier.touch(keys, bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=NOT_A_CONTEXT + name):
            tier.on_request_finished(bad)  # type: ignore[arg-type]
    assert tier.has_pending_work() is False and list(tier.get_finished_jobs()) == []
    # A valid job after shutdown: reported failed, as vLLM's contract asks of a tier that cannot run it.
    tier.submit_load(_job(6, keys, [2, 3]))
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(6, False)]
    assert tier.lookup(keys[0], ReqContext(req_id="a")) == LookupResult.MISS
    assert {path: path.read_bytes() for path in page_files(tmp_path)} == files
    # The page files serve a tier started afresh over the directory, bit-exact.
    managers.append(again := make_manager(tmp_path))
    ctx = ReqContext(req_id="b")
    with again.lock:
        again.on_new_request(ctx)
    assert lookup_all(again, keys, ctx) == [LookupResult.HIT, LookupResult.HIT]
    assert load(again, keys, ctx) == [payload(1), payload(2)]
