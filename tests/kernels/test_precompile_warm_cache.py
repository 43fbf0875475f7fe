"""A restart with a warm Triton cache starts no compile helper (:mod:`aiokv.kernels.precompile`).

The helper lists each variant it compiled in Triton's cache directory; a later warm-up reads the
listings and starts a helper for the other variants only. The helpers here are real processes that
really compile for sm_90 (Triton's CUDA backend and ``ptxas``, no device); the warm-ups run as on
CUDA (variants kept loaded, a helper first) while their launches stay interpreted. Faults are real:
files of Triton's entries deleted or truncated, listings overwritten, planted, replaced by a FIFO or
a symlink, a restart for another GPU target, and a process whose Triton keys a variant otherwise.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from aiokv.kernels import PageMover, TransferPath
from aiokv.kernels import precompile as precompile_module
from aiokv.kernels import warmup as warmup_module
from aiokv.kernels.launch import LaunchKey, record_launches
from aiokv.kernels.paths import interpreting
from aiokv.kernels.precompile import Precompile, fingerprint, listed_variant
from aiokv.kernels.warmup import WarmUp, variants_of, warm_up
from aiokv.layout import KVBuffer, KVLayout, TPSlice

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU test: movers under the Triton interpreter")

LAYOUT = KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4)


def _target(arch: int = 90) -> object:
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", arch, 32)


def _mover() -> PageMover:
    kv = KVBuffer.wrap(LAYOUT, torch.zeros(LAYOUT.num_layers, 64, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype),
                       TPSlice.of(LAYOUT))
    page_elems = LAYOUT.page_bytes // LAYOUT.itemsize
    pool = torch.zeros((8, page_elems), dtype=LAYOUT.dtype)[:, : LAYOUT.payload_bytes // LAYOUT.itemsize]
    return PageMover(kv, pool.view(8, *LAYOUT.page_shape), TransferPath.DIRECT, 2)


def _two_keys() -> list[LaunchKey]:
    keys = variants_of(_mover())[0].keys
    gather = next(k for k in keys if k[0] == "gather")
    scatter = next(k for k in keys if k[0] == "scatter")
    return [gather, scatter]


class Spawns:
    """The helpers warm-ups start in a test: each one's keys, and every process started."""

    def __init__(self) -> None:
        self.helpers: list[list[LaunchKey]] = []
        self.processes = 0


@pytest.fixture
def spawns(monkeypatch: pytest.MonkeyPatch) -> Spawns:
    seen = Spawns()
    real_popen = subprocess.Popen

    class CountedPopen(real_popen):  # type: ignore[misc,valid-type]
        def __init__(self, *args: object, **kwargs: object) -> None:
            seen.processes += 1
            super().__init__(*args, **kwargs)

    class RecordedPrecompile(Precompile):
        def __init__(self, keys: list[LaunchKey], *args: object, **kwargs: object) -> None:
            seen.helpers.append(list(keys))
            super().__init__(keys, *args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", CountedPopen)
    monkeypatch.setattr(precompile_module, "Precompile", RecordedPrecompile)
    return seen


@pytest.fixture
def as_on_a_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, object]:
    """Warm-ups of CPU movers run as on CUDA (variants kept loaded, a helper compiling first) for the
    target in the returned dict (``"arch"``), into ``tmp_path/triton``. ``restart()``: a new process
    (nothing loaded, the enumeration kept)."""
    cache = tmp_path / "triton"
    state: dict[str, object] = {"arch": 90, "cache": cache}
    monkeypatch.setattr(warmup_module, "_compiles", lambda device: True)
    monkeypatch.setattr(warmup_module, "_compile_target", lambda: (_target(int(state["arch"])), str(cache)))  # type: ignore[call-overload]
    monkeypatch.setattr(warmup_module, "_loaded", {})
    state["restart"] = lambda: monkeypatch.setattr(warmup_module, "_loaded", {})
    return state


def _warm() -> tuple[WarmUp, list[LaunchKey]]:
    with record_launches() as record:
        result = warm_up(_mover())
    assert not result.stopped, result
    return result, list(record.keys)


def _entry_files(cache: Path, listing: dict[str, object], key: LaunchKey) -> tuple[Path, dict[str, object]]:
    path = Path(precompile_module._entry_path(str(cache), listing, key))
    return path, json.loads(path.read_text())


# -- the warm-up ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_restart_with_a_warm_cache_starts_no_helper_and_launches_the_same_variants(
    as_on_a_gpu: dict[str, object], spawns: Spawns
) -> None:
    cold, cold_keys = _warm()
    assert cold.precompile_error is None, cold
    assert cold.precompiled == cold.variants == len(cold_keys) > 0, cold
    assert spawns.helpers == [cold_keys] and spawns.processes == 1
    as_on_a_gpu["restart"]()  # type: ignore[operator]
    began = time.perf_counter()
    warm, warm_keys = _warm()
    took = time.perf_counter() - began
    assert spawns.processes == 1 and len(spawns.helpers) == 1, f"the restart started a helper: {spawns.helpers[1:]}"
    assert warm.precompile_error is None and warm.precompiled == 0 and warm_keys == cold_keys, warm
    assert (cold.cached, warm.cached) == (0, warm.variants) and warm.variants == cold.variants, (cold, warm)
    print(f"cold warm-up {cold.seconds:.2f} s, warm restart {took:.2f} s ({warm.variants} variants)")


def _triton_file(cache: Path, listing: dict[str, object], key: LaunchKey, metadata: bool) -> Path:
    """The metadata (``.json``) or the binary of ``key``'s entry in Triton's cache."""
    entry = _entry_files(cache, listing, key)[1]
    files: list[str] = entry["files"]  # type: ignore[assignment]
    return cache / str(entry["dir"]) / next(f for f in files if f.endswith(".json") == metadata)


@pytest.mark.slow
def test_broken_entries_start_a_helper_for_exactly_those_and_it_repairs_them(
    as_on_a_gpu: dict[str, object], spawns: Spawns
) -> None:
    cold, keys = _warm()
    assert cold.precompile_error is None and len(keys) >= 5, cold
    cache = Path(str(as_on_a_gpu["cache"]))
    listing = fingerprint(_target())

    def restart_repairs(broken: list[LaunchKey], helpers: int) -> None:
        as_on_a_gpu["restart"]()  # type: ignore[operator]
        warm, warm_keys = _warm()
        assert spawns.helpers[helpers:] == [broken], f"helper keys {spawns.helpers[helpers:]}, broken {broken}"
        assert warm.precompile_error is None and warm.precompiled == len(broken), warm
        assert warm.cached == len(keys) - len(broken) and warm_keys == keys, warm
        as_on_a_gpu["restart"]()  # type: ignore[operator]
        again, _ = _warm()  # the helper listed what it compiled again
        assert len(spawns.helpers) == helpers + 1 and again.cached == len(keys), (spawns.helpers, again)

    # Triton's entries broken (the listings whole), one key intact at least.
    _triton_file(cache, listing, keys[0], metadata=False).unlink()  # Triton's entry partial
    _triton_file(cache, listing, keys[1], metadata=False).write_bytes(b"")  # its binary emptied
    meta = _triton_file(cache, listing, keys[2], metadata=True)
    meta.write_bytes(meta.read_bytes()[:20])  # its metadata torn (Triton's launch fails on it)
    meta = _triton_file(cache, listing, keys[3], metadata=True)
    (meta.parent / f"__grp__{meta.name}").write_text('{"child_paths": {"')  # its group file torn
    restart_repairs(keys[:4], 1)
    # Then the listings broken (Triton's entries whole again).
    _entry_files(cache, listing, keys[0])[0].write_bytes(b"\x00not json")  # a listing overwritten
    path = _entry_files(cache, listing, keys[1])[0]
    path.write_bytes(path.read_bytes()[:-9])  # a listing cut short
    restart_repairs(keys[:2], 2)
    # Triton's own lookup, in a process of its own, now finds every entry whole.
    assert _loads(cache, listing, keys, debug=False) == {"listed": True, "hits": [True] * len(keys), "stale": []}


@pytest.mark.slow
def test_a_restart_for_another_target_does_not_take_the_listings(
    as_on_a_gpu: dict[str, object], spawns: Spawns
) -> None:
    cold, keys = _warm()
    assert cold.precompile_error is None, cold
    as_on_a_gpu["restart"]()  # type: ignore[operator]
    as_on_a_gpu["arch"] = 80
    other, _ = _warm()
    assert spawns.helpers == [keys, keys] and other.cached == 0 and other.precompiled == len(keys), other


# -- the listings, one by one ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def listed_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[LaunchKey]]:
    """Two variants a real helper compiled for sm_90 and listed (TRITON_INTERPRET as in every test here)."""
    cache = tmp_path_factory.mktemp("listed") / "triton"
    keys = _two_keys()
    with Precompile(keys, _target(), str(cache), fingerprint(_target())) as child:
        assert [child.wait(i) for i in range(len(keys))] == [True, True], (child.error, child.failures)
    return cache, keys


@pytest.mark.slow
def test_a_listing_names_triton_s_own_entry(listed_cache: tuple[Path, list[LaunchKey]], tmp_path: Path) -> None:
    cache, keys = listed_cache
    listing = fingerprint(_target())
    for key in keys:
        triton_hash = listed_variant(str(cache), listing, key)
        assert triton_hash is not None
        folder = base64.b32encode(bytes.fromhex(triton_hash)).decode().rstrip("=")  # Triton's own naming
        assert _entry_files(cache, listing, key)[1]["dir"] == folder and (cache / folder).is_dir()
    assert listed_variant(str(tmp_path), listing, keys[0]) is None  # a cache the helper did not fill
    assert listed_variant(str(cache), fingerprint(_target(80)), keys[0]) is None  # another target
    assert listed_variant(str(cache), listing, (*keys[0][:2], (("T", 99),))) is None


@pytest.mark.slow
@pytest.mark.parametrize(
    "plant",
    ["other_target", "other_source", "other_key", "outside_dir", "file_elsewhere", "group_names_other_files",
     "fifo", "symlink", "not_a_dict", "deep_listing", "deep_group"],
)
def test_a_planted_or_mismatched_listing_is_ignored(listed_cache: tuple[Path, list[LaunchKey]], plant: str) -> None:
    cache, keys = listed_cache
    listing = fingerprint(_target())
    key, other_key = keys
    path, entry = _entry_files(cache, listing, key)
    saved = path.read_bytes()
    group_path = cache / str(entry["dir"]) / f"__grp__{next(f for f in entry['files'] if f.endswith('.json'))}"  # type: ignore[attr-defined]
    saved_group = group_path.read_bytes()
    try:
        path.unlink()
        if plant == "other_target":
            path.write_text(json.dumps({**entry, "fingerprint": {**listing, "target": ["cuda", 80, 32]}}))
        elif plant == "other_source":
            path.write_text(json.dumps({**entry, "fingerprint": {**listing, "source": "0" * 64}}))
        elif plant == "other_key":
            path.write_text(json.dumps(_entry_files(cache, listing, other_key)[1]))
        elif plant == "outside_dir":
            path.write_text(json.dumps({**entry, "dir": "../" + str(entry["dir"])}))
        elif plant == "file_elsewhere":
            path.write_text(json.dumps({**entry, "files": ["../../x.json"]}))
        elif plant == "group_names_other_files":
            path.write_bytes(saved)
            group = json.loads(saved_group)
            group["child_paths"] = {name: p for name, p in group["child_paths"].items() if name.endswith(".json")}
            group_path.write_text(json.dumps(group))
        elif plant == "fifo":
            os.mkfifo(path)  # opening it for reading would block: it must not
        elif plant == "symlink":
            (path.parent / "real.json").write_bytes(saved)
            path.symlink_to(path.parent / "real.json")
        elif plant == "deep_listing":  # json.loads raised RecursionError out of the warm-up
            path.write_text("[" * 100000)
        elif plant == "deep_group":
            path.write_bytes(saved)
            group_path.write_text('{"child_paths": ' + "[" * 100000)
        else:
            path.write_text(json.dumps([entry]))
        began = time.perf_counter()
        assert listed_variant(str(cache), listing, key) is None
        assert time.perf_counter() - began < 1.0
        assert listed_variant(str(cache), listing, other_key) is not None  # the other listing still counts
    finally:
        path.unlink(missing_ok=True)
        (path.parent / "real.json").unlink(missing_ok=True)
        path.write_bytes(saved)
        group_path.write_bytes(saved_group)
    assert listed_variant(str(cache), listing, key) is not None  # restored: the check above was not moot


# -- a listed variant that this process keys otherwise ---------------------------------------------------

# A fresh process, not interpreted, loading each key through the JIT as the engine's process would
# (Triton's warmup path, the target given, no device), optionally with Triton's debug knob set in
# code (a knob the fingerprint cannot see: Triton then keys each variant otherwise and compiles it).
LOADS = r"""
import json, sys
import triton
from triton.runtime import driver
from triton.backends.compiler import GPUTarget
from aiokv.kernels import _jit
from aiokv.kernels.precompile import _TargetOnly, _freeze, _stand_in, listed_variant, stale_entries
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton._utils import canonicalize_dtype
from triton.backends.compiler import BaseBackend

cache, listing, keys, debug = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4] == "1"
keys = [(k[0], _freeze(k[1]), _freeze(k[2])) for k in keys]
driver.set_active(_TargetOnly(GPUTarget("cuda", 90, 32)))
triton.knobs.runtime.debug = debug
hits = []
triton.knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
listed = {key: listed_variant(cache, listing, key) for key in keys}
dtypes = {canonicalize_dtype(getattr(tl, n)): getattr(tl, n) for n in ("int64", "int32", "int16", "uint8")}
spec = lambda a, v=True: tuple(native_specialize_impl(BaseBackend, a, False, v, True))
for name, specs, constexprs in keys:
    getattr(_jit, name + "_kernel").warmup(*[_stand_in(s, spec, dtypes) for s in specs], grid=(1,),
                                           **dict(constexprs))
stale = stale_entries(listed, 0)
print(json.dumps({"listed": all(listed.values()), "hits": hits, "stale": [keys.index(k) for k in stale]}))
"""


def _loads(cache: Path, listing: dict[str, object], keys: list[LaunchKey], debug: bool) -> dict[str, object]:
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-c", LOADS, str(cache), json.dumps(listing), json.dumps(keys),
                          "1" if debug else "0"], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    out: dict[str, object] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("debug", [False, True], ids=["same_keys", "debug_set_in_code"])
def test_a_listed_variant_this_process_compiled_itself_is_found(
    listed_cache: tuple[Path, list[LaunchKey]], debug: bool
) -> None:
    cache, keys = listed_cache
    out = _loads(cache, fingerprint(_target()), keys, debug)
    assert out["listed"], out
    if debug:  # Triton keyed both otherwise and compiled them: both listings were stale here
        assert out["hits"] == [False, False] and out["stale"] == [0, 1], out
    else:
        assert out["hits"] == [True, True] and out["stale"] == [], out
