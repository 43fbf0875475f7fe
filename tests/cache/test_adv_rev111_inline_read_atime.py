"""The hang behind review 111's held-groups test: a page read that io_uring issues inline, in the
loop thread's ``io_uring_enter``, updated the file's access time there, and the update waits for the
file system (``touch_atime`` -> ``ext4_dirty_inode``: the journal, a read of the inode's table
block). With the disk hung the loop thread stayed in the kernel; in the held-groups test, whose gate
is let go by the test on that loop, for good (seen under load: a jbd2 commit fell into the hold;
every later ``mkfs.ext4`` and ``losetup -a`` on the host then hung opening that loop device).

Here the inode table blocks are dropped from the cache before the hold (the journal checkpointed,
then ``POSIX_FADV_DONTNEED`` on the block device), so the update must read one from the held
device: the loop thread must not wait for it. A watchdog thread lets the gate go once the loop
thread sat in the kernel (state D) for ``STUCK_S`` straight, so the test fails instead of hanging.
Root only.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import struct
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from cache_helpers import assert_quiescent
from group_helpers import GROUP, LAYOUT, T, group_config, put_on_disk, random_kv, random_tokens
from loop_probes import until_thread

from aiokv import CacheConfig, DiskBackend, KVCache

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from gate_helpers import GateControl, gated_ext4

PAGES = GROUP + 7
N = PAGES * T
POOL_PAGES = 2 * PAGES + 8
BACKENDS = [DiskBackend.URING_FIXED, DiskBackend.URING]
BOUND_S = 30.0
STUCK_S = 2.0
EXT4_IOC_CHECKPOINT = 0x4004662B  # _IOW('f', 43, __u32), Linux 5.13


def _config(root: Path, backend: DiskBackend) -> CacheConfig:
    return group_config(root, PAGES, POOL_PAGES, backend, disk={"direct_io": True, "min_free_bytes": 1 << 20,
                                                                 "queue_depth": 4})


def _drop_cached_metadata(mount: Path) -> None:
    """Every metadata block of the ext4 at ``mount`` out of the cache: the journal checkpointed (its
    blocks written home and let go: a commit first), then the block device's clean pages dropped."""
    fd = os.open(mount, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, EXT4_IOC_CHECKPOINT, struct.pack("I", 0))
    except OSError as exc:
        if exc.errno in (errno.ENOTTY, errno.EOPNOTSUPP, errno.EINVAL):
            pytest.skip(f"no EXT4_IOC_CHECKPOINT here: {exc}")
        raise
    finally:
        os.close(fd)
    device = next(line.split()[0] for line in Path("/proc/mounts").read_text().splitlines()
                  if line.split()[1] == str(mount))
    fd = os.open(device, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _watch(gate: GateControl, thread_id: int, done: threading.Event, stuck: list[str]) -> None:
    """Until ``done``: once the thread ``thread_id`` was in state D for STUCK_S straight (in the kernel,
    waiting for I/O: CPU load alone leaves it R or S), record its kernel stack and let the gate go."""
    task = f"/proc/self/task/{thread_id}"
    since: float | None = None
    while not done.wait(0.01):
        with open(f"{task}/stat", encoding="ascii") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        now = time.monotonic()
        if state != "D":
            since = None
        elif since is None:
            since = now
        elif now - since >= STUCK_S:
            with open(f"{task}/stack", encoding="ascii") as f:
                stuck.append(f.read())
            gate.release()
            return


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
async def test_a_read_issued_inline_never_holds_the_loop_on_a_hung_disk_s_metadata(
        tmp_path: Path, backend: DiskBackend) -> None:
    with gated_ext4(tmp_path, 64) as (mount, gate):
        source, tokens = random_kv(27, 3 * N), random_tokens(27, N)
        await put_on_disk(_config(mount / "kv", backend), tokens, source)
        kv = random_kv(28, 3 * N)
        async with KVCache(_config(mount / "kv", backend), LAYOUT, kv) as cache:
            await cache.pool.wait_ready()
            disk = cache.disk
            assert disk is not None
            match = await cache.match(tokens)
            assert match.disk_pages == PAGES
            _drop_cached_metadata(mount)
            done, stuck = threading.Event(), list[str]()
            watcher = threading.Thread(target=_watch, args=(gate, threading.get_native_id(), done, stuck),
                                       name="test-watch", daemon=True)
            gate.hold()
            try:
                watcher.start()
                task = asyncio.create_task(cache.load(match, torch.arange(N, 2 * N)))
                # A read at the gate: the load's page read (or, before the fix, the inode block's
                # read under the loop thread's io_uring_enter: this await then ends only after the
                # watchdog let the gate go).
                await asyncio.to_thread(gate.wait_held)
                await until_thread(lambda: disk.statistics().reads_in_flight > 0, "a page read in flight", BOUND_S)
            finally:
                done.set()
                gate.release()
                watcher.join(BOUND_S)
            assert not stuck, f"the loop thread waited in the kernel for the held disk:\n{stuck[0]}"
            async with asyncio.timeout(BOUND_S):
                result = await task
            assert result.tokens == N
            assert torch.equal(kv[:, N : 2 * N], source[:, :N])
            await assert_quiescent(cache)
            assert not any(cache.stats().errors.values()), cache.stats().errors
