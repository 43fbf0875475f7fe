"""A v2 transfer naming a pool never registered with the SGLang backend (or None as its name) is
refused by name, before any pool opens or page moves, in every state.

SGLang 0.5.23 names in its transfers only pools of its host pool group, and registers each with the
backend before a transfer can name it: every entry at attach (``HybridCacheController``'s
``attach_storage_backend``, before any operation is queued), and a sidecar's entry added later
(``register_host_pool_entry``) before its spec is kept (``UnifiedRadixCache.register_sidecar_pool``);
sidecar specs are made only for pools of the group. So only a caller's bug names another. Before:
``batch_get_v2``/``batch_set_v2`` answered that pool all False (logged "not registered") and ran the
other transfers; ``str(None)`` was taken as a pool 'None'; ``batch_exists_v2`` took such a pool as
holding nothing; a first call opened (created) the pools' files first, and after ``close()`` the call
was a closed miss.

Real SGLang host pools (MHA, Mamba) and factory (sglang_helpers.py), real page files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make test installs requirements-engines.txt)")

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang_helpers import attach, fill, host_pool, indices, stored_hybrid
from test_adv_rev298_sglang_v2_indices import _files, _same, _snapshot

NOT_REGISTERED = r"transfer\.name: pool 'swa' is not registered with this backend; registered: \['kv', 'mamba'\]"


@pytest.mark.parametrize("write", [False, True], ids=["batch_get_v2", "batch_set_v2"])
def test_a_transfer_naming_a_pool_never_registered_refuses_the_whole_call(tmp_path: Path, backends: list[Any],
                                                                          write: bool) -> None:
    backend, kv, mamba = stored_hybrid(backends, tmp_path)
    call = backend.batch_set_v2 if write else backend.batch_get_v2
    valid = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([3]), keys=["h0"])
    before = _snapshot(backend, kv, mamba, tmp_path)
    for unknown in (PoolTransfer(name=PoolName.SWA, host_indices=torch.tensor([0]), keys=["h0"]),
                    PoolTransfer(name=PoolName.SWA, host_indices=None, keys=None)):  # no key: still a bug
        for transfers in ([valid, unknown], [unknown, valid]):
            with pytest.raises(ValueError, match=NOT_REGISTERED):
                call(transfers)  # was {"swa": [False] or [], "mamba": [True]}, logged
            assert _same(_snapshot(backend, kv, mamba, tmp_path), before)
    for name in (None, 3):
        with pytest.raises(TypeError, match=r"transfer\.name must be a pool name \(SGLang's PoolName\), got "):
            call([valid, PoolTransfer(name=name, host_indices=torch.tensor([0]), keys=["h0"])])  # type: ignore[arg-type]
    assert _same(_snapshot(backend, kv, mamba, tmp_path), before)  # (None was a pool 'None': all False)
    assert call([valid]) == {"mamba": [True]}


def test_a_lookup_naming_a_pool_never_registered_is_refused(tmp_path: Path, backends: list[Any]) -> None:
    backend, kv, mamba = stored_hybrid(backends, tmp_path)
    before = _snapshot(backend, kv, mamba, tmp_path)
    with pytest.raises(ValueError, match=NOT_REGISTERED):  # was taken as holding nothing
        backend.batch_exists_v2(["h0"], [PoolTransfer(name=PoolName.MAMBA, keys=["h0"]),
                                         PoolTransfer(name=PoolName.SWA, keys=["h0"])])
    with pytest.raises(TypeError, match=r"transfer\.name must be a pool name"):
        backend.batch_exists_v2(["h0"], [PoolTransfer(name=None, keys=["h0"])])  # type: ignore[arg-type]
    assert _same(_snapshot(backend, kv, mamba, tmp_path), before)
    found = backend.batch_exists_v2(["h0"], [PoolTransfer(name=PoolName.MAMBA, keys=["h0"])])
    assert (found.kv_hit_pages, found.extra_pool_hit_pages) == (1, {"kv": 1, "mamba": 1})


@pytest.mark.parametrize("call", ["batch_get_v2", "batch_set_v2", "batch_exists_v2"])
def test_a_pool_never_registered_is_refused_before_the_files_open_and_after_close(
        tmp_path: Path, backends: list[Any], call: str) -> None:
    pool = host_pool(4)
    fill(pool, 0, seed=1)
    backend = attach(backends, tmp_path, pool, interface_v1=True)  # KV only, files not opened yet
    transfer = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0]), keys=["h0"])

    def run() -> object:
        if call == "batch_exists_v2":
            return backend.batch_exists_v2(["h0"], [PoolTransfer(name=PoolName.MAMBA, keys=["h0"])])
        return getattr(backend, call)([transfer])

    with pytest.raises(ValueError, match=r"pool 'mamba' is not registered with this backend; registered: \['kv'\]"):
        run()  # was answered after opening (creating) the KV pool's files
    assert backend.statistics() == {} and not _files(tmp_path), "a refused call opened the pools"
    assert backend.batch_set_v1(["h0"], indices([0])) == [True]
    backend.close()
    with pytest.raises(ValueError, match="pool 'mamba' is not registered"):
        run()  # was a closed miss: all False (or no hit), counted
    assert backend.closed_misses == 0
