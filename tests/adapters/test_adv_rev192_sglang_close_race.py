"""Review 192: an SGLang lookup racing the backend's close (SGLang's prefetch thread asks while its
controller detaches the backend).

The lookup's hand-over to the loop thread passed its check before the close and its start was
queued after the loop's end had run the loop for the last time: before 584a734 nothing answered it
and ``batch_exists`` waited for good; after, its future is cancelled, and ``batch_exists`` (as
``batch_exists_v2`` and ``clear``, which catch only ``LoopDied``) let
``concurrent.futures.CancelledError`` out into SGLang's thread. It now misses (0), as after a death.
The interleavings are forced with tracers on the asking thread and the loop thread."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from aiokv.adapters.loopthread import LoopThread

sglang_helpers = pytest.importorskip("sglang_helpers")
from test_adv_rev192_end_races import _pause_at  # noqa: E402

BOUND_S = 10.0


def test_a_lookup_racing_the_close_misses_instead_of_raising(tmp_path: Path) -> None:
    h = sglang_helpers
    made: list[Any] = []
    backend = h.attach(made, tmp_path / "kv", h.host_pool(4), True)
    assert backend.batch_exists(["warm-up"]) == 0  # opens the files and starts the loop thread
    loop_thread = backend._loop()
    at_submit, submit_go = threading.Event(), threading.Event()
    at_close, close_go = threading.Event(), threading.Event()
    submit_tracer = _pause_at(LoopThread.submit, "asyncio.run_coroutine_threadsafe", at_submit, submit_go)
    end_tracer = _pause_at(LoopThread._end, "self._loop.close()", at_close, close_go)
    loop_thread.loop.call_soon_threadsafe(sys.settrace, end_tracer)
    outcome: list[object] = []

    def ask() -> None:
        sys.settrace(submit_tracer)
        try:
            outcome.append(backend.batch_exists(["page-0", "page-1"]))
        except BaseException as exc:  # the outcome under test
            outcome.append(exc)
        finally:
            sys.settrace(None)

    asking = threading.Thread(target=ask, name="sglang-prefetch")
    closing = threading.Thread(target=backend.close, name="sglang-detach")
    try:
        asking.start()
        assert at_submit.wait(BOUND_S), "the lookup never reached its hand-over"
        closing.start()
        assert at_close.wait(BOUND_S), "the loop's end never reached its close"
        submit_go.set()
        asking.join(0.5)  # bounded: only so the hand-over is done before the loop closes
        close_go.set()
        closing.join(BOUND_S)
        asking.join(BOUND_S)
        assert not closing.is_alive() and not asking.is_alive(), "the close or the lookup hung"
        assert outcome == [0], f"the lookup racing the close did not miss: {outcome!r}"
    finally:
        submit_go.set()
        close_go.set()
        closing.join(BOUND_S)
        asking.join(BOUND_S)
        backend.close()
