"""Adversarial (review 294): chunk ids that are not a 1-D array given to aiokv's vLLM tier, and
``touch`` keys that are not a collection.

vLLM passes each job's chunk ids as a 1-D integer array, one per key (``np.array(list, int32)``
from its tiering manager, or its CPU spec's ``block_ids``). A 2-D array (``[[2, 3]]``, shape
(2, 1)) or a scalar is a caller's error: ``submit_store``/``submit_load`` must raise
``ValueError`` naming the chunk ids and the shape, and change nothing (statistics, the chunk
region, no work pending, nothing finished). Afterwards a valid load is bit-exact, and what vLLM
really passes is still taken. vLLM's real manager and tier (vllm_helpers.py), real page files.

Before the fix: a 2-D array or a scalar was flattened and the job ran; ragged chunk ids raised
numpy's "setting an array element with a sequence", and ``touch(None)`` "'NoneType' object is not
iterable", naming nothing.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

import torch
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm_helpers import finish_jobs, payload, stored_tier

from aiokv.adapters.vllm import AiokvTier

CTX = ReqContext(req_id="r")


def _job(job_id: int, keys: list[bytes], chunks: object) -> TransferJob:
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=chunks, is_promotion=False, req_context=CTX)


def _assert_unchanged(tier: AiokvTier, statistics: dict[str, object], region: torch.Tensor) -> None:
    assert not tier.has_pending_work() and finish_jobs(tier) == []
    assert dict(tier.statistics()) == statistics
    assert torch.equal(tier._region, region)


@pytest.mark.parametrize("chunks", [np.array([[2, 3]]), np.array([[2], [3]], dtype=np.int32),
                                    np.array([[[2, 3]]], dtype=np.uint16), torch.tensor([[2, 3]])],
                         ids=["1x2", "2x1-int32", "1x1x2-uint16", "torch-1x2"])
def test_chunk_ids_of_two_or_more_dimensions_are_refused_by_name(tmp_path: Path, managers: list[Any],
                                                                 chunks: object) -> None:
    tier, keys = stored_tier(tmp_path, managers, _job)
    before, region = dict(tier.statistics()), tier._region.clone()
    shape = tuple(np.asarray(chunks).shape)
    for submit in (tier.submit_load, tier.submit_store):
        with pytest.raises(ValueError, match=re.escape(f"chunk ids must be 1-D, got shape {shape}")):
            submit(_job(5, keys, chunks))  # was flattened and run
        _assert_unchanged(tier, before, region)
    tier.submit_load(_job(9, keys, np.array([2, 3], dtype=np.int32)))
    assert finish_jobs(tier) == [(9, True)]
    assert tier._region[2].numpy().tobytes() == payload(1) and tier._region[3].numpy().tobytes() == payload(2)


def test_a_scalar_or_ragged_chunk_ids_are_refused_by_name(tmp_path: Path, managers: list[Any]) -> None:
    tier, keys = stored_tier(tmp_path, managers, _job)
    before, region = dict(tier.statistics()), tier._region.clone()
    for submit in (tier.submit_load, tier.submit_store):
        with pytest.raises(ValueError, match=r"chunk ids must be 1-D, got shape \(\)"):
            submit(_job(5, keys[:1], np.int64(2)))  # was taken as [2]
        with pytest.raises(ValueError, match="chunk ids must be a 1-D array of integers, got a ragged list"):
            submit(_job(5, keys, [[2], [3, 1]]))  # was numpy's "inhomogeneous shape"
        _assert_unchanged(tier, before, region)
    tier.submit_load(_job(9, keys[:1], np.array([3])))
    assert finish_jobs(tier) == [(9, True)]
    assert tier._region[3].numpy().tobytes() == payload(1)


def test_what_vllm_passes_is_taken(tmp_path: Path, managers: list[Any]) -> None:
    """The forms vLLM 0.33's tiering manager builds: ``np.array(list, dtype=np.int32)`` (batched
    promotions), its CPU spec's ``chunk_ids`` (store jobs), and an empty job."""
    tier, keys = stored_tier(tmp_path, managers, _job)
    tier.submit_load(_job(2, keys[:1], CPULoadStoreSpec([3]).chunk_ids))
    tier.submit_load(_job(3, keys[1:], np.array([2], dtype=np.int32)))
    tier.submit_store(_job(4, [], np.array([], dtype=np.int32)))
    assert sorted(finish_jobs(tier)) == [(2, True), (3, True), (4, True)]
    assert tier._region[3].numpy().tobytes() == payload(1) and tier._region[2].numpy().tobytes() == payload(2)


def test_touch_keys_that_are_not_a_collection_are_refused_by_name(tmp_path: Path, managers: list[Any]) -> None:
    tier, keys = stored_tier(tmp_path, managers, _job)
    before, region = dict(tier.statistics()), tier._region.clone()
    for bad in (None, 3, keys[0], "ab"):
        with pytest.raises(TypeError, match="keys must be a collection of bytes"):  # None: "... is not iterable"
            tier.touch(bad, CTX)  # type: ignore[arg-type]
        _assert_unchanged(tier, before, region)
    tier.touch(keys, CTX)
    tier.submit_load(_job(9, keys, np.array([3, 2], dtype=np.int32)))
    assert finish_jobs(tier) == [(9, True)]
    assert tier._region[3].numpy().tobytes() == payload(1) and tier._region[2].numpy().tobytes() == payload(2)
