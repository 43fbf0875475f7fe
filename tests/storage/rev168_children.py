"""The cache process of review 168's lock tests (``test_adv_rev168_lock_watch.py``): a disk tier in
a process of its own, over the directory the test's tiers share, driven over a pipe."""

from __future__ import annotations

import asyncio
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from disk_helpers import config, fill, key_of, payload, reserve, seed_payload, small_layout

from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.layoutdir import UnsafeDirectoryError

TAG = 7
"""Every cache stores seed ``i``'s page under ``key_of(i, TAG)``: a page's bytes are a function of its key."""


def cache_child(directory: str, backend: str, capacity: int, interval: float, conn: Connection) -> None:
    """A cache (disk tier) in its own process. Sends ``("ready", read_only)`` or ``("refused", why)``
    (a start that refused the directory: a symlink planted at ``.lock``). Then, one answer per
    message: ``("write", [i, ...])`` -> ``[stored, ...]``; ``("read", [i, ...])`` -> ``[hit, ...]``
    (a hit is bit-exact; other bytes answer ``"wrong"``); ``"status"`` -> ``(read_only,
    lock_retaken, lock_lost, took_over, writes stored)`` after asking for a check and a look at
    once; ``"close"`` closes and answers ``"closed"``, then the process ends."""

    async def main() -> None:
        layout = small_layout()
        pool = PagePool.create(layout, 16 * layout.page_bytes, register_cuda=False, workers=1)
        try:
            pool.wait_ready_blocking()
            conf = config(Path(directory), DiskBackend(backend), capacity, follow_interval_s=interval,
                          min_free_bytes=0, free_space_recheck_s=0.01)
            tier = DiskTier(conf, layout, pool)
            try:
                await tier.start()
            except UnsafeDirectoryError as exc:
                conn.send(("refused", str(exc)))
                return
            stored = 0
            try:
                conn.send(("ready", tier.read_only))
                while (message := await asyncio.to_thread(conn.recv)) != "close":
                    if message == "status":
                        tier._check_lock_soon()
                        tier._look_soon()
                        stats = tier.statistics()
                        conn.send((stats.read_only, stats.lock_retaken, stats.lock_lost, stats.took_over, stored))
                        continue
                    what, seeds = message
                    answers: list[object] = []
                    for i in seeds:
                        key = key_of(i, TAG)
                        if what == "write":
                            handle = fill(pool, key, i)
                            try:
                                ok = await tier.write(key, handle)
                            finally:
                                pool.table.release(handle)
                                pool.table.discard(key)
                            stored += ok
                            answers.append(ok)
                        else:
                            into = reserve(pool, key_of(900 + i, 99))
                            try:
                                hit = await tier.read(key, into)
                                right = torch.equal(payload(pool, into), seed_payload(pool, i, 98)) if hit else True
                                answers.append(hit if right else "wrong")
                            finally:
                                pool.table.abort(into)
                    conn.send(answers)
            finally:
                await tier.aclose()
            conn.send("closed")
        finally:
            pool.close()

    asyncio.run(main())
