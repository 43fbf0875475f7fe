"""Review 266: a reader store (``Sharing.READER``: an MLA reader rank) whose own loop thread the
kernel refuses (a pids limit reached: ``RuntimeError: can't start new thread``).

``PageFileStore.__init__`` starts the reader's staleness-check worker (``ReaderCheck``, a thread) and
only then its own loop thread (``open_thread``), both before the ``try`` whose cleanup joins that
worker: a refused loop thread left the check worker running for good, nobody holding the store. Each
start retried under the limit (an engine restarting its tier) leaks one more thread, each taking one
more of the pids the limit is short of. The refused ``LoopThread`` left its event loop unclosed too
(self-pipe sockets, selector), warning wherever gc collected it. Both fixed (helper 269): each test fails
without its fix.

The fault is real: the constructing thread moved into a pids cgroup (v1) that admits one more task
(the check worker), so that the loop thread's start is refused. Root only.
"""

from __future__ import annotations

import gc
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from store_helpers import pids_limited, wait_for

from aiokv.adapters.store import PageFileStore, Sharing, StoreConfig

PAGE = 8192
BOUND_S = 10.0


@pytest.fixture
def limited() -> Iterator[Path]:
    with pids_limited("rev266", BOUND_S) as group:
        yield group


def _checks() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "aiokv-rev266-check" and t.is_alive()]


@pytest.mark.root
def test_a_refused_loop_thread_leaves_no_check_worker(tmp_path: Path, limited: Path) -> None:
    assert not _checks()
    errors: list[BaseException] = []

    def start() -> None:
        (limited / "tasks").write_text(str(threading.get_native_id()))
        (limited / "pids.max").write_text("2")  # this thread and one more: the check worker
        try:
            PageFileStore(StoreConfig(directory=tmp_path / "kv", close_timeout=1.0), "rev266", {"model": "m"}, PAGE,
                          sharing=Sharing.READER)
        except BaseException as exc:
            errors.append(exc)

    with warnings.catch_warnings():  # what earlier tests left unclosed is not this test's
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    starter = threading.Thread(target=start, name="test-starter", daemon=True)
    try:
        starter.start()
        starter.join(BOUND_S)
        assert not starter.is_alive(), "the store's start hung"
        assert len(errors) == 1 and isinstance(errors[0], RuntimeError), errors
        assert "can't start new thread" in str(errors[0]), "the loop thread was not the one refused"
        wait_for(lambda: not _checks(), "the reader's check worker ended", 2.0)
        # The refused LoopThread's event loop is closed by its __init__ (its self-pipe and selector), not left
        # to gc: collected unclosed, it warns (ResourceWarning) in whichever later test gc runs.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            errors.clear()
            gc.collect()
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)], \
            [str(w.message) for w in caught]
    finally:
        errors.clear()
        for leaked in _checks():  # stopped here (its ReaderCheck is its target's instance)
            leaked._target.__self__.stop()  # type: ignore[attr-defined]
            leaked.join(BOUND_S)
