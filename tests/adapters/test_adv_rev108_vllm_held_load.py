"""vLLM's shutdown while a promotion's read is held in the kernel (review 108).

The ext4 under the page files stops answering (``gate_helpers``: a FUSE-backed loop device whose
reads are held), a promotion's read into vLLM's CPU region is in flight, and vLLM shuts the tier
down. vLLM's contract (``TieringOffloadingManager.shutdown``): a tier whose shutdown raises may still
use the primary region, so vLLM keeps it mapped. The tier's shutdown waited for the read without a
bound: vLLM's shutdown hung for as long as the disk did. Now it waits ``close_timeout`` and then
raises, holding on to the region; once the read ends, a second shutdown goes through (root only).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm_helpers import CHUNK_BYTES, STEP, keys_of, make_manager, payload, step, store, tier_of

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from gate_helpers import gated_ext4

CLOSE_S = 1.0
MARGIN_S = 3.0
BOUND_S = 30.0


def _hold_a_promotion(manager: Any, gate: Any) -> tuple[list[Any], Any]:
    """Two chunks stored, pushed out of vLLM's CPU tier, looked up again: their promotion's reads
    reach the gated file system and wait there. Returns their keys and the request context."""
    keys = keys_of("held", 2)
    store(manager, "r1", keys, [1, 2])
    store(manager, "r2", keys_of("evictor", 8), range(100, 108))  # the CPU tier forgets keys
    ctx = ReqContext(req_id="r3")
    with manager.lock:
        manager.on_new_request(ctx)
        assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * 2
    step(manager)
    with manager.lock:
        assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT_PENDING] * 2
    gate.hold()
    with manager.lock:
        manager.on_schedule_end(STEP)  # submit_load: the reads reach the gate and wait there
    gate.wait_held()
    return keys, ctx


@pytest.mark.root
def test_shutdown_with_a_promotion_held_in_the_kernel_keeps_its_bound_and_the_region(tmp_path: Path) -> None:
    with gated_ext4(tmp_path, 320) as (mount, gate):  # room above the tier's 256 MiB free-space floor
        manager = make_manager(mount / "kv", cpu_chunks=8, options={"close_timeout": CLOSE_S, "direct_io": True})
        tier = tier_of(manager)
        done = threading.Event()
        outcome: list[BaseException | None] = []
        try:
            keys, ctx = _hold_a_promotion(manager, gate)

            def shut() -> None:
                try:
                    manager.shutdown()
                    outcome.append(None)
                except BaseException as exc:
                    outcome.append(exc)
                finally:
                    done.set()

            began = time.monotonic()
            threading.Thread(target=shut, name="vllm-shutdown", daemon=True).start()
            assert done.wait(CLOSE_S + MARGIN_S), "vLLM's shutdown hangs while a read is held in the kernel"
            took = time.monotonic() - began
            (error,) = outcome
            assert isinstance(error, RuntimeError) and "still" in str(error), error
            assert took >= CLOSE_S * 0.9
            # vLLM keeps its region mapped after a tier's shutdown failed: the read may land in it.
            with manager.primary_tier.get_kv_memoryview().cast("B") as flat:
                assert flat.nbytes > 0
            assert tier._bytes_view.nbytes == 8 * CHUNK_BYTES  # the tier still holds its view of the region
            gate.release()
            tier.drain_jobs()  # the held reads end; the job is reported
            with manager.lock:
                found = [manager.lookup(k, ctx) for k in keys]
            assert found == [LookupResult.HIT] * 2  # the held reads ended well
            hits = [k for k, f in zip(keys, found, strict=True) if f is LookupResult.HIT]
            with manager.lock:
                spec = manager.prepare_load(hits, ctx)
                with manager.primary_tier.get_kv_memoryview().cast("B") as flat:
                    got = [bytes(flat[int(c) * CHUNK_BYTES : (int(c) + 1) * CHUNK_BYTES]) for c in spec.chunk_ids]
                manager.complete_load(hits, ctx)
                manager.on_request_finished(ctx)
            seeds = dict(zip(keys, [1, 2], strict=True))
            assert got == [payload(seeds[k]) for k in hits]
        finally:
            gate.release()
            done.wait(BOUND_S)
            manager.shutdown()


def test_close_timeout_is_an_option_of_both_engines(tmp_path: Path) -> None:
    """It bounds vLLM's shutdown and SGLang's close and clear; SGLang ignored it (a warning) and
    vLLM refused it (TypeError), so the 30 s default was the only bound either could have."""
    manager = make_manager(tmp_path / "vllm", options={"close_timeout": 2.5})
    try:
        assert tier_of(manager)._store.config.close_timeout == 2.5
    finally:
        manager.shutdown()
    sglang_helpers = pytest.importorskip("sglang_helpers")
    made: list[object] = []
    backend = sglang_helpers.attach(made, tmp_path / "sglang", sglang_helpers.host_pool(2), True,
                                    options={"close_timeout": 2.5})
    try:
        assert backend.config.close_timeout == 2.5
    finally:
        backend.close()


def _die() -> None:
    raise SystemExit("injected: the loop thread ends")


@pytest.mark.root
def test_shutdown_after_the_loop_died_with_a_read_held_keeps_its_bound(tmp_path: Path) -> None:
    """The loop thread dies (a SystemExit let out on it) while a promotion's read is held in the
    kernel: its end cancels the job, which waits for the read before it lets go of vLLM's chunk.
    vLLM's shutdown joined that dying thread without a bound; now it raises after close_timeout,
    holding the region, and goes through once the read ended."""
    with gated_ext4(tmp_path, 320) as (mount, gate):
        manager = make_manager(mount / "kv", cpu_chunks=8, options={"close_timeout": CLOSE_S, "direct_io": True})
        tier = tier_of(manager)
        thread = tier._store.thread
        done = threading.Event()
        outcome: list[BaseException | None] = []
        try:
            _hold_a_promotion(manager, gate)
            thread.loop.call_soon_threadsafe(_die)
            pause, deadline = threading.Event(), time.monotonic() + BOUND_S
            while thread.died is None:  # set as the loop ends, before its work is cancelled
                assert time.monotonic() < deadline, "the loop did not die"
                pause.wait(0.001)

            def shut() -> None:
                try:
                    manager.shutdown()
                    outcome.append(None)
                except BaseException as exc:
                    outcome.append(exc)
                finally:
                    done.set()

            threading.Thread(target=shut, name="vllm-shutdown", daemon=True).start()
            assert done.wait(CLOSE_S + MARGIN_S), "vLLM's shutdown hangs on a dying loop whose read is held"
            (error,) = outcome
            assert isinstance(error, RuntimeError), error
            assert tier._bytes_view.nbytes == 8 * CHUNK_BYTES  # still held: the read may land in it
            gate.release()
            thread._thread.join(BOUND_S)
            assert thread.dead
        finally:
            gate.release()
            done.wait(BOUND_S)
            manager.shutdown()
