"""A completion callback that raises a ``BaseException`` (a ``CancelledError`` escaping a chain's
callback: it is no ``Exception``, so the drain's guard lets it through) inside a ring wake-up.
The CQEs the drain had consumed must stay consumed (handled again, a chain's silent ops were
counted twice and the ring's room with them) and the ones after it must still be drained in the
next turn: the eventfd will not fire again for CQEs already posted, so before, they waited for an
unrelated completion (here: for ever), and with them the wake-up's SQEs of the next pages."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aiokv.storage.uring import OP_NOP, TURNS, UringEngine, sqe


@pytest.mark.asyncio
async def test_completions_after_a_raising_callback_are_drained_next_turn() -> None:
    engine = UringEngine.open(8)
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        calls: list[str] = []
        later: asyncio.Future[list[int]] = loop.create_future()

        def raising(_results: list[int]) -> None:
            calls.append("raising")
            raise asyncio.CancelledError  # a BaseException: through the drain's guard

        engine.submit([sqe(OP_NOP)], None, raising)
        engine.submit([sqe(OP_NOP)], None, later.set_result)  # completes in the same drain, after it
        inflight = engine._ops_inflight
        assert inflight == 2
        await asyncio.wait({later}, timeout=3)
        stuck = not later.done()
        assert not stuck, "the completion after the raising callback was never drained"
        assert later.result() == [0] and calls == ["raising"]  # each handled once
        assert engine._ops_inflight == 0 and engine.in_flight == 0
        assert not TURNS.waking and not engine._waking
        assert any(isinstance(c.get("exception"), asyncio.CancelledError) for c in reported)
        # The ring goes on: another round trip, its room intact.
        assert await asyncio.wait_for(engine.nop(), 3) == 0
    finally:
        loop.set_exception_handler(None)
        if engine._inflight:  # the failure above: what is left would hold aclose for good
            engine._inflight.clear()
            engine._ops_inflight = 0
        await engine.aclose()
