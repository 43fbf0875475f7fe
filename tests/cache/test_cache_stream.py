"""Compute-or-load split: the engine computes the front, the stream loads the back, never both."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, make_kv, mover_of, prompt

sys.path.append(str(Path(__file__).resolve().parents[2] / "tools"))

from bench_cache import ThreadCPU, thread_clocks_work  # one probe of per-thread CPU clocks, the benchmark's

from aiokv import KVCache
from aiokv.costs import CostModel, RateMeter
from aiokv.manager import CacheManager
from aiokv.stream import LoadStream, StreamResult

T = LAYOUT.page_tokens
MARK = 9.0  # what the simulated engine writes into the tokens it computes


def _flip_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[4096 + 10] ^= 0xFF  # a payload byte (after the 4096-byte header)
    path.write_bytes(bytes(data))


def _slow_copies(monkeypatch: pytest.MonkeyPatch, cache: KVCache, reps: int) -> None:
    """Make every copy run ``reps`` times over (idempotent): a slow tier the engine can race."""
    mover = mover_of(cache)
    for name in ("load", "offload"):
        original: Callable[..., Any] = getattr(mover, name)

        def slow(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            for _ in range(reps):
                result = _original(*args, **kwargs)
            return result

        monkeypatch.setattr(mover, name, slow)


async def _engine(stream: LoadStream, kv: torch.Tensor, slots: torch.Tensor, start: int, chunk: int,
                  turns: int) -> tuple[int, StreamResult]:
    """Claim and "compute" (write MARK) chunk by chunk, yielding ``turns`` loop turns per chunk."""
    pos = start
    while (end := stream.claim(pos + chunk)) > pos:
        kv[:, slots[pos - start : end - start].to(DEVICE)] = MARK
        pos = end
        for _ in range(turns):
            await asyncio.sleep(0)
    return pos, await stream.finish()


@pytest.mark.asyncio
@pytest.mark.parametrize("turns", [0, 3, 50], ids=["engine-never-yields", "race", "engine-slow"])
async def test_split_covers_the_prefix_once_and_never_writes_claimed_tokens(
    monkeypatch: pytest.MonkeyPatch, turns: int
) -> None:
    kv = make_kv(70)
    original = kv.clone()
    n = 12 * T
    tokens = prompt(70, n)
    async with KVCache(config(None, pool_pages=16, launch_pages=1, launch_turn_s=0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(n))
        if DEVICE.type == "cpu":
            _slow_copies(monkeypatch, cache, 20)
        target = torch.arange(100, 100 + n - 2)
        kv[:, target.to(DEVICE)] = 0
        stream = await cache.start_load(await cache.match(tokens), target, from_token=2)
        computed, result = await _engine(stream, kv, target, 2, T, turns)
        assert result.claimed == computed <= result.loaded_from <= n
        assert result.loaded_from - result.claimed < T  # the fronts met (give or take a page)
        got = kv[:, target.to(DEVICE)]
        # The engine's tokens hold the engine's bytes: the load never wrote a claimed token.
        assert bool((got[:, : computed - 2] == MARK).all())
        # The loaded suffix is bit-exact.
        lo = result.loaded_from - 2
        assert torch.equal(got[:, lo:], original[:, result.loaded_from : n])
        assert result.loaded_tokens == (result.pool_pages + result.disk_pages) * T - (2 if lo == 0 else 0)
        if turns == 0:
            assert result.loaded_from == n  # the engine claimed everything before the loader ran
        else:
            assert result.loaded_tokens > 0 and result.claimed > 2  # both fronts moved
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_an_idle_engine_gets_everything_loaded_from_pool_and_disk(tmp_path: Path) -> None:
    kv = make_kv(71)
    original = kv.clone()
    n = 8 * T
    tokens = prompt(71, n)
    async with KVCache(config(tmp_path, pool_pages=16), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(n))
        await cache.flush()
        cache.pool.table.evict(cache.pool.num_pages)  # the second half only on disk
        await cache.offload(tokens[: 4 * T], torch.arange(4 * T))
        match = await cache.match(tokens)
        assert (match.pool_pages, match.disk_pages) == (4, 4)
        target = torch.arange(50, 50 + n)
        async with await cache.start_load(match, target) as stream:
            result = await stream.finish()
        assert (result.loaded_from, result.pool_pages, result.disk_pages) == (0, 4, 4)
        assert torch.equal(kv[:, target.to(DEVICE)], original[:, :n])
        async with await cache.match(tokens) as again:
            estimate = cache.estimate(again)
        assert estimate.pool_seconds is not None and estimate.pool_seconds > 0
        assert estimate.disk_seconds == 0.0  # every page is in the pool now
        disk_rate = cache.manager.costs.disk.rate
        assert disk_rate is not None and disk_rate > 0  # measured from the stream's disk reads
        await assert_quiescent(cache)


async def _only_on_disk(cache: KVCache, tokens: list[int]) -> CostModel:
    """Offload ``tokens`` (slots from 0), flush to disk, empty the pool: every page only on disk;
    the disk meter says a page read takes 10 ms. Returns the cost model."""
    await cache.pool.wait_ready()
    await cache.offload(tokens, torch.arange(len(tokens)))
    await cache.flush()
    cache.pool.table.evict(cache.pool.num_pages)
    costs = cache.manager.costs
    costs.disk.update(LAYOUT.page_bytes, 0.010)
    return costs


@pytest.mark.asyncio
async def test_a_disk_read_must_land_before_the_engine_reaches_the_first_token_of_its_page(tmp_path: Path) -> None:
    # Regression: the loader compared a read's landing with when the engine would reach the END of
    # the page; the engine claims from the page's first token on, after which the read is wasted.
    kv = make_kv(73)
    n = 8 * T
    tokens = prompt(73, n)
    async with KVCache(config(tmp_path, pool_pages=16), LAYOUT, kv) as cache:
        costs = await _only_on_disk(cache, tokens)
        costs.prefill.update(T, 0.010)  # the engine computes a page in 10 ms
        match = await cache.match(tokens)
        assert match.disk_pages == 8
        stream = await cache.start_load(match, torch.arange(50, 50 + n))
        # Before the loader's first turn: the engine has claimed two pages, nothing is in flight.
        stream._claimed = 2 * T
        # Page 3 starts one page ahead of the engine: a read landing in 10 ms lands as the engine
        # gets there, too late; page 4 starts two pages ahead.
        assert not stream._lands_in_time(3)
        assert stream._lands_in_time(4)
        await stream.aclose()
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_whether_a_read_lands_in_time_prices_the_engines_tokens_with_attention(tmp_path: Path) -> None:
    # Regression: the loader priced the engine's progress with the meter's average rate; tokens
    # deep in a prompt cost more (attention), so the engine arrives later than that rate says and
    # reads that would land were not started.
    kv = make_kv(74)
    n = 8 * T
    tokens = prompt(74, n)
    async with KVCache(config(tmp_path, pool_pages=16), LAYOUT, kv) as cache:
        costs = await _only_on_disk(cache, tokens)
        # Token i costs a + b·i, b chosen so that tokens [2T, 4T) take 20 ms; the engine's calls
        # seen so far were short ones at the front of prompts (fast on average).
        a = 1e-6
        b = (0.010 / T - a) / (3 * T)
        for i in range(30):
            t = (1, 2, 4)[i % 3] * T / 4
            costs.prefill.update(t, a * t + b * t * t / 2, prefix=0)
        average = costs.prefill.rate
        assert average is not None and 2 * T / average < 0.010  # the average rate: reached in < 10 ms
        reached = costs.prefill.compute_seconds(2 * T, 4 * T, calls=1)
        assert reached is not None and reached == pytest.approx(0.020, rel=0.05)
        match = await cache.match(tokens)
        stream = await cache.start_load(match, torch.arange(50, 50 + n))
        stream._claimed = 2 * T
        assert stream._lands_in_time(4)  # 10 ms to land, ~20 ms until the engine gets there
        assert not stream._lands_in_time(3)  # ~8 ms until the engine gets there: too late
        await stream.aclose()
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_a_corrupt_disk_page_shortens_the_loaded_suffix_and_the_engine_computes_the_rest(
    tmp_path: Path,
) -> None:
    kv = make_kv(72)
    original = kv.clone()
    n = 6 * T
    tokens = prompt(72, n)
    async with KVCache(config(tmp_path, pool_pages=16), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(n))
        await cache.flush()
        cache.pool.table.evict(cache.pool.num_pages)
        keys = cache.keys(tokens)
        disk = cache.disk
        assert disk is not None
        _flip_payload_byte(Path(disk.files.path(keys[3])))
        target = torch.arange(60, 60 + n)
        kv[:, target.to(DEVICE)] = 0
        stream = await cache.start_load(await cache.match(tokens), target)
        result = await stream.finish()
        assert result.loaded_from == 4 * T  # pages 4 and 5 loaded; page 3 is the engine's to compute
        assert torch.equal(kv[:, target[4 * T :].to(DEVICE)], original[:, 4 * T : n])
        assert cache.stats().errors["load_shortened"] >= 1
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_cancelled_finish_leaves_no_copy_and_no_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = make_kv(73)
    n = 10 * T
    tokens = prompt(73, n)
    async with KVCache(config(None, pool_pages=16, launch_pages=1, launch_turn_s=0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(n))
        if DEVICE.type == "cpu":
            _slow_copies(monkeypatch, cache, 20)
        target = torch.arange(100, 100 + n)
        stream = await cache.start_load(await cache.match(tokens), target)
        task = asyncio.create_task(stream.finish())
        for _ in range(3):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        snapshot = kv[:, target.to(DEVICE)].clone()
        await cache.flush()
        assert torch.equal(kv[:, target.to(DEVICE)], snapshot), "a copy wrote the slots after CancelledError"
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_stream_arguments_are_checked_before_anything_changes() -> None:
    async with KVCache(config(None, pool_pages=8), LAYOUT, make_kv(74)) as cache:
        await cache.pool.wait_ready()
        tokens = prompt(74, 2 * T)
        await cache.offload(tokens, torch.arange(2 * T))
        match = await cache.match(tokens)
        with pytest.raises(ValueError, match="entries"):
            await cache.start_load(match, torch.arange(T))
        assert not match.released
        stream = await cache.start_load(match, torch.arange(2 * T))
        with pytest.raises(TypeError):
            stream.claim(1.5)  # type: ignore[arg-type]
        assert stream.claim(10**6) <= 2 * T
        first = stream.claim(0)
        assert stream.claim(0) == first  # claims never shrink
        await stream.finish()
        with pytest.raises(RuntimeError, match="already"):
            await stream.finish()
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_a_bad_layer_is_refused_as_such_while_the_loader_still_runs() -> None:
    # Regression (helper-158's fuzz): wait_layer checked "before launched()" first, so a bad layer
    # given while the loader ran was a RuntimeError, not the TypeError/ValueError of a bad argument.
    async with KVCache(config(None, pool_pages=8), LAYOUT, make_kv(75)) as cache:
        await cache.pool.wait_ready()
        tokens = prompt(75, 6 * T)
        await cache.offload(tokens, torch.arange(6 * T))
        stream = await cache.start_load(await cache.match(tokens), torch.arange(6 * T), layered=True)
        assert not stream._loader.done()  # six pages: the loader yields a loop turn per page
        for bad, error in (("0", TypeError), (None, TypeError), (True, TypeError), (-1, ValueError),
                           (LAYOUT.num_layers, ValueError)):
            with pytest.raises(error, match="layer"):
                await stream.wait_layer(bad)  # type: ignore[arg-type]
        assert not stream._loader.done()
        with pytest.raises(RuntimeError, match="before launched"):
            await stream.wait_layer(0)  # a good layer, too early: still refused
        assert (await stream.finish()).tokens == 6 * T
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_a_rate_is_folded_before_the_call_that_awaited_the_copies_returns() -> None:
    # Regression: the pool rate was folded in a done-callback of a gather of the copies, which
    # could still be queued when finish() returned (seen on CUDA: estimate() right after a stream
    # load had no pool rate). A call that awaited its copies now folds the rate itself.
    loop = asyncio.get_running_loop()
    meter = RateMeter()
    copies = [loop.create_future() for _ in range(3)]
    fold = CacheManager._measure(copies, 3, time.perf_counter(), meter, 4096)
    fold()
    assert meter.rate is None  # not all done: nothing folded yet
    for copy in copies:
        copy.set_result(None)
    fold()  # no loop turn since: the done-callbacks have not run
    assert meter.rate is not None and meter.rate > 0
    folded = meter.rate
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert meter.rate == folded  # the callbacks fold nothing twice


def test_cost_model_split_meets_where_load_and_compute_times_match() -> None:
    model = CostModel(prefill_tokens_per_s=1000.0)
    model.pool.update(1000.0, 1.0)  # 1000 bytes/s: one 100-byte page per 0.1 s
    model.disk.update(100.0, 1.0)  # 1 page/s
    # 10 pool pages of 10 tokens (0.01 s to compute each, 0.1 s to load): loading loses.
    pool = model.estimate(10, 0, 10, 100)
    assert pool.pool_seconds == pytest.approx(1.0) and pool.recompute_seconds == pytest.approx(0.1)
    assert pool.worth_loading is False
    assert pool.split_token is not None and 0 <= pool.split_token <= 100
    fast = CostModel(prefill_tokens_per_s=10.0)
    fast.pool.update(1e6, 1.0)
    fast.disk.update(1e6, 1.0)
    est = fast.estimate(6, 4, 10, 100)
    assert est.worth_loading is True and est.split_token == 0  # loading is far faster: load all
    unknown = CostModel().estimate(3, 0, 10, 100)
    assert unknown.worth_loading is None and unknown.split_token is None


@pytest.mark.asyncio
async def test_layer_readiness_is_honoured_with_slow_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    # A consumer that waits on layer l's readiness sees layer l's loaded bytes, bit-exact, while
    # later layers may still be on their way (the copies are slowed so they are).
    import aiokv.kernels.mover as mover_module

    kv = make_kv(75)
    original = kv.clone()
    n = 6 * T
    tokens = prompt(75, n)
    async with KVCache(config(None, pool_pages=16, launch_pages=2, launch_turn_s=0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(n))
        real: Callable[..., Any] = mover_module.HostScatter.load
        # Layer l + 1 is copied only once the consumer has checked layer l: readiness can then be
        # proven to come before the next layer lands, deterministically.
        gates = [threading.Event() for _ in range(LAYOUT.num_layers)]
        gates[0].set()
        calls = [0]

        def gated(*args: Any, **kwargs: Any) -> None:
            layer = calls[0]
            calls[0] += 1
            gates[min(layer, len(gates) - 1)].wait()
            real(*args, **kwargs)

        if DEVICE.type == "cpu":
            monkeypatch.setattr(mover_module.HostScatter, "load", gated)
        target = torch.arange(80, 80 + n - 1)
        kv[:, target.to(DEVICE)] = 0
        stream = await cache.start_load(await cache.match(tokens), target, from_token=1, layered=True)
        try:
            assert await stream.launched() == 1  # nothing claimed: the whole match is launched
            ahead = 0
            for layer in range(LAYOUT.num_layers):
                assert await stream.wait_layer(layer)
                got = kv[layer, target.to(DEVICE)]
                assert torch.equal(got, original[layer, 1:n]), f"layer {layer} not in place when ready"
                if layer + 1 < LAYOUT.num_layers:
                    if not torch.equal(kv[layer + 1, target.to(DEVICE)], original[layer + 1, 1:n]):
                        ahead += 1  # ready before the next layer landed: a real layer-wise load
                    gates[layer + 1].set()
        finally:
            for gate in gates:
                gate.set()  # never leave the copy thread blocked, also when the test fails
        result = await stream.finish()
        assert result.loaded_from == 1
        assert torch.equal(kv[:, target.to(DEVICE)], original[:, 1:n])
        if DEVICE.type == "cpu":
            assert ahead == LAYOUT.num_layers - 1
        with pytest.raises(ValueError, match="layer"):
            await stream.wait_layer(LAYOUT.num_layers)
        await assert_quiescent(cache)


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["load", "stream"])
async def test_slots_are_checked_once_per_call_at_the_public_edge(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    # The rule (#10): slot indices are validated once per call (range, duplicates: a pass
    # over the indices and a bitmap or sort), at the public edge; the launches below trust them
    # (the kernels' own check never runs).
    import aiokv.kernels.checks as checks
    import aiokv.slots as edge

    n = 6 * T
    tokens = prompt(76, n)
    calls = [0]
    below = [0]
    real: Callable[..., Any] = edge.check_values
    kernels_check: Callable[..., Any] = checks.check_slot_range

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    def counted_below(*args: Any, **kwargs: Any) -> Any:
        below[0] += 1
        return kernels_check(*args, **kwargs)

    async with KVCache(config(None, pool_pages=16, launch_pages=1, launch_turn_s=0), LAYOUT, make_kv(76)) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(n))
        monkeypatch.setattr(edge, "check_values", counted)
        monkeypatch.setattr(checks, "check_slot_range", counted_below)
        match = await cache.match(tokens)
        assert match.pool_pages == 6  # six launch groups of one page
        target = torch.arange(100, 100 + n)
        if path == "load":
            result = await cache.load(match, target)
            assert result.tokens == n
        else:
            async with await cache.start_load(match, target) as stream:
                assert (await stream.finish()).loaded_from == 0
        assert calls[0] == 1 and below[0] == 0
        await assert_quiescent(cache)


def test_thread_cpu_tells_a_thread_that_burns_cpu_from_one_that_blocks() -> None:
    """The measurement the test below (and bench_cache) relies on, checked where it can run: a
    thread that spins for 30 ms of its own CPU time, and one blocked on an event meanwhile."""
    if not thread_clocks_work():
        pytest.skip("per-thread CPU clocks do not advance here")
    go, spun, done = threading.Event(), threading.Event(), threading.Event()

    def spin() -> None:
        go.wait()
        began, give_up = time.thread_time(), time.monotonic() + 30
        while time.thread_time() - began < 0.03 and time.monotonic() < give_up:
            pass
        spun.set()
        done.wait()

    spinner, sleeper = threading.Thread(target=spin), threading.Thread(target=done.wait)
    spinner.start()
    sleeper.start()
    try:
        outer = time.perf_counter()
        with ThreadCPU([spinner]) as burned, ThreadCPU([sleeper]) as idle:
            go.set()
            assert spun.wait(60), "the spinning thread never finished"
        outer = time.perf_counter() - outer
    finally:
        go.set()
        done.set()
        spinner.join()
        sleeper.join()
    assert burned.cpu is not None and idle.cpu is not None
    assert 0.03 <= burned.cpu <= burned.wall + 0.001 and burned.wall <= outer, (burned.cpu, burned.wall, outer)
    assert idle.cpu < 0.005, idle.cpu


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the CUDA waiter threads exist on a GPU only")
@pytest.mark.asyncio
async def test_waiter_threads_do_not_spin_while_copies_are_in_flight() -> None:
    # The issue's rule (#10): a waiter thread blocks while the GPU works. CUDA: "If the
    # cudaEventBlockingSync flag has not been set, then the CPU thread will busy-wait until the
    # event has been completed by the device" (cudaEventSynchronize): a core burned per lane for
    # as long as copies are in flight.
    if not thread_clocks_work():
        pytest.skip("per-thread CPU clocks do not advance here: a spinning waiter cannot be seen")
    n = 6 * T
    tokens = prompt(77, n)
    async with KVCache(config(None, pool_pages=16), LAYOUT, make_kv(77)) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(n))
        await cache.flush()
        lane = next(t for t in cache._bridge._threads if t.name == "aiokv-cuda-load")
        assert lane.ident is not None
        match = await cache.match(tokens)
        torch.cuda._sleep(300_000_000)  # type: ignore[no-untyped-call]  # ~0.2 s of GPU time before the copies
        with ThreadCPU([lane]) as waiter:
            result = await cache.load(match, torch.arange(100, 100 + n))
        assert result.tokens == n
        cpu, wall = waiter.cpu, waiter.wall
        assert cpu is not None
        assert wall > 0.05, "the copies did not wait behind the GPU's work: nothing measured"
        assert cpu < 0.2 * wall, f"the load lane's waiter used {cpu * 1e3:.0f} ms of CPU in {wall * 1e3:.0f} ms"
        await assert_quiescent(cache)
