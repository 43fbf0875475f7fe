"""A rank worker's session cancelled a second time while it ends still waits for its warm-up and
unmaps the pool; neither does a cancel during the attach or the bridge's close leave anything behind.

Regression: the session's end waited through one cancel for the copies running, then raised
``CancelledError``, so a second cancel there (two ``aclose()`` calls, or ``run()`` cancelled and
then ``aclose()``) skipped the warm-up's join and the unmap: the pool stayed mapped in the rank
process after the manager freed it, and the warm-up thread ran on unjoined.

A real :class:`RankGroup` and a real :class:`RankWorker` on this loop (tp_size 1); the worker's copy,
warm-up, attach or bridge close is held inside the real call on a ``threading.Event`` until the
test lets it go, so each cancel lands at a known point. Mapped or not is read from
``/proc/self/maps`` and ``/proc/self/fd`` (the manager's own mapping of the pool is the baseline).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from held_call import BOUND_S, Hold
from loop_probes import until, waiting_in
from tp_helpers import full_kv, new_pool
from warmup_gate import WARM, warm_threads

from aiokv.cuda import CompletionBridge
from aiokv.kernels import TransferPath
from aiokv.kernels import mover as mover_module
from aiokv.kernels.launch import LaunchKey, record_launches
from aiokv.kernels.paths import interpreting
from aiokv.kernels.warmup import warm_up as real_warm_up
from aiokv.layout import KVLayout
from aiokv.pool import PageMemory, PagePool
from aiokv.tp import Direction, RankGroup, RankWorker, TPConfig
from aiokv.tp import rankwarm as rankwarm_module

LAYOUT = KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
CONFIG = TPConfig(reconnect_initial_s=0.001, reconnect_max_s=0.05, inline_copy_bytes=0)
"""Every CPU copy goes through the copy thread (none runs on the loop), where the test holds it."""


@pytest.fixture
def holds() -> Iterator[Callable[[], Hold]]:
    """``make()``: a new :class:`Hold`; all are released at the end (a failing test never leaves a
    thread held)."""
    made: list[Hold] = []

    def make() -> Hold:
        made.append(Hold())
        return made[-1]

    yield make
    for hold in made:
        hold.release()


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[PagePool]:
    pool = await new_pool(LAYOUT.for_tp(1), 16)
    yield pool
    await pool.aclose()


@pytest_asyncio.fixture
async def group(pool: PagePool, tmp_path: Path) -> AsyncIterator[RankGroup]:
    async with RankGroup(LAYOUT, 1, pool.name, pool.num_pages, CONFIG, tmp_path / "g") as group:
        yield group


def mappings(name: str) -> int:
    """Lines of ``/proc/self/maps`` that map segment ``name``, plus descriptors open on it."""
    path = "/dev/shm" + name
    with open("/proc/self/maps") as maps:
        mapped = sum(1 for line in maps if len(line.split()) >= 6 and line.split()[5] == path)
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}") == path
        except OSError:
            pass  # closed meanwhile (the listing's own descriptor)
    return mapped + fds


def _worker(group: RankGroup, path: TransferPath) -> RankWorker:
    return RankWorker(group.address, 0, 1, LAYOUT, full_kv(LAYOUT, 1, 64), CONFIG, path=path)


async def _cancel_twice(worker: RankWorker, run: asyncio.Task[None], how: str) -> list[asyncio.Future[None]]:
    """Cancel the session once (``how``), wait until its end began (the pool is no longer served:
    it is fenced and waits for the copy), then cancel it again with ``aclose()``."""
    session = worker._session_task
    assert session is not None
    if how == "aclose twice":
        first: asyncio.Future[None] = asyncio.ensure_future(worker.aclose())
    else:  # the engine cancels run(), then closes the worker
        run.cancel()
        first = run
    await until(lambda: not worker.attached)  # set right before the fence: the session's end is under way
    second = asyncio.ensure_future(worker.aclose())
    await until(lambda: session.cancelling() >= 2)
    assert not session.done()
    return [first, second]


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["aclose twice", "run cancelled then aclose"])
async def test_a_second_cancel_while_a_copy_runs_still_unmaps_the_pool(
    pool: PagePool, group: RankGroup, holds: Callable[[], Hold], monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    copy = holds()
    monkeypatch.setattr(mover_module.HostScatter, "load", copy.wrap(mover_module.HostScatter.load))
    baseline = mappings(pool.name)
    worker = _worker(group, TransferPath.REFERENCE)
    run = asyncio.ensure_future(worker.run())
    try:
        async with asyncio.timeout(BOUND_S):
            await worker.wait_attached()
            await group.wait_attached()
            executor = worker._executor
            assert executor is not None
            assert mappings(pool.name) > baseline, "the probe does not see the worker's mapping"
            job = group.submit_nowait(group.spec(Direction.LOAD, [0], range(T)))
            await copy.wait_entered()
            closes = await _cancel_twice(worker, run, how)
            assert not any(c.done() for c in closes), "a close ended while the copy still ran"
            copy.release()
            results = await asyncio.gather(*closes, return_exceptions=True)
            assert (await job).ok, "the copy's report did not go out before the link closed"
    finally:
        copy.release()
        await worker.aclose()
        await asyncio.gather(run, return_exceptions=True)
    # Old code: the second cancel cut the session's end short after the drain.
    assert executor._mover is None and executor.memory.segment.closed, "the pool is still mapped"
    assert mappings(pool.name) == baseline, "the worker's mapping of the pool is still in the process"
    assert worker._executor is None and worker._warm is None
    if how == "aclose twice":
        assert results == [None, None]
    else:
        assert run.cancelled() and results[1] is None
    assert not worker.statistics().attached


@pytest.mark.asyncio
@pytest.mark.skipif(not interpreting(), reason="CPU test: kernels under the Triton interpreter")
async def test_a_second_aclose_while_a_copy_runs_still_joins_the_warm_up(
    pool: PagePool, group: RankGroup, holds: Callable[[], Hold], monkeypatch: pytest.MonkeyPatch
) -> None:
    # STAGING path: the session warms its kernels on a thread of its own. That thread is held at
    # its first launch after it declared the page-aligned variants warm (specs run from then on),
    # and the copy is held at its first launch on the copy thread: both run when the closes come.
    warm_hold, copy_hold = holds(), holds()
    past_ready = threading.Event()

    def warm_up(mover: Any, stop: Any, on_ready: Callable[[], None]) -> Any:
        def ready() -> None:
            past_ready.set()
            on_ready()

        return real_warm_up(mover, stop, ready)

    monkeypatch.setattr(rankwarm_module, "warm_up", warm_up)

    def hook(_: LaunchKey) -> None:
        if threading.current_thread().name == WARM:
            if past_ready.is_set():
                warm_hold.wrap(lambda: None)()
        elif threading.current_thread() is not threading.main_thread():
            copy_hold.wrap(lambda: None)()

    baseline = mappings(pool.name)
    worker = _worker(group, TransferPath.STAGING)
    with record_launches(hook=hook):
        run = asyncio.ensure_future(worker.run())
        try:
            async with asyncio.timeout(BOUND_S):
                await worker.wait_attached()
                await group.wait_attached()
                await warm_hold.wait_entered()  # the warm-up runs on, past "ready"
                executor, warm = worker._executor, worker._warm
                assert executor is not None and warm is not None
                threads = warm_threads()
                assert len(threads) == 1
                executor._mover.load_runs = False  # the load launches the kernel the copy hold stops in
                job = group.submit_nowait(group.spec(Direction.LOAD, [0], range(T)))
                await copy_hold.wait_entered()
                session = worker._session_task
                assert session is not None
                closes = await _cancel_twice(worker, run, "aclose twice")
                copy_hold.release()
                assert (await job).ok
                # Now the session must wait for the warm-up thread; old code ended the close here.
                await until(lambda: all(c.done() for c in closes) or waiting_in(session, "aclose"))
                assert not any(c.done() for c in closes), "the close ended with the warm-up thread running"
                assert threads[0].is_alive() and executor._mover is not None
                warm_hold.release()
                assert await asyncio.gather(*closes) == [None, None]
        finally:
            warm_hold.release()
            copy_hold.release()
            await worker.aclose()
            await asyncio.gather(run, return_exceptions=True)
    assert warm._thread is not None and warm._thread.done(), "aclose returned before the warm-up's thread did"
    threads[0].join(10)  # it returned its result; only its exit may be left
    assert not threads[0].is_alive()
    result = warm.result
    assert result is not None and result.stopped
    assert executor._mover is None and mappings(pool.name) == baseline, "the pool is still mapped"


@pytest.mark.asyncio
async def test_aclose_during_a_reconnect_attach_leaves_no_mapping(
    pool: PagePool, tmp_path: Path, holds: Callable[[], Hold], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The manager restarts with a new pool; the worker reconnects and its attach of the new pool
    # (a thread) is held when aclose() cancels the session. Old code abandoned that thread: the
    # mapping it made stayed in the process, with a descriptor holding the segment open for good.
    attach = holds()
    real_attach = PagePool.attach
    directory = tmp_path / "restart"
    worker = RankWorker(directory / "manager.sock", 0, 1, LAYOUT, full_kv(LAYOUT, 2, 64), CONFIG,
                        path=TransferPath.REFERENCE)
    run = asyncio.ensure_future(worker.run())
    second_pool = await new_pool(LAYOUT.for_tp(1), 8)
    baseline = mappings(second_pool.name)
    try:
        async with asyncio.timeout(BOUND_S):
            async with RankGroup(LAYOUT, 1, pool.name, pool.num_pages, CONFIG, directory) as first:
                await first.wait_attached()
            await worker.wait_detached()

            def held_attach(name: str, layout: KVLayout) -> PageMemory:
                if name == second_pool.name:
                    return attach.wrap(real_attach)(name, layout)  # type: ignore[no-any-return]
                return real_attach(name, layout)

            monkeypatch.setattr(PagePool, "attach", staticmethod(held_attach))
            async with RankGroup(LAYOUT, 1, second_pool.name, second_pool.num_pages, CONFIG, directory):
                await attach.wait_entered()
                closing = asyncio.ensure_future(worker.aclose())
                session = worker._session_task
                assert session is not None
                await until(lambda: session.cancelling() >= 1)
                attach.release()
                await closing
                assert await asyncio.to_thread(attach.returned.wait, BOUND_S)
                for _ in range(3):
                    await asyncio.sleep(0)  # what a done thread still hands to the loop
                assert mappings(second_pool.name) == baseline, "the abandoned attach left the pool mapped"
        assert worker.statistics().sessions == 1 and not worker.attached
    finally:
        attach.release()
        await worker.aclose()
        await asyncio.gather(run, return_exceptions=True)
        await second_pool.aclose()


@pytest.mark.asyncio
async def test_run_cancelled_twice_while_the_bridge_closes_still_ends_the_worker(
    group: RankGroup, holds: Callable[[], Hold], monkeypatch: pytest.MonkeyPatch
) -> None:
    # run()'s end joins the completion bridge's threads (in a thread); cancelled again there, old
    # code never marked the worker ended, and aclose() (no task of its own to wait for) hung.
    bridge_close = holds()
    monkeypatch.setattr(CompletionBridge, "close", bridge_close.wrap(CompletionBridge.close))
    worker = _worker(group, TransferPath.REFERENCE)
    run = asyncio.ensure_future(worker.run())
    try:
        async with asyncio.timeout(BOUND_S):
            await worker.wait_attached()
            run.cancel()
            await bridge_close.wait_entered()
            run.cancel()
            await until(lambda: run.cancelling() >= 2)
            bridge_close.release()
        async with asyncio.timeout(10):  # old code: waits for ever
            await worker.aclose()
        assert bridge_close.returned.is_set(), "aclose returned before the bridge's threads were joined"
        with pytest.raises(RuntimeError, match="has stopped"):
            await worker.wait_attached()
    finally:
        bridge_close.release()
        await asyncio.gather(run, return_exceptions=True)
    assert run.cancelled()
