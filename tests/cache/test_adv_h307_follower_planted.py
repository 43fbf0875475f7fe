"""Adversarial (helper-307): a page file replaced behind a *following* cache's back (read-only: another
live process holds the directory's lock), after its ``match`` found the page and before its load,
stream or prefetch reads it: truncated, swapped with another page's file, a FIFO, a symlink to a
copy of the right bytes, a directory, a flipped payload byte.

``test_adv_planted_files.py`` does this to the directory's writer; a follower reads through the
follow path (it may not remove or rename anything, and its index is refreshed by looks), so its
reads are checked here. Oracle: each token's KV is a function of its whole prefix; the load stops
at the bad page (a stream keeps the pages after it), nothing served is wrong, nothing raises or
hangs, nothing stays referenced or reserved, and nothing is written through the symlink.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, prompt
from child_procs import end_child, fork_context
from test_adv_crash_restart import prefix_oracle
from test_adv_planted_files import BAD, MUTATIONS, PAGES

from aiokv import DiskBackend, KVCache
from aiokv.storage import ReadOnly

T = LAYOUT.page_tokens
SLOTS = 256
BOUND_S = 20.0


def _config(disk: Path, backend: DiskBackend) -> Any:
    cfg = config(disk, pool_pages=16, disk_pages=64, backend=backend, launch_pages=1, launch_turn_s=0)
    assert cfg.disk is not None
    return dataclasses.replace(cfg, disk=dataclasses.replace(cfg.disk, follow_interval_s=3600.0))


def holder(disk: str, backend: str, conn: Any) -> None:
    """Store the two prompts, flush, say so, and hold the directory (its lock) until killed."""

    async def main() -> None:
        kv = torch.zeros(LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
        async with KVCache(_config(Path(disk), DiskBackend(backend)), LAYOUT, kv) as cache:
            for seed in (31, 32):
                tokens = prompt(seed, PAGES * T)
                kv[:, : PAGES * T] = prefix_oracle(tokens)
                await cache.offload(tokens, torch.arange(PAGES * T))
            await cache.flush()
            conn.send("held")
            await asyncio.sleep(3600)

    asyncio.run(main())


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", [DiskBackend.URING_FIXED, DiskBackend.THREADS], ids=lambda b: b.value)
@pytest.mark.parametrize("mutation", list(MUTATIONS))
async def test_a_page_file_replaced_under_a_follower_serves_no_wrong_byte(tmp_path: Path, backend: DiskBackend,
                                                                         mutation: str) -> None:
    disk = tmp_path / "disk"
    tokens, other = prompt(31, PAGES * T), prompt(32, PAGES * T)
    oracle = prefix_oracle(tokens)
    ctx = fork_context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=holder, args=(str(disk), backend.value, child), daemon=True)
    proc.start()
    child.close()
    try:
        assert await asyncio.to_thread(parent.poll, 60), "the holder never stored its pages"
        assert parent.recv() == "held"
        kv = torch.zeros(LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
        async with KVCache(_config(disk, backend), LAYOUT, kv) as probe:
            assert probe.disk is not None
            paths = [Path(probe.disk.files.path(k)) for k in probe.keys(tokens)]
            others = [Path(probe.disk.files.path(k)) for k in probe.keys(other)]
        pristine = tmp_path / "pristine"
        await asyncio.to_thread(shutil.copyfile, paths[BAD], pristine)
        for way in ("load", "stream", "prefetch"):
            kv.zero_()
            bad = paths[BAD]
            if bad.is_dir() and not bad.is_symlink():
                bad.rmdir()
            elif bad.exists() or bad.is_symlink():
                bad.unlink()
            await asyncio.to_thread(shutil.copyfile, pristine, bad)  # as written
            async with KVCache(_config(disk, backend), LAYOUT, kv) as cache:  # a follower: its own index
                assert cache.disk is not None and cache.disk.read_only is ReadOnly.LOCKED
                match = await cache.match(tokens)
                assert match.disk_pages == PAGES
                if way == "prefetch":
                    match.release()
                MUTATIONS[mutation](bad, others[BAD], tmp_path / f"aside-{way}")
                async with asyncio.timeout(BOUND_S):
                    if way == "load":
                        loaded = await cache.load(match, torch.arange(PAGES * T))
                        assert loaded.tokens <= BAD * T, loaded
                        assert torch.equal(kv[:, : loaded.tokens], oracle[:, : loaded.tokens])
                        assert torch.all(kv[:, loaded.tokens : PAGES * T] == 0)
                    elif way == "stream":
                        stream = await cache.start_load(match, torch.arange(PAGES * T))
                        low = (await stream.finish()).loaded_from
                        assert low >= (BAD + 1) * T, low
                        assert torch.equal(kv[:, low : PAGES * T], oracle[:, low : PAGES * T])
                        assert torch.all(kv[:, :low] == 0)
                    else:
                        fetched = await cache.prefetch(tokens)
                        assert fetched.promoted <= BAD, fetched
                        async with await cache.match(tokens) as again:
                            assert again.pool_pages <= BAD
                            into = torch.arange(PAGES * T, PAGES * T + again.tokens)
                            got = (await cache.load(again, into)).tokens
                            assert torch.equal(kv[:, into[:got]], oracle[:, :got])
                await asyncio.wait_for(assert_quiescent(cache), BOUND_S)
            if mutation == "symlink":  # nothing wrote through the link
                assert (tmp_path / f"aside-{way}").read_bytes() == pristine.read_bytes()
    finally:
        end_child(proc, 30)
        parent.close()
