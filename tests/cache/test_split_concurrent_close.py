"""A stream closed by another task (the request aborted) while the engine's task is in a stream call.

Found by ``test_split_oracle_props.py`` (helper-97), fixed since: ``aclose()`` from a second task while
the first is in ``finish()`` (or in its own ``aclose()``) returned at once, copies still writing the
slots; and ``launched()`` raised ``CancelledError`` in a task nobody cancelled when another task
closed the stream. Minimal deterministic cases: the CPU copy is held on a gate, so it is provably in
flight.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, make_kv, prompt
from loop_probes import until_thread

from aiokv import KVCache
from aiokv.kernels.hostcopy import HostScatter

T = LAYOUT.page_tokens
cpu_only = pytest.mark.skipif(DEVICE.type != "cpu", reason="holds the CPU copy thread on a gate")


@asynccontextmanager
async def _held_copies(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[threading.Event, threading.Event]]:
    """Copies into the KV buffer wait for the first event; the second is set once one is waiting."""
    gate, entered = threading.Event(), threading.Event()
    real: Callable[..., None] = HostScatter.load

    def held(*args: Any, **kwargs: Any) -> None:
        entered.set()
        gate.wait(30)
        real(*args, **kwargs)

    monkeypatch.setattr(HostScatter, "load", held)
    try:
        yield gate, entered
    finally:
        gate.set()  # never leave the copy thread blocked, also when the test fails


@cpu_only
@pytest.mark.asyncio
async def test_aclose_from_another_task_during_finish_waits_for_the_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = make_kv(1)
    tokens = prompt(1, 4 * T)
    async with KVCache(config(None), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(4 * T))
        target = torch.arange(100, 100 + 4 * T)
        kv[:, target] = 0
        async with _held_copies(monkeypatch) as (gate, entered):
            stream = await cache.start_load(await cache.match(tokens), target)
            finishing = asyncio.ensure_future(stream.finish())  # the request's task
            await until_thread(entered.is_set, "the copy started")  # its copy is in flight, held
            closing = asyncio.ensure_future(stream.aclose())  # another task aborts the request
            for _ in range(20):
                await asyncio.sleep(0)
            returned = closing.done()
            gate.set()
            await closing
            await finishing
        # aclose: "returns only when no copy touches the slots and every page is released".
        assert not returned, "aclose() returned while finish()'s copy was still writing the slots"
        await assert_quiescent(cache)


@cpu_only
@pytest.mark.asyncio
async def test_cancelled_task_whose_stream_another_task_is_closing_ends_after_the_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kv = make_kv(2)
    tokens = prompt(2, 4 * T)
    async with KVCache(config(None), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(4 * T))
        target = torch.arange(100, 100 + 4 * T)
        kv[:, target] = 0
        async with _held_copies(monkeypatch) as (gate, entered):
            stream = await cache.start_load(await cache.match(tokens), target)

            async def request() -> None:
                async with stream:
                    await asyncio.Event().wait()  # the engine computes something else meanwhile

            task = asyncio.ensure_future(request())
            await until_thread(entered.is_set, "the copy started")
            closing = asyncio.ensure_future(stream.aclose())  # an abort: quiescing, held by the copy
            await asyncio.sleep(0)
            task.cancel()  # the request's own task is cancelled too: its __aexit__ calls aclose
            for _ in range(20):
                await asyncio.sleep(0)
            ended_early = task.done()
            gate.set()
            await closing
            with pytest.raises(asyncio.CancelledError):
                await task
        assert not ended_early, "the cancelled task ended while a copy into its slots was still running"
        await assert_quiescent(cache)


@asynccontextmanager
async def _on_disk_only(tmp_path: Path, kv: torch.Tensor, tokens: list[int]) -> AsyncIterator[KVCache]:
    """A cache restarted over ``tokens``' pages written by an earlier one: on disk only, none in the pool."""
    async with KVCache(config(tmp_path), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(len(tokens)))
        await cache.flush()
    async with KVCache(config(tmp_path), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        yield cache


@cpu_only
@pytest.mark.asyncio
async def test_launched_returns_when_another_task_closes_the_stream(tmp_path: Path) -> None:
    kv = make_kv(3)
    tokens = prompt(3, 6 * T)
    async with _on_disk_only(tmp_path, kv, tokens) as cache:
        match = await cache.match(tokens)
        assert match.disk_pages == 6
        stream = await cache.start_load(match, torch.arange(100, 100 + 6 * T))
        waiting = asyncio.ensure_future(stream.launched())  # the engine's task, before its tail prefill
        front = asyncio.ensure_future(stream.wait_front(0))  # the same wait through wait_front
        await asyncio.sleep(0)
        await stream.aclose()  # another task aborts the request
        assert await front == stream.front  # wait_front: returns where the load stopped
        try:
            got = await waiting
        except asyncio.CancelledError:
            got = None
        assert got == stream.front, "launched() raised CancelledError in a task nobody cancelled"
        await assert_quiescent(cache)


@pytest.mark.asyncio
async def test_aclose_during_finish_stops_a_load_waiting_on_a_stuck_read(tmp_path: Path) -> None:
    # helper-98's review: the aclose() above waited for finish(), which waited on a disk read; with
    # the read stuck (a hung file system) the abort hung too, and no timeout could end it (the wait
    # goes through cancellation). An abort stops the load as its own aclose() would.
    kv = make_kv(4)
    tokens = prompt(4, 6 * T)
    async with _on_disk_only(tmp_path, kv, tokens) as cache:
        manager = cache._manager
        real = manager.promote
        gate = asyncio.Event()
        entered = asyncio.Event()

        async def stuck(key: Any, windowed: bool = False) -> Any:  # a read held in the kernel until the gate opens
            entered.set()
            await gate.wait()
            return await real(key, windowed)

        manager.promote = stuck  # type: ignore[method-assign]
        try:
            stream = await cache.start_load(await cache.match(tokens), torch.arange(100, 100 + 6 * T))
            finishing = asyncio.ensure_future(stream.finish())  # the request's task, no claim
            await entered.wait()
            async with asyncio.timeout(10):  # returns once the loader stopped, the read still stuck
                await stream.aclose()  # the scheduler aborts the request
            assert not gate.is_set()
            result = await finishing  # finish() settles what was launched: nothing, the read never landed
            assert result.loaded_from == result.tokens and result.disk_pages == 0
            with pytest.raises(RuntimeError, match="already called"):
                await stream.finish()
        finally:
            gate.set()  # the adopted read lands and is released
        await assert_quiescent(cache)


@cpu_only
@pytest.mark.asyncio
async def test_finish_after_another_tasks_aclose_waits_for_its_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    # finish() while another task's aclose() quiesces raised RuntimeError at once, its copy still
    # writing the slots (the caller would then reuse them): it raises only once the close is through.
    kv = make_kv(5)
    tokens = prompt(5, 4 * T)
    async with KVCache(config(None), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        await cache.offload(tokens, torch.arange(4 * T))
        target = torch.arange(100, 100 + 4 * T)
        async with _held_copies(monkeypatch) as (gate, entered):
            stream = await cache.start_load(await cache.match(tokens), target)
            await until_thread(entered.is_set, "the copy started")  # a copy in flight, held
            closing = asyncio.ensure_future(stream.aclose())  # another task aborts the request
            await asyncio.sleep(0)
            finishing = asyncio.ensure_future(stream.finish())  # the request's task
            for _ in range(20):
                await asyncio.sleep(0)
            raised_early = finishing.done()
            gate.set()
            await closing
            with pytest.raises(RuntimeError, match="after aclose"):
                await finishing
        assert not raised_early, "finish() returned while the aborted copy still wrote the slots"
        await assert_quiescent(cache)
