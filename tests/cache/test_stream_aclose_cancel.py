"""A cancelled or timed-out ``LoadStream.aclose()`` (and ``__aexit__``) raises after its copy ended.

Review: ``aclose`` waits through a cancel until no copy writes the engine's slots (so the engine
may reuse them), but then returned normally: the cancel was lost (``_abandon`` and
``Transfers.quiesce`` swallowed it, and ``aclose`` has no error of its own to raise). A TaskGroup or
an ``asyncio.timeout`` around it misbehaved. Each test holds the stream's copy on the copy thread,
cancels while it is held, and checks the call raised only once the copy was over, that nothing wrote
the slots after it raised, and that no reference is left.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, make_kv, mover_of, prompt

from aiokv import KVCache
from aiokv.stream import LoadStream

T = LAYOUT.page_tokens
pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="a CPU copy held on the copy thread")


@dataclass
class Held:
    """A started stream whose one copy is held on the copy thread until ``release`` is set."""

    cache: KVCache
    kv: torch.Tensor
    target: torch.Tensor
    stream: LoadStream
    release: threading.Event
    ended: list[float] = field(default_factory=list)
    """When the held copy ended (perf_counter), once it did."""


@asynccontextmanager
async def held_stream(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Held]:
    kv = make_kv(7)
    tokens = prompt(7, 4 * T)
    target = torch.arange(100, 100 + len(tokens))
    kv[:, target] = 0
    cache = KVCache(config(None, pool_pages=16, launch_pages=8, launch_turn_s=0), LAYOUT, kv)
    await cache.start()
    release = threading.Event()
    try:
        await cache.pool.wait_ready()
        assert (await cache.offload(tokens, torch.arange(len(tokens)))).stored == 4
        mover = mover_of(cache)
        real, started = mover.load, threading.Event()
        ended: list[float] = []

        def held(*args: Any, **kwargs: Any) -> Any:
            started.set()
            assert release.wait(30)
            out = real(*args, **kwargs)
            ended.append(time.perf_counter())
            return out

        monkeypatch.setattr(mover, "load", held)
        stream = await cache.start_load(await cache.match(tokens), target)
        await stream.launched()
        assert await asyncio.to_thread(started.wait, 30)
        yield Held(cache, kv, target, stream, release, ended)
    finally:
        release.set()
        await cache.aclose()


async def _settled_after_raise(h: Held, raised: float) -> None:
    """The copy ended before the call raised; nothing wrote the slots after; nothing is held."""
    assert h.ended and h.ended[0] <= raised, "the call raised while its copy still ran into the slots"
    after_raise = h.kv[:, h.target].clone()
    h.release.set()
    await assert_quiescent(h.cache)
    assert torch.equal(h.kv[:, h.target], after_raise), "the slots were written after the call raised"
    assert not any(h.cache.stats().errors.values()), h.cache.stats().errors


async def _until(predicate: Callable[[], bool]) -> None:
    for _ in range(10_000):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


@pytest.mark.asyncio
async def test_cancelled_aclose_raises_once_its_copy_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    async with held_stream(monkeypatch) as h:
        closer = asyncio.ensure_future(h.stream.aclose())
        await asyncio.sleep(0)  # aclose began
        await _until(h.stream._loader.done)  # past the loader (all launched): waiting on the copy
        await asyncio.sleep(0)
        assert not closer.done() and not h.ended, "the copy must still be held when the cancel arrives"
        closer.cancel()
        threading.Timer(0.1, h.release.set).start()  # the copy ends 0.1 s from now
        with pytest.raises(asyncio.CancelledError):
            await closer
        raised = time.perf_counter()
        assert closer.cancelled()
        await _settled_after_raise(h, raised)
        await h.stream.aclose()  # idempotent: nothing left to wait for, no second raise


@pytest.mark.asyncio
async def test_timeout_around_aclose_raises_timeout_error(monkeypatch: pytest.MonkeyPatch) -> None:
    async with held_stream(monkeypatch) as h:
        threading.Timer(0.3, h.release.set).start()  # longer than the timeout
        began = time.perf_counter()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await h.stream.aclose()
        raised = time.perf_counter()
        assert raised - began >= 0.05
        await _settled_after_raise(h, raised)


@pytest.mark.asyncio
async def test_aexit_cancelled_while_it_waits_propagates_the_cancel(monkeypatch: pytest.MonkeyPatch) -> None:
    async with held_stream(monkeypatch) as h:
        exiting = asyncio.Event()

        async def use() -> None:
            async with h.stream:
                exiting.set()  # the body ends normally; __aexit__ waits for the held copy

        task = asyncio.ensure_future(use())
        await exiting.wait()
        await asyncio.sleep(0)
        assert not task.done() and not h.ended
        task.cancel()
        threading.Timer(0.1, h.release.set).start()
        with pytest.raises(asyncio.CancelledError):
            await task
        raised = time.perf_counter()
        assert task.cancelled()
        await _settled_after_raise(h, raised)


@pytest.mark.asyncio
async def test_taskgroup_sibling_failure_cancels_aclose_and_the_group_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A sibling's error cancels the aclose; the group must see it end cancelled (else it would wait
    # for nothing and report the aclose as done), and raise the sibling's error.
    async with held_stream(monkeypatch) as h:
        closer_task: list[asyncio.Task[None]] = []

        async def fail() -> None:
            await asyncio.sleep(0.01)
            assert not h.ended
            threading.Timer(0.1, h.release.set).start()
            raise ValueError("sibling")

        async def group() -> None:
            async with asyncio.TaskGroup() as tasks:
                closer_task.append(tasks.create_task(h.stream.aclose()))
                tasks.create_task(fail())

        with pytest.raises(ExceptionGroup) as info:
            await group()
        raised = time.perf_counter()
        assert [type(e) for e in info.value.exceptions] == [ValueError]
        assert closer_task[0].cancelled()
        await _settled_after_raise(h, raised)
