"""Review 205: a loop-wide cancel cuts the cache's close while it waits.

An application's SIGTERM handler cancels every task of the loop while ``KVCache.aclose`` waits
(for the rates file's save, held in its thread; for the disk tier's close, held by write-behind
stuck in the kernel on a frozen file system). That cancelled the close's own tasks (the cache's,
the manager's, the tier's) and every later ``aclose()`` raised that cancel at once: the pool's
segment was left in /dev/shm, the directory's lock held, the tier's threads running. A later
``aclose()`` must now finish the close: the segment gone, the lock free, no aiokv thread left.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import sys
import threading
from pathlib import Path

import pytest
import torch
from cache_helpers import LAYOUT, config, make_kv
from loop_probes import cancel_every_task_but_nowait, until, until_thread, waiting_in
from test_cache_lifetime import _directory_is_free, _hold_rates_writes

from aiokv import DiskBackend, KVCache

sys.path.insert(0, str(Path(__file__).parents[1] / "storage"))
from fs_helpers import freeze, loop_ext4, thaw
from test_adv_cache_fs import LAYOUT as FS_LAYOUT
from test_adv_cache_fs import SLOTS, cache_config, offload_all, prompts

BOUND_S = 30.0


def _aiokv_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aiokv")]


async def _cut_then_close_again(cache: KVCache, held: asyncio.Future[None], let_go: object, must_wait: bool) -> None:
    """Close; once ``held`` says the close waits, cancel every task but this one; a later
    aclose() must finish the close, not raise at once; ``must_wait``: it waits for the held step
    (I/O that may still use pool pages) until ``let_go()`` lets it."""
    segment = f"/dev/shm/{cache.pool.name.lstrip('/')}"
    assert await asyncio.to_thread(os.path.exists, segment)
    closing = asyncio.ensure_future(cache.aclose())
    async with asyncio.timeout(BOUND_S):
        await held
    cancel_every_task_but_nowait(asyncio.current_task())  # the application's SIGTERM handler
    await asyncio.wait({closing})
    again = asyncio.ensure_future(cache.aclose())
    await asyncio.wait({again}, timeout=0.5)  # bounded: it waits for the held step
    assert not (again.done() and again.cancelled()), (
        "a later aclose() raised the loop-wide cancel at once: the pool is never freed")
    if must_wait:
        assert not again.done(), "the close ended while I/O that may use pool pages was still held"
        assert await asyncio.to_thread(os.path.exists, segment)
    let_go()  # type: ignore[operator]
    async with asyncio.timeout(BOUND_S):
        await again
        await cache.manager.close_pool()  # idempotent: already done by the cache's close
    assert not await asyncio.to_thread(os.path.exists, segment), "the pool's segment is left in /dev/shm"


@pytest.mark.asyncio
async def test_adv_rev205_cut_while_the_rates_are_saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entered, release = _hold_rates_writes(monkeypatch)
    cache = KVCache(config(tmp_path), LAYOUT, make_kv(205))
    await cache.start()
    try:
        assert cache.disk is not None and cache.disk.read_only is None
        cache.manager.costs.pool.update(1e9, 1.0)  # a rate changed: the close writes it (held here)
        await _cut_then_close_again(cache, entered, release.set, must_wait=False)
        assert await _directory_is_free(tmp_path), "the disk tier's lock is still held"
        await until_thread(lambda: not _aiokv_threads(), "no aiokv thread left", BOUND_S)
    finally:
        release.set()
        with contextlib.suppress(asyncio.CancelledError):  # before the fix: raised at once, left open
            async with asyncio.timeout(BOUND_S):
                await cache.aclose()


@pytest.mark.asyncio
async def test_adv_rev205_cut_while_a_background_job_runs(tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    cache = KVCache(config(tmp_path, close_timeout=BOUND_S), LAYOUT, make_kv(207))
    await cache.start()
    job: asyncio.Future[None] = loop.create_future()  # a copy the close must wait for (a plain future:
    cache.manager.track(job, lambda: None)              # a loop-wide cancel reaches tasks only)
    held: asyncio.Future[None] = loop.create_future()

    async def close_waits() -> None:
        await until(lambda: waiting_in(cache.manager._close_task, "wait"), turns=100_000)
        held.set_result(None)

    watch = asyncio.ensure_future(close_waits())
    try:
        await _cut_then_close_again(cache, held, lambda: job.set_result(None), must_wait=True)
        assert await _directory_is_free(tmp_path), "the disk tier's lock is still held"
        await until_thread(lambda: not _aiokv_threads(), "no aiokv thread left", BOUND_S)
    finally:
        watch.cancel()
        if not job.done():
            job.set_result(None)
        with contextlib.suppress(asyncio.CancelledError):  # before the fix: raised at once, left open
            async with asyncio.timeout(BOUND_S):
                await cache.aclose()


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("backend", [DiskBackend.URING_FIXED, DiskBackend.URING, DiskBackend.THREADS],
                         ids=lambda b: b.value)
async def test_adv_rev205_cut_while_the_disk_tier_closes(tmp_path: Path, backend: DiskBackend) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    kv = torch.zeros(FS_LAYOUT.num_layers, SLOTS, FS_LAYOUT.rows, FS_LAYOUT.head_dim, dtype=FS_LAYOUT.dtype)
    with loop_ext4(tmp_path, 24) as mount:
        root = mount / "kv"
        cfg = cache_config(root)
        assert cfg.disk is not None
        cfg = dataclasses.replace(cfg, close_timeout=BOUND_S, disk=dataclasses.replace(cfg.disk, backend=backend))
        watchdog = threading.Timer(2 * BOUND_S, thaw, args=(mount,))  # nothing stays frozen on a failure
        cache = KVCache(cfg, FS_LAYOUT, kv)
        await cache.start()
        try:
            disk = cache.disk
            assert disk is not None and disk.read_only is None
            await offload_all(cache, kv, prompts(1, 10))
            await cache.flush()
            freeze(mount)
            watchdog.start()
            await offload_all(cache, kv, prompts(2, 8))  # write-behind held in the kernel
            await until_thread(lambda: disk.statistics().in_flight > 0, "a write held by the freeze", BOUND_S)
            loop = asyncio.get_running_loop()
            held: asyncio.Future[None] = loop.create_future()

            async def tier_close_waits() -> None:
                await until(lambda: waiting_in(disk._close_task, "aclose"), turns=1_000_000)
                held.set_result(None)

            watch = asyncio.ensure_future(tier_close_waits())
            try:
                await _cut_then_close_again(cache, held, lambda: thaw(mount), must_wait=True)
            finally:
                watch.cancel()
            assert disk.io_ended.done()
        finally:
            watchdog.cancel()
            thaw(mount)
            with contextlib.suppress(asyncio.CancelledError):  # before the fix: raised at once, left open
                async with asyncio.timeout(BOUND_S):
                    await cache.aclose()
        async with KVCache(cfg, FS_LAYOUT, kv) as probe:  # a new cache over it gets the lock
            assert probe.disk is not None and probe.disk.read_only is None, "the disk tier's lock is still held"
        await until_thread(lambda: not _aiokv_threads(), "no aiokv thread left", BOUND_S)
