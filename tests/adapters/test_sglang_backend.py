"""aiokv's disk tier as SGLang 0.5.23's HiCache storage backend, created by SGLang's real factory.

The backend comes from SGLang's own ``StorageBackendFactory.create_backend("dynamic", ...)`` with a
real ``HiCacheStorageConfig`` and SGLang's real host pool, ``MHATokenToKVPoolHost`` on the CPU (no
pinning); the tests call it as SGLang's cache controller does (register the host pool, batch_exists
for the prefix, batch_get_v1/batch_set_v1, or get/set with the pool's own data pages).

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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make test installs requirements-engines.txt)")

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
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


def _import_host_pool() -> Any:
    try:
        import torchvision  # noqa: F401  # a working torchvision needs no placeholder
    except Exception:
        pass
    else:
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        return MHATokenToKVPoolHost
    finder = _Placeholder()
    sys.meta_path.insert(0, finder)
    try:
        # SGLang's model and quantization modules warn at import on a CPU (deprecated torch.jit
        # APIs, "only CUDA supports ..."); the suite turns warnings into errors.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    except ImportError as exc:
        pytest.skip(f"SGLang's host pool does not import here ({exc}); make engines installs what it needs",
                    allow_module_level=True)
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
    return MHATokenToKVPoolHost


MHATokenToKVPoolHost = _import_host_pool()
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo  # noqa: E402


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


def storage_config(disk_dir: Path, interface_v1: bool, model: str = "test/model",
                   tp_rank: int = 0, page_first: bool = True) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=page_first, model_name=model,
        extra_config={"backend_name": "aiokv", "module_path": "aiokv.adapters.sglang",
                      "class_name": "AiokvHiCacheStorage", "interface_v1": int(interface_v1),
                      "disk_dir": str(disk_dir), "disk_bytes": 64 << 20, "queue_depth": 4},
    )


@pytest.fixture
def backends() -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for backend in made:
        backend.close()


def attach(made: list[Any], disk_dir: Path, pool: Any, interface_v1: bool, **kw: Any) -> AiokvHiCacheStorage:
    """What SGLang's attach_storage_backend does: factory, then register the host pool."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(disk_dir, interface_v1, **kw), pool)
    made.append(backend)
    assert isinstance(backend, AiokvHiCacheStorage)
    assert isinstance(backend, HiCacheStorage)
    backend.register_mem_pool_host(pool)
    return backend


def indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_v1_round_trip_prefix_and_restart(tmp_path: Path, backends: list[Any], layout: str) -> None:
    page_first = layout == "page_first"
    pool = host_pool(8, layout)
    for p in range(4):
        fill(pool, p, seed=p)
    expected = [page(pool, p) for p in range(4)]
    keys = [f"hash-{i}" for i in range(4)]
    backend = attach(backends, tmp_path, pool, interface_v1=True, page_first=page_first)
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys[:3], indices([0, 1, 2])) == [True] * 3
    # Prefix semantics: the 4th page is missing, and a gap stops the count.
    assert backend.batch_exists(keys) == 3
    assert backend.batch_exists(["hash-0", "other", "hash-2"]) == 1
    assert backend.exists("hash-2") and not backend.exists("hash-3")
    # Read into other host slots (pages 5, 6, 7): bit-exact, the rest of the pool untouched.
    assert backend.batch_get_v1(keys[:3], indices([5, 6, 7])) == [True] * 3
    for src, dst in zip(range(3), (5, 6, 7), strict=True):
        assert torch.equal(page(pool, dst), expected[src])
    assert torch.equal(page(pool, 4), torch.zeros_like(expected[0]))
    backend.close()
    # Restart over the same directory: every page is found and verified again.
    fresh = host_pool(8, layout)
    again = attach(backends, tmp_path, fresh, interface_v1=True, page_first=page_first)
    assert again.batch_exists(keys) == 3
    assert again.batch_get_v1(keys, indices([0, 1, 2, 3])) == [True, True, True, False]
    for p in range(3):
        assert torch.equal(page(fresh, p), expected[p])
    assert torch.equal(page(fresh, 3), torch.zeros_like(expected[0]))


def test_plain_interface_round_trip(tmp_path: Path, backends: list[Any]) -> None:
    """As SGLang's _generic_page_set/_generic_page_get: the pool's flat data pages out, its dummy
    flat pages in, then set_from_flat_data_page."""
    pool = host_pool(4)
    fill(pool, 0, seed=10)
    fill(pool, 1, seed=11)
    backend = attach(backends, tmp_path, pool, interface_v1=False)
    pages = [pool.get_data_page(i * PAGE) for i in range(2)]
    assert backend.batch_set(["p0", "p1"], pages)
    assert backend.batch_exists(["p0", "p1", "p2"]) == 2
    target = pool.get_dummy_flat_data_page()
    assert backend.get("p1", target) is target
    assert torch.equal(target, pages[1])
    assert backend.get("p2", pool.get_dummy_flat_data_page()) is None
    got = backend.batch_get(["p0", "p2"], [pool.get_dummy_flat_data_page() for _ in range(2)])
    assert got[1] is None and got[0] is not None and torch.equal(got[0], pages[0])
    pool.set_from_flat_data_page(3 * PAGE, got[0])
    assert torch.equal(page(pool, 3), page(pool, 0))


def test_corrupt_page_is_a_miss(tmp_path: Path, backends: list[Any]) -> None:
    pool = host_pool(4)
    fill(pool, 0, seed=3)
    backend = attach(backends, tmp_path, pool, interface_v1=True)
    assert backend.batch_set_v1(["c0"], indices([0])) == [True]
    backend.close()
    (path,) = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0x01
    path.write_bytes(bytes(raw))
    fresh = host_pool(4)
    again = attach(backends, tmp_path, fresh, interface_v1=True)
    assert again.batch_get_v1(["c0"], indices([1])) == [False]
    assert torch.equal(page(fresh, 1), torch.zeros_like(page(fresh, 1)))  # never wrong bytes
    assert again.statistics()["corrupt"] == 1
    assert again.batch_exists(["c0"]) == 0


def test_ranks_and_models_do_not_share_pages(tmp_path: Path, backends: list[Any]) -> None:
    pool = host_pool(2)
    fill(pool, 0, seed=4)
    rank0 = attach(backends, tmp_path, pool, interface_v1=True, tp_rank=0)
    assert rank0.batch_set_v1(["k"], indices([0])) == [True]
    rank1 = attach(backends, tmp_path, host_pool(2), interface_v1=True, tp_rank=1)
    other = attach(backends, tmp_path, host_pool(2), interface_v1=True, model="test/other")
    assert rank0.batch_exists(["k"]) == 1
    assert rank1.batch_exists(["k"]) == 0  # rank 1 holds other heads
    assert other.batch_exists(["k"]) == 0
