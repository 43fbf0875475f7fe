"""Each SGLang v1/v2 call checks its host indices once (:func:`aiokv.adapters.sglang._page_starts`).

Before: v1 checked them at its edge (before the pool's files open, 7035d11) and ``_moves`` checked
them again; v2 likewise (``_check_transfer_indices``, then ``_moves``): two checks per call, or per
v2 transfer, each walking every index. Now the edge's check hands the page starts on. Where the host
pool that moves is not the one checked (a KV host pool registered again after the files opened
over the first), they are checked against that one too, as before.

Real SGLang host pools (MHA, Mamba), real page files; the check is counted, not replaced.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make test installs requirements-engines.txt)")

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang_helpers import attach, fill, host_pool, indices, page, state, stored_hybrid

import aiokv.adapters.sglang as sglang_adapter


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The host pool each call of ``_page_starts`` checked against, in order."""
    seen: list[Any] = []
    real = sglang_adapter._page_starts

    def counted(host: Any, count: int, host_indices: object, write: bool, what: str = "host indices") -> list[int]:
        seen.append(host)
        return real(host, count, host_indices, write, what)

    monkeypatch.setattr(sglang_adapter, "_page_starts", counted)
    return seen


def named(checks: list[Any], **pools: Any) -> list[str]:
    """``checks`` as the names of their host pools (``pools``: name=pool)."""
    return [next((n for n, p in pools.items() if p is host), "?") for host in checks]


def test_v1_calls_check_their_host_indices_once(tmp_path: Path, backends: list[Any], checks: list[Any]) -> None:
    pool = host_pool(4)
    for p in range(2):
        fill(pool, p, seed=p)
    backend = attach(backends, tmp_path, pool, interface_v1=True)
    assert backend.batch_set_v1(["a", "b"], indices([0, 1])) == [True, True]  # the first call opens the files
    assert named(checks, kv=pool) == ["kv"]  # was ["kv", "kv"]: the edge's, then _moves'
    assert backend.batch_get_v1(["a", "b"], indices([3, 2])) == [True, True]
    assert named(checks, kv=pool) == ["kv", "kv"]
    assert torch.equal(page(pool, 3), page(pool, 0)) and torch.equal(page(pool, 2), page(pool, 1))
    assert backend.batch_get_v1([], torch.tensor([], dtype=torch.int64)) == []  # nothing moves: not checked
    assert named(checks, kv=pool) == ["kv", "kv"]


@pytest.mark.parametrize("write", [False, True], ids=["batch_get_v2", "batch_set_v2"])
def test_v2_calls_check_each_transfers_host_indices_once(tmp_path: Path, backends: list[Any], checks: list[Any],
                                                         write: bool) -> None:
    backend, kv, mamba = stored_hybrid(backends, tmp_path)
    checks.clear()
    call = backend.batch_set_v2 if write else backend.batch_get_v2
    got = call([PoolTransfer(name=PoolName.KV, host_indices=indices([2]), keys=["h0"]),
                PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([3]), keys=["h0"])])
    assert got == {"kv": [True], "mamba": [True]}
    assert named(checks, kv=kv, mamba=mamba) == ["kv", "mamba"]  # was ["kv", "mamba", "kv", "mamba"]
    if not write:
        assert torch.equal(page(kv, 2), page(kv, 0)) and torch.equal(state(mamba, 3), state(mamba, 1))
    checks.clear()
    assert call([PoolTransfer(name=PoolName.MAMBA, host_indices=None, keys=None)]) == {"mamba": []}
    assert checks == []  # a transfer without keys moves nothing: nothing to check


def test_v1_indices_are_checked_against_the_host_pool_that_moves(tmp_path: Path, backends: list[Any],
                                                                 checks: list[Any]) -> None:
    """A KV host pool registered again after the files opened over the first: the first still
    moves (its files' geometry), so indices valid in the new one but not in it are refused."""
    small, large = host_pool(4), host_pool(8)
    fill(small, 0, seed=1)
    backend = attach(backends, tmp_path, small, interface_v1=True)
    assert backend.batch_set_v1(["a"], indices([0])) == [True]
    backend.register_mem_pool_host(large)
    checks.clear()
    with pytest.raises(ValueError, match="outside the host pool's"):
        backend.batch_get_v1(["a"], indices([6]))  # inside the new pool, past the one that moves
    assert named(checks, large=large, small=small) == ["large", "small"]
    checks.clear()
    assert backend.batch_get_v1(["a"], indices([1])) == [True] and torch.equal(page(small, 1), page(small, 0))
    assert named(checks, large=large, small=small) == ["large", "small"]
