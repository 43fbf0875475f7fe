"""SGLang's backend closed while a ``batch_get_v1`` read is held in the kernel (review 108).

The ext4 under the page files stops answering (``gate_helpers``: a FUSE-backed loop device whose
reads are held) while SGLang's prefetch thread waits in ``batch_get_v1``, and the backend is closed.
Each pool's store keeps ``close_timeout``, but the backend then joined the pools' shared loop
thread, whose end waits for the stuck read: ``close()`` hung for as long as the disk did, and the
waiting call got ``concurrent.futures.CancelledError``. Now ``close()`` returns after
``close_timeout``; the loop thread stops (and the staging pool is freed) once the read ended; the
waiting call returns only then (its read lands in SGLang's host pool before it returns, never
after), with per-key answers. And calls in flight answer before the loop stops.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from gate_helpers import gated_ext4

sglang_helpers = pytest.importorskip("sglang_helpers")

CLOSE_S = 1.0
MARGIN_S = 3.0
BOUND_S = 30.0


@pytest.mark.root
def test_close_keeps_close_timeout_while_a_read_is_held_and_the_read_answers_after(tmp_path: Path) -> None:
    h = sglang_helpers
    with gated_ext4(tmp_path, 320) as (mount, gate):  # room above the tier's 256 MiB free-space floor
        pool = h.host_pool(8)
        for p in range(2):
            h.fill(pool, p, seed=p)
        made: list[Any] = []
        backend = h.attach(made, mount / "kv", pool, True, options={"close_timeout": CLOSE_S, "direct_io": True})
        answers: list[Any] = []
        reading = threading.Thread(target=lambda: answers.append(_get(backend)), name="sglang-prefetch", daemon=True)
        try:
            assert backend.batch_set_v1(["a", "b"], h.indices([0, 1])) == [True, True]
            written = [h.page(pool, p) for p in range(2)]
            loop_thread = backend._loop()  # the pools' shared loop thread (started with their files)
            before = [h.page(pool, p) for p in range(8)]
            gate.hold()
            reading.start()
            gate.wait_held()
            began = time.monotonic()
            closing = threading.Thread(target=backend.close, name="sglang-detach", daemon=True)
            closing.start()
            closing.join(CLOSE_S + MARGIN_S)
            assert not closing.is_alive(), "close() hangs while a read is held in the kernel"
            assert time.monotonic() - began >= CLOSE_S * 0.9
            assert reading.is_alive(), "the call returned while its read may still land in the host pool"
            gate.release()
            if reading.ident is not None:
                reading.join(BOUND_S)
            loop_thread._thread.join(BOUND_S)  # stops once the read ended: the staging pool is freed
            assert not loop_thread._thread.is_alive()
            (got,) = answers
            assert isinstance(got, list) and len(got) == 2 and all(isinstance(x, bool) for x in got), got
            after = [h.page(pool, p) for p in range(8)]
            for slot, ok, want in zip((4, 5), got, written, strict=True):
                if ok:
                    assert bool((after[slot] == want).all()), "a read reported good holds other bytes"
            assert all(bool((before[p] == after[p]).all()) for p in (0, 1, 2, 3, 6, 7))
        finally:
            gate.release()
            if reading.ident is not None:
                reading.join(BOUND_S)
            backend.close()


def test_close_lets_calls_in_flight_answer_before_it_stops_the_loop(tmp_path: Path) -> None:
    """A ``batch_set_v1`` of many pages (one staging page: they take turns) in flight while the
    backend closes: the stores close and refuse the rest at once, but the backend then stopped the
    loop while the call still ran, cancelling it under SGLang's thread, which got
    ``concurrent.futures.CancelledError`` (every time with this interleaving; 2 calls in 10 in a
    plain race). The interleaving is forced by holding the loop in a callback while the call and
    the close queue up behind it. Now the call answers per key. No root needed."""
    h = sglang_helpers
    pages = 256
    pool = h.host_pool(pages)
    made: list[Any] = []
    backend = h.attach(made, tmp_path / "kv", pool, True, options={"staging_pages": 1, "queue_depth": 1})
    assert backend.batch_exists(["warm-up"]) == 0  # opens the files and starts the loop thread
    loop_thread = backend._loop()
    go, pause = threading.Event(), threading.Event()
    held = loop_thread.call(lambda: go.wait(BOUND_S))  # the loop runs nothing else until go

    def queued(count: int, what: str) -> None:
        deadline = time.monotonic() + BOUND_S
        while len(loop_thread._waiting) < count:  # futures handed out, not answered yet
            assert time.monotonic() < deadline, f"{what} never reached the loop"
            pause.wait(0.001)

    answers: list[Any] = []
    keys = [f"page-{i}" for i in range(pages)]
    writing = threading.Thread(target=lambda: answers.append(_set(backend, keys, h.indices(list(range(pages))))),
                               name="sglang-backup", daemon=True)
    closing = threading.Thread(target=backend.close, name="sglang-detach", daemon=True)
    try:
        writing.start()
        queued(2, "the write")
        closing.start()
        queued(3, "the close")
        go.set()
        closing.join(BOUND_S)
        writing.join(BOUND_S)
        assert held.result(BOUND_S) is True
        (got,) = answers
        assert isinstance(got, list) and len(got) == pages and all(isinstance(x, bool) for x in got), got
        assert not got[-1]  # the close refused what had not been written yet
    finally:
        go.set()
        closing.join(BOUND_S)
        writing.join(BOUND_S)
        backend.close()


def _set(backend: Any, keys: list[str], indices: Any) -> Any:
    try:
        return backend.batch_set_v1(keys, indices)
    except BaseException as exc:  # what reached SGLang's thread
        return exc


def _get(backend: Any) -> Any:
    try:
        return backend.batch_get_v1(["a", "b"], sglang_helpers.indices([4, 5]))
    except BaseException as exc:  # what reached SGLang's thread
        return exc


def _die() -> None:
    raise SystemExit("injected: the loop thread ends")


@pytest.mark.root
def test_close_after_the_loop_died_with_a_read_held_keeps_close_timeout(tmp_path: Path) -> None:
    """The loop thread dies (a SystemExit let out on it) while a ``batch_get_v1`` read is held in the
    kernel: its end waits for that read. ``close()`` then joined the dying thread without a bound;
    now it returns after ``close_timeout`` and the thread ends by itself once the read did. The
    waiting call answers False for each key, only after its read ended."""
    h = sglang_helpers
    with gated_ext4(tmp_path, 320) as (mount, gate):
        pool = h.host_pool(8)
        h.fill(pool, 0, seed=5)
        h.fill(pool, 1, seed=6)
        made: list[Any] = []
        backend = h.attach(made, mount / "kv", pool, True, options={"close_timeout": CLOSE_S, "direct_io": True})
        answers: list[Any] = []
        reading = threading.Thread(target=lambda: answers.append(_get(backend)), name="sglang-prefetch", daemon=True)
        try:
            assert backend.batch_set_v1(["a", "b"], h.indices([0, 1])) == [True, True]
            loop_thread = backend._loop()
            gate.hold()
            reading.start()
            gate.wait_held()
            loop_thread.loop.call_soon_threadsafe(_die)
            pause, deadline = threading.Event(), time.monotonic() + BOUND_S
            while loop_thread.died is None:
                assert time.monotonic() < deadline, "the loop did not die"
                pause.wait(0.001)
            began = time.monotonic()
            closing = threading.Thread(target=backend.close, name="sglang-detach", daemon=True)
            closing.start()
            closing.join(CLOSE_S + MARGIN_S)
            assert not closing.is_alive(), "close() hangs on a dying loop whose read is held in the kernel"
            assert time.monotonic() - began < CLOSE_S + MARGIN_S
            assert reading.is_alive(), "the call returned while its read may still land in the host pool"
            gate.release()
            reading.join(BOUND_S)
            assert loop_thread.wait_ended(BOUND_S)
            assert answers == [[False, False]]
        finally:
            gate.release()
            if reading.ident is not None:
                reading.join(BOUND_S)
            backend.close()
