"""SGLang 0.5.23: aiokv's disk tier as a HiCache storage backend (L3 below SGLang's host pool).

Start SGLang with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "aiokv",
        "module_path": "aiokv.adapters.sglang", "class_name": "AiokvHiCacheStorage",
        "interface_v1": 1, "disk_dir": "/mnt/nvme/aiokv", "disk_bytes": 1099511627776}'

``interface_v1`` makes SGLang call :meth:`AiokvHiCacheStorage.batch_get_v1` /
:meth:`~AiokvHiCacheStorage.batch_set_v1` with host-pool indices: pages move between the host
pool's own memory (found through its ``get_page_buffer_meta``) and page files, with no tensor made
per page. Without it SGLang uses the plain ``get``/``set`` interface with page tensors.

SGLang calls storage backends synchronously from its prefetch and backup threads; each call hands
its pages to aiokv's event loop (a thread of the backend's own) and waits for them. Keys: SGLang's
page hash strings under aiokv's seed of the model identity (model, TP/PP/CP shard, host layout,
dtype, page bytes, interface) and namespace; each identity has its own directory.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from .store import PageFileStore, StoreConfig

log = logging.getLogger(__name__)

_FACTORY_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")
_STORE_KEYS = ("disk_dir", "disk_bytes", "namespace", "disk_backend", "direct_io", "queue_depth", "staging_pages",
               "poll_s", "linger_s", "idle_poll_s")


def _memory(address: int, size: int) -> torch.Tensor:
    """A ``uint8`` tensor over ``size`` bytes at ``address`` (no copy)."""
    return torch.frombuffer((ctypes.c_ubyte * size).from_address(address), dtype=torch.uint8)


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("pages must be contiguous CPU tensors")
    return tensor.reshape(-1).view(torch.uint8)


class AiokvHiCacheStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang is untyped for mypy here
    """aiokv page files behind SGLang's ``HiCacheStorage`` interface; created by SGLang's
    ``StorageBackendFactory`` for the ``dynamic`` backend.

    Options in the extra config besides the factory's: ``disk_dir``, ``disk_bytes``, ``namespace``,
    ``disk_backend``, ``direct_io``, ``queue_depth``, ``staging_pages`` (see the README). The disk
    tier opens when SGLang registers its host pool (page bytes come from it), or at the first plain
    ``set``/``get`` otherwise.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        ignored = sorted(set(extra) - set(_FACTORY_KEYS) - set(_STORE_KEYS))
        if ignored:
            log.warning("aiokv backend: ignoring extra-config entries %s", ignored)
        self.config = StoreConfig.from_options({k: extra[k] for k in _STORE_KEYS if k in extra})
        self.storage_config = storage_config
        self.mem_pool_host: Any = None
        self._store: PageFileStore | None = None
        self._opening = threading.Lock()  # SGLang's prefetch and backup threads may both open it

    # -- set-up ---------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Keep SGLang's host pool and open the disk tier for its page size."""
        self.mem_pool_host = mem_pool_host
        page_size = int(mem_pool_host.page_size)
        _, sizes = mem_pool_host.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
        self._open(int(sum(sizes)))

    def _facts(self) -> dict[str, object]:
        c = self.storage_config
        pool = self.mem_pool_host
        return {
            "model": c.model_name,
            # MLA pages are the same on every TP rank; other pages hold the rank's heads only.
            "tp": None if c.is_mla_model else (c.tp_rank, c.tp_size),
            "pp": (c.pp_rank, c.pp_size),
            "attn_cp": (c.attn_cp_rank, c.attn_cp_size),
            "dcp": (c.dcp_rank, c.dcp_size),
            "mla": c.is_mla_model,
            "host_layout": getattr(pool, "layout", None),
            "dtype": str(getattr(pool, "dtype", None)),
            "page_tokens": getattr(pool, "page_size", None),
            "interface": "v1" if self.interface_v1 else "plain",
        }

    def _open(self, page_bytes: int) -> PageFileStore:
        with self._opening:
            if self._store is None:
                self._store = PageFileStore(self.config, "sglang", self._facts(), page_bytes)
            elif self._store.page_bytes != page_bytes:
                raise ValueError(f"pages of {page_bytes} bytes, but this backend stores {self._store.page_bytes}")
            return self._store

    def _opened(self) -> PageFileStore | None:
        return self._store

    # -- v1: host-pool pages in place ------------------------------------------------------------

    def _host_pages(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[list[torch.Tensor]]:
        pool = self.mem_pool_host
        if pool is None:
            raise RuntimeError("batch_*_v1 needs the host pool (register_mem_pool_host)")
        if host_indices.numel() != len(keys) * int(pool.page_size):
            raise ValueError(f"{host_indices.numel()} host indices for {len(keys)} pages of {pool.page_size} tokens")
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        per_page = len(ptrs) // max(1, len(keys))
        if per_page * len(keys) != len(ptrs):
            raise ValueError(f"{len(ptrs)} buffers do not split into {len(keys)} pages")
        return [[_memory(int(p), int(s)) for p, s in zip(ptrs[i * per_page : (i + 1) * per_page],
                                                        sizes[i * per_page : (i + 1) * per_page], strict=True)]
                for i in range(len(keys))]

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read each page into its host-pool slots; per key, True when it arrived verified."""
        store = self._opened()
        if store is None or not keys:
            return [False] * len(keys)
        return self._run_all(store, False, keys, self._host_pages(keys, host_indices))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Write each page from its host-pool slots; per key, True when stored."""
        store = self._opened()
        if store is None or not keys:
            return [False] * len(keys)
        return self._run_all(store, True, keys, self._host_pages(keys, host_indices))

    # -- plain interface --------------------------------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Read ``key`` into ``target_location`` (a page tensor) and return it; None on a miss."""
        if target_location is None:
            return None
        page = _flat_bytes(target_location)
        ok = self._run_all(self._open(page.numel()), False, [key], [[page]])
        return target_location if ok[0] else None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        if not keys or target_locations is None:
            return [None] * len(keys)
        pages = [_flat_bytes(t) for t in target_locations]
        ok = self._run_all(self._open(pages[0].numel()), False, keys, [[p] for p in pages])
        return [t if hit else None for t, hit in zip(target_locations, ok, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store the page tensor ``value`` under ``key``."""
        if value is None:
            return False
        page = _flat_bytes(value)
        return self._run_all(self._open(page.numel()), True, [key], [[page]])[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if not keys or values is None:
            return not keys
        pages = [_flat_bytes(v) for v in values]
        return all(self._run_all(self._open(pages[0].numel()), True, keys, [[p] for p in pages]))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading ``keys`` have page files (SGLang's prefix semantics)."""
        store = self._opened()
        if store is None or not keys:
            return 0
        page_keys = [store.key(k.encode("utf-8")) for k in keys]
        return store.thread.call(lambda: store.present_prefix(page_keys)).result()

    def clear(self) -> None:
        log.warning("aiokv backend: clear() is not supported; delete the directory of a stopped server instead")

    def close(self) -> None:
        """Wait for I/O in flight and close the disk tier. Idempotent."""
        if self._store is not None:
            self._store.close()

    def statistics(self) -> Mapping[str, object]:
        """The disk tier's statistics (for tests and tools); empty before the tier opened."""
        store = self._opened()
        return {} if store is None else vars(store.thread.call(store.statistics).result())

    # -- internals ------------------------------------------------------------------------------

    @staticmethod
    def _run_all(store: PageFileStore, write: bool, keys: Sequence[str],
                 pages: Sequence[list[torch.Tensor]]) -> list[bool]:
        page_keys = [store.key(k.encode("utf-8")) for k in keys]
        move = store.store if write else store.load

        async def run() -> list[bool]:
            done = await asyncio.gather(*(move(k, p) for k, p in zip(page_keys, pages, strict=True)),
                                        return_exceptions=True)
            errors = [d for d in done if isinstance(d, BaseException)]
            if errors:
                log.error("aiokv backend: %d page transfers raised; first: %r", len(errors), errors[0])
            return [d is True for d in done]

        return store.thread.run(run())
