"""aiokv's disk tier as SGLang 0.5.23's HiCache storage backend, created by SGLang's real factory.

The backend comes from SGLang's own ``StorageBackendFactory.create_backend("dynamic", ...)`` with a
real ``HiCacheStorageConfig`` and SGLang's real host pools (``MHATokenToKVPoolHost``,
``MambaPoolHost``, ``MLATokenToKVPoolHost``) on the CPU (no pinning; sglang_helpers.py says how
they import here); the tests call it as SGLang's cache controller does (register the host pool,
batch_exists for the prefix, batch_get_v1/batch_set_v1, or get/set with the pool's own data pages).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make test installs requirements-engines.txt)")

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang_helpers import (
    PAGE,
    attach,
    attach_hybrid,
    fill,
    fill_state,
    host_pool,
    indices,
    mamba_pool,
    mla_fill,
    mla_pool,
    page,
    state,
    storage_config,
)

from aiokv.adapters.sglang import AiokvHiCacheStorage

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))  # the storage suite's file-system helpers
from fs_helpers import loop_ext4, remount


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_v1_round_trip_prefix_and_restart(tmp_path: Path, backends: list[Any], layout: str) -> None:
    page_first = layout == "page_first"
    pool = host_pool(8, layout)
    for p in range(4):
        fill(pool, p, seed=p)
    expected = [page(pool, p) for p in range(4)]
    keys = [f"hash-{i}" for i in range(4)]
    backend = attach(backends, tmp_path, pool, interface_v1=True, page_first=page_first)
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys[:3], indices([0, 1, 2])) == [True] * 3
    # Prefix semantics: the 4th page is missing, and a gap stops the count.
    assert backend.batch_exists(keys) == 3
    assert backend.batch_exists(["hash-0", "other", "hash-2"]) == 1
    assert backend.exists("hash-2") and not backend.exists("hash-3")
    # Read into other host slots (pages 5, 6, 7): bit-exact, the rest of the pool untouched.
    assert backend.batch_get_v1(keys[:3], indices([5, 6, 7])) == [True] * 3
    for src, dst in zip(range(3), (5, 6, 7), strict=True):
        assert torch.equal(page(pool, dst), expected[src])
    assert torch.equal(page(pool, 4), torch.zeros_like(expected[0]))
    backend.close()
    # Restart over the same directory: every page is found and verified again.
    fresh = host_pool(8, layout)
    again = attach(backends, tmp_path, fresh, interface_v1=True, page_first=page_first)
    assert again.batch_exists(keys) == 3
    assert again.batch_get_v1(keys, indices([0, 1, 2, 3])) == [True, True, True, False]
    for p in range(3):
        assert torch.equal(page(fresh, p), expected[p])
    assert torch.equal(page(fresh, 3), torch.zeros_like(expected[0]))


def test_plain_interface_round_trip(tmp_path: Path, backends: list[Any]) -> None:
    """As SGLang's _generic_page_set/_generic_page_get: the pool's flat data pages out, its dummy
    flat pages in, then set_from_flat_data_page."""
    pool = host_pool(4)
    fill(pool, 0, seed=10)
    fill(pool, 1, seed=11)
    backend = attach(backends, tmp_path, pool, interface_v1=False)
    pages = [pool.get_data_page(i * PAGE) for i in range(2)]
    assert backend.batch_set(["p0", "p1"], pages)
    assert backend.batch_exists(["p0", "p1", "p2"]) == 2
    target = pool.get_dummy_flat_data_page()
    assert backend.get("p1", target) is target
    assert torch.equal(target, pages[1])
    assert backend.get("p2", pool.get_dummy_flat_data_page()) is None
    got = backend.batch_get(["p0", "p2"], [pool.get_dummy_flat_data_page() for _ in range(2)])
    assert got[1] is None and got[0] is not None and torch.equal(got[0], pages[0])
    pool.set_from_flat_data_page(3 * PAGE, got[0])
    assert torch.equal(page(pool, 3), page(pool, 0))


def test_corrupt_page_is_a_miss(tmp_path: Path, backends: list[Any]) -> None:
    pool = host_pool(4)
    fill(pool, 0, seed=3)
    backend = attach(backends, tmp_path, pool, interface_v1=True)
    assert backend.batch_set_v1(["c0"], indices([0])) == [True]
    backend.close()
    (path,) = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0x01
    path.write_bytes(bytes(raw))
    fresh = host_pool(4)
    again = attach(backends, tmp_path, fresh, interface_v1=True)
    assert again.batch_get_v1(["c0"], indices([1])) == [False]
    assert torch.equal(page(fresh, 1), torch.zeros_like(page(fresh, 1)))  # never wrong bytes
    assert again.statistics()["corrupt"] == 1
    assert again.batch_exists(["c0"]) == 0


def test_ranks_and_models_do_not_share_pages(tmp_path: Path, backends: list[Any]) -> None:
    pool = host_pool(2)
    fill(pool, 0, seed=4)
    rank0 = attach(backends, tmp_path, pool, interface_v1=True, tp_rank=0)
    assert rank0.batch_set_v1(["k"], indices([0])) == [True]
    rank1 = attach(backends, tmp_path, host_pool(2), interface_v1=True, tp_rank=1)
    other = attach(backends, tmp_path, host_pool(2), interface_v1=True, model="test/other")
    assert rank0.batch_exists(["k"]) == 1
    assert rank1.batch_exists(["k"]) == 0  # rank 1 holds other heads
    assert other.batch_exists(["k"]) == 0


# -- v2: a hybrid model's extra pools ------------------------------------------------------------


def trailing(keys: int = 1) -> PoolTransfer:
    return PoolTransfer(name=PoolName.MAMBA, keys=[f"window-{i}" for i in range(keys)],
                        hit_policy=PoolHitPolicy.TRAILING_PAGES)


@pytest.mark.parametrize("side_state", [False, True], ids=["in-place", "flat-pages"])
def test_v2_hybrid_round_trip_hit_policies_and_restart(tmp_path: Path, backends: list[Any], side_state: bool) -> None:
    kv, mamba = host_pool(8), mamba_pool(8, side_state)
    for p in range(4):
        fill(kv, p, seed=p)
        fill_state(mamba, p, seed=100 + p)
    kv_pages = [page(kv, p) for p in range(4)]
    states = [state(mamba, p) for p in range(4)]
    keys = [f"h{i}" for i in range(4)]
    backend = attach_hybrid(backends, tmp_path, kv, {PoolName.MAMBA: mamba})
    assert backend.batch_set_v1(keys, indices([0, 1, 2, 3])) == [True] * 4  # KV: the base controller's v1
    # Mamba keeps the state at some page boundaries only (here after pages 2 and 4).
    stored = backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([1, 3]),
                                                keys=["h1", "h3"])])
    assert stored == {"mamba": [True, True]}

    found = backend.batch_exists_v2(keys, [trailing()])
    assert (found.kv_hit_pages, found.restorable_prefix_pages) == (4, [2, 4])
    assert found.extra_pool_hit_pages == {"kv": 4, "mamba": 4}
    found = backend.batch_exists_v2(keys, [trailing(2)])  # windows of 2 pages: (h0, h1) or (h2, h3)
    assert (found.kv_hit_pages, found.restorable_prefix_pages) == (0, [])
    found = backend.batch_exists_v2(keys, [PoolTransfer(name=PoolName.MAMBA, keys=keys)])  # ALL_PAGES
    assert (found.kv_hit_pages, found.restorable_prefix_pages, found.extra_pool_hit_pages) == (0, [], {"kv": 4})
    found = backend.batch_exists_v2(["h0", "gap", "h2"], [trailing()])  # the KV prefix bounds every pool
    assert (found.kv_hit_pages, found.restorable_prefix_pages) == (0, [])
    assert backend.batch_exists_v2(["h0", "h1"], [trailing()]).kv_hit_pages == 2

    got = backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([5, 6]), keys=["h3", "h0"]),
                                PoolTransfer(name=PoolName.KV, host_indices=indices([6]), keys=["h2"])])
    assert got == {"mamba": [True, False], "kv": [True]}
    assert torch.equal(state(mamba, 5), states[3])
    assert torch.equal(state(mamba, 6), torch.zeros_like(states[0]))  # a miss leaves the slot alone
    assert torch.equal(page(kv, 6), kv_pages[2])

    kv_stats, mamba_stats = backend.statistics(), backend.statistics("mamba")
    assert mamba_stats["pages"] == 2 and kv_stats["pages"] == 4
    assert 0 < mamba_stats["capacity_bytes"] < kv_stats["capacity_bytes"]
    assert kv_stats["capacity_bytes"] + mamba_stats["capacity_bytes"] <= 64 << 20  # disk_bytes, shared
    backend.close()

    kv2, mamba2 = host_pool(8), mamba_pool(8, side_state)
    again = attach_hybrid(backends, tmp_path, kv2, {PoolName.MAMBA: mamba2})
    assert again.batch_exists_v2(keys, [trailing()]).restorable_prefix_pages == [2, 4]
    got = again.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0, 1]), keys=["h1", "h3"])])
    assert got == {"mamba": [True, True]}
    assert torch.equal(state(mamba2, 0), states[1]) and torch.equal(state(mamba2, 1), states[3])
    assert again.batch_get_v1(keys, indices([0, 1, 2, 3])) == [True] * 4
    assert all(torch.equal(page(kv2, p), kv_pages[p]) for p in range(4))


def test_v2_refuses_what_it_cannot_serve(tmp_path: Path, backends: list[Any]) -> None:
    kv, mamba = host_pool(4), mamba_pool(4)
    fill_state(mamba, 0, seed=1)
    backend = attach_hybrid(backends, tmp_path, kv, {PoolName.MAMBA: mamba})
    # A pool never registered (SGLang registers each before naming it): the whole call is refused
    # by the pool's name (it was all False, logged; the other transfer ran).
    with pytest.raises(ValueError, match=r"pool 'swa' is not registered with this backend; registered: "
                                         r"\['kv', 'mamba'\]"):
        backend.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=torch.tensor([0]), keys=["a"]),
                              PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0]), keys=["a"])])
    assert backend.statistics("mamba")["writes"] == 0
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0]), keys=["a"])]) \
        == {"mamba": [True]}
    # An index count that is not one per page: the whole call is refused naming them (it was all False, logged).
    with pytest.raises(ValueError, match=r"transfer\.host_indices \(pool 'mamba'\): 2 indices for 1 pages"):
        backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0, 1]), keys=["b"])])
    assert backend.statistics("mamba")["writes"] == 1
    block_groups = PoolTransfer(name=PoolName.MAMBA, keys=["a"], hit_policy=PoolHitPolicy.BLOCK_GROUPS)
    with pytest.raises(ValueError, match="Unsupported pool hit policy"):
        backend.batch_exists_v2(["a"], [block_groups])
    # A lookup naming a pool never registered is refused too (it was taken as holding nothing).
    assert backend.batch_set_v1(["a"], indices([0])) == [True]
    with pytest.raises(ValueError, match="pool 'swa' is not registered"):
        backend.batch_exists_v2(["a"], [PoolTransfer(name=PoolName.SWA, keys=["a"])])
    found = backend.batch_exists_v2(["a"], [PoolTransfer(name=PoolName.MAMBA, keys=["a"])])
    assert (found.kv_hit_pages, found.extra_pool_hit_pages) == (1, {"kv": 1, "mamba": 1})


def test_a_pool_registered_at_run_time_gets_files_of_its_own(tmp_path: Path, backends: list[Any]) -> None:
    kv, mamba = host_pool(4), mamba_pool(4)
    fill_state(mamba, 2, seed=9)
    backend = attach_hybrid(backends, tmp_path, kv, {})
    with pytest.raises(ValueError, match="pool 'mamba' is not registered"):  # not yet (it was all False)
        backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([2]), keys=["k"])])
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)  # SGLang's register_host_pool_entry
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([2]), keys=["k"])]) \
        == {"mamba": [True]}
    assert backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([3]), keys=["k"])]) \
        == {"mamba": [True]}
    assert torch.equal(state(mamba, 3), state(mamba, 2))
    assert backend.statistics("mamba")["pages"] == 1


# -- clear() ---------------------------------------------------------------------------------------


def page_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def test_clear_removes_this_identity_only_and_keeps_serving(tmp_path: Path, backends: list[Any]) -> None:
    kv, mamba = host_pool(4), mamba_pool(4)
    fill(kv, 0, seed=1)
    fill_state(mamba, 0, seed=2)
    backend = attach_hybrid(backends, tmp_path, kv, {PoolName.MAMBA: mamba})
    assert backend.batch_set_v1(["a"], indices([0])) == [True]
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0]), keys=["a"])]) \
        == {"mamba": [True]}
    other = attach(backends, tmp_path, host_pool(4), interface_v1=True, model="test/other")
    assert other.batch_set_v1(["a"], indices([0])) == [True]
    assert len(page_files(tmp_path)) == 3

    assert backend.clear() is True
    assert backend.batch_exists(["a"]) == 0
    assert backend.batch_exists_v2(["a"], [trailing()]).kv_hit_pages == 0
    assert backend.batch_get_v1(["a"], indices([1])) == [False]
    assert torch.equal(page(kv, 1), torch.zeros_like(page(kv, 1)))
    assert other.batch_exists(["a"]) == 1  # another model's files stay
    assert len(page_files(tmp_path)) == 1
    # Cleared, not closed: new pages are stored and read back, and a restart does not bring old ones back.
    fill(kv, 2, seed=3)
    assert backend.batch_set_v1(["b"], indices([2])) == [True]
    assert backend.batch_get_v1(["b"], indices([3])) == [True]
    assert torch.equal(page(kv, 3), page(kv, 2))
    backend.close()
    again = attach_hybrid(backends, tmp_path, host_pool(4), {PoolName.MAMBA: mamba_pool(4)})
    assert again.batch_exists(["a", "b"]) == 0 and again.batch_exists(["b"]) == 1
    assert again.statistics("mamba")["pages"] == 0


def test_clear_before_any_pool_is_registered_says_so(tmp_path: Path, backends: list[Any]) -> None:
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(tmp_path, True), None)
    backends.append(backend)
    assert backend.clear() is False
    assert backend.batch_exists(["a"]) == 0


@pytest.mark.root
def test_clear_on_a_read_only_file_system_refuses_and_keeps_serving(tmp_path: Path, backends: list[Any]) -> None:
    with loop_ext4(tmp_path, 320) as mount:  # room above the disk tier's 256 MiB free-space floor
        kv = host_pool(4)
        fill(kv, 0, seed=5)
        expected = page(kv, 0)
        backend = attach(backends, mount, kv, interface_v1=True)
        assert backend.batch_set_v1(["a"], indices([0])) == [True]
        backend.close()
        remount(mount, "ro")
        try:
            fresh = host_pool(4)
            again = attach(backends, mount, fresh, interface_v1=True)
            assert again.clear() is False  # a read-only tier serves and refuses to delete
            assert again.batch_get_v1(["a"], indices([1])) == [True]
            assert torch.equal(page(fresh, 1), expected)
            again.close()
        finally:
            remount(mount, "rw")


def test_clear_while_another_thread_reads_never_gives_wrong_bytes(tmp_path: Path, backends: list[Any]) -> None:
    """SGLang's prefetch thread reads while its scheduler asks for clear(): every page a read
    reports is bit-exact, and once clear() returned every read misses."""
    kv = host_pool(16)
    for p in range(8):
        fill(kv, p, seed=40 + p)
    expected = [page(kv, p) for p in range(8)]
    keys = [f"c{p}" for p in range(8)]
    backend = attach(backends, tmp_path, kv, interface_v1=True)
    assert backend.batch_set_v1(keys, indices(list(range(8)))) == [True] * 8
    cleared = threading.Event()
    seen: list[tuple[bool, list[bool]]] = []

    def reader() -> None:
        for _ in range(100_000):  # bounded; ends at the first read that starts after clear() returned
            after = cleared.is_set()
            got = backend.batch_get_v1(keys, indices(list(range(8, 16))))
            for p, hit in enumerate(got):
                if hit:
                    assert torch.equal(page(kv, 8 + p), expected[p])
            seen.append((after, got))
            if after:
                return

    thread = threading.Thread(target=reader)
    thread.start()
    assert backend.clear() is True
    cleared.set()
    thread.join(60)
    assert not thread.is_alive()
    assert seen and seen[-1] == (True, [False] * 8)


# -- zero copy -------------------------------------------------------------------------------------


def counters(backend: AiokvHiCacheStorage, pool: str = "kv") -> tuple[int, int]:
    """(pages moved in place, pages moved through a staging page) of one pool's files."""
    store = backend._pools[pool].store
    assert store is not None
    return store.thread.call(lambda: (store.direct_pages, store.staged_pages)).result()


@pytest.mark.parametrize("zero_copy", [True, False], ids=["in-place", "staged"])
def test_plain_pages_move_in_place_and_split_pages_through_staging(
        tmp_path: Path, backends: list[Any], zero_copy: bool) -> None:
    """A plain page is one tensor of 16 KiB: it moves straight between SGLang's tensor and its file.
    A v1 page of the page_first host pool is two buffers (K and V), and a Mamba state page is 608
    bytes (not a 4096-multiple): those go through a staging page. Bit-exact every way."""
    pool = host_pool(4)
    fill(pool, 0, seed=21)
    config = storage_config(tmp_path, interface_v1=False)
    config.extra_config["zero_copy"] = zero_copy
    plain = StorageBackendFactory.create_backend("dynamic", config, pool)
    backends.append(plain)
    plain.register_mem_pool_host(pool)
    assert plain.set("p", pool.get_data_page(0))
    target = pool.get_dummy_flat_data_page()
    assert plain.get("p", target) is target
    assert torch.equal(target, pool.get_data_page(0))
    assert counters(plain) == ((2, 0) if zero_copy else (0, 2))

    kv, mamba = host_pool(4), mamba_pool(4)
    fill(kv, 1, seed=22)
    fill_state(mamba, 1, seed=23)
    v1 = attach_hybrid(backends, tmp_path / "v1", kv, {PoolName.MAMBA: mamba})
    assert v1.batch_set_v1(["k"], indices([1])) == [True]
    assert v1.batch_get_v1(["k"], indices([2])) == [True]
    assert torch.equal(page(kv, 2), page(kv, 1))
    assert v1.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([1]), keys=["k"])]) \
        == {"mamba": [True]}
    assert v1.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([2]), keys=["k"])]) \
        == {"mamba": [True]}
    assert torch.equal(state(mamba, 2), state(mamba, 1))
    assert counters(v1) == (0, 2) and counters(v1, "mamba") == (0, 2)


def test_mla_pages_move_in_place_between_the_host_pool_and_files(tmp_path: Path, backends: list[Any]) -> None:
    """An MLA page is one buffer of the host pool: v1 writes it from, and reads it into, SGLang's
    own host memory (no staging copy), bit-exact; a corrupt file read in place fails, and no
    host page outside that read's own slots changes."""
    pool = mla_pool(8)
    for p in range(3):
        mla_fill(pool, p, seed=60 + p)
    expected = [page(pool, p) for p in range(3)]
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(tmp_path, True, mla=True), pool)
    backends.append(backend)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    assert backend.batch_set_v1(["m0", "m1", "m2"], indices([0, 1, 2])) == [True] * 3
    assert backend.batch_get_v1(["m0", "m1"], indices([4, 5])) == [True, True]
    assert torch.equal(page(pool, 4), expected[0]) and torch.equal(page(pool, 5), expected[1])
    assert counters(backend) == (5, 0)
    (victim,) = [p for p in tmp_path.rglob("*") if p.name == backend._pools["kv"].store.key(b"m2").hex()]
    raw = bytearray(victim.read_bytes())
    raw[4096 + 100] ^= 0x20
    victim.write_bytes(bytes(raw))
    before = [page(pool, p) for p in range(8)]
    assert backend.batch_get_v1(["m2"], indices([6])) == [False]  # SGLang frees slot 6 unused
    after = [page(pool, p) for p in range(8)]
    assert [p for p in range(8) if not torch.equal(before[p], after[p])] in ([], [6])
    assert backend.statistics()["corrupt"] == 1 and backend.batch_exists(["m2"]) == 0


def test_a_dead_loop_thread_makes_every_call_miss_never_hang(tmp_path: Path, backends: list[Any]) -> None:
    """Regression: with the backend's loop thread gone, SGLang's prefetch and backup threads got
    RuntimeError from every call, or waited for ever in one the loop died during. Now every call
    answers a miss or a failure at once."""
    kv = host_pool(4)
    fill(kv, 0, seed=70)
    backend = attach_hybrid(backends, tmp_path, kv, {PoolName.MAMBA: mamba_pool(4)})
    assert backend.batch_set_v1(["a"], indices([0])) == [True]

    def die() -> None:
        raise SystemExit("injected: the loop thread ends")

    thread = backend._loop()
    thread.post_call(die)
    thread.wake()
    thread.close()  # joins it
    assert thread.dead
    assert backend.batch_exists(["a"]) == 0
    assert backend.batch_get_v1(["a"], indices([1])) == [False]
    assert backend.batch_set_v1(["b"], indices([0])) == [False]
    assert backend.batch_exists_v2(["a"], [trailing()]).kv_hit_pages == 0
    assert backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0]), keys=["a"])]) \
        == {"mamba": [False]}
    assert backend.clear() is False
    backend.close()
