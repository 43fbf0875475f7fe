"""Adversarial (review 298): bad ``transfer.host_indices`` in the SGLang backend's v2 calls are
refused by name for the whole call, as v1 refuses bad host indices and v2 bad ``transfer.keys``.

``batch_get_v2``/``batch_set_v2``/``batch_exists_v2``: host indices that are not
``len(transfer.keys)`` whole pages of the transfer's host pool (negative, past the pool, a float,
bool or list, 2-D, sparse, meta, too many or too few, not page-aligned or not consecutive, None
beside keys in a transfer, a page read twice) are a ``TypeError``/``ValueError`` naming
``transfer.host_indices`` and the pool, raised before any pool opens or any page moves: a valid
transfer beside the bad one is not run either. Before: ``batch_get_v2``/``batch_set_v2`` answered
that pool all False (logged) and ran the other transfers; ``batch_exists_v2`` never looked at them.
SGLang's own forms stay taken: None in a lookup (its lookups pass None: staging is allocated once the
hit is known), None or an empty tensor beside no keys.

Real SGLang host pools (MHA, Mamba) and factory (sglang_helpers.py), real page files; nothing changes
(both pools' statistics, every KV page and Mamba slot, the page files), and a valid call afterwards
is bit-exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make test installs requirements-engines.txt)")

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang_helpers import PAGE, attach, fill, host_pool, indices, page, state, stored_hybrid

from aiokv.adapters.sglang import AiokvHiCacheStorage

# Mamba host pool of stored_hybrid: one slot per page, slots 0..4 (mamba_pool(4) holds 5).
BAD_MAMBA: dict[str, tuple[object, list[str], type[Exception]]] = {
    "negative": (torch.tensor([-1]), ["h0"], ValueError),
    "past_end": (torch.tensor([5]), ["h0"], ValueError),
    "far": (torch.tensor([1 << 36]), ["h0"], ValueError),
    "float": (torch.tensor([2.0]), ["h0"], TypeError),
    "bool": (torch.tensor([True]), ["h0"], TypeError),
    "list": ([2], ["h0"], TypeError),
    "none": (None, ["h0"], TypeError),
    "2-D": (torch.tensor([[2]]), ["h0"], ValueError),
    "sparse": (torch.tensor([2]).to_sparse(), ["h0"], TypeError),
    "meta": (torch.empty(1, dtype=torch.int64, device="meta"), ["h0"], TypeError),
    "too_many": (torch.tensor([2, 3]), ["h0"], ValueError),
    "too_few": (torch.tensor([], dtype=torch.int64), ["h0"], ValueError),
    "none_keys_with_indices": (torch.tensor([2]), [], ValueError),
}
# The KV pool: pages of PAGE consecutive indices, page-aligned.
BAD_KV: dict[str, tuple[object, list[str], type[Exception]]] = {
    "mid_page": (torch.arange(PAGE // 2, PAGE + PAGE // 2), ["h0"], ValueError),
    "not_consecutive": (torch.cat([torch.arange(2 * PAGE, 2 * PAGE + PAGE // 2),
                                   torch.arange(3 * PAGE, 3 * PAGE + PAGE // 2)]), ["h0"], ValueError),
    "int_not_page": (torch.arange(2 * PAGE, 3 * PAGE) + 1, ["h0"], ValueError),
}

_Snapshot = tuple[dict[str, object], dict[str, object], list[torch.Tensor], list[torch.Tensor],
                  list[tuple[str, int, int]]]


def _files(root: Path) -> list[tuple[str, int, int]]:
    """Every file under ``root``: relative path, size, modification time (ns)."""
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in root.rglob("*") if p.is_file())


def _snapshot(backend: AiokvHiCacheStorage, kv: Any, mamba: Any, root: Path) -> _Snapshot:
    """Both pools' statistics, every KV host page, every Mamba slot and the page files."""
    return (dict(backend.statistics()), dict(backend.statistics("mamba")),
            [page(kv, p) for p in range(5)], [state(mamba, s) for s in range(5)], _files(root))


def _same(a: _Snapshot, b: _Snapshot) -> bool:
    return (a[:2] == b[:2] and a[4] == b[4]
            and all(torch.equal(x, y) for x, y in zip(a[2], b[2], strict=True))
            and all(torch.equal(x, y) for x, y in zip(a[3], b[3], strict=True)))


def _bad(name: PoolName, bad: tuple[object, list[str], type[Exception]]) -> PoolTransfer:
    return PoolTransfer(name=name, host_indices=bad[0], keys=list(bad[1]))  # type: ignore[arg-type]


def _valid_beside(write: bool) -> PoolTransfer:
    """A valid KV transfer: read h0 into page 2, or store page 3 as "new"."""
    if write:
        return PoolTransfer(name=PoolName.KV, host_indices=indices([3]), keys=["new"])
    return PoolTransfer(name=PoolName.KV, host_indices=indices([2]), keys=["h0"])


@pytest.mark.parametrize("write", [False, True], ids=["batch_get_v2", "batch_set_v2"])
def test_v2_bad_host_indices_refuse_the_whole_call(tmp_path: Path, backends: list[Any], write: bool) -> None:
    backend, kv, mamba = stored_hybrid(backends, tmp_path)
    call = backend.batch_set_v2 if write else backend.batch_get_v2
    before = _snapshot(backend, kv, mamba, tmp_path)
    cases = [(PoolName.MAMBA, form, bad) for form, bad in BAD_MAMBA.items()]
    cases += [(PoolName.KV, form, bad) for form, bad in BAD_KV.items()]
    for name, form, bad in cases:
        # Beside a valid transfer of the other pool, first and last: neither order runs it.
        other = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([3]), keys=["h0"]) \
            if name == PoolName.KV else _valid_beside(write)
        for transfers in ([other, _bad(name, bad)], [_bad(name, bad), other]):
            with pytest.raises(bad[2], match=rf"transfer\.host_indices \(pool '{name.value}'\)"):
                call(transfers)  # was {pool: [False...]}, the other transfer run
        assert _same(_snapshot(backend, kv, mamba, tmp_path), before), form
    # Afterwards valid calls are bit-exact; SGLang's forms beside them (no keys: None, an empty
    # tensor) are taken.
    got = backend.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=indices([2]), keys=["h0"]),
                                PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([3]), keys=["h0"])])
    assert got == {"kv": [True], "mamba": [True]}
    assert torch.equal(page(kv, 2), before[2][0]) and torch.equal(state(mamba, 3), before[3][1])
    assert backend.batch_set_v2([
        PoolTransfer(name=PoolName.KV, host_indices=indices([3]).to(torch.int32), keys=["new"]),
        PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([], dtype=torch.int64), keys=[])]) \
        == {"kv": [True], "mamba": []}
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=None, keys=None)]) == {"mamba": []}
    assert backend.batch_get_v1(["new"], indices([4])) == [True] and torch.equal(page(kv, 4), before[2][3])


def test_v2_read_naming_one_host_page_twice_is_refused(tmp_path: Path, backends: list[Any]) -> None:
    """As v1: two reads into one slot race and fail verification (a valid page counted corrupt).
    A write from one page under two keys is fine."""
    backend, kv, mamba = stored_hybrid(backends, tmp_path)
    before = _snapshot(backend, kv, mamba, tmp_path)
    twice = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([3, 3]), keys=["h0", "h0"])
    with pytest.raises(ValueError, match=r"transfer\.host_indices \(pool 'mamba'\): a read names one host page twice"):
        backend.batch_get_v2([_valid_beside(False), twice])  # was {"kv": [True], "mamba": [False]}
    assert _same(_snapshot(backend, kv, mamba, tmp_path), before)
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([1, 1]),
                                              keys=["a", "b"])]) == {"mamba": [True, True]}


@pytest.mark.parametrize("policy", [PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES])
def test_v2_exists_refuses_bad_host_indices_given(tmp_path: Path, backends: list[Any],
                                                  policy: PoolHitPolicy) -> None:
    """A lookup reads no host index, but any given are held to what the load would take (it
    answered a hit for a transfer the load then refused); None, SGLang's, is taken."""
    backend, kv, mamba = stored_hybrid(backends, tmp_path)
    before = _snapshot(backend, kv, mamba, tmp_path)
    for form, bad in BAD_MAMBA.items():
        if bad[0] is None:
            continue  # a lookup's own form
        transfer = PoolTransfer(name=PoolName.MAMBA, host_indices=bad[0], keys=list(bad[1]),  # type: ignore[arg-type]
                                hit_policy=policy)
        with pytest.raises(bad[2], match=r"transfer\.host_indices \(pool 'mamba'\)"):
            backend.batch_exists_v2(["h0"], [transfer])  # was answered: kv_hit_pages 1
        assert _same(_snapshot(backend, kv, mamba, tmp_path), before), form
    found = backend.batch_exists_v2(["h0"], [PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"],
                                                          hit_policy=policy)])
    assert (found.kv_hit_pages, found.restorable_prefix_pages) == (1, [1])
    found = backend.batch_exists_v2(["h0"], [PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([4]),
                                                          keys=["h0"], hit_policy=policy)])
    assert (found.kv_hit_pages, found.restorable_prefix_pages) == (1, [1])


def test_v2_bad_host_indices_open_nothing(tmp_path: Path, backends: list[Any]) -> None:
    """Refused before the pools' files open (the first call opens them): it opened them, then
    answered all False."""
    kv = host_pool(4)
    fill(kv, 0, seed=5)
    backend = attach(backends, tmp_path, kv, interface_v1=True)
    for call in (backend.batch_get_v2, backend.batch_set_v2):
        with pytest.raises(ValueError, match=r"transfer\.host_indices \(pool 'kv'\) outside the host pool's 80 slots"):
            call([PoolTransfer(name=PoolName.KV, host_indices=indices([5]), keys=["a"])])
    with pytest.raises(ValueError, match=r"transfer\.host_indices \(pool 'kv'\)"):
        backend.batch_exists_v2(["a"], [PoolTransfer(name=PoolName.KV, host_indices=indices([0, 1]), keys=["a"])])
    assert backend.statistics() == {} and not any(tmp_path.iterdir())
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=indices([0]), keys=["a"])]) \
        == {"kv": [True]}
    assert backend.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=indices([2]), keys=["a"])]) \
        == {"kv": [True]}
    assert torch.equal(page(kv, 2), page(kv, 0))
