"""SGLang's lookup on an MLA reader rank while the backend closes with the reader's staleness check
stuck (helper-145).

A reader rank looks for a page file it lacks on its check worker (``ReaderCheck``); on a hung file
system that look blocks in the kernel. ``close()`` (SGLang's detach) then held the lookup waiting
on it: the store's close waited ``close_timeout`` for the worker, the backend's close another
``close_timeout`` for the lookup to answer, then stopped the loop under it, and ``batch_exists``
raised ``concurrent.futures.CancelledError`` into SGLang's prefetch thread (its contract: a count of
leading hits). Now the close answers the stuck check False at once: the lookup misses (0) while
the close still waits for the worker. The look is held here by a gate in place of the kernel (the
worker's one call into the file system), so the test needs no root.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage",
                    reason="SGLang is not installed (make test installs requirements-engines.txt)")

import sglang_helpers as sh

import aiokv.adapters.storedirs as storedirs

CLOSE_S = 5.0
"""close_timeout: the lookup must answer well before the close's bound on the stuck worker."""
ANSWER_S = 4.0
BOUND_S = 30.0


def test_a_lookup_held_by_a_stuck_staleness_check_misses_when_the_backend_closes(
        tmp_path: Path, backends: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    options = {"reader_refresh_s": 0, "close_timeout": CLOSE_S}
    writer = sh.attach(backends, tmp_path, sh.mla_pool(4), True, mla=True, tp_rank=0, options=options)
    writer.on_host_pools_registered()
    reader = sh.attach(backends, tmp_path, sh.mla_pool(4), True, mla=True, tp_rank=1, options=options)
    reader.on_host_pools_registered()
    assert reader.batch_exists(["before"]) == 0  # no file: the look runs and answers

    entered, gate = threading.Event(), threading.Event()
    look = storedirs._any_page_file

    def held(layout_fd: int, names: Any) -> bool:
        entered.set()
        gate.wait(BOUND_S)  # a look stuck in the kernel
        return look(layout_fd, names)

    monkeypatch.setattr(storedirs, "_any_page_file", held)
    answer: list[object] = []
    answered = threading.Event()

    def lookup() -> None:  # SGLang's prefetch thread
        try:
            answer.append(reader.batch_exists(["page-the-writer-never-wrote"]))
        except BaseException as exc:
            answer.append(exc)
        answered.set()

    closed = threading.Event()
    threads = [threading.Thread(target=lookup, name="prefetch", daemon=True),
               threading.Thread(target=lambda: (reader.close(), closed.set()), name="detach", daemon=True)]
    try:
        threads[0].start()
        assert entered.wait(BOUND_S), "the lookup never looked for the page file"
        threads[1].start()
        # Answered while the close still waits (up to close_timeout) for the stuck worker.
        assert answered.wait(ANSWER_S), "the lookup waits for the stuck look through close()"
        assert answer == [0]
    finally:
        gate.set()
    assert closed.wait(BOUND_S)
    for thread in threads:
        thread.join(BOUND_S)
        assert not thread.is_alive()
