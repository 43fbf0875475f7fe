"""The backend under SGLang's own cache-controller storage paths (helper-145).

The other SGLang tests call the backend as the controller does; these run the controller's own code:
``HiCacheController._page_backup`` (the backup thread's batches of ``STORAGE_BATCH_SIZE`` pages,
``batch_set_v1`` or ``batch_set`` with the host pool's data pages), ``_storage_hit_query`` (the
prefetch thread's ``batch_exists`` per batch, stopping at the first short one) and
``_page_transfer`` (``batch_get_v1``, or ``batch_get`` then ``set_from_flat_data_page``, counting
leading hits). The controller is SGLang's class with only the attributes those paths read (its
constructor needs a device pool and CUDA streams). A page file that rots mid-chain must cut the
prefix there: every page SGLang counts as completed is bit-exact, the later ones are not used.
SGLang's page hash (a C++ extension it compiles on first use, ~15 s) is replaced by a SHA-256 chain
of the same shape: the keys' scheme is not under test.
"""

from __future__ import annotations

import hashlib
import queue
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make test installs requirements-engines.txt)")

import sglang_helpers as sh
import torch
from sglang.srt.managers import cache_controller  # after sglang_helpers: it makes SGLang importable here
from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation, StorageOperation
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE

PAGES = STORAGE_BATCH_SIZE + 8  # two batches each way
ROTTEN = STORAGE_BATCH_SIZE + 3  # a page of the second batch


def page_hashes(tokens: list[int], prior: str | None = None, page_size: int | None = None) -> list[str]:
    """SGLang's get_storage_hash_str's shape: one hex key per whole page, each chained on the last."""
    size = page_size or 1
    keys, last = [], bytes.fromhex(prior) if prior else b""
    for start in range(0, len(tokens) - size + 1, size):
        last = hashlib.sha256(last + repr(tokens[start : start + size]).encode()).digest()
        keys.append(last.hex())
    return keys


def controller(backend: Any, pool: Any, interface_v1: bool) -> Any:
    """SGLang's HiCacheController as attach_storage_backend leaves it, for its storage paths."""
    ctl = object.__new__(HiCacheController)
    ctl.storage_backend = backend
    ctl.storage_host_pool = ctl.mem_pool_host = pool
    ctl.page_size = sh.PAGE
    ctl.prefetch_sync_queue = queue.Queue()
    ctl.page_get_func = ctl._page_get_zero_copy if interface_v1 else ctl._generic_page_get
    ctl.page_set_func = ctl._page_set_zero_copy if interface_v1 else ctl._generic_page_set
    return ctl


def prefetch(ctl: Any, tokens: list[int], first_slot_page: int) -> tuple[int, int]:
    """The prefetch thread's hit query, then the I/O thread's transfer into host pages from
    ``first_slot_page`` on: (pages hit, pages completed)."""
    operation = PrefetchOperation("request", tokens)
    hashes, hit_tokens = ctl._storage_hit_query(operation)
    operation.hash_value = hashes
    operation.host_indices = sh.indices(list(range(first_slot_page, first_slot_page + len(hashes))))
    return hit_tokens // sh.PAGE, ctl._page_transfer(operation)


@pytest.mark.parametrize("interface_v1", [True, False], ids=["v1", "plain"])
def test_sglang_s_controller_backs_up_and_prefetches_a_prefix_cut_where_a_page_rotted(
        tmp_path: Path, backends: list[Any], interface_v1: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_controller, "get_storage_hash_str", page_hashes)
    pool = sh.host_pool(3 * PAGES)
    backend = sh.attach(backends, tmp_path, pool, interface_v1)
    backend.on_host_pools_registered()
    ctl = controller(backend, pool, interface_v1)
    tokens = list(range(PAGES * sh.PAGE))
    hashes = page_hashes(tokens, None, page_size=sh.PAGE)
    for p in range(PAGES):
        sh.fill(pool, p, seed=p)
    want = [sh.page(pool, p) for p in range(PAGES)]

    backup = StorageOperation(sh.indices(list(range(PAGES))), tokens, hash_value=hashes)
    ctl._page_backup(backup)
    assert backup.completed_tokens == PAGES * sh.PAGE

    assert prefetch(ctl, tokens, PAGES) == (PAGES, PAGES)
    assert all(torch.equal(sh.page(pool, PAGES + p), want[p]) for p in range(PAGES))

    assert backend.statistics()["pages"] == PAGES
    store = backend._pools["kv"].store
    rotten = store._layout_dir / store.thread.call(lambda: store._started()[1].files.rel(
        store.key(hashes[ROTTEN].encode("utf-8")))).result()
    data = bytearray(rotten.read_bytes())
    data[-64] ^= 0x40  # one bit of the payload
    rotten.write_bytes(bytes(data))

    # Indexed still: the hit query counts it, the transfer stops there (prefix semantics).
    assert prefetch(ctl, tokens, 2 * PAGES) == (PAGES, ROTTEN)
    assert all(torch.equal(sh.page(pool, 2 * PAGES + p), want[p]) for p in range(ROTTEN))
    # The rotten file is gone: the next query stops before it, and a backup writes it again.
    assert prefetch(ctl, tokens, PAGES) == (ROTTEN, ROTTEN)
    backup = StorageOperation(sh.indices(list(range(PAGES))), tokens, hash_value=hashes)
    ctl._page_backup(backup)
    assert backup.completed_tokens == PAGES * sh.PAGE
    assert prefetch(ctl, tokens, PAGES) == (PAGES, PAGES)
    assert all(torch.equal(sh.page(pool, PAGES + p), want[p]) for p in range(PAGES))
    acks = ctl.prefetch_sync_queue.qsize()
    assert acks == 4 * 2  # one PrefetchAck per batch of each of the four transfers
