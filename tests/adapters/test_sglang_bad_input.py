"""Bad input to aiokv's SGLang backend is refused at the public edge with nothing read, written or
stored: host indices outside the host pool, not page-aligned runs, or naming one page twice in a
read; host-pool pointers outside its memory; plain batches with one bad page; keys that are not str
or not valid UTF-8. Real SGLang host pools and factory (sglang_helpers.py), real page files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make test installs requirements-engines.txt)")

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang_helpers import PAGE, attach, fill, host_pool, indices, page


def _pages(pool: Any, count: int) -> list[torch.Tensor]:
    return [page(pool, i) for i in range(count)]


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("bad", ["negative", "past_end", "far", "mid_page", "not_consecutive", "float", "list"])
def test_v1_refuses_host_indices_outside_whole_pages_of_the_pool(
        tmp_path: Path, backends: list[Any], layout: str, bad: str) -> None:
    """Before: negative indices stored memory from before the pool, 2**36 segfaulted, a page starting
    mid-page read half over its neighbour; all answered True."""
    pool = host_pool(4, layout)
    for i in range(pool.size // PAGE):
        fill(pool, i, seed=i + 1)
    backend = attach(backends, tmp_path, pool, interface_v1=True, page_first=layout == "page_first")
    assert backend.batch_set_v1(["a"], indices([0])) == [True]
    bad_indices: Any = {
        "negative": torch.arange(-2 * PAGE, -PAGE),
        "past_end": torch.arange(pool.size, pool.size + PAGE),
        "far": torch.arange(1 << 36, (1 << 36) + PAGE),
        "mid_page": torch.arange(PAGE + PAGE // 2, 2 * PAGE + PAGE // 2),
        "not_consecutive": torch.cat([torch.arange(PAGE, PAGE + PAGE // 2),
                                      torch.arange(3 * PAGE, 3 * PAGE + PAGE // 2)]),
        "float": indices([1]).float(),
        "list": list(range(PAGE, 2 * PAGE)),
    }[bad]
    before = _pages(pool, pool.size // PAGE)
    with pytest.raises((ValueError, TypeError)):
        backend.batch_get_v1(["a"], bad_indices)
    with pytest.raises((ValueError, TypeError)):
        backend.batch_set_v1(["new"], bad_indices)
    assert all(torch.equal(a, b) for a, b in zip(before, _pages(pool, pool.size // PAGE), strict=True))
    assert backend.batch_exists(["new"]) == 0
    assert backend.batch_get_v1(["a"], indices([2])) == [True]  # still serving
    assert torch.equal(page(pool, 2), before[0])


def test_v1_read_naming_one_host_page_twice_is_refused(tmp_path: Path, backends: list[Any]) -> None:
    """Two reads into one host page race; the store would count a valid page corrupt (and delete it)."""
    pool = host_pool(4)
    fill(pool, 0, seed=1)
    fill(pool, 1, seed=2)
    backend = attach(backends, tmp_path, pool, interface_v1=True)
    assert backend.batch_set_v1(["a", "b"], indices([0, 1])) == [True, True]
    with pytest.raises(ValueError, match="twice"):
        backend.batch_get_v1(["a", "b"], indices([2, 2]))
    assert backend.batch_exists(["a", "b"]) == 2
    assert backend.batch_get_v1(["a", "b"], indices([2, 3])) == [True, True]
    assert backend.batch_set_v1(["c", "d"], indices([0, 0])) == [True, True]  # writes from one page: fine


def test_v2_bad_indices_refuse_the_whole_call(tmp_path: Path, backends: list[Any]) -> None:
    """As v1 refuses them (review 298; they answered that pool all False, logged, the call going on):
    a ValueError naming transfer.host_indices and the pool, nothing stored."""
    pool = host_pool(4)
    fill(pool, 0, seed=1)
    backend = attach(backends, tmp_path, pool, interface_v1=True)
    bad = PoolTransfer(name=PoolName.KV, host_indices=torch.arange(-PAGE, 0), keys=["n"])
    with pytest.raises(ValueError, match=r"transfer\.host_indices \(pool 'kv'\) outside the host pool"):
        backend.batch_set_v2([bad])
    assert backend.batch_exists(["n"]) == 0
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=indices([0]), keys=["n"])]) \
        == {"kv": [True]}


def test_in_place_pointers_outside_the_pool_are_refused(tmp_path: Path, backends: list[Any]) -> None:
    """A host pool whose ``get_page_buffer_meta`` (unchecked in SGLang) names memory past its buffer
    (injected: its pointers shifted by the buffer's size) is refused before any memory is touched."""
    pool = host_pool(4)
    fill(pool, 0, seed=1)
    backend = attach(backends, tmp_path, pool, interface_v1=True)
    assert backend.batch_set_v1(["a"], indices([0])) == [True]
    real = pool.get_page_buffer_meta
    shift = pool.kv_buffer.numel() * pool.kv_buffer.element_size()

    def shifted(host_indices: torch.Tensor) -> tuple[list[int], list[int]]:
        ptrs, sizes = real(host_indices)
        return [p + shift for p in ptrs], sizes

    pool.get_page_buffer_meta = shifted
    with pytest.raises(ValueError, match="outside the host pool's memory"):
        backend.batch_get_v1(["a"], indices([1]))
    with pytest.raises(ValueError, match="outside the host pool's memory"):
        backend.batch_set_v1(["b"], indices([1]))
    pool.get_page_buffer_meta = real
    assert backend.batch_exists(["b"]) == 0
    assert backend.batch_get_v1(["a"], indices([1])) == [True]


def test_plain_batch_with_one_bad_page_stores_nothing(tmp_path: Path, backends: list[Any]) -> None:
    """Before: batch_set(["x", "y"], [page, 100 bytes]) returned False and stored x."""
    pool = host_pool(2)
    fill(pool, 0, seed=1)
    backend = attach(backends, tmp_path, pool, interface_v1=False)
    v = page(pool, 0)
    with pytest.raises(ValueError, match="different sizes"):
        backend.batch_set(["x", "y"], [v, v[:50]])
    with pytest.raises(ValueError, match="contiguous"):
        backend.batch_set(["x", "y"], [v, v[::2]])
    with pytest.raises(ValueError, match="2 page tensors for 3 keys"):
        backend.batch_set(["x", "y", "z"], [v, v])
    assert backend.batch_exists(["x"]) == 0
    assert backend.batch_set(["x", "y"], [v, v.clone()])
    target = torch.zeros_like(v)
    with pytest.raises(ValueError, match="share memory"):
        backend.batch_get(["x", "y"], [target, target])
    with pytest.raises(ValueError, match="share memory"):
        backend.batch_get(["x", "y"], [target, target.view(torch.uint8)])
    assert backend.batch_exists(["x", "y"]) == 2
    got = backend.batch_get(["x", "y"], [target, torch.zeros_like(v)])
    assert got[0] is target and torch.equal(target, v)


@pytest.mark.parametrize("interface_v1", [True, False])
def test_keys_not_str_or_not_utf8_are_refused(tmp_path: Path, backends: list[Any], interface_v1: bool) -> None:
    """Before: AttributeError for a non-str key, UnicodeEncodeError for a lone surrogate."""
    pool = host_pool(4)
    fill(pool, 0, seed=1)
    backend = attach(backends, tmp_path, pool, interface_v1=interface_v1)
    v = page(pool, 0)
    for key, error in ((5, TypeError), (b"x", TypeError), ("\udcff", ValueError)):
        with pytest.raises(error):
            backend.batch_exists([key])
        with pytest.raises(error):
            backend.exists(key)
        if interface_v1:
            with pytest.raises(error):
                backend.batch_set_v1(["ok", key], indices([0, 1]))
            with pytest.raises(error):
                backend.batch_get_v1([key], indices([2]))
        else:
            with pytest.raises(error):
                backend.set(key, v)
            with pytest.raises(error):
                backend.batch_set(["ok", key], [v, v])
            with pytest.raises(error):
                backend.get(key, torch.zeros_like(v))
    with pytest.raises(TypeError):
        backend.batch_exists("abc")
    assert backend.batch_exists(["ok"]) == 0


def test_v2_call_naming_a_pool_twice_is_refused(tmp_path: Path, backends: list[Any]) -> None:
    """Before: both transfers ran and the answer kept only the second ({'kv': [True, False]})."""
    pool = host_pool(4)
    fill(pool, 0, seed=1)
    backend = attach(backends, tmp_path, pool, interface_v1=True)
    assert backend.batch_set_v1(["a"], indices([0])) == [True]
    twice = [PoolTransfer(name=PoolName.KV, host_indices=indices([1]), keys=["a"]),
             PoolTransfer(name=PoolName.KV, host_indices=indices([2]), keys=["b"])]
    with pytest.raises(ValueError, match="twice"):
        backend.batch_get_v2(twice)
    with pytest.raises(ValueError, match="twice"):
        backend.batch_set_v2(twice)
    assert backend.batch_exists(["b"]) == 0
    with pytest.raises(TypeError):
        backend.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=indices([1]), keys=[7])])
    assert backend.batch_get_v2([twice[0]]) == {"kv": [True]}
