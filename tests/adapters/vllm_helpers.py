"""Helpers of the vLLM adapter tests: vLLM's real TieringOffloadingManager with the aiokv tier,
driven as vLLM's scheduler drives it (manager lock, on_schedule_end steps), the tests writing and
reading the primary (CPU) chunks where vLLM's GPU worker would."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from aiokv.adapters.vllm import AiokvTier

CHUNK_BYTES = 64 << 10
CPU_CHUNKS = 4
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def make_manager(disk_dir: Path, model: str = "test/model-a", namespace: str = "tests",
                 options: dict[str, object] | None = None, kv_events: bool = False,
                 cpu_chunks: int = CPU_CHUNKS) -> TieringOffloadingManager:
    tier = {"type": "AiokvTier", "module_path": "aiokv.adapters.vllm", "disk_dir": str(disk_dir),
            "disk_bytes": 64 * CHUNK_BYTES, "namespace": namespace, "queue_depth": 4, **(options or {})}
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0.self_attn",), group_id=0),),
        worker_kv_bytes_per_block=CHUNK_BYTES,
        enable_kv_cache_events=kv_events,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_chunks * CHUNK_BYTES,
                      "secondary_tiers": [tier]},
        engine_id=f"aiokv-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=False),
    )
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    assert isinstance(manager.secondary_tiers[0], AiokvTier)
    return manager


def offloading_spec(source: Path) -> Any:
    """vLLM's real offloading spec (from a manager over ``source``, made and shut down)."""
    manager = make_manager(source)
    spec = tier_of(manager)._offloading_spec
    manager.shutdown()
    return spec


def bare_tier(spec: Any, view: memoryview, disk_dir: Path) -> AiokvTier:
    """A tier made directly over ``view`` (vLLM's region), as vLLM's factory makes it."""
    return AiokvTier(spec, view, "aiokv", disk_dir=str(disk_dir), disk_bytes=64 * CHUNK_BYTES, queue_depth=4)


def tier_threads() -> set[threading.Thread]:
    """The tiers' loop threads alive now."""
    return {t for t in threading.enumerate() if t.name == "aiokv-vllm"}


def tier_of(manager: TieringOffloadingManager) -> AiokvTier:
    tier = manager.secondary_tiers[0]
    assert isinstance(tier, AiokvTier)
    return tier


def keys_of(name: str, count: int) -> list[bytes]:
    return [make_offload_key(f"{name}-{i}".encode().ljust(32, b"."), 0) for i in range(count)]


def payload(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (CHUNK_BYTES,), dtype=torch.uint8, generator=g).numpy().tobytes()


def write_chunk(manager: TieringOffloadingManager, chunk: int, data: bytes) -> None:
    with manager.primary_tier.get_kv_memoryview().cast("B") as flat:
        flat[chunk * CHUNK_BYTES : (chunk + 1) * CHUNK_BYTES] = data


def read_chunk(manager: TieringOffloadingManager, chunk: int) -> bytes:
    with manager.primary_tier.get_kv_memoryview().cast("B") as flat:
        return bytes(flat[chunk * CHUNK_BYTES : (chunk + 1) * CHUNK_BYTES])


def step(manager: TieringOffloadingManager) -> None:
    """End a scheduler step, then wait (as reset_cache would) until the tier's work is done."""
    with manager.lock:
        manager.on_schedule_end(STEP)
    tier_of(manager).drain_jobs()


def store(manager: TieringOffloadingManager, req: str, keys: Sequence[bytes], seeds: Sequence[int]) -> None:
    """GPU -> CPU store of one request (the worker's copy is a write into the chunk), cascaded to aiokv."""
    ctx = ReqContext(req_id=req)
    with manager.lock:
        manager.on_new_request(ctx)
        out = manager.prepare_store(keys, ctx)
        assert out is not None
        assert list(out.keys_to_store) == list(keys)
        for chunk, seed in zip(out.store_spec.chunk_ids, seeds, strict=True):
            write_chunk(manager, int(chunk), payload(seed))
        manager.complete_store(keys, ctx)
    step(manager)
    with manager.lock:
        manager.on_request_finished(ctx)
    step(manager)  # collects the cascade's completion: the chunks are unpinned


def lookup_all(manager: TieringOffloadingManager, keys: Sequence[bytes], ctx: ReqContext) -> list[Any]:
    """Look the keys up as the scheduler does, a step at a time, until no answer is RETRY/HIT_PENDING."""
    for _ in range(6):
        with manager.lock:
            results = [manager.lookup(key, ctx) for key in keys]
        if all(r in (LookupResult.HIT, LookupResult.MISS) for r in results):
            return results
        step(manager)
    raise AssertionError(f"lookups did not settle: {results}")


def load(manager: TieringOffloadingManager, keys: Sequence[bytes], ctx: ReqContext) -> list[bytes]:
    """CPU -> GPU load: the chunks vLLM's worker would read."""
    with manager.lock:
        spec = manager.prepare_load(keys, ctx)
        data = [read_chunk(manager, int(c)) for c in spec.chunk_ids]
        manager.complete_load(keys, ctx)
    return data


def page_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def complete_stores(manager: TieringOffloadingManager, req: str, keys: Sequence[bytes], seeds: Sequence[int]) -> None:
    """GPU -> CPU store of one request, ending with complete_store (which submits the cascade to
    aiokv), and no scheduler step after it."""
    ctx = ReqContext(req_id=req)
    with manager.lock:
        manager.on_new_request(ctx)
        out = manager.prepare_store(keys, ctx)
        assert out is not None
        for chunk, seed in zip(out.store_spec.chunk_ids, seeds, strict=True):
            write_chunk(manager, int(chunk), payload(seed))
        manager.complete_store(keys, ctx)


def on_disk(manager: TieringOffloadingManager, keys: Sequence[bytes]) -> list[bool]:
    """Whether the aiokv tier holds a page file for each key (asked on its loop)."""
    store = tier_of(manager)._store
    page_keys = [store.key(k) for k in keys]
    return store.thread.call(lambda: store.contains(page_keys)).result()


def finish_jobs(tier: AiokvTier) -> list[tuple[Any, bool]]:
    """End a scheduler step, drain the tier's jobs; the (job id, success) of each finished job."""
    tier.on_schedule_end(STEP)
    tier.drain_jobs()
    return [(r.job_id, r.success) for r in tier.get_finished_jobs()]


def stored_tier(disk_dir: Path, managers: list[Any],
                job: Callable[[int, list[bytes], Any], Any]) -> tuple[AiokvTier, list[bytes]]:
    """A tier with two keys stored from chunks 0 and 1 (payloads 1 and 2) by ``job(1, keys, chunk
    ids)``, its statistics settled: the pool's io_uring registration ends in the background and
    turns the statistics' backend from uring into uring_fixed, so it is waited for."""
    managers.append(manager := make_manager(disk_dir))
    tier = tier_of(manager)
    keys = keys_of("k", 2)
    for chunk, seed in ((0, 1), (1, 2)):
        tier._region[chunk].copy_(torch.frombuffer(bytearray(payload(seed)), dtype=torch.uint8))
    tier.submit_store(job(1, keys, np.array([0, 1], dtype=np.int32)))
    assert finish_jobs(tier) == [(1, True)]
    store = tier._store
    store.thread.run(store._started()[1].wait_registered(), 60)
    return tier, keys
