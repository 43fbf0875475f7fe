"""Data-parallel replicas on one host each keep a working disk tier (helper-145).

Each DP replica is an engine of its own (vLLM: an EngineCore with its own offloading manager;
SGLang without DP attention: a scheduler of its own under its DP controller, whose storage config
says ``dp_rank`` 0 on every replica). The replicas' page identities were equal, so they shared one
directory: the first to start held its lock and every other replica ran read-only with the index
it found at start, storing nothing and never seeing the first one's later pages. Now the replica
index is part of the identity: one directory per replica, each writable.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")
pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make test installs requirements-engines.txt)")

import sglang.srt.runtime_context as runtime_context
import sglang_helpers as sh
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm_helpers import CHUNK_BYTES, CPU_CHUNKS, keys_of, on_disk, store, tier_of

REPLICAS = 2


def replica_manager(disk_dir: Path, index: int) -> TieringOffloadingManager:
    """vLLM's manager of DP replica ``index`` of ``REPLICAS`` (the tests' usual tier otherwise)."""
    tier = {"type": "AiokvTier", "module_path": "aiokv.adapters.vllm", "disk_dir": str(disk_dir),
            "disk_bytes": 64 * CHUNK_BYTES, "namespace": "tests", "queue_depth": 4}
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0.self_attn",), group_id=0),),
        worker_kv_bytes_per_block=CHUNK_BYTES,
        enable_kv_cache_events=False,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": CPU_CHUNKS * CHUNK_BYTES,
                      "secondary_tiers": [tier]},
        engine_id=f"aiokv-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name="test/model-a", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=index, data_parallel_size=REPLICAS,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False),
    )
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    return manager


def test_vllm_dp_replicas_on_one_disk_dir_each_store_their_pages(tmp_path: Path, managers: list[Any]) -> None:
    replicas = [replica_manager(tmp_path, i) for i in range(REPLICAS)]
    managers.extend(replicas)
    keys = [keys_of(f"replica{i}", 2) for i in range(REPLICAS)]
    for i, manager in enumerate(replicas):
        store(manager, f"r{i}", keys[i], [10 * i + 1, 10 * i + 2])
    for i, manager in enumerate(replicas):
        assert tier_of(manager).statistics()["read_only"] is None
        assert on_disk(manager, keys[i]) == [True, True]


def test_sglang_dp_replicas_on_one_disk_dir_each_store_their_pages(
        tmp_path: Path, backends: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    made = []
    for replica in range(REPLICAS):
        # The scheduler process of replica `replica`, as SGLang's DP controller launches it.
        monkeypatch.setattr(runtime_context, "get_parallel", lambda r=replica: SimpleNamespace(dp_rank=r))
        pool = sh.host_pool(2)
        sh.fill(pool, 0, seed=replica)
        backend = sh.attach(backends, tmp_path, pool, True)  # the same storage config on every replica
        backend.on_host_pools_registered()
        made.append(backend)
    for replica, backend in enumerate(made):
        assert backend.batch_set_v1([f"page-{replica}"], sh.indices([0])) == [True]
        assert backend.statistics()["read_only"] is None
        assert backend.batch_exists([f"page-{replica}"]) == 1
