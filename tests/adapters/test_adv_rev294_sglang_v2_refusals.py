"""Adversarial (review 294): bad arguments to the SGLang backend's pool statistics and its v2
(hybrid model) transfers are refused by name, with nothing changed.

- ``statistics(pool=...)``: an unknown pool name is a ``ValueError`` naming it and the valid names
  (``"kv"`` and the pools registered with ``register_mem_host_pool_v2``); a name that is not a
  ``str`` a ``TypeError`` naming ``pool``. Before: an unknown name answered ``{}``, as a pool not
  opened yet does, and a list raised "unhashable type: 'list'".
- ``batch_get_v2``/``batch_set_v2``/``batch_exists_v2``: a ``transfer.keys`` that is not a list of
  ``str`` (an int, one string, bytes, a set, an iterator) is a ``TypeError`` naming
  ``transfer.keys`` and the pool, raised before any pool opens or any page moves (the whole call:
  a valid transfer beside it moves nothing either). Before: "'int' object is not iterable"
  naming nothing, one string taken as one key per character, a set or an iterator taken in
  whatever order it gave. Transfers that are not a list of ``PoolTransfer`` raised "... is not
  iterable" or ``AttributeError``: now a ``TypeError`` naming the argument.

Real SGLang host pools (MHA, Mamba) and factory (sglang_helpers.py), real page files; a valid call
afterwards is bit-exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make test installs requirements-engines.txt)")

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang_helpers import attach, fill, host_pool, indices, page, state, stored_hybrid

from aiokv.adapters.sglang import AiokvHiCacheStorage

_Snapshot = tuple[dict[str, object], dict[str, object], list[torch.Tensor], list[torch.Tensor]]


def _snapshot(backend: AiokvHiCacheStorage, kv: Any, mamba: Any) -> _Snapshot:
    """Both pools' statistics, every KV host page and every Mamba slot."""
    return (dict(backend.statistics()), dict(backend.statistics("mamba")),
            [page(kv, p) for p in range(4)], [state(mamba, s) for s in range(4)])


def _same(a: _Snapshot, b: _Snapshot) -> bool:
    return (a[:2] == b[:2] and all(torch.equal(x, y) for x, y in zip(a[2], b[2], strict=True))
            and all(torch.equal(x, y) for x, y in zip(a[3], b[3], strict=True)))


def test_statistics_of_an_unknown_pool_is_refused_by_name(tmp_path: Path, backends: list[Any]) -> None:
    backend, kv, mamba = stored_hybrid(backends, tmp_path)
    before = _snapshot(backend, kv, mamba)
    with pytest.raises(ValueError, match=r"pool 'bogus' is not a pool of this backend; valid names: \['kv', 'mamba'\]"):
        backend.statistics(pool="bogus")  # was {}
    with pytest.raises(ValueError, match="pool 'swa'"):  # a pool name SGLang has, never registered here
        backend.statistics(PoolName.SWA)
    for bad in (None, 3, ["kv"]):
        with pytest.raises(TypeError, match="pool must be a pool name"):  # a list: "unhashable type"
            backend.statistics(bad)  # type: ignore[arg-type]
    assert _same(_snapshot(backend, kv, mamba), before)
    assert backend.statistics(PoolName.MAMBA)["pages"] == 1 and backend.statistics()["pages"] == 1
    got = backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([3]), keys=["h0"])])
    assert got == {"mamba": [True]} and torch.equal(state(mamba, 3), before[3][1])
    backend.close()
    assert backend.statistics("mamba") == {}  # known, closed: empty, as documented
    with pytest.raises(ValueError, match="pool 'bogus'"):
        backend.statistics("bogus")


def test_statistics_of_a_known_pool_not_opened_yet_is_empty(tmp_path: Path, backends: list[Any]) -> None:
    backend = attach(backends, tmp_path, host_pool(4), interface_v1=True)
    assert backend.statistics() == {}  # registered, files not opened yet (opened by the first call)
    with pytest.raises(ValueError, match=r"valid names: \['kv'\]"):
        backend.statistics("mamba")
    assert backend.statistics() == {}  # the refusal opened nothing


BAD_KEYS = (3, object(), "ab", b"ab", {"a"}, iter(["a"]), ("a", 7), [None])


@pytest.mark.parametrize("write", [False, True], ids=["batch_get_v2", "batch_set_v2"])
def test_v2_transfer_keys_not_a_list_of_str_are_refused_by_name(tmp_path: Path, backends: list[Any],
                                                                write: bool) -> None:
    backend, kv, mamba = stored_hybrid(backends, tmp_path)
    call = backend.batch_set_v2 if write else backend.batch_get_v2
    before = _snapshot(backend, kv, mamba)
    for keys in BAD_KEYS:
        # Beside a valid KV transfer: the whole call is refused, nothing of it moves.
        transfers = [PoolTransfer(name=PoolName.KV, host_indices=indices([2]), keys=["h0"]),
                     PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([2]), keys=keys)]
        with pytest.raises(TypeError, match=r"transfer\.keys \(pool 'mamba'\) must be"):  # was "... not iterable"
            call(transfers)  # (one string was taken as 2 keys, a set or an iterator in its order)
    for transfers in (None, 3, PoolTransfer(name=PoolName.KV, keys=["h0"]), [None], ["kv"]):
        with pytest.raises(TypeError, match="transfers must"):  # was "... not iterable" or AttributeError
            call(transfers)  # type: ignore[arg-type]
    assert _same(_snapshot(backend, kv, mamba), before)
    # Afterwards valid calls are bit-exact (None keys: SGLang's transfer without keys, nothing moved).
    got = backend.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=indices([3]), keys=["h0"]),
                                PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([3]), keys=("h0",))])
    assert got == {"kv": [True], "mamba": [True]}
    assert backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=None, keys=None)]) == {"mamba": []}
    assert torch.equal(page(kv, 3), before[2][0]) and torch.equal(state(mamba, 3), before[3][1])


def test_v2_exists_transfer_keys_not_a_list_of_str_are_refused_by_name(tmp_path: Path, backends: list[Any]) -> None:
    backend, kv, mamba = stored_hybrid(backends, tmp_path)
    before = _snapshot(backend, kv, mamba)
    for policy in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES):
        for keys in BAD_KEYS:
            with pytest.raises(TypeError, match=r"transfer\.keys \(pool 'mamba'\) must be"):
                # TRAILING_PAGES: was "object of type 'int' has no len()" once the loop had looked;
                # ALL_PAGES: taken (its keys are not read)
                backend.batch_exists_v2(["h0"], [PoolTransfer(name=PoolName.MAMBA, keys=keys, hit_policy=policy)])
    for transfers in (3, "kv", [None]):
        with pytest.raises(TypeError, match="pool_transfers must"):
            backend.batch_exists_v2(["h0"], transfers)  # type: ignore[arg-type]
    assert _same(_snapshot(backend, kv, mamba), before)
    found = backend.batch_exists_v2(["h0"], [PoolTransfer(name=PoolName.MAMBA, keys=["x"],
                                                          hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert (found.kv_hit_pages, found.restorable_prefix_pages) == (1, [1])
    assert backend.batch_exists_v2(["h0"], None).kv_hit_pages == 1


def test_v2_refusal_opens_nothing(tmp_path: Path, backends: list[Any]) -> None:
    """Refused before the pools' files open (the first call opens them)."""
    kv = host_pool(4)
    fill(kv, 0, seed=5)
    backend = attach(backends, tmp_path, kv, interface_v1=True)
    for call in (backend.batch_get_v2, backend.batch_set_v2):
        with pytest.raises(TypeError, match=r"transfer\.keys \(pool 'kv'\)"):
            call([PoolTransfer(name=PoolName.KV, host_indices=indices([0, 1]), keys="ab")])  # was taken: 2 keys
    assert backend.statistics() == {} and not any(tmp_path.iterdir())
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=indices([0]), keys=["a"])]) \
        == {"kv": [True]}
    assert backend.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=indices([2]), keys=["a"])]) \
        == {"kv": [True]}
    assert torch.equal(page(kv, 2), page(kv, 0))
