"""GPU check of the kernel warm-up: the first copies after start compile nothing on the event loop.

Runs with ``AIOKV_TEST_DEVICE=cuda`` on a CUDA machine (skipped elsewhere). Each mode is a fresh
process with an empty ``TRITON_CACHE_DIR``, so every kernel variant really compiles:

- ``warm``: ``await cache.wait_warm()``, then the first offload, a load, a load starting mid-page
  and a layer-wise load. They must add no compiled variant to Triton's cache and stall the loop
  less than :data:`STALL_LIMIT_MS` each (a loop-lag probe sleeping 1 ms at a time). While the
  warm-up runs (its helper process compiles, this process only loads what it compiled) the loop
  stalls at most :data:`WARM_STALL_LIMIT_MS`, and this process compiles no variant itself (each
  stall is counted after the probe's next turn, in the step that caused it). A second
  cache of the same layout, started after the first closed, launches nothing (all loaded already).
- ``ready``: the same copies right after start, without ``wait_warm`` (they wait for the
  page-aligned variants themselves). Reported, not bounded: the warm-up compiles beside them.
- ``control``: the warm-up stopped before its first launch (as before it existed): the copies
  compile their variants themselves, on the loop. It must compile some (else the check is moot).
- ``restart``: ``warm`` again in a fresh process on the Triton cache a ``warm`` run filled: it must
  start no compile helper (the variants are listed there) and compile nothing. Its ``wait_warm`` is
  compared with the cold one and with a restart whose listings were removed (a helper starts and
  finds every variant in Triton's cache: the warm restart before the listings).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DEVICE = os.environ.get("AIOKV_TEST_DEVICE", "cpu")
STALL_LIMIT_MS = 10.0
WARM_STALL_LIMIT_MS = 5.0
"""Compiling on a thread of this process stalled the loop up to 23 ms (H200 host, 28 variants).
Bounded above the same process's idle stall (``idle_stall_ms``): on a host whose other work
delays a 1 ms sleep by several ms (16 xdist workers, 8.03 ms seen), 5 ms alone measured the host.
A host noisier than :data:`IDLE_NOISE_LIMIT_MS` fails the test: it could not tell a compile."""
IDLE_NOISE_LIMIT_MS = 15.0


def _stall_bound(out: dict[str, object]) -> float:
    """The warm-up stall bound for one run: :data:`WARM_STALL_LIMIT_MS` above its idle stall."""
    idle = out["idle_stall_ms"]
    assert isinstance(idle, float)
    assert idle < IDLE_NOISE_LIMIT_MS, f"the host is too noisy to judge a stall ({idle} ms idle): {out}"
    return WARM_STALL_LIMIT_MS + idle

pytestmark = pytest.mark.skipif(
    not (DEVICE.startswith("cuda") and torch.cuda.is_available()), reason="GPU check: AIOKV_TEST_DEVICE=cuda"
)

SCRIPT = r"""
import asyncio, dataclasses, json, sys, time
import torch
from aiokv import CacheConfig, KVCache, KVLayout

mode, device = sys.argv[1], sys.argv[2]
IDLE_S = 1.0
import subprocess
helpers = []  # compile helpers this process started


class CountedPopen(subprocess.Popen):
    def __init__(self, *args, **kwargs):
        command = args[0] if args else kwargs.get("args", ())
        if any(str(part).endswith("precompile.py") for part in command):  # not Triton's ptxas calls
            helpers.append(command)
        super().__init__(*args, **kwargs)


subprocess.Popen = CountedPopen
layout = KVLayout.mha(8, 8, 128, torch.bfloat16, page_tokens=16)
KVCache.preload(device)
import triton
from aiokv.kernels import _jit

import gc

gc_pauses = []  # seconds of each collection of this process
_gc_began = [0.0]


def _gc_timed(phase, info):
    if phase == "start":
        _gc_began[0] = time.perf_counter()
    else:
        gc_pauses.append(time.perf_counter() - _gc_began[0])


gc.callbacks.append(_gc_timed)

import collections, threading

samples = []  # (perf_counter, thread name, innermost frames) while a step runs: where a stall went
sampling = threading.Event()


def _sample():
    names = {}
    while True:
        sampling.wait()
        now = time.perf_counter()
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue
            if ident not in names:
                names[ident] = next((t.name for t in threading.enumerate() if t.ident == ident), str(ident))
            parts = []
            while frame is not None and len(parts) < 5:  # no source lines read: cheap under the GIL
                parts.append(f"{frame.f_code.co_name}@{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}")
                frame = frame.f_back
            samples.append((now, names[ident], " < ".join(parts)))
        time.sleep(0.001)


threading.Thread(target=_sample, daemon=True, name="stall-sampler").start()


def stall_stacks(began, ended):
    # The most frequent stacks of each thread sampled in [began, ended): for a step that stalled.
    by_thread = collections.defaultdict(collections.Counter)
    for at, name, stack in samples:
        if began <= at < ended:
            by_thread[name][stack] += 1
    return {name: counts.most_common(3) for name, counts in by_thread.items()}
compiled_here = []  # variants this process compiled itself (not found in Triton's disk cache)
triton.knobs.compilation.listener = lambda **kw: None if kw["cache_hit"] else compiled_here.append(1)


def compiled():
    return sum(len(c[0]) for k in (_jit.gather_kernel, _jit.scatter_kernel) for c in k.device_caches.values())


class Probe:
    # Largest delay of a 1 ms sleep beyond its 1 ms: the longest the loop was kept from running it.
    def __init__(self):
        self.worst, self.running, self.turns = 0.0, True, 0

    async def run(self):
        while self.running:
            began = time.perf_counter()
            await asyncio.sleep(0.001)
            self.worst = max(self.worst, time.perf_counter() - began - 0.001)
            self.turns += 1

    async def take(self):
        # After the probe's next full turn: a stall that just ended is counted in the step that
        # caused it, not in the next one (the caller may resume before the probe wakes).
        turns = self.turns
        while self.turns < turns + 2:
            await asyncio.sleep(0)
        worst, self.worst = self.worst, 0.0
        return round(worst * 1e3, 2)


async def main():
    kv = torch.randn(layout.num_layers, 4096, layout.rows, layout.head_dim, device=device).to(layout.dtype)
    config = CacheConfig(cpu_bytes=64 * layout.page_bytes, disk=None, namespace="gpu-warm")
    out = {"mode": mode}
    probe = Probe()
    probing = asyncio.ensure_future(probe.run())
    await asyncio.sleep(0.05)
    await probe.take()
    # The host's own noise, same process and probe, before any cache exists: the stall bounds are
    # above it (a loaded host delayed a 1 ms sleep 8 ms with nothing of aiokv's running).
    await asyncio.sleep(IDLE_S)
    out["idle_stall_ms"] = await probe.take()
    cache = KVCache(config, layout, kv)
    if mode == "control":
        cache._warm_stop.set()  # the warm-up stops before its first launch
    async with cache:
        await cache.pool.wait_ready()
        out["start_stall_ms"] = await probe.take()
        if mode in ("warm", "restart"):
            began = time.perf_counter()
            warm = await cache.wait_warm()
            out["wait_warm_s"] = round(time.perf_counter() - began, 3)
            out["warm_up"] = dataclasses.asdict(warm) if warm is not None else None
            out["stall_during_warm_up_ms"] = await probe.take()
            out["compiled_in_process_while_warming"] = len(compiled_here)
            out["helpers_started"] = len(helpers)
        before = compiled()
        tokens = list(range(8 * layout.page_tokens))
        # Spread slots, none next to another: pages whose slots are one run go by run copies (no
        # kernel since f45d2fa), and with consecutive slots the control compiled nothing at all.
        spread = torch.randperm(4096, generator=torch.Generator().manual_seed(7))
        n = len(tokens)
        slots = spread[:n]
        stalls, compiles, seconds, collected = {}, {}, {}, {}

        async def step(name, coro):
            began, count, pauses = time.perf_counter(), compiled(), len(gc_pauses)
            samples.clear()
            sampling.set()
            await coro
            seconds[name] = round(time.perf_counter() - began, 4)
            stalls[name] = await probe.take()
            sampling.clear()
            if stalls[name] >= 10.0:  # STALL_LIMIT_MS: where the loop's thread and the others were
                out.setdefault("stall_stacks", {})[name] = stall_stacks(began, time.perf_counter())
            compiles[name] = compiled() - count
            collected[name] = round(sum(gc_pauses[pauses:]) * 1e3, 2)

        async def load(block, from_token=0, layered=False):
            match = await cache.match(tokens)
            target = spread[block * n : (block + 1) * n][from_token:]
            if layered:
                stream = await cache.start_load(match, target, from_token=from_token, layered=True)
                await stream.finish()
            else:
                await cache.load(match, target, from_token=from_token)

        await step("offload", cache.offload(tokens, slots))
        await step("load", load(1))
        await step("load_mid_page", load(2, from_token=5))
        await step("layered", load(3, layered=True))
        await step("layered_mid_page", load(3, from_token=9, layered=True))
        torch.cuda.synchronize()
        out.update(stalls_ms=stalls, compiled=compiles, seconds=seconds, compiled_by_copies=compiled() - before,
                   gc_ms=collected)
        out["errors"] = dict(cache.stats().errors)
    if mode == "warm":
        second = KVCache(config, layout, kv)
        async with second:
            began = time.perf_counter()
            warm = await second.wait_warm()
            out["second_wait_warm_s"] = round(time.perf_counter() - began, 4)
            out["second_warm_up"] = dataclasses.asdict(warm) if warm is not None else None
            out["second_stall_ms"] = await probe.take()
    probe.running = False
    await probing
    print(json.dumps(out))


asyncio.run(main())
"""


def _run(mode: str, tmp: Path, cache: str | None = None) -> dict[str, object]:
    cache_dir = tmp / f"triton-{cache or mode}"
    cache_dir.mkdir(exist_ok=True)
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache_dir)}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-c", SCRIPT, mode, DEVICE], capture_output=True, text=True, timeout=400,
                         env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    out: dict[str, object] = json.loads(run.stdout.strip().splitlines()[-1])
    print(json.dumps(out))
    return out


@pytest.mark.slow(seconds=36)
@pytest.mark.timing
def test_first_copies_after_the_warm_up_compile_nothing_on_the_loop(tmp_path: Path) -> None:
    warm = _run("warm", tmp_path)
    control = _run("control", tmp_path)
    ready = _run("ready", tmp_path)  # reported only (see the module docstring)
    assert isinstance(control["compiled_by_copies"], int) and control["compiled_by_copies"] > 0, control
    assert warm["warm_up"] is not None and not warm["warm_up"]["stopped"], warm  # type: ignore[index]
    assert warm["compiled_by_copies"] == 0, f"copies compiled variants the warm-up missed: {warm}"
    stalls, collected = warm["stalls_ms"], warm["gc_ms"]
    assert isinstance(stalls, dict) and isinstance(collected, dict)
    # Less the garbage collector's pauses in the same step: any Python code of the engine's can set
    # off a full collection of this process (torch and Triton imported), and what the bound is for
    # is compiling. (Twenty-fourth session, H200 host: the mid-page load stalled 68 ms with nothing
    # compiled; whether that was a collection is not known yet: gc_ms is reported since.)
    own = {name: stall - collected[name] for name, stall in stalls.items()}
    assert max(own.values()) < STALL_LIMIT_MS, f"first copies stalled the loop: {warm} (control: {control})"
    assert "warm_up_failed" not in warm["errors"] and "warm_up_failed" not in ready["errors"]  # type: ignore[operator]
    summary = warm["warm_up"]
    assert isinstance(summary, dict) and summary["precompile_error"] is None, summary
    assert summary["precompiled"] == summary["variants"] > 0, summary
    assert warm["compiled_in_process_while_warming"] == 0, f"this process compiled variants itself: {warm}"
    assert isinstance(warm["stall_during_warm_up_ms"], float)
    if warm["stall_during_warm_up_ms"] > _stall_bound(warm):
        # Once more in a fresh process: a neighbour's burst (the timing half runs six tests at once;
        # H100 host: 5.77 ms there, 2.0-3.8 ms alone) lands in one run's window, while a stall the
        # warm-up itself causes shows in both.
        again = _run("warm", tmp_path, cache="warm-again")
        assert isinstance(again["stall_during_warm_up_ms"], float)
        assert again["stall_during_warm_up_ms"] <= _stall_bound(again), \
            f"the loop stalled while warming, twice: {warm}; {again}"
    second = warm["second_warm_up"]
    assert isinstance(second, dict) and second["variants"] == 0 and second["skipped"] == summary["variants"], warm


@pytest.mark.slow(seconds=35)
@pytest.mark.timing
def test_a_restart_with_a_warm_triton_cache_starts_no_helper(tmp_path: Path) -> None:
    from aiokv.kernels.precompile import ENTRIES_DIR

    cold = _run("warm", tmp_path, cache="shared")
    restart = _run("restart", tmp_path, cache="shared")
    shutil.rmtree(tmp_path / "triton-shared" / ENTRIES_DIR)  # as before the listings: a helper starts
    unlisted = _run("restart", tmp_path, cache="shared")
    print(json.dumps({"wait_warm_s": {"cold": cold["wait_warm_s"], "restart": restart["wait_warm_s"],
                                      "restart_with_helper": unlisted["wait_warm_s"]}}))
    first, again, helped = cold["warm_up"], restart["warm_up"], unlisted["warm_up"]
    assert isinstance(first, dict) and isinstance(again, dict) and isinstance(helped, dict)
    assert first["precompiled"] == first["variants"] > 0 and cold["helpers_started"] == 1, cold
    assert restart["helpers_started"] == 0, f"the restart started a compile helper: {restart}"
    assert again["cached"] == again["variants"] == first["variants"] and again["precompiled"] == 0, restart
    assert again["precompile_error"] is None and "precompile_failed" not in restart["errors"], restart  # type: ignore[operator]
    assert restart["compiled_in_process_while_warming"] == 0 and restart["compiled_by_copies"] == 0, restart
    assert isinstance(restart["stall_during_warm_up_ms"], float)
    assert restart["stall_during_warm_up_ms"] <= _stall_bound(restart), restart
    # The start itself (constructor included): its copy engine is built off the loop (CUDA streams
    # created on the loop stalled it ~7 ms, once counted as the warm-up's stall).
    assert isinstance(restart["start_stall_ms"], float) and restart["start_stall_ms"] <= _stall_bound(restart), restart
    assert unlisted["helpers_started"] == 1 and helped["cached"] == 0, unlisted  # the control
    assert helped["precompiled"] == helped["variants"] == first["variants"], unlisted
    assert restart["wait_warm_s"] < unlisted["wait_warm_s"], (restart, unlisted)  # type: ignore[operator]
