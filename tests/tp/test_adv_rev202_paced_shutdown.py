"""Review 202: a loop's shutdown ended a CUDA rank's paced load while its feed still queued copies.

``feed_layers`` (a CUDA rank's layer-wise load fed a few units at a time) returned a task awaiting
the feed on the copy thread. ``asyncio.run`` ending cancels every task left: that task too, while
the feed went on. The executor took the cancelled future for the copy's end (``COPY_FAILED``), the
worker's drain ended, CLOSED went out and the manager freed the load's slots and pages while the
feed still queued units writing them (wrong KV once the engine reused the slots). The future is
now a plain one, settled by callbacks, which the shutdown does not cancel.

Without a GPU: the CPU stand-in of ``test_paced`` plays the feed (copying each layer for real when
let), with the real ``CompletionBridge``; the drain is the worker's (``Cancels.outlast`` over a plain
future resolved when the load's future ends, as ``RankExecutor.drained`` is once the load reports).
The feed is let go only by the shutdown's cancel, so the shutdown lands mid-feed.
"""

from __future__ import annotations

import asyncio
import contextlib

import torch
from test_paced import LAYOUT, WAIT_S, HostPacedLoad, _buffers, _want

from aiokv.cuda import CompletionBridge
from aiokv.tp.cancels import Cancels
from aiokv.tp.layers import LayerProgress
from aiokv.tp.paced import feed_layers


def test_a_loop_s_shutdown_does_not_end_a_paced_load_while_its_feed_runs() -> None:
    raw, kv, pages, slots = _buffers()
    paced = HostPacedLoad(kv, pages, slots)
    bridge = CompletionBridge()
    seen: list[tuple[bool, int]] = []  # when the drain saw the load end: (cancelled, layers copied)

    def layers_copied() -> int:
        return sum(torch.equal(raw[layer, slots], _want(pages, layer)) for layer in range(LAYOUT.num_layers))

    async def main() -> None:
        progress = LayerProgress(LAYOUT.num_layers)
        fed = feed_layers(paced, progress, bridge)
        paced.gate.release()  # layer 0 is copied and issued; the feed then waits for the next release
        assert await asyncio.to_thread(progress.wait, 0, WAIT_S), "the feed never issued layer 0"
        started = asyncio.Event()
        # The executor's drained(): a plain future (no task, so no loop-wide cancel reaches it)
        # resolved when the load reports, i.e. when its future ends; the result is whether it ended
        # cancelled (the load then reported COPY_FAILED).
        reported: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        fed.add_done_callback(lambda done: reported.done() or reported.set_result(done.cancelled()))

        async def drain() -> None:
            cancelled = await Cancels().outlast(reported)
            seen.append((cancelled, layers_copied()))

        async def watch() -> None:
            started.set()
            try:
                await asyncio.Event().wait()
            finally:  # the shutdown's cancel (every task left): the feed goes on from here
                for event in paced.events:
                    event.done.set()
                paced.gate.release(LAYOUT.num_layers)

        left = {asyncio.create_task(drain()), asyncio.create_task(watch())}  # left to the shutdown
        await started.wait()
        assert not any(task.done() for task in left)

    try:
        with contextlib.suppress(asyncio.CancelledError):
            asyncio.run(main())
    finally:
        paced.gate.release(LAYOUT.num_layers)
        for event in paced.events:
            event.done.set()
        bridge.close()
    assert seen == [(False, LAYOUT.num_layers)], (
        f"the drain saw the load end (cancelled, layers copied) {seen} while its feed still ran")
    assert paced.fed == 1

