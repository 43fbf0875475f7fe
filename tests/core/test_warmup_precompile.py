"""The warm-up's helper process (:mod:`aiokv.kernels.precompile`) and the per-process enumeration table.

The helper compiles for a GPU target without touching a device, so its compile runs for real here
(Triton's CUDA backend and its ``ptxas``, target sm_90): a second, independent process then finds
each variant in Triton's disk cache, as the engine's process does when the warm-up launches it.
Its faults are real processes: an interpreter that cannot start, one that crashes, stalls or writes
garbage, a key it cannot compile, a stop while it works.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from aiokv.kernels import PageMover, TransferPath
from aiokv.kernels import precompile as precompile_module
from aiokv.kernels import warmup as warmup_module
from aiokv.kernels.launch import LaunchKey, record_launches
from aiokv.kernels.paths import interpreting
from aiokv.kernels.precompile import Precompile
from aiokv.kernels.warmup import _Enumeration, _roles, variants_of, warm_up
from aiokv.layout import KVBuffer, KVLayout, TPSlice

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU test: movers under the Triton interpreter")

LAYOUT = KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4)


def _mover(staging: int = 2, path: TransferPath = TransferPath.STAGING) -> PageMover:
    kv = KVBuffer.wrap(LAYOUT, torch.zeros(LAYOUT.num_layers, 64, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype),
                       TPSlice.of(LAYOUT))
    page_elems = LAYOUT.page_bytes // LAYOUT.itemsize
    pool = torch.zeros((8, page_elems), dtype=LAYOUT.dtype)[:, : LAYOUT.payload_bytes // LAYOUT.itemsize]
    return PageMover(kv, pool.view(8, *LAYOUT.page_shape), path, staging)


def _target() -> object:
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


# A fresh process, not interpreted, loading each key through the JIT as the engine's process would
# (Triton's own warmup path, the target given, no device): prints whether each was a cache hit.
VERIFY = r"""
import json, sys
import triton
from triton.runtime import driver
from triton.backends.compiler import GPUTarget
from aiokv.kernels import _jit
from aiokv.kernels.precompile import _TargetOnly, _freeze, _stand_in
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton._utils import canonicalize_dtype
from triton.backends.compiler import BaseBackend

driver.set_active(_TargetOnly(GPUTarget("cuda", 90, 32)))
hits = []
triton.knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
dtypes = {canonicalize_dtype(getattr(tl, n)): getattr(tl, n) for n in ("int64", "int32", "int16", "uint8")}
spec = lambda a, v=True: tuple(native_specialize_impl(BaseBackend, a, False, v, True))
for name, specs, constexprs in json.loads(sys.argv[1]):
    getattr(_jit, name + "_kernel").warmup(*[_stand_in(_freeze(s), spec, dtypes) for s in specs], grid=(1,),
                                           **dict(constexprs))
print(json.dumps(hits))
"""


def _fresh_env(cache: Path) -> dict[str, str]:
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    env.pop("TRITON_INTERPRET", None)
    return env


def _cached_in_another_process(keys: list[LaunchKey], cache: Path) -> list[bool]:
    run = subprocess.run([sys.executable, "-c", VERIFY, json.dumps(keys)], capture_output=True, text=True,
                         timeout=240, env=_fresh_env(cache))
    assert run.returncode == 0, run.stderr[-3000:]
    hits: list[bool] = json.loads(run.stdout.strip().splitlines()[-1])
    return hits


@pytest.mark.slow
def test_the_helper_compiles_each_variant_into_the_cache_the_engine_process_reads(tmp_path: Path) -> None:
    variants, _ = variants_of(_mover())
    gather = next(k for k in variants.keys if k[0] == "gather")
    scatter = next(k for k in variants.keys if k[0] == "scatter" and ("constexpr", 1) in k[1])
    keys = [gather, scatter]
    cache = tmp_path / "triton"
    with Precompile(keys, _target(), str(cache)) as child:
        assert [child.wait(i) for i in range(len(keys))] == [True, True], (child.error, child.failures)
        assert (child.ok, child.reported, child.error, child.failures) == (2, 2, None, {})
    assert any(cache.iterdir()), "nothing was written to the cache directory it was given"
    assert _cached_in_another_process(keys, cache) == [True, True]
    # The control: a cache the helper did not fill compiles (else the check above is moot).
    assert _cached_in_another_process(keys[:1], tmp_path / "empty") == [False]


def test_a_key_the_helper_cannot_compile_is_reported_and_the_rest_goes_on(tmp_path: Path) -> None:
    bad: LaunchKey = ("gather", (("*nonsense", "D"),), ())
    unknown: LaunchKey = ("no_such", (), ())
    with Precompile([bad, unknown], _target(), str(tmp_path)) as child:
        assert child.wait(0) is False and child.wait(1) is False
        assert child.error is None and child.ok == 0 and child.reported == 2
        assert "no stand-in argument" in child.failures[0] and "no_such_kernel" in child.failures[1]


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("cat >/dev/null; echo boom >&2; exit 3", "exited with 3 after 0 of 1 keys; its stderr ends: boom"),
        ("cat >/dev/null; echo hello", "wrote b'hello'"),
        ("cat >/dev/null; echo 'ok 1'", "wrote b'ok 1'"),  # out of order
    ],
    ids=["crash", "garbage", "order"],
)
def test_a_helper_that_fails_leaves_an_error_and_no_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, why: str
) -> None:
    monkeypatch.setattr(sys, "executable", _script(tmp_path, body))
    child = Precompile([("gather", (), ())], _target(), str(tmp_path))
    assert child._child is not None
    pid = child._child.pid
    assert child.wait(0) is False
    assert child.error is not None and why in child.error, child.error
    assert _gone(pid)
    child.close()


def test_a_helper_that_stalls_is_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", _script(tmp_path, "exec sleep 60"))
    monkeypatch.setattr(precompile_module, "STALL_S", 0.3)
    child = Precompile([("gather", (), ())], _target(), str(tmp_path))
    assert child._child is not None
    pid = child._child.pid
    assert child.wait(0) is False
    assert child.error is not None and "reported nothing for 0 s" in child.error
    assert _gone(pid)


def test_stop_kills_a_working_helper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", _script(tmp_path, "exec sleep 60"))
    stop = threading.Event()
    child = Precompile([("gather", (), ())], _target(), str(tmp_path))
    assert child._child is not None
    pid = child._child.pid
    threading.Timer(0.2, stop.set).start()
    assert child.wait(0, stop) is False
    assert child.error == "stopped" and _gone(pid)


def test_a_helper_that_cannot_start_leaves_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "missing"))
    child = Precompile([("gather", (), ())], _target(), str(tmp_path))
    assert child.wait(0) is False
    assert child.error is not None and child.error.startswith("the compile process did not start")
    monkeypatch.setattr(sys, "executable", "")
    assert Precompile([], _target(), str(tmp_path)).error is not None


# -- the warm-up with its helper ---------------------------------------------------------------------


@pytest.fixture
def as_on_a_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Warm-ups of CPU movers run as on CUDA: variants stay loaded, and a helper process compiles
    them first, for sm_90, into the returned directory (the launches here stay interpreted)."""
    cache = tmp_path / "triton"
    monkeypatch.setattr(warmup_module, "_compiles", lambda device: True)
    monkeypatch.setattr(warmup_module, "_compile_target", lambda: (_target(), str(cache)))
    monkeypatch.setattr(warmup_module, "_loaded", {})
    return cache


@pytest.mark.slow
def test_the_warm_up_launches_each_variant_once_its_helper_compiled_it(as_on_a_gpu: Path) -> None:
    with record_launches() as record:
        result = warm_up(_mover(path=TransferPath.DIRECT))
    assert result.precompile_error is None and not result.stopped, result
    assert result.precompiled == result.variants == len(record.keys) > 0
    assert any(as_on_a_gpu.iterdir())
    again = warm_up(_mover(path=TransferPath.DIRECT))  # loaded in this process: nothing to do
    assert (again.variants, again.skipped, again.precompiled) == (0, result.variants, 0)


def test_a_crashing_helper_leaves_the_compiles_to_this_process(
    as_on_a_gpu: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sys, "executable", _script(tmp_path, "cat >/dev/null; echo boom >&2; exit 3"))
    ready: list[int] = []
    with record_launches() as record:
        result = warm_up(_mover(path=TransferPath.DIRECT), on_ready=lambda: ready.append(len(record.keys)))
    assert result.precompile_error is not None and "exited with 3" in result.precompile_error
    assert not result.stopped and result.precompiled == 0
    assert result.variants == len(record.keys) == len(variants_of(_mover(path=TransferPath.DIRECT))[0].keys)
    assert ready == [result.ready_variants]
    assert "compiled in this process" in caplog.text


def test_a_helper_that_cannot_start_leaves_the_compiles_to_this_process(
    as_on_a_gpu: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_target() -> tuple[object, str]:
        raise RuntimeError("injected: this Triton has no target API")

    monkeypatch.setattr(warmup_module, "_compile_target", no_target)
    result = warm_up(_mover(path=TransferPath.DIRECT))
    assert result.precompile_error == "the helper process was not started"
    assert not result.stopped and result.variants > 0


def test_stop_while_the_helper_works_ends_the_warm_up_and_the_helper(
    as_on_a_gpu: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid_file = tmp_path / "pid"
    monkeypatch.setattr(sys, "executable", _script(tmp_path, f"echo $$ > {pid_file}; exec sleep 60"))
    stop = threading.Event()

    def stop_once_it_runs() -> None:  # the helper wrote its pid: it runs (a bounded wait for another process)
        for _ in range(3000):
            if pid_file.exists() and pid_file.read_text().strip():
                break
            time.sleep(0.01)
        stop.set()

    threading.Thread(target=stop_once_it_runs).start()
    with record_launches() as record:
        result = warm_up(_mover(path=TransferPath.DIRECT), stop)
    assert result.stopped and result.variants == len(record.keys) == 0
    assert _gone(int(pid_file.read_text()))
    assert warmup_module._loaded == {}  # a stopped warm-up remembers nothing


# -- the per-process enumeration table ---------------------------------------------------------------


def test_an_equivalent_mover_reuses_the_enumeration_and_it_is_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warmup_module, "_memo", type(warmup_module._memo)())
    first, known = variants_of(_mover())
    assert not known and first.keys
    second_mover = _mover()
    again, known = variants_of(second_mover)
    assert known and again is first
    assert _Enumeration(second_mover, _roles(second_mover)).run() == first  # what it would have found
    other, known = variants_of(_mover(staging=3))  # another staging size: other call shapes
    assert not known and other != first
    direct, known = variants_of(_mover(path=TransferPath.DIRECT))
    assert not known and direct.keys != first.keys


def test_the_enumeration_table_is_bounded_and_thread_safe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warmup_module, "_memo", type(warmup_module._memo)())
    monkeypatch.setattr(warmup_module, "MEMO_ENTRIES", 2)
    movers = [_mover() for _ in range(4)]
    results: list[object] = []
    barrier = threading.Barrier(len(movers))

    def enumerate_one(mover: PageMover) -> None:
        barrier.wait(10)
        results.append(variants_of(mover)[0].keys)

    threads = [threading.Thread(target=enumerate_one, args=(m,)) for m in movers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 4 and all(r == results[0] for r in results)
    assert len(warmup_module._memo) == 1
    for staging in (1, 3, 4):
        variants_of(_mover(staging=staging))
    assert len(warmup_module._memo) == 2  # the oldest went
    assert not variants_of(movers[0])[1]  # the first signature was evicted


# -- the loop's stalls while variants compile ---------------------------------------------------------

# A fresh process, not interpreted: an event loop with a 1 ms sleeper while a thread (named as the
# warm-up's) either compiles the keys itself or has the helper compile them and loads each as the
# warm-up does (the JIT's cache hit). Each sleep's delay discounts the loop thread's own run-queue
# wait (/proc/thread-self/schedstat): CPU taken by other processes is not a GIL stall.
PROBE = r"""
import asyncio, json, os, sys, threading, time
import triton, triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton._utils import canonicalize_dtype
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.runtime import driver
from aiokv.kernels import _jit
from aiokv.kernels.precompile import Precompile, _TargetOnly, _freeze, _stand_in

target = GPUTarget("cuda", 90, 32)
driver.set_active(_TargetOnly(target))
dtypes = {canonicalize_dtype(getattr(tl, n)): getattr(tl, n) for n in ("int64", "int32", "int16", "uint8")}
spec = lambda a, v=True: tuple(native_specialize_impl(BaseBackend, a, False, v, True))
keys = [(k[0], _freeze(k[1]), _freeze(k[2])) for k in json.loads(sys.argv[1])]

def load(key):  # the launch's compile step: a compile, or a cache hit
    name, specs, constexprs = key
    getattr(_jit, name + "_kernel").warmup(*[_stand_in(s, spec, dtypes) for s in specs], grid=(1,), **dict(constexprs))

def in_thread(cache):
    for key in keys:
        load(key)

def with_helper(cache):
    with Precompile(keys, target, cache) as child:
        for i, key in enumerate(keys):
            child.wait(i)
            load(key)
            time.sleep(0.0005)  # the warm-up's pause between launches
        assert child.error is None and not child.failures, (child.error, child.failures)

async def measure(mode, work):
    cache = os.path.join(sys.argv[2], mode)
    triton.knobs.cache.dir = cache
    for kernel in (_jit.gather_kernel, _jit.scatter_kernel):
        kernel.device_caches.clear()
    fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    waited = lambda: int(os.pread(fd, 100, 0).split()[1]) / 1e9
    done, delays = threading.Event(), []
    thread = threading.Thread(target=lambda: (work(cache), done.set()), name="aiokv-warmup")
    began = time.perf_counter()
    thread.start()
    while not done.is_set():
        w, t = waited(), time.perf_counter()
        await asyncio.sleep(0.001)
        delays.append((time.perf_counter() - t - 0.001 - (waited() - w)) * 1e3)
    thread.join()
    delays.sort()
    return {"s": round(time.perf_counter() - began, 2), "max_ms": round(delays[-1], 2),
            "p99_ms": round(delays[int(0.99 * (len(delays) - 1))], 2), "over_5ms": sum(d > 5 for d in delays),
            "samples": len(delays)}

async def main():
    print(json.dumps({"thread": await measure("thread", in_thread), "helper": await measure("helper", with_helper)}))

asyncio.run(main())
"""


@pytest.mark.timing
@pytest.mark.slow
def test_compiling_in_the_helper_keeps_the_loop_s_stalls_short(tmp_path: Path) -> None:
    variants, _ = variants_of(_mover())
    keys = list(variants.keys[:8])
    run = subprocess.run([sys.executable, "-c", PROBE, json.dumps(keys), str(tmp_path)], capture_output=True,
                         text=True, timeout=600, env=_fresh_env(tmp_path / "unused"))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print(json.dumps(result))
    thread, helper = result["thread"], result["helper"]
    assert thread["over_5ms"] > 0, f"compiling on a thread stalled nothing: the comparison is moot ({result})"
    assert helper["over_5ms"] * 2 <= thread["over_5ms"] and helper["p99_ms"] < thread["p99_ms"], result


@pytest.mark.asyncio
async def test_a_cache_counts_a_failed_helper_once_and_its_copies_go_on(
    as_on_a_gpu: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVCache counts the helper's failure as a fault (precompile_failed): before, it was only
    logged, so an engine's metrics never showed that its loop could stall on in-process compiles."""
    from aiokv import CacheConfig, KVCache

    monkeypatch.setattr(sys, "executable", _script(tmp_path, "cat >/dev/null; echo boom >&2; exit 3"))
    kv = torch.randn(LAYOUT.num_layers, 64, LAYOUT.rows, LAYOUT.head_dim).to(LAYOUT.dtype)
    config = CacheConfig(cpu_bytes=16 * LAYOUT.page_bytes, disk=None, transfer_path=TransferPath.DIRECT,
                         namespace="precompile-failed")
    async with KVCache(config, LAYOUT, kv) as cache:
        warm = await cache.wait_warm()
        assert warm is not None and warm.precompile_error is not None and warm.variants > 0
        errors = cache.stats().errors
        assert errors.get("precompile_failed") == 1 and "warm_up_failed" not in errors, errors
        tokens = list(range(2 * LAYOUT.page_tokens))
        assert (await cache.offload(tokens, torch.arange(len(tokens)))).stored == 2
