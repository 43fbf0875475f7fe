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

Hybrid models (SGLang's ``HybridCacheController``: Mamba states, SWA, indexer or draft pools
beside the KV pool) use the v2 interface: each extra host pool is registered by name
(``register_mem_host_pool_v2``) and gets page files of its own; ``batch_exists_v2`` applies
SGLang's per-pool hit policies, ``batch_get_v2`` / ``batch_set_v2`` move several pools' pages in
one call. ``clear()`` (SGLang's ``/clear_hicache_storage_backend``) deletes this backend's page
files and goes on empty.

SGLang calls storage backends synchronously from its prefetch and backup threads; each call hands
its pages to aiokv's event loop (a thread of the backend's own) and waits for them. Keys: SGLang's
page hash strings under aiokv's seed of the model identity (model, TP/PP/CP/DCP shard, DP group,
host layout, dtype, page bytes, interface) and namespace; each identity has its own directory.
MLA pages carry no TP rank: the ranks share their directory, one writing, all reading.
"""

from __future__ import annotations

import _thread
import asyncio
import concurrent.futures
import ctypes
import dataclasses
import functools
import itertools
import logging
import threading
from collections.abc import Collection, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from .aside import Aside
from .loopthread import LoopDied, LoopThread
from .store import STUCK_REPORT_MIN_S, PageFileStore, Sharing, StoreConfig, open_thread, page_file_bytes

log = logging.getLogger(__name__)

_KV = "kv"  # SGLang's PoolName.KV

T = TypeVar("T")

_FACTORY_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")
_STORE_KEYS = ("disk_dir", "disk_bytes", "namespace", "disk_backend", "direct_io", "queue_depth", "staging_pages",
               "poll_s", "linger_s", "idle_poll_s", "zero_copy", "writer_wait_s", "reader_refresh_s", "close_timeout")


def _memory(address: int, size: int) -> torch.Tensor:
    """A ``uint8`` tensor over ``size`` bytes at ``address`` (no copy)."""
    return torch.frombuffer((ctypes.c_ubyte * size).from_address(address), dtype=torch.uint8)


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("pages must be contiguous CPU tensors")
    return tensor.reshape(-1).view(torch.uint8)


@dataclass
class _Pool:
    """One of SGLang's host pools and the page files of its pages."""

    name: str
    host: Any
    """SGLang's host pool (``HostKVCache``)."""
    page_bytes: int
    in_place: bool
    """Pages move straight between the pool's memory and page files (``get_page_buffer_meta``);
    else through SGLang's flat data pages (``get_data_page`` / ``set_from_flat_data_page``)."""
    store: PageFileStore | None = None
    parts: int = 0
    """Buffers per page in the pool's memory (in place); 1: each page is one buffer, which moves
    with no staging copy when its size is a 4096-multiple (the pool's memory is then registered)."""


@dataclass(frozen=True)
class _Checked:
    """Host indices checked against a host pool (:func:`_page_starts`) at a call's edge."""

    host: Any
    """The host pool they were checked against (SGLang's ``HostKVCache``)."""
    firsts: list[int]
    """The first host index of each page."""


@dataclass
class _Move:
    """One pool's share of a batch: per key the page's buffers, and for flat reads where they go."""

    store: PageFileStore
    keys: list[str]
    pages: list[list[torch.Tensor]]
    host: Any = None
    flat_targets: list[int] | None = None
    """Flat reads: the host index each page is set at once read (on SGLang's thread)."""


class AiokvHiCacheStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang is untyped for mypy here
    """aiokv page files behind SGLang's ``HiCacheStorage`` interface; created by SGLang's
    ``StorageBackendFactory`` for the ``dynamic`` backend.

    Options in the extra config besides the factory's: ``disk_dir``, ``disk_bytes``, ``namespace``,
    ``disk_backend``, ``direct_io``, ``queue_depth``, ``staging_pages``, ``zero_copy``,
    ``close_timeout`` (the bound of :meth:`close` and :meth:`clear` on disk I/O stuck in the
    kernel, 30 s), and for MLA with TP > 1 ``writer_wait_s`` / ``reader_refresh_s`` (see the
    README and ``StoreConfig``).

    MLA with TP > 1: MLA pages are the same on every rank, so every rank's backend serves one
    directory; SGLang's storage writer (``is_storage_writer``) writes it, the others read it and
    rescan it when a lookup misses a page the writer published since (:class:`~.store.Sharing`).

    Pools: the KV pool (``register_mem_pool_host``) and, for hybrid models, the extra host pools
    SGLang registers by name (``register_mem_host_pool_v2``: Mamba states, SWA, indexer, draft...).
    Each pool's pages are page files of their own identity (directory and key seed), all driven by
    one loop thread. ``disk_bytes`` is shared among the pools known when the files open, in
    proportion to their page-file sizes (one pool: all of it); a pool registered later adds its
    share on top. The files open when SGLang says the pools are registered
    (``on_host_pools_registered``) or at the first call that needs them.

    After :meth:`close` (and for a call racing it) every call misses: nothing read, nothing stored,
    nothing cleared, counted in :attr:`closed_misses`; SGLang's controller may still ask from its
    prefetch or backup thread while it detaches the backend.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        if not isinstance(storage_config, HiCacheStorageConfig):
            # Read for its extra config first: None raised AttributeError naming nothing.
            raise TypeError(f"storage_config must be SGLang's HiCacheStorageConfig, "
                            f"got {type(storage_config).__name__}")
        given = storage_config.extra_config
        if given is not None and not isinstance(given, Mapping):
            # dict() of it raised "dictionary update sequence element #0 ..." naming nothing.
            raise TypeError(f"extra_config must be a mapping of option names to values, got {type(given).__name__}")
        extra = dict(given or {})
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        # Sorted by repr: names of mixed types (an int beside the strs) raised TypeError in the sort.
        ignored = sorted(set(extra) - set(_FACTORY_KEYS) - set(_STORE_KEYS), key=repr)
        if ignored:
            log.warning("aiokv backend: ignoring extra-config entries %s", ignored)
        self.config = StoreConfig.from_options({k: extra[k] for k in _STORE_KEYS if k in extra})
        self.storage_config = storage_config
        self.mem_pool_host: Any = None
        self._extra_hosts: dict[str, Any] = {}  # registered by name (v2), in order
        self._pools: dict[str, _Pool] = {}  # opened: KV first
        # Every store constructed, in order (those of pools not kept yet included): close() closes these.
        self._stores: list[PageFileStore] = []
        self._thread: LoopThread | None = None
        self._weight_at_open = 0
        self._opening = threading.Lock()  # SGLang's prefetch and backup threads may both open it
        self._closed = False
        # Made here: close()'s first call hands it over (no Python code, where an interrupt lands, before it).
        self._closing = Aside(self._close_all, "aiokv-sglang-close")
        self.closed_misses = 0
        """Calls answered as misses because the backend was closed before or during them."""

    # -- set-up ---------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Keep SGLang's (KV) host pool; its page files open with the other pools'."""
        self.mem_pool_host = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Keep one of a hybrid model's host pools under its name; opened at once when the other
        pools' files are already open (a pool added at run time)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        with self._opening:
            self._extra_hosts[name] = host_pool
            if self._pools and name != _KV and name not in self._pools:
                self._open_pool(name, host_pool, self._weight_at_open)

    def on_host_pools_registered(self) -> None:
        """SGLang registered every pool it has now: open their page files (``disk_bytes`` shared)."""
        self._open_all()

    def _kv_facts(self, pool: Any, name: str = _KV) -> dict[str, object]:
        c = self.storage_config
        facts: dict[str, object] = {
            "model": c.model_name,
            # MLA pages are the same on every TP rank; other pages hold the rank's heads only.
            "tp": None if c.is_mla_model else (c.tp_rank, c.tp_size),
            # With DP attention, tp_rank counts within a DP group: each group has its own files
            # (and, for MLA, its own writer).
            "dp": c.dp_rank,
            "pp": (c.pp_rank, c.pp_size),
            "attn_cp": (c.attn_cp_rank, c.attn_cp_size),
            "dcp": (c.dcp_rank, c.dcp_size),
            "mla": c.is_mla_model,
            "host_layout": getattr(pool, "layout", None),
            "dtype": str(getattr(pool, "dtype", None)),
            "page_tokens": getattr(pool, "page_size", None),
            "interface": "v1" if self.interface_v1 else "plain",
        }
        replica = _dp_replica()
        if replica is not None:
            # Plain DP (no DP attention): each replica is a scheduler of its own whose storage config
            # says dp_rank 0, so replicas' ranks had one identity; in one directory the first to start
            # held the lock and the others ran read-only, storing nothing.
            facts["dp_replica"] = replica
        published = _published_model(draft=name.startswith("draft"))
        path = published.pop("model_path", None)
        if path is not None and path != c.model_name:
            # SGLang's model_name is --served-model-name, an alias an operator may move to another
            # checkpoint of the same geometry (a fine-tune): the model it loads must count.
            facts["model_path"] = path
        kv_cache_dtype = published.pop("kv_cache_dtype", None)
        facts.update(published)  # revision, config overrides (RoPE...), fp8 KV scales: where given
        if getattr(pool, "dtype", None) == torch.uint8:
            # SGLang keeps fp8 and fp4 KV as bytes (store_dtype): fp8_e4m3 and fp8_e5m2 pages have the
            # same dtype and size here, so the KV cache dtype SGLang resolved must name them.
            facts["kv_cache_dtype"] = kv_cache_dtype
        temporal = getattr(pool, "temporal_dtype", None)
        if temporal is not None and temporal != getattr(pool, "dtype", None):
            # A Mamba pool's dtype is its conv state's; its SSM state's (float16 or bfloat16, the
            # same size) decides what the rest of the page means.
            facts["state_dtype"] = str(temporal)
        return facts

    def _extra_facts(self, name: str, host: Any, in_place: bool) -> dict[str, object]:
        c = self.storage_config
        facts = self._kv_facts(host, name)
        # As SGLang's own file backend: Mamba state is sharded by TP rank even beside replicated MLA KV.
        facts["tp"] = (c.tp_rank, c.tp_size) if not c.is_mla_model or name == "mamba" else None
        facts["interface"] = "v2-in-place" if in_place else "v2-flat"
        facts["pool"] = name
        facts["pool_type"] = type(host).__name__
        return facts

    def _open_all(self, plain_page_bytes: int | None = None) -> bool:
        """Open every known pool's page files unless open; False when there is nothing to open yet
        (no host pool registered and no plain page seen) or the backend is closed."""
        with self._opening:
            if self._pools:
                return True
            if self._closed:
                return False
            if self.mem_pool_host is None and plain_page_bytes is None:
                return False
            shapes = []  # (name, host, page bytes, in place, buffers per page)
            if self.mem_pool_host is not None:
                shapes.append((_KV, self.mem_pool_host, *_page_geometry(self.mem_pool_host, self.interface_v1)))
            else:
                assert plain_page_bytes is not None
                shapes.append((_KV, None, plain_page_bytes, False, 0))
            for name, host in self._extra_hosts.items():
                if name != _KV:
                    shapes.append((name, host, *_page_geometry(host, True)))
            self._weight_at_open = sum(page_file_bytes(shape[2]) for shape in shapes)
            held: list[LoopThread] = []
            cleanup = Aside(functools.partial(self._close_failed_open, held), "aiokv-sglang-close")
            try:
                # Into ``held`` (see open_thread), inside the try whose cleanup stops it: returned by
                # open_thread, an interrupt landing at that return left it running for good (idle).
                open_thread(self.config, "sglang", held)
                self._thread = held[0]
                for name, host, page_bytes, in_place, parts in shapes:
                    if name == _KV:
                        kv = _Pool(_KV, host, page_bytes, in_place, self._new_store(
                            self._kv_facts(host), page_bytes, self._weight_at_open), parts)
                        self._pools[_KV] = kv
                        _register_host(kv)
                    else:
                        self._open_pool(name, host, self._weight_at_open)
            except BaseException:
                # Closed on a thread of its own (aside.py), handed over by this clause's first call (C code: no
                # signal's handler runs before it), and waited for: made here, a second interrupt landing at the
                # entry of the function closing them skipped it (the stores' tiers open, the loop running).
                try:
                    _thread.start_new_thread(cleanup.start, ())
                except RuntimeError:  # no thread may start (a pids limit): made here, exposed as before
                    cleanup.run()
                cleanup.wait()  # an interrupt here leaves it running to its end
                raise
            return True

    def _close_failed_open(self, held: list[LoopThread]) -> None:
        """Close what an open cut short made: the stores made so far, then the loop thread (``held``:
        that thread, or nothing when its constructor failed, which then stopped it)."""
        if held:
            self._thread = held[0]  # not kept yet where the interrupt landed at the append's return
        self._close_pools_here()

    def _open_pool(self, name: str, host: Any, weight_total: int) -> None:
        page_bytes, in_place, parts = _page_geometry(host, True)
        facts = self._extra_facts(name, host, in_place)
        pool = _Pool(name, host, page_bytes, in_place, self._new_store(facts, page_bytes, weight_total), parts)
        self._pools[name] = pool
        _register_host(pool)

    def _sharing(self, facts: Mapping[str, object]) -> Sharing:
        """Pages without the TP rank in their identity (MLA: the same on every rank) are shared by
        the ranks: SGLang's storage writer (``is_storage_writer``: rank 0, or the first DCP group)
        writes them and the other ranks read them, as SGLang's own backends do."""
        c = self.storage_config
        if facts["tp"] is not None or c.tp_size <= 1:
            return Sharing.ALONE
        return Sharing.WRITER if c.is_storage_writer else Sharing.READER

    def _new_store(self, facts: Mapping[str, object], page_bytes: int, weight_total: int) -> PageFileStore:
        weight = page_file_bytes(page_bytes)
        share = max(weight, self.config.capacity_bytes * weight // max(weight, weight_total))
        assert self._thread is not None
        config = dataclasses.replace(self.config, capacity_bytes=share)
        # Constructed into _stores by C code (list.extend over map), where no signal handler runs between
        # the constructor's return and the append: returned to Python first, an interrupt (a
        # KeyboardInterrupt from a signal handler, Ctrl-C at start-up) landing as the call returned, or
        # before its pool was kept, left the store open (its tier, ring and directory lock, its staging
        # pool mapped) and unknown to close(). A constructor that raised cleaned up after itself (an
        # open cut short on the shared loop closes what it opened: close() waits for that, see
        # _close_pools_here).
        self._stores.extend(map(PageFileStore, [config], ["sglang"], [facts], [page_bytes], [self._thread],
                                [self._sharing(facts)]))
        return self._stores[-1]

    def _kv(self, plain_page_bytes: int | None = None) -> _Pool | None:
        """The KV pool, its files open; None before anything registered it, and once the backend
        is closed (counted: the caller answers a miss)."""
        # .get: a close() on another thread may clear the pools once _open_all found them open.
        kv = self._pools.get(_KV) if self._open_all(plain_page_bytes) else None
        if kv is None:
            if self._closed:
                self._closed_miss()
            return None
        if plain_page_bytes is not None and kv.page_bytes != plain_page_bytes:
            raise ValueError(f"pages of {plain_page_bytes} bytes, but this backend stores {kv.page_bytes}")
        return kv

    # -- v1: host-pool pages in place ------------------------------------------------------------

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read each page into its host-pool slots; per key, True when it arrived verified.
        ``TypeError``/``ValueError``, nothing moved, for keys not str and for host indices that are
        not whole pages of the pool, one per key, each named once (:func:`_page_starts`), before the
        pool's files open and also after :meth:`close` (where valid calls miss)."""
        _check_keys(keys)
        checked = self._check_v1_indices(keys, host_indices, write=False)
        kv = self._kv()
        if kv is None or not keys:
            return [False] * len(keys)
        return self._run([self._moves(kv, kv.host, keys, host_indices, write=False, checked=checked)], write=False)[0]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Write each page from its host-pool slots; per key, True when stored (bad keys or indices
        refused as in :meth:`batch_get_v1`)."""
        _check_keys(keys)
        checked = self._check_v1_indices(keys, host_indices, write=True)
        kv = self._kv()
        if kv is None or not keys:
            return [False] * len(keys)
        return self._run([self._moves(kv, kv.host, keys, host_indices, write=True, checked=checked)], write=True)[0]

    # -- v2: several pools per call (hybrid models) -----------------------------------------------

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The usable prefix of ``keys`` across the KV pool and each transfer's pool, with SGLang's
        hit policies: ``ALL_PAGES`` (every page of the prefix in that pool), ``TRAILING_PAGES`` (the
        last ``len(transfer.keys)`` pages before a stop point). ``BLOCK_GROUPS`` raises
        ``ValueError`` (as SGLang's own backends do; nothing in 0.5.23 sends it). Transfers, their pools
        and keys are checked as in :meth:`batch_get_v2` (a pool never registered: ``ValueError``; it
        was taken as holding nothing), and their host indices too where given (SGLang passes None:
        they are not read here)."""
        _check_keys(keys)
        transfers = _check_transfers([] if pool_transfers is None else pool_transfers, "pool_transfers")
        for transfer in transfers:
            if transfer.hit_policy not in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES):
                raise ValueError(f"Unsupported pool hit policy: {transfer.hit_policy}")
        # Read nowhere here (SGLang's lookups pass None: staging comes after the hit), but any given
        # are held to what get/set would take, so a lookup does not pass what the load refuses.
        self._check_transfer_indices(transfers, write=True, lookup=True)
        kv = self._kv()
        if kv is None or not keys:
            return PoolTransferResult(0, {}, [])
        kv_store = _opened(kv)
        kv_keys = [kv_store.key(k.encode("utf-8")) for k in keys]
        pools = [self._pools.get(str(t.name)) for t in transfers]  # .get: a close() may clear them meanwhile
        stores = [None if p is None else p.store for p in pools]
        pool_keys = [None if s is None else [s.key(k.encode("utf-8")) for k in keys] for s in stores]

        async def look() -> tuple[int, list[list[bool]]]:
            kv_pages = await kv_store.fresh_prefix(kv_keys)
            present = [[False] * kv_pages if s is None or pk is None else await s.fresh_contains(pk[:kv_pages])
                       for s, pk in zip(stores, pool_keys, strict=True)]
            return kv_pages, present

        looked = self._on_loop(look(), "every page misses")
        if looked is None:
            return PoolTransferResult(0, {}, [])
        kv_pages, present = looked
        hits: dict[str, int] = {_KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer, exists in zip(transfers, present, strict=True):
            if not restorable:
                break
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = exists.index(False) if False in exists else kv_pages
                allowed = set(range(1, boundary + 1))
            else:
                window = max(1, len(transfer.keys) if transfer.keys else 1)
                allowed = {n for n in range(1, kv_pages + 1) if all(exists[max(0, n - window):n])}
                boundary = max(allowed, default=0)
            if boundary:
                hits[str(transfer.name)] = boundary
            restorable = [n for n in restorable if n in allowed]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Read each transfer's pages from its pool's files into that pool's host slots; per pool,
        per key, True when the page arrived verified. ``TypeError``/``ValueError``, nothing opened or
        moved (a valid transfer beside the bad one is not run either), for transfers that are not a
        list of ``PoolTransfer``, keys of one that are not None or a list of ``str``, a pool name that
        is not a ``str`` (None) or names a pool never registered (SGLang 0.5.23 registers each pool
        before a transfer can name it, so only a caller's bug does; it was answered all False,
        logged), a pool named twice, and host indices of one that are not ``len(transfer.keys)``
        whole pages of its pool as v1 checks them (negative, out of range, a wrong dtype or count,
        2-D, sparse, meta, a page read twice...; the message names ``transfer.host_indices`` and the
        pool; these were answered all False for that pool, logged)."""
        return self._batch_v2(transfers, write=False)

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Write each transfer's pages from its pool's host slots; per pool, per key, True when stored
        (bad input refused as in :meth:`batch_get_v2`; one host page may be written under two keys)."""
        return self._batch_v2(transfers, write=True)

    def _batch_v2(self, transfers: list[PoolTransfer], write: bool) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        transfers = _check_transfers(transfers, "transfers")  # before anything opens or moves
        named = [str(t.name) for t in transfers]
        if len(set(named)) != len(named):  # one answer per pool: two transfers of a pool would lose one
            raise ValueError(f"one call names a pool twice: {sorted(n for n in set(named) if named.count(n) > 1)}")
        # Every transfer's pool and indices, before anything opens or moves.
        checks = self._check_transfer_indices(transfers, write)
        if self._kv() is None:
            return {str(t.name): [False] * len(t.keys or []) for t in transfers}
        names: list[str] = []
        moves: list[_Move] = []
        closed_meanwhile = False
        for transfer, checked in zip(transfers, checks, strict=True):
            name, keys = str(transfer.name), list(transfer.keys or [])
            pool = self._pools.get(name)
            host = self._extra_hosts.get(name, pool.host if pool is not None else None)
            if pool is None or host is None or not keys:
                if keys and pool is None and self._closed:
                    # A close() on another thread cleared the pools once _kv found them open: a
                    # miss of the closed backend (counted below). (A pool never registered was
                    # refused above; one registered after the files opened opens at once.)
                    closed_meanwhile = True
                elif keys:
                    log.error("aiokv backend: pool %r has no host pool", name)
                results[name] = [False] * len(keys)
                continue
            try:
                move = self._moves(pool, host, keys, transfer.host_indices, write, checked)
            except (ValueError, TypeError) as exc:
                # Its indices were checked above: the host pool's own pointers outside its memory.
                log.error("aiokv backend: %s: %s", name, exc)
                results[name] = [False] * len(keys)
                continue
            names.append(name)
            moves.append(move)
        if closed_meanwhile and not moves:
            self._closed_miss()  # (with moves left, _run's hand-over to the gone loop counts it)
        for name, done in zip(names, self._run(moves, write), strict=True):
            results[name] = done
        return results

    # -- plain interface --------------------------------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Read ``key`` into ``target_location`` (a page tensor) and return it; None on a miss."""
        if target_location is None:
            return None
        _check_keys([key])
        page = _flat_bytes(target_location)
        kv = self._kv(page.numel())
        if kv is None:  # closed
            return None
        ok = self._run([_Move(_opened(kv), [key], [[page]])], write=False)[0]
        return target_location if ok[0] else None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        if not keys or target_locations is None:
            return [None] * len(keys)
        targets = list(target_locations)
        kv, pages = self._plain_pages(keys, targets, write=False)
        if kv is None:  # closed
            return [None] * len(keys)
        ok = self._run([_Move(_opened(kv), list(keys), [[p] for p in pages])], write=False)[0]
        return [t if hit else None for t, hit in zip(targets, ok, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store the page tensor ``value`` under ``key``."""
        if value is None:
            return False
        _check_keys([key])
        page = _flat_bytes(value)
        kv = self._kv(page.numel())
        if kv is None:  # closed
            return False
        return self._run([_Move(_opened(kv), [key], [[page]])], write=True)[0][0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if not keys or values is None:
            return not keys
        kv, pages = self._plain_pages(keys, list(values), write=True)
        if kv is None:  # closed
            return False
        return all(self._run([_Move(_opened(kv), list(keys), [[p] for p in pages])], write=True)[0])

    def _plain_pages(self, keys: list[str], tensors: list[Any],
                     write: bool) -> tuple[_Pool | None, list[torch.Tensor]]:
        """The KV pool (None once closed) and the byte views of a plain batch's page tensors, every
        one checked before anything moves: str keys, one contiguous CPU tensor of the store's page
        size per key, and for a read no two targets sharing memory (two reads into one page race
        and fail verification)."""
        _check_keys(keys)
        if len(tensors) != len(keys):
            raise ValueError(f"{len(tensors)} page tensors for {len(keys)} keys")
        pages = [_flat_bytes(t) for t in tensors]
        sizes = {p.numel() for p in pages}
        if len(sizes) != 1:
            raise ValueError(f"pages of different sizes in one batch: {sorted(sizes)} bytes")
        if not write:
            spans = sorted((p.data_ptr(), p.data_ptr() + p.numel()) for p in pages)
            if any(nxt[0] < prev[1] for prev, nxt in itertools.pairwise(spans)):
                raise ValueError("two read targets share memory")
        return self._kv(pages[0].numel()), pages

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading ``keys`` have page files (SGLang's prefix semantics)."""
        _check_keys(keys)
        kv = self._kv()
        if kv is None or not keys:
            return 0
        store = _opened(kv)
        page_keys = [store.key(k.encode("utf-8")) for k in keys]
        found = self._on_loop(store.fresh_prefix(page_keys), "every page misses")
        return 0 if found is None else found

    def clear(self) -> bool:
        """Delete every page file of this backend's pools (this model, rank and layout; other
        identities under ``disk_dir`` stay) and go on empty. True when all were cleared; False when
        a pool's directory is read-only or held by another process, or removal failed part-way
        (logged). Transfers running meanwhile miss or are refused, never see removed bytes."""
        if self._kv() is None:
            if not self._closed:
                log.warning("aiokv backend: clear() before any host pool was registered: nothing known to clear")
            return False
        stores = [_opened(pool) for pool in list(self._pools.values())]  # a copy: a pool may open meanwhile

        async def clear_all() -> list[bool | BaseException]:
            return await asyncio.gather(*(s.clear() for s in stores), return_exceptions=True)

        done = self._on_loop(clear_all(), "not all was cleared")
        if done is None:
            return False
        errors = [d for d in done if isinstance(d, BaseException)]
        if errors:
            log.error("aiokv backend: clearing failed: %r", errors[0])
        return all(d is True for d in done)

    def close(self) -> None:
        """Wait for I/O in flight and close every pool's files and the loop thread. Idempotent (a later
        call waits for the first one's close to end).

        The close runs on a thread of its own (``aiokv-sglang-close``), handed over by this method's first
        call (C code: no signal's handler runs before it, see aside.py) and waited for: an interrupt of
        this thread (a ``KeyboardInterrupt`` from a signal handler, Ctrl-C at shutdown) is raised at once
        and the close goes on to its end. Run here, the interrupt left the stores after the one closing
        unclosed and stopped the loop under that close; landing after the close was marked begun and
        before its thread started (the entry of a function of its own making it), it skipped the whole
        close, which SGLang makes once: the disk tiers open for good (threads, ring, directory lock),
        their staging pools mapped, the loop thread running. Where no thread may start (a pids limit),
        closed on this thread (logged)."""
        try:
            _thread.start_new_thread(self._closing.start, ())
        except RuntimeError as exc:
            # No thread may start (a pids limit; Python 3.12+ at interpreter shutdown): closed here, an
            # interrupt of this thread then cutting the close short. Raised, nothing was closed: the disk
            # tiers open for good, the staging pools mapped, the loop thread running.
            log.error("aiokv backend: no thread could start to close the pools (%s); closing them on the "
                      "calling thread", exc)
            self._closing.run()
        self._closing.wait()  # an interrupt here leaves it running to its end

    def _close_all(self) -> None:
        """close()'s work, on its thread (see :meth:`close`): marked closed, under the opening lock (an
        open running on another thread ends first), then every pool closed."""
        with self._opening:
            self._closed = True
            self._close_pools_here()

    def _close_pools_here(self) -> None:
        stores = list(self._stores)
        failed: Exception | None = None
        try:
            for store in stores:
                # Each closed whatever the ones before raised (raised once all were): the first's
                # error (its disk tier's close failed) skipped the rest, their tiers left open for good
                # (threads, ring, directory lock), their staging pools mapped, the loop kept running
                # for their tasks (review 266).
                try:
                    store.close()
                except Exception as exc:
                    log.error("aiokv backend: closing the disk tier of %s failed", store.directory, exc_info=exc)
                    failed = failed or exc
        finally:
            self._pools.clear()
            self._stores.clear()
            thread, self._thread = self._thread, None
            report_s = max(self.config.close_timeout, STUCK_REPORT_MIN_S)
            if thread is not None:
                if thread.died is not None:
                    # Its end cancels the calls in flight, each waiting for its I/O (a hung file
                    # system), and closes the stores (finalizers): it ends by itself; joined only
                    # within the bound (close() waited for as long as the disk hung).
                    if thread.wait_ended(self.config.close_timeout):
                        thread.close()
                elif any(store.io_stuck for store in stores):
                    _stop_when_settled(thread, stores, report_s)
                elif not thread.wait_answered(self.config.close_timeout) or _busy(thread):
                    # Still running: an open whose caller an interrupt cut short (its store closes what
                    # it opened, then answers), or the background close of the tier it opened, its
                    # I/O stuck in the kernel (a frozen file system: that store's close returned after
                    # close_timeout). The loop stops once they ended: stopped now, it cancelled them,
                    # the tier left open for good (threads, ring, lock), its staging pool mapped.
                    _stop_when_settled(thread, stores, report_s)
                else:
                    # Calls of other threads still in flight end at once on the closed stores (reads
                    # miss, writes are refused): they answered before the loop stops, which would
                    # cancel them under their callers.
                    thread.close()
        if failed is not None:
            raise failed

    def statistics(self, pool: str = _KV) -> Mapping[str, object]:
        """The disk tier's statistics of one pool's files (for tests and tools); empty before they opened
        and after :meth:`close`. ``pool``: ``"kv"`` or a name registered with ``register_mem_host_pool_v2``;
        ``TypeError``/``ValueError`` otherwise (an unknown name answered ``{}``, as a pool not opened yet)."""
        if not isinstance(pool, str):
            raise TypeError(f"pool must be a pool name (str), got {type(pool).__name__}")
        known = [_KV, *(name for name in list(self._extra_hosts) if name != _KV)]
        if pool not in known:
            raise ValueError(f"pool {str(pool)!r} is not a pool of this backend; valid names: {known}")
        opened = self._pools.get(pool)
        if opened is None or opened.store is None:
            return {}
        return vars(self._loop().call(opened.store.statistics).result())

    # -- internals ------------------------------------------------------------------------------

    def _loop(self) -> LoopThread:
        if self._thread is None:
            raise RuntimeError("aiokv backend is closed")
        return self._thread

    def _on_loop(self, coro: Coroutine[Any, Any, T], miss: str) -> T | None:
        """Run ``coro`` on the pools' loop thread and wait for its result; None (logged: ``miss``
        says what the caller's answer then means) when it cannot answer: the loop thread died, or
        the backend was closed before or while it ran (counted in :attr:`closed_misses`; a close
        ends the transfers in flight, their I/O first, before it answers)."""
        thread = self._thread
        try:
            if thread is None:  # closed since the caller's pools were found open
                coro.close()
                raise RuntimeError("aiokv backend is closed")
            return thread.run(coro)
        except LoopDied:
            log.error("aiokv backend: the loop thread died; %s", miss)
        except concurrent.futures.CancelledError:  # close() stopped the loop under it
            log.error("aiokv backend: closed during the call; %s", miss)
            self._closed_miss()
        except RuntimeError:
            if not self._closed:
                raise
            self._closed_miss()  # the loop thread closed since the caller took it
        return None

    def _closed_miss(self) -> None:
        """Count a call answered as a miss because the backend is closed (logged the first time)."""
        self.closed_misses += 1
        if self.closed_misses == 1:
            log.warning("aiokv backend: called after close() (SGLang detaching it?); such calls miss, moving nothing")

    def _check_v1_indices(self, keys: list[str], host_indices: object, write: bool) -> _Checked | None:
        """v1's host indices checked against the registered KV host pool (:func:`_page_starts`) before
        the pool's files open and in every state: a first call with bad indices opened the files
        before refusing, and a closed backend answered them all False (a closed miss) where v2
        refuses them. Nothing to check without keys (nothing moves) or without a registered pool
        (None then). Returns what was checked, for :meth:`_moves`."""
        host = self.mem_pool_host
        if keys and host is not None:
            return _Checked(host, _page_starts(host, len(keys), host_indices, write))
        return None

    def _check_transfer_indices(self, transfers: Sequence[PoolTransfer], write: bool,
                                lookup: bool = False) -> list[_Checked | None]:
        """``ValueError`` naming the pool for the first transfer that names a pool never registered
        (the KV pool by ``register_mem_pool_host`` or by name, the others by
        ``register_mem_host_pool_v2``): SGLang 0.5.23 names only pools of its host pool group, each
        registered before any transfer can name it (at attach, or as a sidecar's entry is added), so
        only a caller's bug can (it answered that pool all False, logged). Then ``TypeError``/
        ``ValueError`` naming ``transfer.host_indices`` and the pool for the first transfer whose host
        indices are not ``len(transfer.keys)`` whole pages of its registered host pool
        (:func:`_page_starts`, as v1 checks them; for a read no page twice). All checked before any
        pool opens or page moves, so a valid transfer beside a bad one is not run either (it answered
        that pool all False, logged, and ran the others). None is taken where a transfer names no key
        (it moves nothing) and in a ``lookup`` (``batch_exists_v2``: SGLang's lookups pass None, the
        staging allocated once the hit is known). Returns, per transfer, what was checked (None where
        nothing was), for :meth:`_moves`."""
        checked: list[_Checked | None] = []
        for transfer in transfers:
            name = str(transfer.name)
            host = self._extra_hosts.get(name, self.mem_pool_host if name == _KV else None)
            if host is None:
                known = {_KV} if self.mem_pool_host is not None else set()
                known.update(n for n, h in self._extra_hosts.items() if h is not None)
                raise ValueError(f"transfer.name: pool {name!r} is not registered with this backend; "
                                 f"registered: {sorted(known)}")
            keys = transfer.keys or []
            if transfer.host_indices is None and (lookup or not keys):
                checked.append(None)
                continue
            what = f"transfer.host_indices (pool {name!r})"
            checked.append(_Checked(host, _page_starts(host, len(keys), transfer.host_indices, write, what)))
        return checked

    def _moves(self, pool: _Pool, host: Any, keys: list[str], host_indices: torch.Tensor | None,
               write: bool, checked: _Checked | None) -> _Move:
        """What moves for ``keys`` (checked by the caller: :func:`_check_keys`) at ``host_indices`` of
        ``host``. Their page starts are ``checked``'s where it checked them against ``host`` (the
        caller's check, before the pool's files opened: each call checks them once); else, where
        ``host`` was registered or replaced since, they are checked here (``TypeError``/``ValueError``
        for indices that are not ``len(keys)`` whole pages of the pool, see :func:`_page_starts`,
        before anything moves)."""
        if checked is not None and checked.host is host:
            firsts = checked.firsts
        else:
            firsts = _page_starts(host, len(keys), host_indices, write)
        store = _opened(pool)
        if pool.in_place:
            assert host_indices is not None
            return _Move(store, keys, _pages_in_place(host, len(keys), host_indices))
        if write:
            return _Move(store, keys, [[_flat_bytes(host.get_data_page(i, flat=True))] for i in firsts])
        pages = [[_flat_bytes(host.get_dummy_flat_data_page())] for _ in firsts]
        return _Move(store, keys, pages, host, firsts)

    def _run(self, moves: Sequence[_Move], write: bool) -> list[list[bool]]:
        """Move every page of ``moves`` on the loop, all at once, and wait; per move, per key, True
        when stored (write) or read verified. Flat reads are set into their host pool afterwards."""
        if not moves:
            return []

        async def run() -> list[list[bool]]:
            groups = []
            for move in moves:
                store = move.store
                step = store.store if write else store.load
                groups.append(asyncio.gather(*(step(store.key(k.encode("utf-8")), p)
                                               for k, p in zip(move.keys, move.pages, strict=True)),
                                             return_exceptions=True))
            done = await asyncio.gather(*groups)
            errors = [d for group in done for d in group if isinstance(d, BaseException)]
            if errors:
                log.error("aiokv backend: %d page transfers raised; first: %r", len(errors), errors[0])
            return [[d is True for d in group] for group in done]

        results = self._on_loop(run(), "every transfer fails")
        if results is None:
            return [[False] * len(move.keys) for move in moves]
        for move, ok in zip(moves, results, strict=True):
            if move.flat_targets is None:
                continue
            for index, page, hit in zip(move.flat_targets, move.pages, ok, strict=True):
                if hit:
                    move.host.set_from_flat_data_page(index, page[0])
        return results


def _busy(thread: LoopThread) -> bool:
    """Whether a task still runs on the pools' loop (none may be cancelled by its stop); True when
    that cannot be asked (the loop died meanwhile: its end is then waited for as after stuck I/O)."""
    try:
        return thread.call(lambda: bool(asyncio.all_tasks(thread.loop))).result()
    except (RuntimeError, concurrent.futures.CancelledError):  # LoopDied too
        return True


async def _others_ended(report_s: float) -> None:
    """Until no task but the caller's runs on its loop (one that ends may start another: a stuck
    I/O's end starts the release of the staging pool it used); warned every ``report_s``, never silent."""
    me = asyncio.current_task()
    waited = 0.0
    while others := asyncio.all_tasks() - {me}:
        waited = await _waited(others, report_s, waited, "task(s) to end")


async def _waited(awaited: Collection[asyncio.Future[Any]], report_s: float, waited: float, what: str) -> float:
    """Wait ``report_s`` at most for ``awaited``; warn when some are still pending. Returns the time
    waited in all so far (``waited`` plus this wait when it was warned)."""
    _, pending = await asyncio.wait(awaited, timeout=report_s)
    if pending:
        waited += report_s
        log.warning("aiokv backend: the pools' loop thread has waited %.0f s after close() for %d %s before it "
                    "stops (disk I/O stuck in the kernel?); it keeps waiting", waited, len(pending), what)
    return waited


def _stop_when_settled(thread: LoopThread, stores: Sequence[PageFileStore], report_s: float) -> None:
    """Stop the pools' loop thread once the disk I/O their closes left stuck in the kernel ended
    (a hung file system), their staging pools are freed and nothing else runs on it (an open cut
    short by an interrupt of its caller, closing what it opened: its close, too, may leave I/O
    stuck), without waiting for that here: joining it kept :meth:`AiokvHiCacheStorage.close`
    waiting for as long as the disk hung, past ``close_timeout``. A call still waiting on such I/O
    gets its answer once it ended. What it still waits for is warned every ``report_s``."""

    async def settled() -> None:
        # Warned as the wait for other tasks is: awaited plainly, it waited silently for as long as
        # the disk hung, the loop thread and the staging pools kept (review 266).
        waits: set[asyncio.Future[Any]] = {asyncio.ensure_future(store.wait_io_settled()) for store in stores}
        waited = 0.0
        try:
            while waits:
                waited = await _waited(waits, report_s, waited, "store(s)' stuck disk I/O to end")
                for wait in [wait for wait in waits if wait.done() and not wait.cancelled()]:
                    if (error := wait.exception()) is not None:  # read: the stop goes on regardless
                        log.error("aiokv backend: waiting for a store's stuck disk I/O failed", exc_info=error)
                waits = {wait for wait in waits if not wait.done()}
        finally:
            for wait in waits:  # cut (the loop's end): nothing waits for them any more
                wait.cancel()
        await _others_ended(report_s)

    def stop(_: object) -> None:  # on the loop thread, which must not join itself
        refused = thread.close_soon("aiokv-sglang-stop")
        if refused is not None:  # a pids limit: raised here, the loop ran for good after the close
            log.error("aiokv backend: no thread could stop the pools' loop thread after their stuck I/O "
                      "ended (%s); it stopped itself", refused)

    try:
        thread.submit(settled()).add_done_callback(stop)
    except RuntimeError:  # LoopDied too: it ended meanwhile, nothing runs there any more
        # A dying thread's finalizers wait for the stuck I/O before it ends: joined within the bound, as
        # close() does for a death it sees (joined without one, close() waited for as long as the disk hung).
        if thread.died is None or thread.wait_ended(report_s):
            thread.close()


def _dp_replica() -> int | None:
    """The data-parallel replica this scheduler process serves (SGLang's ``dp_rank`` of its launch,
    one per scheduler under its DP controller), or None: no DP controller, or not published (a
    backend made outside SGLang's scheduler: tests, tools)."""
    try:
        from sglang.srt import runtime_context

        value = runtime_context.get_parallel().dp_rank
    except Exception:  # not published (ValueError, RuntimeError), or an SGLang without it
        return None
    return None if value is None else int(value)


def _published_model(draft: bool) -> dict[str, str]:
    """What SGLang's scheduler process serves, as its runtime context publishes it, by fact name:
    ``model_path`` (``--model-path``), ``kv_cache_dtype`` (``--kv-cache-dtype``: ``auto``,
    ``fp8_e4m3``...), and where given ``revision``, ``model_overrides``
    (``--json-model-override-args``: RoPE scaling and the like change every stored K) and
    ``kv_scales`` (``--quantization-param-path``: fp8 KV scales). A draft pool's model, revision
    and KV cache dtype are the draft model's (``--speculative-draft-model-path``...) where set.
    Empty where SGLang has not published them (a backend made outside its scheduler: tests, tools)."""
    try:
        from sglang.srt import runtime_context

        model: Any = runtime_context.get_model()
        spec: Any = runtime_context.get_spec() if draft else None
    except Exception:  # not published (ValueError), or an SGLang without these bags
        return {}
    found = {
        "model_path": getattr(model, "model_path", None),
        "revision": getattr(model, "revision", None),
        "kv_cache_dtype": getattr(model, "kv_cache_dtype", None),
        "model_overrides": getattr(model, "json_model_override_args", None),
        "kv_scales": getattr(model, "quantization_param_path", None),
    }
    if getattr(spec, "speculative_draft_model_path", None) is not None:
        found["model_path"] = spec.speculative_draft_model_path
        found["revision"] = getattr(spec, "speculative_draft_model_revision", None)
    found["kv_cache_dtype"] = getattr(spec, "speculative_draft_kv_cache_dtype", None) or found["kv_cache_dtype"]
    # Defaults count as absent: a run with none of them keeps the identity it had.
    return {name: str(value) for name, value in found.items() if value not in (None, "", "{}")}


def _opened(pool: _Pool) -> PageFileStore:
    if pool.store is None:
        raise RuntimeError(f"pool {pool.name!r} has no page files open")
    return pool.store


def _page_geometry(host: Any, in_place: bool) -> tuple[int, bool, int]:
    """Page bytes of ``host``'s pages, whether they move in place, and in how many buffers: in
    place through the pool's buffer addresses (``get_page_buffer_meta``) when asked and the pool
    gives them, else as flat data pages (Mamba pools with side states, for one, refuse the
    addresses; 0 buffers)."""
    if in_place:
        try:
            _, sizes = host.get_page_buffer_meta(torch.arange(int(host.page_size) or 1, dtype=torch.int64))
        except (NotImplementedError, ValueError, AttributeError) as exc:
            log.info("aiokv backend: %s pages move as flat data pages (%s)", type(host).__name__, exc)
        else:
            return int(sum(int(s) for s in sizes)), True, len(sizes)
    dummy = host.get_dummy_flat_data_page()
    return int(dummy.numel() * dummy.element_size()), False, 0


def _register_host(pool: _Pool) -> None:
    """Register the host pool's memory (its ``kv_buffer`` tensors) with the pool's disk tier when
    its pages move in place as one buffer each (MLA ``page_first``...), so they move through
    io_uring fixed buffers (pinned in the background). Pages split in several buffers go through
    staging pages, for which registering would only pin memory."""
    store, host = pool.store, pool.host
    if store is None or host is None or not pool.in_place or pool.parts != 1 or not store.config.zero_copy:
        return
    regions = _host_regions(host)
    def register() -> None:
        for region in regions:
            store.register_memory(region)

    if regions:
        store.thread.call(register).result()


def _host_regions(host: Any) -> list[memoryview]:
    """Writable byte views of the host pool's CPU buffers (``kv_buffer``: a tensor or a list of them)."""
    buffers = getattr(host, "kv_buffer", None)
    tensors = list(buffers) if isinstance(buffers, (list, tuple)) else [buffers]
    regions = []
    for tensor in tensors:
        if (isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and tensor.is_contiguous()
                and tensor.numel()):
            regions.append(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return regions


def _check_keys(keys: Sequence[object], what: str = "keys") -> None:
    """``TypeError`` unless every key is a ``str``, ``ValueError`` for one that is not valid UTF-8
    (a lone surrogate): keys become file keys through their UTF-8 bytes. ``what``: the argument's
    name in the messages."""
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"{what} must be a list of str, not one string")
    if not isinstance(keys, Sequence):
        # (None raised "'NoneType' object is not iterable", naming nothing; a set or a generator
        # has no order or length for the pages they pair with)
        raise TypeError(f"{what} must be a list of str, got {type(keys).__name__}")
    for key in keys:
        if not isinstance(key, str):
            raise TypeError(f"{what} must be str, not {type(key).__name__}")
        try:
            key.encode("utf-8")
        except UnicodeEncodeError as exc:
            # (named the key only: in v2 neither transfer.keys nor the pool)
            raise ValueError(f"{what} must be valid UTF-8: key {key!r} is not ({exc.reason})") from None


def _check_transfers(transfers: object, what: str) -> list[PoolTransfer]:
    """``transfers`` (the argument named ``what``) as a list, checked before anything opens or
    moves: a list of SGLang's ``PoolTransfer`` whose ``keys`` are None or a list of ``str``
    (:func:`_check_keys`) and whose ``name`` is a ``str`` (SGLang's ``PoolName``).
    ``TypeError``/``ValueError`` otherwise: keys that were not iterable
    raised "'int' object is not iterable", naming nothing, one string was taken as one key per
    character, and a transfer that was not a ``PoolTransfer`` raised ``AttributeError``."""
    if isinstance(transfers, (str, bytes)) or not isinstance(transfers, Sequence):
        raise TypeError(f"{what} must be a list of PoolTransfer, got {type(transfers).__name__}")
    for transfer in transfers:
        if not isinstance(transfer, PoolTransfer):
            raise TypeError(f"{what} must hold PoolTransfer, not {type(transfer).__name__}")
        if not isinstance(transfer.name, str):  # SGLang's PoolName is a str (None was read as pool 'None')
            raise TypeError(f"transfer.name must be a pool name (SGLang's PoolName), "
                            f"got {type(transfer.name).__name__}")
        if transfer.keys is not None:
            _check_keys(transfer.keys, f"transfer.keys (pool {str(transfer.name)!r})")
    return list(transfers)


def _page_starts(host: Any, count: int, host_indices: object, write: bool, what: str = "host indices") -> list[int]:
    """The first host index of each of ``count`` pages at ``host_indices``, checked against SGLang's
    contract (its host pools allocate whole pages of ``page_size`` slots at page-aligned starts, and
    ``get_page_buffer_meta`` / ``get_data_page`` use each page's first index unchecked): an integer
    tensor of ``count * page_size`` indices, each page a run of consecutive indices starting at a
    multiple of ``page_size`` inside the pool, and for a read no page named twice (two reads into
    one slot race and fail verification). ``TypeError``/``ValueError`` otherwise, naming ``what``
    (the argument: in v2 ``transfer.host_indices`` and the pool)."""
    page_tokens = int(getattr(host, "logical_page_size", host.page_size)) or 1
    slots = int(getattr(host, "logical_size", host.size))
    host_indices = _check_index_form(host_indices, what)
    if host_indices.numel() != count * page_tokens:
        raise ValueError(f"{what}: {host_indices.numel()} indices for {count} pages of {page_tokens} tokens")
    pages = host_indices.detach().reshape(count, page_tokens).to("cpu", torch.int64)
    starts = pages[:, 0]
    if count and (int(starts.min()) < 0 or int(starts.max()) > slots - page_tokens):
        raise ValueError(f"{what} outside the host pool's {slots} slots")
    if bool((starts % page_tokens != 0).any()):
        raise ValueError(f"{what}: host pages must start at a multiple of the page size ({page_tokens})")
    if not torch.equal(pages, starts[:, None] + torch.arange(page_tokens)):
        raise ValueError(f"{what}: each host page must be {page_tokens} consecutive indices")
    firsts = [int(s) for s in starts.tolist()]
    if not write and len(set(firsts)) != len(firsts):
        raise ValueError(f"{what}: a read names one host page twice")
    return firsts


def _check_index_form(host_indices: object, what: str) -> torch.Tensor:
    """``host_indices``; ``TypeError``/``ValueError`` naming ``what`` unless it is a 1-D dense
    integer tensor with values (the part of :func:`_page_starts` that needs no host pool)."""
    if not isinstance(host_indices, torch.Tensor):
        raise TypeError(f"{what} must be a tensor, not {type(host_indices).__name__}")
    # Form first: a sparse one raised torch's RuntimeError at the reshape, a meta one
    # NotImplementedError, a 2-D one (of the right count) SGLang's AssertionError in place.
    if host_indices.is_nested or host_indices.layout is not torch.strided or host_indices.is_quantized:
        raise TypeError(f"{what} must be a dense (strided) tensor, got layout {host_indices.layout}"
                        f"{' (nested)' if host_indices.is_nested else ''}"
                        f"{' (quantized)' if host_indices.is_quantized else ''}")
    if host_indices.is_meta:
        raise TypeError(f"{what} must hold values, got a meta tensor")
    dtype = host_indices.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"{what} must be an integer tensor, not {dtype}")
    if host_indices.dim() != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tuple(host_indices.shape)}")
    return host_indices


def _pool_extents(host: Any) -> list[tuple[int, int]]:
    """(start, end) addresses of the host pool's CPU buffers, over their whole storage."""
    extents = []
    for name in _POOL_BUFFERS:
        buffers = getattr(host, name, None)
        for tensor in (list(buffers) if isinstance(buffers, (list, tuple)) else [buffers]):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                storage = tensor.untyped_storage()
                extents.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return extents


_POOL_BUFFERS = ("kv_buffer", "k_buffer", "v_buffer", "index_k_buffer", "index_k_scale_buffer",
                 "index_k_with_scale_buffer", "temporal_buffer", "conv_buffer", "_host_page_buffer_view")
"""Attributes of SGLang 0.5.23's host pools holding the memory their ``get_page_buffer_meta``
points into (MHA, MLA, DSA, Mamba, unified, MiniMax pools); a pool pointing elsewhere is refused."""


def _pages_in_place(host: Any, count: int, host_indices: torch.Tensor) -> list[list[torch.Tensor]]:
    """Per page, ``uint8`` tensors over its buffers in the host pool's memory (no copy).
    ``ValueError`` when SGLang's (unchecked) pointers name memory outside the pool's buffers."""
    ptrs, sizes = host.get_page_buffer_meta(host_indices)
    per_page = len(ptrs) // max(1, count)
    if per_page * count != len(ptrs) or len(sizes) != len(ptrs):
        raise ValueError(f"{len(ptrs)} buffers do not split into {count} pages")
    # One vectorized check (layer_first pages are 2 * layers buffers each): user-space addresses
    # fit int64.
    starts = torch.tensor([int(p) for p in ptrs], dtype=torch.int64)
    lengths = torch.tensor([int(s) for s in sizes], dtype=torch.int64)
    inside = torch.zeros(len(ptrs), dtype=torch.bool)
    for lo, hi in _pool_extents(host):
        inside |= (starts >= lo) & (starts + lengths <= hi)
    inside &= lengths > 0
    if not bool(inside.all()):
        first = int((~inside).nonzero()[0, 0])
        raise ValueError(f"host page buffer at {int(starts[first]):#x} (+{int(lengths[first])}) is outside "
                         "the host pool's memory")
    return [[_memory(int(p), int(s)) for p, s in zip(ptrs[i * per_page : (i + 1) * per_page],
                                                    sizes[i * per_page : (i + 1) * per_page], strict=True)]
            for i in range(count)]
