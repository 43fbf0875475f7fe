"""Adversarial (review 293): malformed transfer jobs given to aiokv's vLLM tier, drawn by
Hypothesis beyond ``test_vllm_bad_input.py``: jobs that are not a ``TransferJob``, job ids of a
wrong type or still in flight, keys that are not a list of bytes, chunk ids of every bad dtype,
value, count and duplicate (in a load).

Each ``submit_store``/``submit_load`` must raise ``TypeError``/``ValueError`` whose message names
what is wrong, and change nothing: the store's statistics, the chunk region, no work pending and
nothing finished. Afterwards a valid load is bit-exact. vLLM's real manager and tier
(vllm_helpers.py), real page files.

Before the fixes: a job id still in flight was accepted and reported twice (vLLM's scheduler
asserts on the second report), job ids of any type were taken (None, "x", 1.5, True), a job that
was not a ``TransferJob`` raised ``AttributeError`` and keys that were None "'NoneType' object is
not iterable".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm_helpers import finish_jobs, payload, stored_tier

EXAMPLES = 10
CALLS_PER_EXAMPLE = 25


def _job(job_id: Any, keys: Any, chunks: Any, raw: bool = False) -> TransferJob:
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=chunks if raw else np.asarray(chunks), is_promotion=False,
                       req_context=ReqContext(req_id="r"))


@st.composite
def bad_jobs(draw: st.DrawFn, keys: list[bytes], chunks: int, load: bool) -> tuple[object, tuple[str, ...]]:
    """A job ``submit_*`` must refuse, and the words one of which its refusal must contain."""
    kind = draw(st.integers(0, 4))
    if kind == 0:
        return draw(st.sampled_from([None, 3, "job", {"job_id": 5}])), ("TransferJob",)
    if kind == 1:
        return _job(draw(st.sampled_from([None, "5", 1.5, True, np.int64(5)])), keys, [2, 3]), ("job id",)
    if kind == 2:
        bad_keys = draw(st.sampled_from([None, 5, b"ab", "ab", [keys[0], "x"], [keys[0], None], [keys[0], 7]]))
        return _job(5, bad_keys, [2, 3]), ("key", "bytes")
    if kind == 3:
        bad = draw(st.sampled_from([
            np.array([2.0, 3.0]), np.array([True, False]), np.array(["2", "3"]), np.array([2, 3], dtype=object),
            np.array([-1, 2]), np.array([2, chunks]), np.array([2**63 - 1, 2]),
            np.array([2**64 - 1, 2], dtype=np.uint64), np.array([2]), np.array([2, 3, 2]), np.array([], np.int64),
        ]))
        return _job(5, keys, bad, raw=True), ("chunk",)
    if load:  # a load naming one chunk twice
        return _job(5, keys, [2, 2]), ("more than once",)
    return _job(5, keys, draw(st.sampled_from([[2], [2, 3, 3]]))), ("chunk",)


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_bad_jobs_are_refused_by_name_and_change_nothing(data: st.DataObject, tmp_path: Path,
                                                         managers: list[Any]) -> None:
    tier, keys = stored_tier(tmp_path / f"d{len(managers)}", managers, _job)
    region = tier._region
    for _ in range(CALLS_PER_EXAMPLE):
        load = data.draw(st.booleans(), label="load")
        job, names = data.draw(bad_jobs(keys, region.shape[0], load), label="job")
        submit = tier.submit_load if load else tier.submit_store
        before, chunks = dict(tier.statistics()), region.clone()
        with pytest.raises((TypeError, ValueError)) as refused:
            submit(job)  # type: ignore[arg-type]
        text = str(refused.value)
        assert any(name in text for name in names), f"{submit.__name__}({job!r:.80}): names none of {names}: {text}"
        assert not tier.has_pending_work() and finish_jobs(tier) == []
        assert dict(tier.statistics()) == before and torch.equal(region, chunks)
    tier.submit_load(_job(9, keys, [2, 3]))
    assert finish_jobs(tier) == [(9, True)]
    assert region[2].numpy().tobytes() == payload(1) and region[3].numpy().tobytes() == payload(2)


# -- the defects, alone (each failed before the fix) ---------------------------------------------------


def test_a_job_id_still_in_flight_is_refused_and_reported_once(tmp_path: Path, managers: list[Any]) -> None:
    tier, keys = stored_tier(tmp_path, managers, _job)
    tier.submit_load(_job(7, keys[:1], [2]))
    for submit in (tier.submit_load, tier.submit_store):
        with pytest.raises(ValueError, match="job id 7 is still in flight"):  # was accepted: 7 reported twice
            submit(_job(7, keys[1:], [3]))
    assert finish_jobs(tier) == [(7, True)]
    assert not tier.has_pending_work()
    tier.submit_load(_job(7, keys[1:], [3]))  # reported: the id is free again
    assert finish_jobs(tier) == [(7, True)]
    assert tier._region[2].numpy().tobytes() == payload(1) and tier._region[3].numpy().tobytes() == payload(2)


def test_jobs_of_a_wrong_type_are_refused_by_name(tmp_path: Path, managers: list[Any]) -> None:
    tier, keys = stored_tier(tmp_path, managers, _job)
    for submit in (tier.submit_load, tier.submit_store):
        with pytest.raises(TypeError, match="must be a TransferJob"):  # was AttributeError
            submit(None)  # type: ignore[arg-type]
        for job_id in (None, "5", 1.5, True):  # were taken, and reported under that id
            with pytest.raises(TypeError, match="job id must be an int"):
                submit(_job(job_id, keys, [2, 3]))
        with pytest.raises(TypeError, match="keys must be a list of bytes"):  # was "... is not iterable"
            submit(_job(5, None, [2, 3]))
    assert not tier.has_pending_work() and finish_jobs(tier) == []
