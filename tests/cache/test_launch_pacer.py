"""Paced whole-page offloads: at most a budget of bytes queued on the GPU, FIFO, withdrawable.

The pacer's order is tested without a GPU (fake launches); the offload path through it runs on
CUDA only (CPU copies run one at a time on the copy thread and are not paced).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, make_kv, prompt

from aiokv import KVCache
from aiokv.transfers import LaunchPacer, PacedLaunch

T = LAYOUT.page_tokens


class Launches:
    """Fake launches: each returns a future the test completes, and records the bytes in flight."""

    def __init__(self, pacer: LaunchPacer) -> None:
        self.pacer = pacer
        self.started: list[str] = []
        self.inner: dict[str, asyncio.Future[None]] = {}
        self.in_flight_at_start: list[int] = []

    def run(self, name: str, nbytes: int, fail: bool = False) -> PacedLaunch:
        def start() -> tuple[asyncio.Future[None], None]:
            if fail:
                raise RuntimeError(f"launch of {name} refused")
            self.started.append(name)
            self.in_flight_at_start.append(self.pacer.in_flight)
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.inner[name] = future
            return future, None

        return self.pacer.run(nbytes, start)


async def _turns(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_copies_beyond_the_budget_wait_and_run_in_order_as_earlier_ones_land() -> None:
    pacer = LaunchPacer(100)
    fake = Launches(pacer)
    entries = [fake.run(name, 40) for name in "abcde"]
    assert fake.started == ["a", "b"]  # 80 bytes queued; c would make 120
    assert pacer.in_flight == 80 and len(pacer.queue) == 3
    fake.inner["b"].set_result(None)  # completion order need not be launch order
    await _turns()
    assert fake.started == ["a", "b", "c"] and entries[1].future.result() is None
    fake.inner["a"].set_result(None)
    await _turns()
    assert fake.started == ["a", "b", "c", "d"]
    assert max(at + 40 for at in fake.in_flight_at_start) <= 100
    for name in "cd":
        fake.inner[name].set_result(None)
    await _turns()
    fake.inner["e"].set_result(None)
    await _turns()
    assert [e.future.done() and e.future.exception() is None for e in entries] == [True] * 5
    assert pacer.in_flight == 0 and not pacer.queue


@pytest.mark.asyncio
async def test_a_copy_larger_than_the_budget_runs_alone() -> None:
    pacer = LaunchPacer(100)
    fake = Launches(pacer)
    fake.run("small", 10)
    big = fake.run("big", 500)
    after = fake.run("after", 10)
    assert fake.started == ["small"]  # FIFO: nothing overtakes the big one
    fake.inner["small"].set_result(None)
    await _turns()
    assert fake.started == ["small", "big"] and pacer.in_flight == 500
    fake.inner["big"].set_result(None)
    await _turns()
    assert fake.started == ["small", "big", "after"]
    fake.inner["after"].set_result(None)
    await _turns()
    assert big.future.done() and after.future.done()


@pytest.mark.asyncio
async def test_a_withdrawn_copy_never_starts_and_the_next_one_does() -> None:
    pacer = LaunchPacer(50)
    fake = Launches(pacer)
    first = fake.run("first", 50)
    second = fake.run("second", 50)
    third = fake.run("third", 50)
    assert pacer.withdraw(second) is True and second.future.cancelled()
    assert pacer.withdraw(first) is False  # launched: it runs to its end
    # Cancelled by its owner while it waited: skipped like a withdrawn one.
    third.future.cancel()
    fourth = fake.run("fourth", 50)
    fake.inner["first"].set_result(None)
    await _turns()
    assert fake.started == ["first", "fourth"]
    assert first.future.result() is None
    fake.inner["fourth"].set_result(None)
    await _turns()
    assert fourth.future.done() and pacer.in_flight == 0 and not pacer.queue


@pytest.mark.asyncio
async def test_launch_faults_and_failed_copies_settle_their_own_future_only() -> None:
    pacer = LaunchPacer(50)
    fake = Launches(pacer)
    first = fake.run("first", 50)
    refused = fake.run("refused", 50, fail=True)
    failing = fake.run("failing", 50)
    cancelled = fake.run("cancelled", 50)
    last = fake.run("last", 50)
    fake.inner["first"].set_result(None)
    await _turns()
    assert isinstance(refused.future.exception(), RuntimeError)  # the next one launched at once
    assert fake.started == ["first", "failing"]
    fake.inner["failing"].set_exception(OSError("copy failed"))
    await _turns()
    assert isinstance(failing.future.exception(), OSError)
    fake.inner["cancelled"].cancel()
    await _turns()
    assert cancelled.future.cancelled()
    fake.inner["last"].set_result(None)
    await _turns()
    assert first.future.result() is None and last.future.result() is None
    assert pacer.in_flight == 0


cuda_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="offloads are paced on CUDA only")


@cuda_only
@pytest.mark.asyncio
async def test_paced_offload_is_bit_exact_and_keeps_the_budget() -> None:
    kv = make_kv(61)
    n = 12 * T
    tokens = prompt(61, n)
    async with KVCache(config(None, pool_pages=32, launch_pages=1, launch_turn_s=0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        pacer = cache._transfers.offloads  # type: ignore[union-attr]
        pacer.budget = 2 * LAYOUT.page_bytes
        seen: list[int] = []
        launch = pacer._launch

        def watched(entry: PacedLaunch) -> None:
            launch(entry)
            seen.append(pacer.in_flight)

        pacer._launch = watched  # type: ignore[method-assign]
        result = await cache.offload(tokens, torch.arange(n))
        assert result.stored == 12
        assert len(seen) == 12 and max(seen) <= 2 * LAYOUT.page_bytes
        match = await cache.match(tokens)
        target = torch.arange(100, 100 + n)
        loaded = await cache.load(match, target)
        assert loaded.tokens == n
        assert torch.equal(kv[:, target.to(DEVICE)], kv[:, :n])
        await assert_quiescent(cache)


@cuda_only
@pytest.mark.asyncio
async def test_cancelled_paced_offload_withdraws_what_waits_and_stores_no_reused_bytes() -> None:
    kv = make_kv(62)
    original = kv.clone()
    n = 16 * T
    tokens = prompt(62, n)
    async with KVCache(config(None, pool_pages=32, launch_pages=1, launch_turn_s=0), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        # Warm first: an offload waits for the warm-up, whose own GPU work would queue behind the
        # sleep below (nothing reached the pacer within 0.5 s on the H200 without this).
        await cache.wait_warm()
        pacer = cache._transfers.offloads  # type: ignore[union-attr]
        pacer.budget = LAYOUT.page_bytes
        # The GPU busy before the offload: its first copy (ordered after the engine's stream) cannot
        # land before the test cancels, so the rest queue behind it (tiny pages copy in microseconds).
        torch.cuda._sleep(2_000_000_000)  # type: ignore[no-untyped-call]  # ~1 s at the H200's clock
        task = asyncio.create_task(cache.offload(tokens, torch.arange(n)))
        # Until launches are queued behind the first: by time, not loop turns (10,000 turns of
        # uvloop passed before the offload had queued them with 16 test processes on the host).
        deadline = time.monotonic() + 0.5
        for _ in range(100_000):
            if len(pacer.queue) >= 2 or task.done() or time.monotonic() > deadline:
                break
            await asyncio.sleep(0)
        assert len(pacer.queue) >= 2
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not pacer.queue or all(e.future.cancelled() for e in pacer.queue)
        kv[:, :n] = 7  # the engine reuses the slots at once (ordered after launched copies)
        await cache.flush()
        match = await cache.match(tokens)
        target = torch.arange(100, 100 + match.tokens)
        loaded = await cache.load(match, target)
        assert torch.equal(kv[:, target[: loaded.tokens].to(DEVICE)], original[:, : loaded.tokens])
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_closed_pacer_launches_nothing_more_and_drains_what_runs() -> None:
    # Regression (review): a copy queued behind the pacer was launched from a done-callback after
    # aclose had closed the bridge: its kernel reached the GPU with nothing waiting for it while
    # the pool was freed. Closing the pacer first fails what waits; what runs is drained.
    pacer = LaunchPacer(50)
    fake = Launches(pacer)
    running = fake.run("running", 50)
    waiting = fake.run("waiting", 50)
    pacer.close()
    assert isinstance(waiting.future.exception(), RuntimeError) and not pacer.queue
    late = fake.run("late", 10)
    assert isinstance(late.future.exception(), RuntimeError)
    drained = asyncio.create_task(pacer.drain())
    await _turns()
    assert not drained.done()  # "running" is still on the GPU
    fake.inner["running"].set_result(None)
    await asyncio.wait_for(drained, 5)
    assert fake.started == ["running"]  # nothing launched after close
    assert running.future.result() is None and pacer.in_flight == 0


@pytest.mark.asyncio
async def test_withdrawing_a_cancelled_calls_copies_launches_none_of_them() -> None:
    # Regression (review): quiesce withdrew a cancelled call's copies one by one; withdrawing the
    # first let the queue move on and launch the second, a copy started during its own call's
    # cancellation (and then waited for by the engine's stream).
    pacer = LaunchPacer(100)
    fake = Launches(pacer)
    fake.run("other", 50)
    first = fake.run("first", 60)  # does not fit beside "other"
    second = fake.run("second", 40)  # would fit once "first" is gone
    assert pacer.withdraw_all([first, second]) == [True, True]
    assert fake.started == ["other"]
    assert first.future.cancelled() and second.future.cancelled()
    fake.inner["other"].set_result(None)
    await _turns()
    assert fake.started == ["other"] and not pacer.queue and pacer.in_flight == 0
