"""aiokv's disk tier as SGLang 0.5.23's HiCache storage backend, created by SGLang's real factory.

The backend comes from SGLang's own ``StorageBackendFactory.create_backend("dynamic", ...)`` with a
real ``HiCacheStorageConfig``; the tests call it as SGLang's cache controller does (register the host
pool, batch_exists for the prefix, batch_get_v1/batch_set_v1 or get/set per page).

SGLang's host pool (``MHATokenToKVPoolHost``) cannot be imported on a CPU-only torch: its package
imports ``sglang.srt.configs``, which imports torchvision, whose only PyPI build links
libtorch_cuda. ``HostPool`` below stands in for it with the one thing the backend reads from it:
the "page_first" host layout (K pages then V pages, ``[2, tokens, layers, heads, dim]``) and
``get_page_buffer_meta`` (each page's K and V buffer addresses and sizes).
"""

from __future__ import annotations

from collections.abc import Iterator
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


class HostPool:
    """SGLang's page_first host pool memory: ``kv_buffer[2, tokens, layers, heads, dim]`` bf16."""

    layout = "page_first"
    dtype = torch.bfloat16
    page_size = PAGE

    def __init__(self, pages: int) -> None:
        self.kv_buffer = torch.zeros(2, pages * PAGE, LAYERS, HEADS, DIM, dtype=self.dtype)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        size = PAGE * LAYERS * HEADS * DIM * self.kv_buffer.element_size()
        ptrs: list[int] = []
        for first in indices.tolist()[::PAGE]:
            ptrs += [self.kv_buffer[0, first].data_ptr(), self.kv_buffer[1, first].data_ptr()]
        return ptrs, [size] * len(ptrs)

    def page(self, index: int) -> torch.Tensor:
        return self.kv_buffer[:, index * PAGE : (index + 1) * PAGE].clone()

    def fill(self, index: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer[:, index * PAGE : (index + 1) * PAGE] = torch.randn(
            2, PAGE, LAYERS, HEADS, DIM, generator=g).to(self.dtype)


def storage_config(disk_dir: Path, interface_v1: bool, model: str = "test/model",
                   tp_rank: int = 0) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name=model,
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


def attach(made: list[Any], disk_dir: Path, pool: HostPool, interface_v1: bool, **kw: Any) -> AiokvHiCacheStorage:
    """What SGLang's attach_storage_backend does: factory, then register the host pool."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(disk_dir, interface_v1, **kw), pool)
    made.append(backend)
    assert isinstance(backend, AiokvHiCacheStorage)
    assert isinstance(backend, HiCacheStorage)
    backend.register_mem_pool_host(pool)
    return backend


def indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def test_v1_round_trip_prefix_and_restart(tmp_path: Path, backends: list[Any]) -> None:
    pool = HostPool(pages=8)
    for p in range(4):
        pool.fill(p, seed=p)
    expected = [pool.page(p) for p in range(4)]
    keys = [f"hash-{i}" for i in range(4)]
    backend = attach(backends, tmp_path, pool, interface_v1=True)
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys[:3], indices([0, 1, 2])) == [True] * 3
    # Prefix semantics: the 4th page is missing, and a gap stops the count.
    assert backend.batch_exists(keys) == 3
    assert backend.batch_exists(["hash-0", "other", "hash-2"]) == 1
    assert backend.exists("hash-2") and not backend.exists("hash-3")
    # Read into other host slots (pages 5, 6, 7): bit-exact, the rest of the pool untouched.
    assert backend.batch_get_v1(keys[:3], indices([5, 6, 7])) == [True] * 3
    for src, dst in zip(range(3), (5, 6, 7), strict=True):
        assert torch.equal(pool.page(dst), expected[src])
    assert torch.equal(pool.page(4), torch.zeros_like(expected[0]))
    backend.close()
    # Restart over the same directory: every page is found and verified again.
    fresh = HostPool(pages=8)
    again = attach(backends, tmp_path, fresh, interface_v1=True)
    assert again.batch_exists(keys) == 3
    assert again.batch_get_v1(keys, indices([0, 1, 2, 3])) == [True, True, True, False]
    for p in range(3):
        assert torch.equal(fresh.page(p), expected[p])
    assert torch.equal(fresh.page(3), torch.zeros_like(expected[0]))


def test_plain_interface_round_trip(tmp_path: Path, backends: list[Any]) -> None:
    pool = HostPool(pages=4)
    pool.fill(0, seed=10)
    pool.fill(1, seed=11)
    backend = attach(backends, tmp_path, pool, interface_v1=False)
    pages = [pool.page(0).flatten(), pool.page(1).flatten()]
    assert backend.batch_set(["p0", "p1"], pages)
    assert backend.batch_exists(["p0", "p1", "p2"]) == 2
    target = torch.zeros_like(pages[0])
    assert backend.get("p1", target) is target
    assert torch.equal(target, pages[1])
    assert backend.get("p2", torch.zeros_like(pages[0])) is None
    got = backend.batch_get(["p0", "p2"], [torch.zeros_like(pages[0]), torch.zeros_like(pages[0])])
    assert got[1] is None and got[0] is not None and torch.equal(got[0], pages[0])


def test_corrupt_page_is_a_miss(tmp_path: Path, backends: list[Any]) -> None:
    pool = HostPool(pages=4)
    pool.fill(0, seed=3)
    backend = attach(backends, tmp_path, pool, interface_v1=True)
    assert backend.batch_set_v1(["c0"], indices([0])) == [True]
    backend.close()
    (path,) = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0x01
    path.write_bytes(bytes(raw))
    fresh = HostPool(pages=4)
    again = attach(backends, tmp_path, fresh, interface_v1=True)
    assert again.batch_get_v1(["c0"], indices([1])) == [False]
    assert torch.equal(fresh.page(1), torch.zeros_like(fresh.page(1)))  # never wrong bytes
    assert again.statistics()["corrupt"] == 1
    assert again.batch_exists(["c0"]) == 0


def test_ranks_and_models_do_not_share_pages(tmp_path: Path, backends: list[Any]) -> None:
    pool = HostPool(pages=2)
    pool.fill(0, seed=4)
    rank0 = attach(backends, tmp_path, pool, interface_v1=True, tp_rank=0)
    assert rank0.batch_set_v1(["k"], indices([0])) == [True]
    rank1 = attach(backends, tmp_path, HostPool(pages=2), interface_v1=True, tp_rank=1)
    other = attach(backends, tmp_path, HostPool(pages=2), interface_v1=True, model="test/other")
    assert rank0.batch_exists(["k"]) == 1
    assert rank1.batch_exists(["k"]) == 0  # rank 1 holds other heads
    assert other.batch_exists(["k"]) == 0
