"""An engine waits on every layer in turn: a copy's event is waited on once per engine stream.

Regression (twenty-fourth session): ``wait_layer``/``order_layer`` ordered the engine's current
stream after every launched copy's event again for each of the 32 layers: a whole-page copy's one
event took 32 ``cudaStreamWaitEvent`` calls, and the 32 ``wait_layer`` calls of a streaming hit
held the H200's loop 1.6-1.9 ms (``tools/bench_cache.py --mode gpu``). The GPU side here is a fake
stream that counts its waits: the memo's rules (once per stream and event, again on another
stream, a new event always) hold on any machine.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from aiokv.transfers import LocalTransfers


class _Stream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


def _transfers(monkeypatch: pytest.MonkeyPatch, current: list[_Stream]) -> LocalTransfers:
    transfers: Any = object.__new__(LocalTransfers)  # only order_after's fields: no mover, no GPU
    transfers._cuda = True
    transfers._device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    return transfers  # type: ignore[no-any-return]


def test_each_event_is_waited_on_once_per_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = _Stream(11), _Stream(22)
    current = [first]
    transfers = _transfers(monkeypatch, current)
    a, b, c = object(), object(), object()
    seen: set[tuple[int, int]] = set()
    for _ in range(32):  # an engine's wait_layer for every layer of a whole-page load
        transfers.order_after([a, b], seen)  # type: ignore[list-item]
    assert first.waited == [a, b]
    transfers.order_after([a, b, c], seen)  # type: ignore[list-item]  # a later copy's event
    assert first.waited == [a, b, c]
    current[0] = second  # the engine switched streams: that one was never ordered
    transfers.order_after([a, b, c], seen)  # type: ignore[list-item]
    assert second.waited == [a, b, c] and first.waited == [a, b, c]


def test_without_a_memo_every_call_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = _Stream(5)
    transfers = _transfers(monkeypatch, [stream])
    a = object()
    transfers.order_after([a])  # type: ignore[list-item]
    transfers.order_after([a])  # type: ignore[list-item]  # settle's and quiesce's calls keep no memo
    assert stream.waited == [a, a]


@pytest.mark.asyncio
async def test_a_streaming_hits_layer_waits_order_each_copy_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from aiokv.streamcopies import StreamCopies
    from aiokv.transfers import Copy

    stream = _Stream(7)
    transfers = _transfers(monkeypatch, [stream])
    loop = asyncio.get_running_loop()
    copies = StreamCopies(transfers, last_page=5)
    events = [object() for _ in range(3)]
    for low, event in zip((4, 2, 0), events, strict=True):  # whole-page copies, from the back
        done: asyncio.Future[None] = loop.create_future()
        done.set_result(None)
        copies.add(low, Copy(done, event), [], tier=None)  # type: ignore[arg-type]
    for layer in range(32):
        assert await copies.wait_layer(layer)
    assert stream.waited == events  # 96 waits before the memo
