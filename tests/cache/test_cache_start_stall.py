"""Start-up with the disk tier on never stalls the event loop for long (pool registration included)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from aiokv import CacheConfig, KVCache, KVLayout

LAYOUT = KVLayout.mha(32, 8, 128, torch.bfloat16, page_tokens=16)  # 2 MiB pages


def _loop_thread_sched() -> tuple[int, int]:
    """The calling thread's nanoseconds on a CPU and runnable but waiting for one (0, 0 where the
    kernel keeps no scheduler statistics: then nothing is discounted)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            on_cpu, runnable = f.read().split()[:2]
    except OSError:
        return 0, 0
    return int(on_cpu), int(runnable)


async def _start_and_write(directory: Path, gib: float) -> float:
    """Worst lateness of a 1 ms callback while a cache starts and writes one page to disk, less the
    time the loop's thread waited for a CPU that other processes had (the shared machine's load, as
    in ``test_a_processs_first_start_does_not_stall_the_loop``): a wait for this process's own
    threads, the GIL, a lock or a blocking call still counts."""
    kv = torch.zeros(LAYOUT.num_layers, 64, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    config = CacheConfig(cpu_bytes=int(gib * (1 << 30)), disk_dir=directory, disk_bytes=1 << 30, namespace="stall")
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    stop = asyncio.Event()

    async def probe() -> None:
        expected = loop.time() + 0.001
        last = (*_loop_thread_sched(), time.process_time_ns())
        while not stop.is_set():
            await asyncio.sleep(max(0.0, expected - loop.time()))
            (on_cpu, runnable), process = _loop_thread_sched(), time.process_time_ns()
            ours = process - last[2] - (on_cpu - last[0])  # this process's other threads ran meanwhile
            theirs = max(0, runnable - last[1] - ours) / 1e9
            lags.append(loop.time() - expected - theirs)
            expected, last = loop.time() + 0.001, (on_cpu, runnable, process)

    task = asyncio.create_task(probe())
    async with KVCache(config, LAYOUT, kv) as cache:
        await cache.offload(list(range(16)), torch.arange(16))
        await cache.flush()
        disk = cache.disk
        assert disk is not None
        io = disk._io
        await io.wait_registered()  # type: ignore[union-attr]  # the whole registration, too
    stop.set()
    await task
    return max(lags)


@pytest.mark.timing
@pytest.mark.asyncio
@pytest.mark.slow
async def test_start_with_the_disk_tier_does_not_stall_the_loop(tmp_path: Path) -> None:
    # Regression (#11): the tier registered the whole pool as io_uring fixed buffers while
    # holding the ring's lock (pinning ~1 s/GiB of untouched memory), and the loop's submissions
    # waited on it: seconds of stall. Now the pool is faulted in outside the lock and registered
    # 256 MiB at a time in the background. Then (CI failure, 254 ms): each 256 MiB populate and the
    # close's munmap of the whole pool held the process's mmap lock, which the loop's own allocations
    # wait for; now 2 MiB steps, 64 MiB registrations, page tables dropped stepwise before the unmap
    # (6-9 ms worst here, start to close, against 100-250 ms before).
    await _start_and_write(tmp_path / "warm", 0.05)  # one-time costs: imports, Triton's loading
    gc.collect()
    gc.disable()  # a collection pass over a big heap is not what this measures
    try:
        worst = await _start_and_write(tmp_path / "big", 1.0)
    finally:
        gc.enable()
    assert worst < 0.04, f"the loop stalled {worst * 1e3:.0f} ms while the cache started"


@pytest.mark.asyncio
async def test_the_first_offload_starts_no_thread_on_the_loop(tmp_path: Path) -> None:
    # Regression: the copy thread was created by the first offload, on the loop, while the pool's
    # preparation held the mmap lock that creating a thread's stack needs: 20-60 ms stalls. Threads
    # start with the cache now.
    import threading

    kv = torch.zeros(LAYOUT.num_layers, 64, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    config = CacheConfig(cpu_bytes=64 << 20, disk_dir=None, namespace="threads")
    async with KVCache(config, LAYOUT, kv) as cache:
        names = {t.name for t in threading.enumerate()}
        assert any(name.startswith("aiokv-copy") for name in names)
        # By identity: a start's own short-lived thread (the mover's) may still be ending here.
        before = {thread.ident for thread in threading.enumerate()}
        await cache.offload(list(range(16)), torch.arange(16))
        started = [thread.name for thread in threading.enumerate() if thread.ident not in before]
        assert not started, started


@pytest.mark.asyncio
async def test_pool_registration_runs_on_the_pools_own_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: the disk tier started a registration thread of its own from the loop while the
    # pool's preparation ran (a 10-20 ms wait for it under load). It runs on the pool's threads now.
    import threading

    import aiokv.storage.backends as backends

    ran_on: list[str] = []
    populate = backends.populate

    def recording(address: int, length: int) -> None:
        ran_on.append(threading.current_thread().name)
        populate(address, length)

    monkeypatch.setattr(backends, "populate", recording)
    kv = torch.zeros(LAYOUT.num_layers, 64, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    config = CacheConfig(cpu_bytes=64 << 20, disk_dir=tmp_path / "disk", disk_bytes=1 << 30, namespace="reg")
    async with KVCache(config, LAYOUT, kv) as cache:
        disk = cache.disk
        assert disk is not None
        if not hasattr(disk._io, "wait_registered"):
            pytest.skip("io_uring is refused here: the thread-pool backend registers nothing")
        await disk._io.wait_registered()
        if disk._io.kind.value != "uring_fixed":
            pytest.skip("fixed buffers cannot be registered here (memlock)")
    assert ran_on and all(name.startswith("aiokv-pool") for name in ran_on), ran_on


FIRST_START = """
import asyncio, sys
import torch
from aiokv import CacheConfig, KVCache, KVLayout

async def main() -> None:
    layout = KVLayout.mha(32, 8, 128, torch.bfloat16, page_tokens=16)
    kv = torch.zeros(layout.num_layers, 64, layout.rows, layout.head_dim, dtype=layout.dtype)
    config = CacheConfig(cpu_bytes=64 << 20, disk_dir=sys.argv[1], disk_bytes=1 << 30, namespace="first")
    before = set(sys.modules)
    async with KVCache(config, layout, kv):
        imported = sorted(set(sys.modules) - before)
    print(" ".join(imported))

asyncio.run(main())
"""


def test_a_processs_first_start_imports_no_module(tmp_path: Path) -> None:
    # #11, first start: an import holds the GIL for its compile and whole module body while the loop
    # waits; everything the start path needs belongs to the package import, before any loop runs.
    # (KVCache.start imported aiokv.kernels.mover, .reference and .segments in a thread: 3-17 ms
    # holding the GIL. Triton, which the CPU path does not use, stays out of the package import.)
    # (aiokv.segments was the pool's share: see tests/core/test_pool_start.py.)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    run = subprocess.run([sys.executable, "-c", FIRST_START, str(tmp_path / "disk")], capture_output=True,
                         text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [], f"imported during the first start: {run.stdout.strip()}"


FIRST_START_STALL = """
import asyncio, gc, os, sys, time
import torch
from aiokv import CacheConfig, KVCache, KVLayout

try:
    SCHED = os.open("/proc/thread-self/schedstat", os.O_RDONLY)  # the loop's thread: ns on CPU, ns runnable
except OSError:
    SCHED = -1  # no scheduler statistics: nothing is discounted

def loop_thread() -> tuple[int, int]:
    if SCHED < 0:
        return 0, 0
    on_cpu, runnable = os.pread(SCHED, 64, 0).split()[:2]
    return int(on_cpu), int(runnable)

async def main() -> None:
    gc.collect()  # the full collection importing torch leaves owed (see test_pool_start.py)
    layout = KVLayout.mha(32, 8, 128, torch.bfloat16, page_tokens=256)  # 32 MiB pages (8B shape)
    kv = torch.zeros(layout.num_layers, 256, layout.rows, layout.head_dim, dtype=layout.dtype)
    config = CacheConfig(cpu_bytes=1 << 30, disk_dir=sys.argv[1], disk_bytes=1 << 30, namespace="first")
    loop = asyncio.get_running_loop()
    worst = raw = 0.0
    ticks = 0
    due, last = loop.time() + 0.001, (*loop_thread(), time.process_time_ns())
    def tick() -> None:
        global handle
        nonlocal worst, raw, ticks, due, last
        now, (on_cpu, runnable), process = loop.time(), loop_thread(), time.process_time_ns()
        # Of the time the loop's thread was runnable but off the CPU, the part this process's
        # other threads did not use went to other processes: the machine's load, not the start's.
        ours = process - last[2] - (on_cpu - last[0])
        theirs = max(0, runnable - last[1] - ours) / 1e9
        worst, raw = max(worst, now - due - theirs), max(raw, now - due)
        due, last, ticks = now + 0.001, (on_cpu, runnable, process), ticks + 1
        if ticks >= 10 and not probing.done():
            probing.set_result(None)
        handle = loop.call_at(due, tick)
    global handle
    probing = loop.create_future()
    handle = loop.call_at(due, tick)
    await probing  # the probe's first ticks
    worst = raw = 0.0
    ticks = 0
    async with KVCache(config, layout, kv) as cache:
        stall = worst, raw, ticks
    handle.cancel()
    print(*stall)

asyncio.run(main())
"""
FIRST_START_BOUND = 0.005
"""Seconds: the target (#11), for the best of ``FIRST_START_TRIES`` fresh processes (what every first
start pays, without the shared VM's noise). 2-vCPU VM, load average 3-5, 1 GiB pool, disk tier on:
before this bound, first starts stalled 6.0-14.0 ms (imports in threads, the page table's columns
written, regular expressions compiled, all holding the GIL); now 2.8-6.8 ms, most 3-5.

A stall is the probe's lateness less the time the loop's thread waited for a CPU that other
processes had (its runnable time beyond what this process's other threads ran meanwhile, from
``/proc/thread-self/schedstat``). Blocked in a call, waiting for the GIL or a lock, running a long
callback, or queued behind this process's own threads, all still count. Load average 7-8 (two other
CPU-bound processes and a test suite on the 2 vCPUs): raw stalls 10.5-30 ms, none under the bound;
discounted 1.8-17.9 ms, half under it. A start blocked 20 ms on the loop stalls >= 20 ms either way."""
FIRST_START_TRIES = 8


@pytest.mark.timing
@pytest.mark.slow
def test_a_processs_first_start_does_not_stall_the_loop(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    stalls = []
    for attempt in range(FIRST_START_TRIES):
        run = subprocess.run([sys.executable, "-c", FIRST_START_STALL, str(tmp_path / f"disk{attempt}")],
                             capture_output=True, text=True, timeout=120, env=env)
        assert run.returncode == 0, run.stderr
        stall, raw, ticks = map(float, run.stdout.split()[-3:])
        assert ticks >= 3, f"the probe ticked {ticks:.0f} times during the start: {run.stderr}"
        stalls.append(f"{stall * 1e3:.1f} ({raw * 1e3:.1f} raw)")
        if stall < FIRST_START_BOUND:
            return
    pytest.fail(f"every first start stalled the loop: {', '.join(stalls)} ms")


def _thread_starts_on_the_loop(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records each Thread.start made on the calling (loop) thread as "name from <innermost aiokv
    file>" (Thread.start waits there until the new thread runs)."""
    import threading
    import traceback

    loop_thread = threading.get_ident()  # (current_thread() would make a launcher a dummy thread)
    started: list[str] = []
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if threading.get_ident() == loop_thread:
            files = [f.filename for f in traceback.extract_stack()[:-1]]
            package = [f for f in files if "/aiokv/" in f or "/storage/" in f or "/kernels/" in f]
            started.append(f"{self.name} from {package[-1] if package else 'the loop'}")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return started


@pytest.mark.asyncio
async def test_start_and_close_wait_for_no_thread_of_their_own_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression (#11, first start): PagePool.open started the loop's default executor's thread
    # (run_in_executor) and aclose the same through to_thread: Thread.start waits on the loop until
    # the new thread runs (1.5-6 ms on the loaded 2-vCPU VM). Both start their threads without
    # waiting now, and so does the bridge's prestart (it ran on the loop: the copy thread's start).
    # Attributed by the innermost aiokv frame of each start made on the loop's thread.
    ours = ("aiokv/pool.py", "aiokv/shm.py", "aiokv/pagetable.py", "aiokv/cache.py", "aiokv/cuda.py")
    started = _thread_starts_on_the_loop(monkeypatch)
    kv = torch.zeros(LAYOUT.num_layers, 64, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    config = CacheConfig(cpu_bytes=64 << 20, disk_dir=None, namespace="nothread")
    async with KVCache(config, LAYOUT, kv) as cache:
        await cache.offload(list(range(16)), torch.arange(16))
    assert not [s for s in started if s.endswith(ours)], started
    assert not [s for s in started if s.startswith("asyncio")], started  # no default executor without a disk tier


@pytest.mark.asyncio
async def test_the_rates_read_and_write_start_no_thread_on_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression: the saved rates were read at start and written at close through to_thread,
    # whose first call starts the default executor's thread on the loop (Thread.start waits there
    # until it runs). The disk tier's own starts are attributed to storage/ and not counted here.
    started = _thread_starts_on_the_loop(monkeypatch)
    kv = torch.zeros(LAYOUT.num_layers, 64, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    config = CacheConfig(cpu_bytes=64 << 20, disk_dir=tmp_path, disk_bytes=1 << 30, namespace="nothread")
    for _ in range(2):  # the second start reads the rates the first close wrote
        async with KVCache(config, LAYOUT, kv) as cache:
            await cache.offload(list(range(16)), torch.arange(16))
            cache.manager.costs.pool.update(1e9, 1.0)  # a rate changed: the close writes it
    assert not [s for s in started if s.endswith("aiokv/manager.py")], started


PRELOAD_START = """
import asyncio, json, logging, sys
import torch
from aiokv import CacheConfig, KVCache, KVLayout, TransferPath

logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
preload = sys.argv[1] == "preload"
layout = KVLayout.mha(2, 2, 16, torch.bfloat16, page_tokens=4)
before = set(sys.modules)
preloaded = KVCache.preload("cpu", TransferPath.DIRECT) if preload else ()
by_preload = sorted(set(sys.modules) - before)

async def main() -> dict[str, object]:
    kv = torch.zeros(layout.num_layers, 64, layout.rows, layout.head_dim, dtype=layout.dtype)
    config = CacheConfig(cpu_bytes=1 << 20, disk_dir=None, namespace="pre", transfer_path=TransferPath.DIRECT)
    counts = []
    for first in (True, False):  # a second cache in the same process imports nothing again
        cache = KVCache(config, layout, kv)
        before = set(sys.modules)
        await cache.start()
        if first:
            by_start = sorted(set(sys.modules) - before)
        await cache.offload(list(range(8)), torch.arange(8))  # the mover works
        counts.append(cache.stats().errors.get("start_imports", 0))
        await cache.aclose()
    return {"by_start": by_start, "counts": counts}

out = asyncio.run(main())
print(json.dumps({**out, "preloaded": list(preloaded), "by_preload": by_preload}))
"""


def _preload_run(mode: str) -> tuple[dict[str, list[object]], str]:
    # TRITON_INTERPRET lets a CPU KV buffer take a path that launches kernels: a start then imports
    # what it would import on CUDA (aiokv.kernels.launch, Triton).
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", PRELOAD_START, mode], capture_output=True, text=True, timeout=300,
                         env=env)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1]), run.stderr


@pytest.mark.slow(seconds=16)
def test_preload_imports_what_a_start_would_and_the_start_then_imports_nothing() -> None:
    # #11, first start on CUDA: start() imported Triton in a thread, 24-95 ms holding the GIL on an
    # H200 host (a loop stall). KVCache.preload imports it before the loop runs; a start without it
    # says so: counted in stats().errors["start_imports"], logged once.
    cold, cold_log = _preload_run("cold")
    assert "aiokv.kernels.launch" in cold["by_start"] and "triton" in cold["by_start"]
    assert cold["counts"] == [1, 0]  # the first cache imported; the second found it imported
    assert cold_log.count("KVCache.preload('cpu')") == 1, cold_log

    warm, warm_log = _preload_run("preload")
    assert warm["preloaded"] == ["aiokv.kernels.launch"]
    assert set(cold["by_start"]) <= set(warm["by_preload"])  # everything the start imported
    assert warm["by_start"] == [], f"imported by a start after preload: {warm['by_start']}"
    assert warm["counts"] == [0, 0]
    assert "start_imports" not in warm_log


def test_preload_of_a_cpu_device_imports_nothing_and_refuses_bad_arguments() -> None:
    import aiokv

    before = set(sys.modules)
    assert KVCache.preload("cpu") == () and KVCache.preload(torch.device("cpu")) == ()
    assert set(sys.modules) == before  # (that `import aiokv` loads no Triton: test_smoke_hygiene, in a fresh process)
    with pytest.raises(TypeError, match="device"):
        KVCache.preload(0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a device"):
        KVCache.preload("gpu:0")
    with pytest.raises(TypeError, match="transfer_path"):
        KVCache.preload("cpu", "direct")  # type: ignore[arg-type]
    assert aiokv.KVCache.preload is KVCache.preload


@pytest.mark.asyncio
async def test_the_copy_engine_is_built_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression (H200): the start built its PageMover on the loop; creating its CUDA streams and
    # staging took ~7 ms there (a faulthandler watchdog caught the loop in torch.cuda.Stream), the
    # warm-up test's worst stall. A constructor made slow here stands in for that: the loop must go on.
    import threading

    import aiokv.cache as cache_module

    built_on: list[threading.Thread] = []

    class SlowMover(cache_module.PageMover):
        def __init__(self, *args: object, **kwargs: object) -> None:
            built_on.append(threading.current_thread())
            time.sleep(0.2)  # a blocking call, as the driver's stream creation
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cache_module, "PageMover", SlowMover)
    kv = torch.zeros(LAYOUT.num_layers, 64, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    config = CacheConfig(cpu_bytes=64 << 20, disk_dir=None, namespace="mover-thread")
    loop = asyncio.get_running_loop()
    worst = 0.0
    stop = asyncio.Event()

    async def probe() -> None:
        nonlocal worst
        while not stop.is_set():
            began = loop.time()
            await asyncio.sleep(0.001)
            worst = max(worst, loop.time() - began - 0.001)

    task = asyncio.create_task(probe())
    try:
        async with KVCache(config, LAYOUT, kv) as cache:
            await cache.offload(list(range(16)), torch.arange(16))
            async with await cache.match(list(range(16))) as match:
                assert match.tokens == 16
    finally:
        stop.set()
        await task
    assert built_on and built_on[0] is not threading.main_thread(), built_on
    assert worst < 0.1, f"the loop waited {worst * 1e3:.0f} ms for the mover's construction"
