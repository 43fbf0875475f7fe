"""Bad input to aiokv's vLLM tier is refused at the call with nothing changed, and a bad key never
costs the other keys of its step: keys that are not bytes, load jobs naming one chunk twice,
chunk ids that are not integers; calls after shutdown answer as a shut tier does. vLLM's real
manager and tier (vllm_helpers.py), real page files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

import torch
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm_helpers import STEP, keys_of, make_manager, payload, tier_of

from aiokv.adapters.vllm import AiokvTier


def _job(job_id: int, keys: list[Any], chunks: Any) -> TransferJob:
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.asarray(chunks), is_promotion=False,
                       req_context=ReqContext(req_id="r"))


def _finish(tier: AiokvTier) -> list[Any]:
    tier.on_schedule_end(STEP)
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def _settle(tier: AiokvTier, keys: list[Any], ctx: ReqContext) -> list[LookupResult]:
    for _ in range(6):
        got = [tier.lookup(k, ctx) for k in keys]
        if LookupResult.RETRY not in got:
            return got
        tier.on_schedule_end(STEP)
        tier.drain_jobs()
    raise AssertionError(f"lookups did not settle: {got}")


def test_lookup_of_a_key_not_bytes_is_refused_and_the_step_goes_on(tmp_path: Path, managers: list[Any]) -> None:
    """Before: lookup("not-bytes") answered RETRY, the next on_schedule_end raised TypeError into
    the scheduler, and the good keys of that step answered RETRY forever."""
    managers.append(manager := make_manager(tmp_path))
    tier = tier_of(manager)
    ctx = ReqContext(req_id="r")
    good = keys_of("g", 2)
    assert [tier.lookup(k, ctx) for k in good] == [LookupResult.RETRY] * 2
    for bad in ("not-bytes", 5, bytearray(b"x")):
        with pytest.raises(TypeError, match="bytes"):
            tier.lookup(bad, ctx)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="bytes"):
            tier.touch([good[0], bad], ctx)  # type: ignore[list-item]
    assert _settle(tier, good, ctx) == [LookupResult.MISS] * 2
    assert not tier.has_pending_work()


class _Unhashable(bytes):
    """A bytes key whose page key cannot be made (its ``__radd__`` fails, as a broken key type
    would): passes lookup's type check, fails in the step's conversion."""

    def __radd__(self, other: object) -> bytes:
        raise RuntimeError("no page key for this key")


def test_a_key_failing_conversion_is_a_miss_and_the_others_are_answered(
        tmp_path: Path, managers: list[Any]) -> None:
    managers.append(manager := make_manager(tmp_path))
    tier = tier_of(manager)
    ctx = ReqContext(req_id="r")
    good = keys_of("g", 2)
    odd = _Unhashable(b"odd-key".ljust(32, b"."))
    assert [tier.lookup(k, ctx) for k in (good[0], odd, good[1])] == [LookupResult.RETRY] * 3
    tier.on_schedule_end(STEP)  # before: raised, and the good keys stayed RETRY
    tier.drain_jobs()
    assert _settle(tier, [good[0], odd, good[1]], ctx) == [LookupResult.MISS] * 3
    assert not tier.has_pending_work()


def test_a_load_naming_one_chunk_twice_is_refused_and_no_page_is_lost(
        tmp_path: Path, managers: list[Any]) -> None:
    """Before: accepted; both reads landed in chunk 2, A's verification saw B's bytes and A's valid
    page file was deleted as corrupt."""
    managers.append(manager := make_manager(tmp_path))
    tier = tier_of(manager)
    a, b = keys_of("k", 2)
    region = tier._region
    region[0].copy_(torch.frombuffer(bytearray(payload(1)), dtype=torch.uint8))
    region[1].copy_(torch.frombuffer(bytearray(payload(2)), dtype=torch.uint8))
    tier.submit_store(_job(1, [a, b], [0, 1]))
    assert [r.success for r in _finish(tier)] == [True]
    region[2].fill_(0)
    with pytest.raises(ValueError, match="more than once"):
        tier.submit_load(_job(2, [a, b], [2, 2]))
    assert not tier.has_pending_work()
    assert _finish(tier) == []
    assert not bool(region[2].any())
    assert tier.statistics()["corrupt"] == 0
    tier.submit_load(_job(3, [a, b], [2, 3]))
    assert [r.success for r in _finish(tier)] == [True]
    assert region[2].numpy().tobytes() == payload(1) and region[3].numpy().tobytes() == payload(2)


@pytest.mark.parametrize("chunks", [[0.5, 1.9], [True, False], ["0", "1"]])
def test_chunk_ids_not_integers_are_refused(tmp_path: Path, managers: list[Any], chunks: list[Any]) -> None:
    """Before: floats were truncated by int() and the job ran on chunks 0 and 1."""
    managers.append(manager := make_manager(tmp_path))
    tier = tier_of(manager)
    keys = keys_of("k", 2)
    with pytest.raises(TypeError, match="integers"):
        tier.submit_store(_job(1, keys, chunks))
    with pytest.raises(TypeError, match="integers"):
        tier.submit_load(_job(2, keys, chunks))
    with pytest.raises(TypeError, match="bytes"):
        tier.submit_store(_job(3, ["a", "b"], [0, 1]))
    assert not tier.has_pending_work()
    assert _finish(tier) == []


def test_calls_after_shutdown_report_failure_and_leave_no_pending_work(
        tmp_path: Path, managers: list[Any]) -> None:
    """Before: submit_load after shutdown raised ValueError (chunk ids outside an empty region), and
    a lookup after shutdown queued a key, so has_pending_work() stayed True."""
    managers.append(manager := make_manager(tmp_path))
    tier = tier_of(manager)
    keys = keys_of("k", 2)
    ctx = ReqContext(req_id="r")
    tier.shutdown()
    assert tier.lookup(keys[0], ctx) == LookupResult.MISS
    tier.on_schedule_end(STEP)
    tier.submit_load(_job(2, keys, [0, 1]))
    assert tier.has_pending_work()  # the failed job is still to be reported
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(2, False)]
    assert not tier.has_pending_work()
