"""A KVCache offload whose CUDA launch fails part-way fails only once what it did queue has run.

The launch pacer (``LocalTransfers.offloads``) reported such a failure at once: the manager then
aborted the copy's pool pages, which the next offload or disk read could take again while the
gathers queued before the fault still wrote them (a reused page taking a late write: wrong KV). The
TP executor already waited for what it had queued; the in-process path now does too, and the
pacer keeps the copy's bytes in flight until then.

Without a GPU the launch runs over a small model of CUDA streams and events (the mover's contract
on a failed launch: the caller's current stream waits for what its lanes had queued before the
error propagates), with the real completion bridge and pacer. The GPU test injects a real CUDA
error (an invalid pitch on the second run copy) into a real offload by run copies.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, make_kv, prompt

import aiokv.cache
import aiokv.cuda
from aiokv import KVCache
from aiokv.cuda import CompletionBridge
from aiokv.transfers import LocalTransfers

T = LAYOUT.page_tokens
BOUND_S = 30.0


class FakeStream:
    """A stream: the work queued on it so far (each item done once its event is set)."""

    def __init__(self) -> None:
        self.queued: list[threading.Event] = []

    def wait_event(self, event: FakeEvent) -> None:
        self.queued.extend(event.covers)


class FakeEvent:
    """An event: complete once the work queued before its record is done."""

    sticky = False  # a sticky CUDA error: every record fails

    def __init__(self, *_: object, **__: object) -> None:
        self.covers: list[threading.Event] = []

    def record(self, stream: FakeStream | None = None) -> None:
        if FakeEvent.sticky:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (stand-in)")
        assert stream is not None
        self.covers = list(stream.queued)

    def query(self) -> bool:
        return all(work.is_set() for work in self.covers)

    def synchronize(self) -> None:
        for work in self.covers:
            assert work.wait(BOUND_S), "queued work never ended"


class PartWayMover:
    """An offload that queues its first group on a side lane, then fails to launch the second."""

    def __init__(self, current: FakeStream) -> None:
        self.current = current
        self.pages = [torch.empty(LAYOUT.page_bytes, dtype=torch.uint8)]
        self.first_group = threading.Event()

    def offload(self, slots: torch.Tensor, page_ids: list[int], ready: Any = None, *, checked: bool = False) -> Any:
        lane = FakeStream()
        lane.queued.append(self.first_group)  # the first group's gather, still running
        # As PageMover._ordered_on_failure: the caller's stream waits for what was queued.
        queued = FakeEvent()
        queued.record(lane)
        self.current.wait_event(queued)
        raise RuntimeError("launch of the second group refused")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeStream:
    current = FakeStream()
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(FakeEvent, "sticky", False)
    return current


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_a_part_way_failed_offload_launch_fails_only_after_what_it_queued(fake_cuda: FakeStream) -> None:
    mover = PartWayMover(fake_cuda)
    bridge = CompletionBridge()
    transfers = LocalTransfers(mover, bridge, torch.device("cuda"), pace_bytes=LAYOUT.page_bytes)  # type: ignore[arg-type]
    try:
        copy = transfers.offload(torch.arange(2 * T), [0, 1])
        later = transfers.offload(torch.arange(2 * T, 3 * T), [2])  # paced behind it
        await _turns()
        assert copy.launch is not None and copy.launch.launched
        assert not copy.future.done(), "the failure was reported while the first group still ran"
        assert transfers.offloads.in_flight == 2 * LAYOUT.page_bytes, "its bytes left the budget while queued"
        assert not later.future.done() and later.launch is not None and not later.launch.launched
        mover.first_group.set()
        async with asyncio.timeout(BOUND_S):
            with pytest.raises(RuntimeError, match="second group refused"):
                await copy.future
            with pytest.raises(RuntimeError, match="second group refused"):
                await later.future  # launched once the first copy's work ended (and failed alike)
        assert transfers.offloads.in_flight == 0 and not transfers.offloads.running
    finally:
        mover.first_group.set()
        await asyncio.to_thread(bridge.close)


@pytest.mark.asyncio
async def test_a_part_way_failed_launch_with_a_sticky_error_fails_at_once(fake_cuda: FakeStream) -> None:
    """Once every event record fails, nothing queued runs any more: the copy fails at once (waiting
    for an event that cannot be recorded would keep the offload, and the close, waiting for ever)."""
    mover = PartWayMover(fake_cuda)
    bridge = CompletionBridge()
    transfers = LocalTransfers(mover, bridge, torch.device("cuda"), pace_bytes=LAYOUT.page_bytes)  # type: ignore[arg-type]
    try:
        real_offload = mover.offload

        def sticky_after_the_fault(*args: Any, **kwargs: Any) -> Any:
            try:
                return real_offload(*args, **kwargs)
            finally:
                FakeEvent.sticky = True

        mover.offload = sticky_after_the_fault  # type: ignore[method-assign]
        copy = transfers.offload(torch.arange(2 * T), [0, 1])
        await _turns()
        assert copy.future.done()
        assert isinstance(copy.future.exception(), RuntimeError)
        assert transfers.offloads.in_flight == 0
    finally:
        mover.first_group.set()
        await asyncio.to_thread(bridge.close)


class PartWayLoadMover(PartWayMover):
    """A load (whole or layer-wise) that queues its first group on a side lane, then fails to launch
    the second; the caller's stream is ordered after the first (PageMover._ordered_on_failure)."""

    def _queue_then_fail(self) -> None:
        lane = FakeStream()
        lane.queued.append(self.first_group)  # the first group's copies, still reading pool pages
        queued = FakeEvent()
        queued.record(lane)
        self.current.wait_event(queued)
        raise RuntimeError("launch of the second group refused")

    def load(self, *_: Any, **__: Any) -> Any:
        self._queue_then_fail()

    def start_layers(self, *_: Any, **__: Any) -> None:
        return None  # not paced: load_layers queues directly

    def load_layers(self, *_: Any, **__: Any) -> Any:
        self._queue_then_fail()


@pytest.mark.parametrize("layered", [False, True], ids=["whole", "layered"])
@pytest.mark.asyncio
async def test_a_part_way_failed_load_fails_at_once_but_the_close_waits_for_what_it_queued(
    fake_cuda: FakeStream, layered: bool
) -> None:
    """helper-98's review: the load is reported failed at once (its queued copies only write slots
    past the loaded prefix), but nothing waited for them: a close then unmapped the pool they still
    read (a GPU fault in the engine's context). The bridge now holds their end and its close joins it."""
    mover = PartWayLoadMover(fake_cuda)
    bridge = CompletionBridge()
    transfers = LocalTransfers(mover, bridge, torch.device("cuda"))  # type: ignore[arg-type]
    try:
        launch = transfers.load_layers if layered else transfers.load
        copy = launch([0, 1], torch.arange(2 * T), 0)
        await _turns()
        assert copy.future.done() and isinstance(copy.future.exception(), RuntimeError)
        closing = asyncio.ensure_future(asyncio.to_thread(bridge.close))
        done, _ = await asyncio.wait({closing}, timeout=0.3)
        assert not done, "the bridge closed (and the pool could go) while the failed load's copies still ran"
        mover.first_group.set()
        async with asyncio.timeout(BOUND_S):
            await closing
    finally:
        mover.first_group.set()
        await asyncio.to_thread(bridge.close)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs AIOKV_TEST_DEVICE=cuda")
@pytest.mark.asyncio
async def test_a_real_offload_failing_part_way_reports_after_its_queued_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    real = aiokv.cuda.memcpy2d_async
    calls: list[int] = []

    def second_fails(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
                     stream: torch.cuda.Stream) -> None:
        calls.append(dst)
        # The second run copy gets a pitch below its width: the runtime refuses it (a real CUDA error).
        real(dst, 1 if len(calls) == 2 else dpitch, src, spitch, width, height, stream)

    # The cache's mover offloads run-slotted pages by run copies (``_build_mover``: slot_runs):
    # the raw runtime calls a real CUDA error can be injected into.
    kv = make_kv(71)
    n = 2 * T
    tokens = prompt(71, n)
    async with KVCache(config(None, pool_pages=16, launch_pages=2, launch_turn_s=0), LAYOUT, kv) as cache:
        await cache.wait_started()
        monkeypatch.setattr(aiokv.cuda, "memcpy2d_async", second_fails)
        engine = torch.cuda.current_stream(DEVICE)
        torch.cuda._sleep(400_000_000)  # type: ignore[no-untyped-call]  # the copies wait behind it
        slept = torch.cuda.Event()  # type: ignore[no-untyped-call]
        slept.record(engine)
        result = await cache.offload(tokens, torch.arange(n))
        assert len(calls) == 2, "both run copies were tried (one ascending run per page)"
        # The refused call left its error as this thread's last CUDA error: clear it before torch's
        # next launch check reads it as its own.
        runtime = aiokv.cuda._runtime_library()
        assert runtime is not None
        runtime.cudaGetLastError()
        assert slept.query(), "the failure was reported before the copy it had queued ran"
        assert result.stored == 0
        assert cache.stats().errors.get("copy_failed", 0) >= 1
        monkeypatch.setattr(aiokv.cuda, "memcpy2d_async", real)
        await assert_quiescent(cache)
