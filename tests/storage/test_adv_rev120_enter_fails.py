"""A submission the kernel refuses (``io_uring_enter`` fails: here for real, the ring's descriptor
number made to name an eventfd, which the kernel answers with EOPNOTSUPP) fails the SQEs nobody
took. What their callbacks prepare meanwhile (a chain's follow-up, the next page started on the
freed slot) and the requests that waited for ring room must still go out once the ring works again:
before, the failure reset the ring's tail after running those callbacks, wiping the SQEs they had
just written (their callers and ``aclose`` waited for good), and the waiting requests were never
prepared (no completion was left to drain, the one place that prepares them)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from collections.abc import Iterator

import pytest

from aiokv.storage.uring import OP_NOP, UringEngine, sqe


@contextlib.contextmanager
def refusing_ring(engine: UringEngine) -> Iterator[None]:
    """``io_uring_enter`` on ``engine`` fails in the kernel while inside (its fd names an eventfd)."""
    saved = os.dup(engine._fd)
    other = os.eventfd(0, os.EFD_CLOEXEC)
    try:
        os.dup2(other, engine._fd)
        yield
    finally:
        os.dup2(saved, engine._fd)
        os.close(saved)
        os.close(other)


async def settle(engine: UringEngine, *futures: asyncio.Future[list[int]]) -> bool:
    """Whether ``futures`` all completed within 5 s (a lost SQE never completes)."""
    _done, pending = await asyncio.wait(set(futures), timeout=5)
    return not pending and engine.in_flight == 0


@pytest.mark.asyncio
async def test_what_a_refused_submissions_callbacks_prepare_still_goes_out(caplog: pytest.LogCaptureFixture) -> None:
    engine = UringEngine.open(8)
    loop = asyncio.get_running_loop()
    first: asyncio.Future[list[int]] = loop.create_future()
    follow_up: asyncio.Future[list[int]] = loop.create_future()
    try:
        def failed(results: list[int]) -> None:
            first.set_result(results)
            # A chain's follow-up (a CLOSE after a broken chain; the next page on the freed slot).
            engine.submit([sqe(OP_NOP)], None, follow_up.set_result)

        with refusing_ring(engine):
            engine.submit([sqe(OP_NOP)], None, failed)
            engine.submit([sqe(OP_NOP)], None, lambda _r: None)  # a second SQE the kernel did not take
            await first
        assert first.result() == [-errno.EOPNOTSUPP]
        ok = await settle(engine, follow_up)
        if not ok:  # the failure this test is about: the follow-up's SQE was wiped, aclose would hang
            engine._inflight.clear()
            engine._ops_inflight = 0
        assert ok, "the SQE prepared by a failed request's callback never went out"
        assert follow_up.result() in ([0], [-errno.EOPNOTSUPP])  # went out (maybe while still refused)
        assert "io_uring_enter failed" in caplog.text
    finally:
        await engine.aclose()


@pytest.mark.asyncio
async def test_requests_waiting_for_room_go_out_after_a_refused_submission() -> None:
    engine = UringEngine.open(4)
    loop = asyncio.get_running_loop()
    assert engine.sq_entries == 4
    try:
        with refusing_ring(engine):
            refused = [engine.nop() for _ in range(4)]  # the ring's room, prepared in this turn
            later: list[asyncio.Future[list[int]]] = []
            for _ in range(3):  # no room: they wait for completions
                future: asyncio.Future[list[int]] = loop.create_future()
                engine.submit([sqe(OP_NOP)], None, future.set_result)
                later.append(future)
            assert len(engine._waiting) == 3
            results = await asyncio.gather(*refused, return_exceptions=True)
        assert all(isinstance(r, OSError) and r.errno == errno.EOPNOTSUPP for r in results)
        ok = await settle(engine, *later)
        if not ok:  # nothing in the kernel: no completion would ever prepare them
            engine._waiting.clear()
        assert ok, "requests waiting for ring room were never prepared after the refusal"
        # Each went out: done, or refused again in the turn after (the ring still refusing then).
        assert all(f.result() in ([0], [-errno.EOPNOTSUPP]) for f in later)
    finally:
        await engine.aclose()
