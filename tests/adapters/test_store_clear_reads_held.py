"""A reader store's ``clear()`` (a rescan: it replaces its disk tier) keeps ``close_timeout`` while a
page-file read hangs in the kernel.

The rescan closed the tier it replaced without a bound: with a read stuck (an ext4 whose device
stops answering, ``gate_helpers``: a frozen file system still serves reads) ``clear()`` returned
only once the read ended. Now it returns False after ``close_timeout`` (``clear_timeouts``), and
``close()`` keeps its bound too, leaving the staging pool the stuck read fills mapped until it ended;
the read then ends as a miss (it raised ``PoolClosedError`` copying out of the closed staging pool).
Root only.
"""

from __future__ import annotations

import concurrent.futures
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from aiokv.adapters.store import PageFileStore, Sharing, StoreConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from gate_helpers import gated_ext4
from store_helpers import wait_for

PAGE = 8192
CLOSE_S = 1.0
MARGIN_S = 1.5
BOUND_S = 30.0


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    wait_for(condition, what, BOUND_S)


@pytest.mark.root
def test_reader_clear_and_close_keep_close_timeout_while_a_read_hangs(tmp_path: Path) -> None:
    with gated_ext4(tmp_path, 320) as (mount, gate):  # room above the tier's 256 MiB free-space floor
        config = StoreConfig(directory=mount / "kv", queue_depth=4, zero_copy=False, close_timeout=CLOSE_S,
                             direct_io=True, reader_refresh_s=0)
        page = [torch.arange(PAGE, dtype=torch.int32).to(torch.uint8)]
        writer = PageFileStore(config, "test", {"model": "m"}, PAGE, sharing=Sharing.WRITER)
        try:
            key = writer.key(b"page")
            assert writer.thread.run(writer.store(key, page))
        finally:
            writer.close()
        reader = PageFileStore(config, "test", {"model": "m"}, PAGE, sharing=Sharing.READER)
        segment = reader._pool.memory.segment if reader._pool is not None else None
        assert segment is not None
        into = [torch.zeros(PAGE, dtype=torch.uint8)]
        loading: concurrent.futures.Future[bool] | None = None
        try:
            assert reader.thread.run(reader.load(key, into)) and torch.equal(into[0], page[0])
            gate.hold()
            loading = reader.thread.submit(reader.load(key, [torch.zeros(PAGE, dtype=torch.uint8)]))
            _wait_for(lambda: reader.thread.call(lambda: reader.statistics().reads_in_flight).result() == 1,
                      "the read in flight")
            gate.wait_held()  # it reached the device: stuck in the kernel

            began = time.perf_counter()
            cleared = reader.thread.submit(reader.clear()).result(timeout=CLOSE_S + MARGIN_S)
            took = time.perf_counter() - began
            assert took < CLOSE_S + MARGIN_S, f"clear() took {took:.1f} s with close_timeout {CLOSE_S} s"
            assert cleared is False and reader.clear_timeouts == 1
            assert not loading.done(), "the read ended: the gate did not hold it"

            began = time.perf_counter()
            reader.close()
            took = time.perf_counter() - began
            assert took < CLOSE_S + MARGIN_S, f"close() took {took:.1f} s with close_timeout {CLOSE_S} s"
            assert reader.close_timeouts == 1
            assert not segment.closed, "the staging pool was unmapped while a stuck read may fill it"

            gate.release()
            # The stuck read ends as a miss (never raising into the engine: its store is closed).
            assert loading.result(timeout=BOUND_S) is False
            reader.thread._thread.join(BOUND_S)  # the store's own thread stops once the pool is freed
            assert not reader.thread._thread.is_alive()
            assert segment.closed
        finally:
            gate.release()
            reader.close()
            reader.thread.close()
