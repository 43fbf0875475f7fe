"""Review 302: a loop-wide cancel (every task cancelled, as an application's SIGTERM handler or
``asyncio.run``'s end does) that cut the write-behind's workers while their writes were held in the
kernel left each worker's ``CancelledError`` kept by its task (CPython 3.11 keeps a cancelled
task's error until its cancellation is retrieved). That error's traceback held the cut write's
frames, its job and the job's export of the pool's memory: the pool's close could not unmap the
segment, whose mapping and descriptor stayed for as long as the closed cache was referenced. Now a
worker a cancel ended lets go of that error at once.

The cancel comes while the close waits for the write-behind's drain (its caller's wait timed out):
the cut close's frames keep the cut workers' tasks, and so their errors; a cancel with no close
waiting left nothing (those tasks were simply collected). Checked at the close, the cache still
referenced (as an engine keeps it): before, the segment was unmapped only once the cache was
dropped and collected.

Real: the writes held by a frozen loop-mounted ext4; the cancel real; thawed before the close run
anew."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch
from cache_helpers import LAYOUT, make_kv, prompt
from loop_probes import cancel_every_task_but_nowait, until, until_thread, waiting_in
from test_adv_rates_save_budget_spent import _config

from aiokv import KVCache

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from follow_helpers import open_fds
from fs_helpers import freeze, loop_ext4, thaw

BOUND_S = 30.0
T = LAYOUT.page_tokens


def _mapped(name: str) -> bool:
    with open("/proc/self/maps") as maps:
        return any(name in line for line in maps)


@pytest.mark.root
@pytest.mark.asyncio
async def test_a_loop_wide_cancel_of_held_writes_leaves_the_pool_freed_at_close(tmp_path: Path) -> None:
    fds_before = open_fds()
    with loop_ext4(tmp_path, 16) as mount:
        cache = KVCache(_config(mount / "kv"), LAYOUT, make_kv(1))
        watchdog = threading.Timer(2 * BOUND_S, thaw, args=(mount,))  # nothing stays frozen on a failure
        frozen = False
        try:
            await cache.start()
            await cache.pool.wait_ready()
            assert cache.disk is not None
            tier, pool = weakref.ref(cache.disk), weakref.ref(cache.pool)
            name = cache.pool.name.lstrip("/")
            assert await asyncio.to_thread(_mapped, name)
            freeze(mount)
            frozen = True
            watchdog.start()
            tokens = prompt(2, 4 * T)
            await cache.offload(tokens, torch.arange(len(tokens)))  # write-behind held in the kernel
            await until_thread(lambda: (disk := tier()) is not None and disk.statistics().in_flight > 0,
                               "a write held by the freeze", BOUND_S)
            # The close waits for the write-behind to drain (the caller's own wait timed out).
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(cache.aclose(), 0.2)
            await until(lambda: any(waiting_in(t, "join") for t in asyncio.all_tasks()), turns=1_000_000)
            cut = cancel_every_task_but_nowait(asyncio.current_task())
            assert cut
            await asyncio.wait(cut)  # each ended by the cancel (the held writes' workers among them)
            del cut
            thaw(mount)
            frozen = False
            async with asyncio.timeout(BOUND_S):
                await cache.aclose()
            await until_thread(lambda: not [t for t in threading.enumerate() if t.name.startswith("aiokv")],
                               "no aiokv thread left", BOUND_S)
            gc.collect()
            # The cache is closed but still referenced (as an engine keeps it): its pool is freed.
            assert not await asyncio.to_thread(_mapped, name), "the closed pool's segment is still mapped"
            leaked = open_fds() - fds_before
            assert not leaked, [await asyncio.to_thread(os.readlink, f"/proc/self/fd/{fd}") for fd in leaked]
        finally:
            watchdog.cancel()
            if frozen:
                thaw(mount)
            async with asyncio.timeout(BOUND_S):
                await cache.aclose()
        del cache
        gc.collect()
        assert tier() is None and pool() is None, "the closed cache's tier or pool outlived it"
