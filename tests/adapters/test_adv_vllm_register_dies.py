"""The tier's loop thread dying while vLLM's CPU region is being registered with io_uring.

At start the tier hands the disk tier a byte view of vLLM's shared CPU region
(``DiskTier.register_memory``), which pins it in pieces on a thread while the loop goes on. A loop
that died meanwhile (a ``SystemExit`` let out on it, or the loop stopped without ``close``) cancels
the registration; the cancellation's traceback, reachable from the death the loop thread keeps
(``LoopThread.died``: its cause's traceback held the loop thread's frames and, through them, the
cancelled registration's), kept the disk tier's view of the region alive for the life of the
process. vLLM's shutdown then found the region still exported and kept it mapped for good ("buffers
are still exported to native users").

The death is real (a callback lets ``SystemExit`` out on the loop thread, or the loop is stopped);
the test only chooses its moment: the registration's pinning thread waits on an event before its
first piece, and the death lands while it waits."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm_helpers import make_manager, tier_of

import aiokv.storage.backends as backends
from aiokv.adapters.loopthread import LoopThread

BOUND_S = 30.0


def _die() -> None:
    raise SystemExit("injected: the loop thread ends")


def _raise(thread: LoopThread) -> None:
    thread.loop.call_soon_threadsafe(_die)


def _stop(thread: LoopThread) -> None:
    thread.loop.call_soon_threadsafe(thread.loop.stop)


class _Paused:
    """``update_in_batches`` whose first call waits for ``release`` before pinning anything."""

    def __init__(self, real: Callable[..., Iterator[list[Any]]]) -> None:
        self.real, self.entered, self.release = real, threading.Event(), threading.Event()

    def __call__(self, engine: Any, regions: Sequence[Any], stop: threading.Event,
                 prepare: Callable[[Any], None]) -> Iterator[list[Any]]:
        self.entered.set()
        assert self.release.wait(BOUND_S), "the test never released the registration"
        yield from self.real(engine, regions, stop, prepare)


@pytest.mark.parametrize("kill", [_raise, _stop], ids=["raises", "stopped"])
def test_the_loop_dying_inside_the_registration_lets_vllm_unmap_its_region(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        kill: Callable[[LoopThread], None]) -> None:
    paused = _Paused(backends.update_in_batches)
    monkeypatch.setattr(backends, "update_in_batches", paused)
    manager = make_manager(tmp_path)
    try:
        if not paused.entered.wait(BOUND_S):
            pytest.skip("the disk tier did not register vLLM's region (no io_uring here)")
        thread = tier_of(manager)._store.thread
        kill(thread)
        for _ in range(int(BOUND_S / 0.01)):  # the dying loop cancels the registration, which waits
            if thread.died is not None:
                break
            thread.wait_ended(0.01)
        assert thread.died is not None, "the loop did not die"
        paused.release.set()  # the piece in progress ends; the cancelled registration returns
        assert thread.wait_ended(BOUND_S) and thread.dead
        shutting = threading.Thread(target=manager.shutdown, name="vllm-shutdown", daemon=True)
        with caplog.at_level(logging.WARNING):
            shutting.start()
            shutting.join(BOUND_S)
        assert not shutting.is_alive(), "vLLM's shutdown hung"
        assert "still exported" not in caplog.text
        assert manager.primary_tier._mmap_region.mmap_obj is None  # unmapped: nothing holds it
    finally:
        paused.release.set()
        manager.shutdown()
