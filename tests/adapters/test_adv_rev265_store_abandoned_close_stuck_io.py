"""Review 265: a store whose constructor was interrupted on a shared loop (the open abandoned: it closes
what it opened, on that loop) while that close is held by disk I/O stuck in the kernel (a frozen file
system): its ``io_stuck`` and ``wait_io_settled()`` must say so.

Only ``close()`` (its caller's thread) and the own loop's stop callback kept the close's stuck I/O;
the abandoned open's close (``_close_abandoned``) never did: ``io_stuck`` stayed False and
``wait_io_settled()`` returned at once with the write still stuck and the staging pool mapped, so an
owner of the loop that waits on it before stopping the loop would stop it under the close. The close's
run on the loop now keeps it, for every close.

The faults are real: an ext4 loop mount frozen (``fsfreeze -f``) under a write the tier has in flight,
and ``SIGUSR1`` to the constructing thread, its handler raising, sent once that write is held. A
watchdog thaws after THAW_S. Root only.
"""

from __future__ import annotations

import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from store_helpers import Interrupted, frozen_write_then_interrupt, tier_closed, wait_for

from aiokv.adapters.loopthread import LoopThread
from aiokv.adapters.store import PageFileStore, StoreConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from fs_helpers import freeze, loop_ext4, thaw

CLOSE_S = 1.0
THAW_S = 20.0
BOUND_S = 10.0
PAGE_BYTES = 8192


@pytest.mark.root
def test_an_abandoned_opens_close_left_with_stuck_io_is_reported_and_waited_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    main = threading.get_ident()
    count = [0]
    held: dict[str, Any] = {}
    with loop_ext4(tmp_path, 320) as mount:  # room above the disk tier's 256 MiB free-space floor
        watchdog = threading.Timer(THAW_S, thaw, args=(mount,))

        def freeze_fs() -> None:
            freeze(mount)
            watchdog.start()

        start_disk = frozen_write_then_interrupt(held, freeze_fs, main, lambda: count[0] > 0, BOUND_S)

        def handler(signum: int, frame: object) -> None:
            count[0] += 1
            raise Interrupted

        monkeypatch.setattr(PageFileStore, "_start_disk", start_disk)
        config = StoreConfig.from_options({"disk_dir": str(mount / "kv"), "disk_bytes": 64 * PAGE_BYTES,
                                           "close_timeout": CLOSE_S})
        thread = LoopThread("test-rev265-shared")
        previous = signal.signal(signal.SIGUSR1, handler)
        try:
            with pytest.raises(Interrupted):
                PageFileStore(config, "test", {"model": "m"}, PAGE_BYTES, thread=thread)
            assert count[0] == 1
            store, disk = held["store"], held["disk"]
            # The abandoned open's close ended after close_timeout, the write still stuck.
            wait_for(lambda: store.close_timeouts == 1 and store._closing is None,
                     "the abandoned open's close ended after close_timeout", BOUND_S + CLOSE_S)
            assert watchdog.is_alive() and not held["write"].done(), "the freeze did not hold the write"
            assert not tier_closed(disk)
            assert store.io_stuck, "io_stuck is False with the abandoned open's close's write stuck in the kernel"

            async def settled() -> tuple[bool, bool]:
                await store.wait_io_settled()
                return held["write"].done(), store._pool.memory.segment.closed

            waited = thread.submit(settled())
            thaw(mount)
            write_ended, pool_freed = waited.result(BOUND_S)
            assert write_ended and pool_freed, \
                f"wait_io_settled() returned with the write ended: {write_ended}, the staging pool freed: {pool_freed}"
            assert tier_closed(disk)
        finally:
            signal.signal(signal.SIGUSR1, previous)
            watchdog.cancel()
            thaw(mount)
            if "store" in held:  # the loop stops once the thawed close freed the staging pool
                wait_for(lambda: held["store"]._pool.memory.segment.closed, "the staging pool freed", BOUND_S)
            thread.close()
