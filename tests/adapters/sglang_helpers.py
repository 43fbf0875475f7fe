"""Helpers of the SGLang adapter tests: SGLang's real host pools built on the CPU, its real
storage config, and the backend created by SGLang's own factory as its cache controller does.

The host pool's package imports ``sglang.srt.configs``, whose multimodal model configs import
torchvision at module level; the only torchvision on PyPI for x86_64 links libtorch_cuda and does
not load beside the CPU torch. The pool never calls torchvision, so an empty placeholder answers
those imports while the pool's module loads, and is removed from ``sys.modules`` right after
(transformers, imported before it, has already decided torchvision is absent). The import also needs
dill, sentencepiece, compressed-tensors, loguru and gguf (requirements-engines.txt).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, PoolName, PoolTransfer
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from aiokv.adapters.sglang import AiokvHiCacheStorage

LAYERS, HEADS, DIM, PAGE = 2, 2, 64, 16
DTYPE = torch.bfloat16


class _Placeholder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty ``torchvision*`` modules whose every attribute is an empty class (import time only)."""

    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _placeholder_attribute  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _placeholder_attribute(name: str) -> type:
    if name.startswith("__"):  # module protocol (__file__, __spec__...): absent, as on a real module
        raise AttributeError(name)
    return type(name, (), {})


def _import_host_pools() -> tuple[Any, Any, Any]:
    """SGLang's MHA, Mamba and MLA host pool classes."""
    try:
        import torchvision  # noqa: F401  # a working torchvision needs no placeholder
    except Exception:
        pass
    else:
        from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
        return MHATokenToKVPoolHost, MambaPoolHost, MLATokenToKVPoolHost
    finder = _Placeholder()
    sys.meta_path.insert(0, finder)
    try:
        # SGLang's model and quantization modules warn at import on a CPU (deprecated torch.jit
        # APIs, "only CUDA supports ..."); the suite turns warnings into errors.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
            from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
            from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    except ImportError as exc:
        pytest.skip(f"SGLang's host pool does not import here ({exc}); make engines installs what it needs",
                    allow_module_level=True)
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
    return MHATokenToKVPoolHost, MambaPoolHost, MLATokenToKVPoolHost


MHATokenToKVPoolHost, MambaPoolHost, MLATokenToKVPoolHost = _import_host_pools()
from sglang.srt.mem_cache.device_pool_info import (  # noqa: E402
    KVBufferLayout,
    KVBuffers,
    MambaStateBufferInfo,
    MHABufferInfo,
    MLABufferInfo,
)


def host_pool(pages: int, layout: str = "page_first") -> Any:
    """SGLang's MHA host pool of ``pages`` pages on the CPU, over a CPU stand-in for the device KV
    buffers it is built from (per-layer ``[tokens, heads, dim]``; the pool only reads their geometry
    until a GPU transfer, which these tests do not make)."""
    tokens = pages * PAGE
    k = tuple(torch.zeros(tokens, HEADS, DIM, dtype=DTYPE) for _ in range(LAYERS))
    v = tuple(torch.zeros(tokens, HEADS, DIM, dtype=DTYPE) for _ in range(LAYERS))

    def ptrs(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=PAGE, head_num=HEADS, head_dim=DIM, v_head_dim=DIM, dtype=DTYPE,
                         device=torch.device("cpu"))
    pool = MHATokenToKVPoolHost(info, 1.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=tokens, start_layer=0, end_layer=LAYERS)
    pool.test_device_buffers = (k, v)  # kept alive with the pool
    assert pool.size >= tokens
    return pool


def page(pool: Any, index: int) -> torch.Tensor:
    """Page ``index``'s bytes as SGLang reads them (its flat data page, a copy)."""
    return pool.get_data_page(index * PAGE, flat=True).clone()


def fill(pool: Any, index: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.set_from_flat_data_page(index * PAGE, torch.randn(2 * LAYERS * PAGE * HEADS * DIM, generator=g).to(DTYPE))


def storage_config(disk_dir: Path, interface_v1: bool, model: str = "test/model", tp_rank: int = 0,
                   page_first: bool = True, mla: bool = False, tp_size: int = 2, dp_rank: int = 0,
                   options: dict[str, object] | None = None) -> HiCacheStorageConfig:
    """SGLang's storage config of one rank, as its cache controller makes it; ``options``: more
    entries of the extra config (the backend's options)."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=page_first, model_name=model, dp_rank=dp_rank,
        extra_config={"backend_name": "aiokv", "module_path": "aiokv.adapters.sglang",
                      "class_name": "AiokvHiCacheStorage", "interface_v1": int(interface_v1),
                      "disk_dir": str(disk_dir), "disk_bytes": 64 << 20, "queue_depth": 4, **(options or {})},
    )


def attach(made: list[Any], disk_dir: Path, pool: Any, interface_v1: bool, **kw: Any) -> AiokvHiCacheStorage:
    """What SGLang's attach_storage_backend does: factory, then register the host pool."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(disk_dir, interface_v1, **kw), pool)
    made.append(backend)
    assert isinstance(backend, AiokvHiCacheStorage)
    assert isinstance(backend, HiCacheStorage)
    backend.register_mem_pool_host(pool)
    return backend


def stored_backend(made: list[Any], disk_dir: Path) -> tuple[AiokvHiCacheStorage, Any]:
    """A v1 backend over a host pool of 4 pages (each filled), pages 0 and 1 stored as p0 and p1."""
    pool = host_pool(4)
    backend = attach(made, disk_dir, pool, True)
    for index in range(4):
        fill(pool, index, seed=index)
    assert backend.batch_set_v1(["p0", "p1"], indices([0, 1])) == [True, True]
    return backend, pool


def close_right_after(monkeypatch: pytest.MonkeyPatch, backend: AiokvHiCacheStorage, step: str) -> None:
    """``backend.close()`` run inside a call right after its ``step`` (a method) answered: the close
    of SGLang's detaching thread landing there."""
    real = getattr(backend, step)

    def then_closed(*args: Any, **kwargs: Any) -> Any:
        answer = real(*args, **kwargs)
        backend.close()
        return answer

    monkeypatch.setattr(backend, step, then_closed)


def indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def mla_pool(pages: int) -> Any:
    """SGLang's MLA host pool on the CPU (``page_first``: one buffer of 32 KiB per page), over CPU
    stand-ins for the device's per-layer latent buffers ``[tokens, 1, 512]`` (geometry only)."""
    lora, rope = 448, 64
    layers = tuple(torch.zeros(pages * PAGE, 1, lora + rope, dtype=DTYPE) for _ in range(LAYERS))
    info = MLABufferInfo(buffers=layers, data_ptrs=torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64),
                         layer_indices=tuple(range(LAYERS)), device_layer_num=LAYERS, page_size=PAGE,
                         kv_lora_rank=lora, qk_rope_head_dim=rope, kv_cache_dim=lora + rope, dtype=DTYPE,
                         device=torch.device("cpu"))
    pool = MLATokenToKVPoolHost(info, 1.0, 0, PAGE, "page_first", pin_memory=False, device="cpu",
                                device_capacity_tokens=pages * PAGE, start_layer=0, end_layer=LAYERS,
                                target_layer_num=LAYERS)
    pool.test_device_buffers = layers
    return pool


def mla_fill(pool: Any, index: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    size = pool.get_dummy_flat_data_page().numel()
    pool.set_from_flat_data_page(index * PAGE, torch.randn(size, generator=g).to(DTYPE))


def mamba_pool(slots: int, side_state: bool = False) -> Any:
    """SGLang's Mamba state host pool on the CPU (one state slot per page, ``page_first``), over
    CPU stand-ins for the device state buffers ``[layers, slots, ...]`` (read for their geometry
    only). ``side_state``: a registered per-slot side buffer, with which the pool refuses buffer
    addresses (``get_page_buffer_meta``) and pages move as its flat data pages."""
    temporal = torch.zeros(LAYERS, slots, 4, 16, dtype=torch.float32)
    conv = (torch.zeros(LAYERS, slots, 8, 3, dtype=torch.bfloat16),)
    extra = (torch.zeros(slots, 5, dtype=torch.int32),) if side_state else ()
    info = MambaStateBufferInfo(temporal=temporal, conv=conv, extra_checkpoint_buffers=extra)
    pool = MambaPoolHost(info, 1.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first")
    pool.test_device_buffers = (temporal, conv, extra)
    return pool


def fill_state(pool: Any, slot: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    size = pool.get_dummy_flat_data_page().numel()
    pool.set_from_flat_data_page(slot, torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g))


def state(pool: Any, slot: int) -> torch.Tensor:
    return pool.get_data_page(slot, flat=True).clone()


def attach_hybrid(made: list[Any], disk_dir: Path, kv_pool: Any, extra: dict[PoolName, Any],
                  **kw: Any) -> AiokvHiCacheStorage:
    """What SGLang's HybridCacheController.attach_storage_backend does: factory, the KV (anchor)
    pool, each entry of the host pool group by name, then on_host_pools_registered."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(disk_dir, True, **kw), kv_pool)
    made.append(backend)
    assert isinstance(backend, AiokvHiCacheStorage)
    backend.register_mem_pool_host(kv_pool)
    for name, pool in extra.items():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend


def stored_hybrid(made: list[Any], disk_dir: Path) -> tuple[AiokvHiCacheStorage, Any, Any]:
    """A KV + Mamba backend (``attach_hybrid``) over 4 KV pages and 4 Mamba slots, each filled; KV
    page 0 stored as "h0" (v1) and Mamba slot 1 as "h0" (v2). Returns (backend, KV pool, Mamba pool)."""
    kv, mamba = host_pool(4), mamba_pool(4)
    for p in range(4):
        fill(kv, p, seed=p)
        fill_state(mamba, p, seed=100 + p)
    backend = attach_hybrid(made, disk_dir, kv, {PoolName.MAMBA: mamba})
    assert backend.batch_set_v1(["h0"], indices([0])) == [True]
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([1]),
                                              keys=["h0"])]) == {"mamba": [True]}
    return backend, kv, mamba
