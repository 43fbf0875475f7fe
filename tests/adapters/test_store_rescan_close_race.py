"""A reader store's rescan (``fresh_prefix``/``fresh_contains``) racing ``close()`` on a shared loop
thread (SGLang's READER stores share one): the close stops it, and nothing outlives the close.

The rescan ran in the caller's task, which ``close()`` neither stopped nor waited for: close()
returned with the rescan still starting a tier (here: stuck on a frozen file system, ``fsfreeze
-f``, which holds the reader's start-up), and once it got through, ``fresh_prefix`` answered a hit
from a store already closed and left that new tier running (its ring, threads and directory
descriptors leaked). Now close() stops the rescan within ``close_timeout``, the caller gets a miss,
calls after the close miss too, and the rescan's thread closes what it made once the file system
thaws. A watchdog thaws after THAW_S so nothing stays stuck when a check fails. Root only.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from aiokv.adapters.loopthread import LoopThread
from aiokv.adapters.store import PageFileStore, Sharing, StoreConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from fs_helpers import freeze, loop_ext4, thaw
from store_helpers import wait_for

PAGE = 8192
CLOSE_S = 1.0
MARGIN_S = 1.5
THAW_S = 15.0
BOUND_S = 10.0

pytestmark = pytest.mark.root


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    wait_for(condition, what, BOUND_S)


def _open_below(mount: Path) -> list[str]:
    """This process's descriptors of files and directories on the file system at ``mount``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own descriptor, closed by now
        if target == str(mount) or target.startswith(f"{mount}/"):
            found.append(target)
    return found


def test_close_stops_a_readers_rescan_stuck_on_a_frozen_fs(tmp_path: Path) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    with loop_ext4(tmp_path, 320) as mount:  # room above the disk tier's 256 MiB free-space floor
        config = StoreConfig(directory=mount / "kv", queue_depth=2, close_timeout=CLOSE_S, reader_refresh_s=0)
        page = [torch.arange(PAGE, dtype=torch.int32).to(torch.uint8)]
        shared = LoopThread("test-shared")
        writer = PageFileStore(config, "test", {"model": "m"}, PAGE, sharing=Sharing.WRITER)
        reader = PageFileStore(config, "test", {"model": "m"}, PAGE, thread=shared, sharing=Sharing.READER)
        watchdog = threading.Timer(THAW_S, thaw, args=(mount,))
        try:
            key = writer.key(b"late")
            assert writer.thread.run(writer.store(key, page))  # published after the reader indexed
            freeze(mount)  # the reader's rescan (a new tier over the directory) hangs in the kernel
            watchdog.start()
            before = shared.call(lambda: reader._refreshed).result()
            looking = shared.submit(reader.fresh_prefix([key]))
            _wait_for(lambda: shared.call(lambda: reader._refreshed != before).result(), "the rescan began")
            assert not looking.done(), "the rescan ended: the freeze did not hold it"

            began = time.perf_counter()
            reader.close()
            took = time.perf_counter() - began
            assert took < CLOSE_S + MARGIN_S, f"close() took {took:.1f} s with close_timeout {CLOSE_S} s"
            concurrent.futures.wait([looking], timeout=MARGIN_S)
            assert looking.done(), "fresh_prefix still waits for a rescan that close() left running"
            assert looking.result() == 0, "a closed store answered a hit"
            # Calls after the close miss (none rescans again).
            assert shared.run(reader.fresh_prefix([key])) == 0
            assert shared.run(reader.fresh_contains([key])) == [False]
            assert shared.call(lambda: reader.contains([key])).result() == [False]
            assert reader.refreshes == 0

            thaw(mount)
            writer.close()
            # The stopped rescan's thread closes what it had opened once the file system thawed;
            # no tier of the reader's keeps a directory open.
            _wait_for(lambda: not _open_below(mount), "descriptors on the file system to close")
            assert reader.refreshes == 0
        finally:
            watchdog.cancel()
            thaw(mount)
            reader.close()
            writer.close()
            shared.close()
