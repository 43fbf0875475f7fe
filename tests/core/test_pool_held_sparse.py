"""A pool's start waits for a dead creator's segment that a live process still holds only while
letting it go could make the room: by the memory it holds, not its size (review 122, left open).

In a private 16 MiB /dev/shm: 8 MiB taken by a file of the operator's, a 12 MiB segment of a
creator killed after touching 1 MiB (sparse) and mapped by a live process. A 10 MiB pool does not
fit (7 MiB free) and would not once the holder lets go (7 + 1 MiB): its start must fail at once, not
after waiting ``RECLAIM_SETTLE_S`` for memory the segment never held (it counted the 12 MiB size).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from private_shm import SCENARIO, killed_mid_preparation, needs_namespace, run_in_private_shm

MIB = 1 << 20
SETTLE_S = 3.0


@needs_namespace
def test_a_start_does_not_wait_for_a_held_sparse_segment_that_cannot_make_the_room() -> None:
    report = run_in_private_shm(__file__, 16)
    assert report["error"] == "SegmentSpaceError", report
    assert report["waited_s"] < SETTLE_S / 2, report  # before: the whole RECLAIM_SETTLE_S


def _scenario() -> dict[str, Any]:
    import asyncio

    import torch

    from aiokv import KVLayout
    from aiokv import pool as pool_module
    from aiokv.pool import PagePool
    from aiokv.shm import SHM_DIR, SegmentSpaceError

    pool_module.RECLAIM_SETTLE_S = SETTLE_S
    name = killed_mid_preparation(12 * MIB, 1 * MIB)  # first: a creator checks its size fits
    fd = os.open(SHM_DIR + "/operators-file", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.posix_fallocate(fd, 0, 8 * MIB)
    os.close(fd)
    path = SHM_DIR + name
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, mmap, os, sys, time\n"
        f"fd = os.open({path!r}, os.O_RDWR)\n"
        "fcntl.flock(fd, fcntl.LOCK_SH)\n"  # what an attached aiokv process holds
        "m = mmap.mmap(fd, 0)\n"
        "print('mapped', flush=True)\n"
        "time.sleep(120)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "mapped"
        layout = KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4)

        async def start() -> tuple[str | None, float]:
            began = time.monotonic()
            try:
                pool = await PagePool.open(layout, 10 * MIB // layout.page_bytes * layout.page_bytes,
                                           register_cuda=False, chunk_bytes=2 * MIB)
            except SegmentSpaceError as exc:
                return type(exc).__name__, time.monotonic() - began
            await pool.aclose()
            return None, time.monotonic() - began

        error, waited = asyncio.run(start())
        return {"error": error, "waited_s": waited, "present": os.path.exists(path)}
    finally:
        holder.kill()
        holder.wait()


if __name__ == "__main__" and sys.argv[1:2] == [SCENARIO]:
    print(json.dumps(_scenario()))
