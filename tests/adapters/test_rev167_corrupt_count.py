"""One damaged page file read by several loads at once counts as one corrupt page (review 167).

Found by the random drive of ``test_adv_rev167_sequences.py``: the tier counted more corrupt
pages than files the test had damaged. vLLM may promote one key for two requests at once (two
jobs, two chunks); each read of the damaged file fails verification and the disk tier's
``_reject`` counts each, also the ones that find the file already out of the index. The tier's
``corrupt`` statistic and vLLM's ``vllm:kv_offload_aiokv_corrupt_pages`` ("page files that failed
verification") then say three for one file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm_helpers import STEP, keys_of, make_manager, on_disk, page_files, store, tier_of


@pytest.mark.parametrize("zero_copy", [True, False], ids=["in-place", "staged"])
def test_one_damaged_file_read_by_three_loads_is_one_corrupt_page(
        tmp_path: Path, managers: list[TieringOffloadingManager], zero_copy: bool) -> None:
    manager = make_manager(tmp_path, cpu_chunks=8, options={"zero_copy": zero_copy, "idle_poll_s": 0})
    managers.append(manager)
    tier = tier_of(manager)
    keys = keys_of("twice", 1)
    store(manager, "r1", keys, [1])
    (path,) = [p for p in page_files(tmp_path) if p.name == tier._store.key(keys[0]).hex()]
    raw = bytearray(path.read_bytes())
    raw[4096 + 1234] ^= 0x10
    path.write_bytes(bytes(raw))
    ctx = ReqContext(req_id="r2")
    with manager.lock:
        for job_id, chunk in ((100, 5), (101, 6), (102, 7)):  # queued together: the loop sleeps until the step end
            tier.submit_load(TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array([chunk]), is_promotion=True,
                                         req_context=ctx))
        tier.on_schedule_end(STEP)
        tier.drain_jobs()
        results = sorted(tier.get_finished_jobs(), key=lambda r: r.job_id)
    assert [(r.job_id, r.success, r.transfer_bytes) for r in results] == [(i, False, 0) for i in (100, 101, 102)]
    assert all(isinstance(r, JobResult) for r in results)
    assert on_disk(manager, keys) == [False]  # refused: out of the index (its unlink may still be under way)
    assert tier.statistics()["corrupt"] == 1
