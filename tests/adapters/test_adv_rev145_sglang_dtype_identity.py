"""Pages whose bytes mean another element type are never served across a restart (helper-145).

The SGLang backend's page identity names the host pool's ``dtype``, but SGLang keeps fp8 and fp4
KV caches as ``uint8`` (``store_dtype``): the host pool of an ``--kv-cache-dtype fp8_e5m2`` run and
of an ``fp8_e4m3`` run have the same dtype, page size and layout, so a restart with the other fp8
format read the first run's pages as its own (wrong KV, verified checksums). Likewise a Mamba
pool's identity named its conv dtype only: its temporal (SSM) state's dtype (``mamba_ssm_dtype``,
float16 or bfloat16, the same size) did not count. Now the identity names what SGLang resolves as
the KV cache dtype where the pool stores bytes, and the Mamba state's temporal dtype.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make test installs requirements-engines.txt)")

import sglang.srt.runtime_context as runtime_context
import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang_helpers import (
    DIM,
    HEADS,
    LAYERS,
    PAGE,
    KVBufferLayout,
    KVBuffers,
    MambaPoolHost,
    MambaStateBufferInfo,
    MHABufferInfo,
    MHATokenToKVPoolHost,
    attach,
    host_pool,
    indices,
    storage_config,
)


def fp8_host_pool(pages: int) -> Any:
    """SGLang's MHA host pool as an fp8 KV cache makes it: device buffers of ``store_dtype`` uint8."""
    tokens = pages * PAGE
    k = tuple(torch.zeros(tokens, HEADS, DIM, dtype=torch.uint8) for _ in range(LAYERS))
    v = tuple(torch.zeros(tokens, HEADS, DIM, dtype=torch.uint8) for _ in range(LAYERS))

    def ptrs(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=PAGE, head_num=HEADS, head_dim=DIM, v_head_dim=DIM, dtype=torch.uint8,
                         device=torch.device("cpu"))
    pool = MHATokenToKVPoolHost(info, 1.0, 0, PAGE, "page_first", pin_memory=False, device="cpu",
                                device_capacity_tokens=tokens, start_layer=0, end_layer=LAYERS)
    pool.test_device_buffers = (k, v)
    return pool


def published(monkeypatch: pytest.MonkeyPatch, kv_cache_dtype: str) -> None:
    """SGLang's scheduler process as it runs with ``--kv-cache-dtype kv_cache_dtype`` (its resolved
    model bag, which SGLang's memory pools read the KV cache dtype from)."""
    monkeypatch.setattr(runtime_context, "get_model", lambda: SimpleNamespace(kv_cache_dtype=kv_cache_dtype))


def test_an_fp8_format_never_reads_pages_stored_in_the_other(
        tmp_path: Path, backends: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    pool = fp8_host_pool(2)
    pool.set_from_flat_data_page(0, torch.randint(0, 256, (pool.get_dummy_flat_data_page().numel(),),
                                                  dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    published(monkeypatch, "fp8_e5m2")
    first = attach(backends, tmp_path, pool, True)
    assert first.batch_set_v1(["k"], indices([0])) == [True]
    first.close()

    published(monkeypatch, "fp8_e4m3")  # restarted with the other fp8 format, same model and disk
    other = attach(backends, tmp_path, fp8_host_pool(2), True)
    assert other.batch_exists(["k"]) == 0
    assert other.batch_get_v1(["k"], indices([1])) == [False]
    other.close()

    published(monkeypatch, "fp8_e5m2")  # the same format again: its pages are still served
    again = attach(backends, tmp_path, fp8_host_pool(2), True)
    assert again.batch_exists(["k"]) == 1


def mamba_pool(slots: int, temporal_dtype: torch.dtype) -> Any:
    """SGLang's Mamba state host pool on the CPU; ``temporal_dtype``: the SSM state's dtype."""
    temporal = torch.zeros(LAYERS, slots, 4, 16, dtype=temporal_dtype)
    conv = (torch.zeros(LAYERS, slots, 8, 3, dtype=torch.bfloat16),)
    info = MambaStateBufferInfo(temporal=temporal, conv=conv, extra_checkpoint_buffers=())
    pool = MambaPoolHost(info, 1.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first")
    pool.test_device_buffers = (temporal, conv)
    return pool


def attach_hybrid(made: list[Any], disk_dir: Path, mamba: Any) -> Any:
    """What SGLang's HybridCacheController.attach_storage_backend does (KV pool, Mamba by name)."""
    kv = host_pool(2)
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(disk_dir, True), kv)
    made.append(backend)
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    backend.on_host_pools_registered()
    return backend


def test_mamba_states_of_another_ssm_dtype_are_never_served(tmp_path: Path, backends: list[Any]) -> None:
    first_pool = mamba_pool(2, torch.float16)
    size = first_pool.get_dummy_flat_data_page().numel()
    first_pool.set_from_flat_data_page(0, torch.randint(0, 256, (size,), dtype=torch.uint8,
                                                        generator=torch.Generator().manual_seed(2)))
    first = attach_hybrid(backends, tmp_path, first_pool)
    assert first.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0]), keys=["h"])]) \
        == {"mamba": [True]}
    first.close()

    other_pool = mamba_pool(2, torch.bfloat16)  # the same sizes: only the SSM state's dtype differs
    assert other_pool.get_dummy_flat_data_page().numel() == size
    other = attach_hybrid(backends, tmp_path, other_pool)
    got = other.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([1]), keys=["h"])])
    assert got == {"mamba": [False]}
    other.close()

    again = attach_hybrid(backends, tmp_path, mamba_pool(2, torch.float16))
    got = again.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([1]), keys=["h"])])
    assert got == {"mamba": [True]}
