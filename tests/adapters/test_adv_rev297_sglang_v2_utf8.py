"""Adversarial (review 297): a key with a lone surrogate (not valid UTF-8, so it has no file key)
inside an SGLang v2 ``transfer.keys``.

``batch_get_v2``/``batch_set_v2``/``batch_exists_v2`` refuse it with a ``ValueError`` naming
``transfer.keys`` and the pool, as the other v2 refusals do, before any pool opens or any page
moves (the whole call: a valid transfer beside it moves nothing either); the plain keys' refusal
names ``keys``. Before: "key '...' is not valid UTF-8", naming neither the argument nor the pool.

Real SGLang host pools (MHA, Mamba) and factory (sglang_helpers.py), real page files; a valid call
afterwards is bit-exact.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make test installs requirements-engines.txt)")

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang_helpers import attach, fill, host_pool, indices, page, state, stored_hybrid

from aiokv.adapters.sglang import AiokvHiCacheStorage

SURROGATES = ("h\ud800", "\udcff", "ok\udfffok")


def _message(what: str, key: str) -> str:
    return re.escape(f"{what} must be valid UTF-8: key {key!r} is not (surrogates not allowed)")


def _snapshot(backend: AiokvHiCacheStorage, kv: Any, mamba: Any, root: Path) -> tuple[object, ...]:
    """Both pools' statistics, every KV host page, every Mamba slot, and the files under ``root``."""
    return (dict(backend.statistics()), dict(backend.statistics("mamba")),
            [page(kv, p).tolist() for p in range(4)], [state(mamba, s).tolist() for s in range(4)],
            sorted(str(p.relative_to(root)) for p in root.rglob("*")))


@pytest.mark.parametrize("write", [False, True], ids=["batch_get_v2", "batch_set_v2"])
def test_a_lone_surrogate_in_transfer_keys_is_refused_naming_them_and_the_pool(
        tmp_path: Path, backends: list[Any], write: bool) -> None:
    backend, kv, mamba = stored_hybrid(backends, tmp_path)
    call = backend.batch_set_v2 if write else backend.batch_get_v2
    before = _snapshot(backend, kv, mamba, tmp_path)
    for key in SURROGATES:
        # Beside a valid KV transfer, the bad key after a valid one: the whole call is refused.
        transfers = [PoolTransfer(name=PoolName.KV, host_indices=indices([2]), keys=["h0"]),
                     PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([2, 3]), keys=["h0", key])]
        with pytest.raises(ValueError, match=_message("transfer.keys (pool 'mamba')", key)):
            call(transfers)  # was "key '...' is not valid UTF-8"
        kv_only = [PoolTransfer(name=PoolName.KV, host_indices=indices([2]), keys=[key])]
        with pytest.raises(ValueError, match=_message("transfer.keys (pool 'kv')", key)):
            call(kv_only)
    assert _snapshot(backend, kv, mamba, tmp_path) == before
    got = backend.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=indices([3]), keys=["h0"]),
                                PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([3]), keys=["h0"])])
    assert got == {"kv": [True], "mamba": [True]}
    assert torch.equal(page(kv, 3), page(kv, 0)) and torch.equal(state(mamba, 3), state(mamba, 1))


def test_a_lone_surrogate_in_exists_v2_transfer_keys_is_refused_naming_them(tmp_path: Path,
                                                                            backends: list[Any]) -> None:
    backend, kv, mamba = stored_hybrid(backends, tmp_path)
    before = _snapshot(backend, kv, mamba, tmp_path)
    for policy in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES):
        for key in SURROGATES:
            with pytest.raises(ValueError, match=_message("transfer.keys (pool 'mamba')", key)):
                backend.batch_exists_v2(["h0"], [PoolTransfer(name=PoolName.MAMBA, keys=[key], hit_policy=policy)])
            with pytest.raises(ValueError, match=_message("keys", key)):  # the plain keys: named too
                backend.batch_exists_v2([key], None)
    assert _snapshot(backend, kv, mamba, tmp_path) == before
    found = backend.batch_exists_v2(["h0"], [PoolTransfer(name=PoolName.MAMBA, keys=["x"],
                                                          hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert (found.kv_hit_pages, found.restorable_prefix_pages) == (1, [1])


def test_a_lone_surrogate_refusal_opens_nothing(tmp_path: Path, backends: list[Any]) -> None:
    """Refused before the pools' files open (the first call opens them)."""
    kv = host_pool(4)
    fill(kv, 0, seed=5)
    backend = attach(backends, tmp_path, kv, interface_v1=True)
    for call in (backend.batch_get_v2, backend.batch_set_v2):
        with pytest.raises(ValueError, match=_message("transfer.keys (pool 'kv')", "a\ud800")):
            call([PoolTransfer(name=PoolName.KV, host_indices=indices([0]), keys=["a\ud800"])])
    assert backend.statistics() == {} and not any(tmp_path.iterdir())
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=indices([0]), keys=["a"])]) \
        == {"kv": [True]}
    assert backend.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=indices([2]), keys=["a"])]) \
        == {"kv": [True]}
    assert torch.equal(page(kv, 2), page(kv, 0))
