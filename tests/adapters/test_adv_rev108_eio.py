"""A real EIO under the engine adapters (review 108): the ext4 holding the page files is shut down
(``EXT4_IOC_SHUTDOWN``: every later operation fails with EIO, as on a dying disk) between the
engine's lookup and its load. vLLM's promotion job and SGLang's ``batch_get_v1`` report failure
(counted as EIO), no byte of the engine's memory outside the transfer's own targets changes, stores
fail, and the tier still shuts down within a bound. Root only (a loop-mounted ext4)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm_helpers import CHUNK_BYTES, keys_of, make_manager, on_disk, step, store, tier_of

from aiokv.storage import ErrorKind

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from fs_helpers import loop_ext4, shut_down_ext4

pytestmark = pytest.mark.root

SHUTDOWN_BOUND_S = 10.0




def _region(manager: object) -> list[bytes]:
    with manager.primary_tier.get_kv_memoryview().cast("B") as flat:  # type: ignore[attr-defined]
        data = bytes(flat)
    return [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]


@pytest.mark.parametrize("zero_copy", [True, False], ids=["in-place", "staged"])
def test_vllm_promotions_over_a_disk_failing_with_eio_fail_and_change_no_other_chunk(
        tmp_path: Path, zero_copy: bool) -> None:
    with loop_ext4(tmp_path, 320) as mount:
        manager = make_manager(mount, cpu_chunks=8, options={"zero_copy": zero_copy})
        try:
            tier = tier_of(manager)
            keys = keys_of("eio", 3)
            store(manager, "r1", keys, [1, 2, 3])
            store(manager, "r2", keys_of("evictor", 8), range(100, 108))  # the CPU tier forgets keys
            seen: list[JobResult] = []
            loads: list[TransferJob] = []
            finished, submit_load = tier.get_finished_jobs, tier.submit_load

            def recording_finished() -> list[JobResult]:
                results = list(finished())
                seen.extend(results)
                return results

            def recording_submit_load(job: TransferJob) -> None:
                loads.append(job)
                submit_load(job)

            tier.get_finished_jobs = recording_finished  # type: ignore[method-assign]
            tier.submit_load = recording_submit_load  # type: ignore[method-assign]
            ctx = ReqContext(req_id="r3")
            with manager.lock:
                manager.on_new_request(ctx)
                assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * 3
            step(manager)
            with manager.lock:  # vLLM reserves CPU chunks for the promotion
                assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT_PENDING] * 3
            shut_down_ext4(mount)
            before = _region(manager)
            step(manager)  # submit_load, drained: every read fails with EIO
            with manager.lock:
                assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 3
                manager.on_request_finished(ctx)
            (job,) = loads
            (result,) = seen
            assert (result.success, result.successful_keys, result.transfer_bytes) == (False, None, 0)
            targets = {int(c) for c in job.chunk_ids}
            after = _region(manager)
            changed = {i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b}
            assert changed <= (targets if zero_copy else set()), "a chunk outside the job changed"
            stats = tier.statistics()
            assert stats["errors"][ErrorKind.EIO] >= 1
            # Stores over the dead disk fail too, and say so.
            store(manager, "r4", keys_of("after", 2), [7, 8])
            stored = [r for r in seen if r.job_id != result.job_id and r.transfer_bytes is not None]
            assert stored and all(r.success is False and r.transfer_bytes == 0 for r in stored)
            assert on_disk(manager, keys_of("after", 2)) == [False, False]
        finally:
            began = time.monotonic()
            manager.shutdown()
            took = time.monotonic() - began
        assert took < SHUTDOWN_BOUND_S, f"shutdown over a dead disk took {took:.1f} s"


def test_sglang_reads_over_a_disk_failing_with_eio_miss_and_change_no_other_page(tmp_path: Path) -> None:
    sglang_helpers = pytest.importorskip("sglang_helpers")
    with loop_ext4(tmp_path, 320) as mount:
        pool = sglang_helpers.host_pool(8)
        for p in range(4):
            sglang_helpers.fill(pool, p, seed=p)
        made: list[object] = []
        backend = sglang_helpers.attach(made, mount / "kv", pool, True)
        try:
            keys = ["a", "b", "c"]
            assert backend.batch_set_v1(keys, sglang_helpers.indices([0, 1, 2])) == [True] * 3
            assert backend.batch_exists(keys) == 3
            shut_down_ext4(mount)
            before = [sglang_helpers.page(pool, p) for p in range(8)]
            assert backend.batch_get_v1(keys, sglang_helpers.indices([4, 5, 6])) == [False] * 3
            after = [sglang_helpers.page(pool, p) for p in range(8)]
            changed = {p for p in range(8) if not bool((before[p] == after[p]).all())}
            assert changed <= {4, 5, 6}, "a host page outside the read's targets changed"
            assert backend.statistics()["errors"][ErrorKind.EIO] >= 1
            assert backend.batch_set_v1(["d"], sglang_helpers.indices([3])) == [False]
        finally:
            began = time.monotonic()
            backend.close()
            took = time.monotonic() - began
        assert took < SHUTDOWN_BOUND_S, f"close over a dead disk took {took:.1f} s"
