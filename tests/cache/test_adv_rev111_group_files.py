"""Adversarial review 111: page files changed between a match and its load, inside read groups.

After ``match`` counted every page on disk, the files of some pages are truncated, replaced by
another page's file, replaced by a symlink to a file outside the cache, by a FIFO (opening one for
reading blocks until a writer comes), by a directory, or deleted; some in the first read group,
some in the second. The load must stop exactly at the first of them with the pages before it
bit-exact and the slots after it untouched, count the faults, never hang (the FIFO), never touch
the file outside the cache, and leave no reference or reservation. Both backends.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
import torch
from cache_helpers import assert_quiescent
from group_helpers import GROUP, LAYOUT, T, group_config, random_kv, random_tokens

from aiokv import CacheConfig, DiskBackend, KVCache

PAGES = GROUP + 7
N = PAGES * T
POOL_PAGES = 2 * PAGES + 8
BACKENDS = [DiskBackend.URING_FIXED, DiskBackend.THREADS]
BOUND_S = 30.0


def _config(root: Path, backend: DiskBackend) -> CacheConfig:
    return group_config(root, PAGES, POOL_PAGES, backend)


def _kv(seed: int) -> torch.Tensor:
    return random_kv(seed, 3 * N)


def _tokens(seed: int) -> list[int]:
    return random_tokens(seed, N)


def _truncate(path: str, _: str, __: Path) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def _other_page(path: str, other: str, _: Path) -> None:
    shutil.copyfile(other, path + ".x")
    os.replace(path + ".x", path)


def _symlink_out(path: str, other: str, outside: Path) -> None:
    shutil.copyfile(other, outside)
    os.unlink(path)
    os.symlink(outside, path)


def _fifo(path: str, _: str, __: Path) -> None:
    os.unlink(path)
    os.mkfifo(path, 0o600)


def _directory(path: str, _: str, __: Path) -> None:
    os.unlink(path)
    os.mkdir(path, 0o700)


def _delete(path: str, _: str, __: Path) -> None:
    os.unlink(path)


TAMPER = {"truncated": _truncate, "another page's file": _other_page, "symlink out": _symlink_out,
          "fifo": _fifo, "directory": _directory, "deleted": _delete}


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
@pytest.mark.parametrize("first_bad", [0, 6, GROUP - 1, GROUP, GROUP + 3])
async def test_files_changed_after_the_match_end_the_load_exactly_at_the_first(
        tmp_path: Path, backend: DiskBackend, first_bad: int) -> None:
    source, tokens = _kv(31), _tokens(31)
    root = tmp_path / "kv"
    async with KVCache(_config(root, backend), LAYOUT, source) as writer:
        await writer.pool.wait_ready()
        await writer.offload(tokens, torch.arange(N))
        await writer.flush()
    kv = _kv(32)
    before = kv.clone()
    outside = tmp_path / "outside.bin"
    async with KVCache(_config(root, backend), LAYOUT, kv) as cache:
        await cache.pool.wait_ready()
        disk = cache.disk
        assert disk is not None
        keys = cache.keys(tokens)
        match = await cache.match(tokens)
        assert match.disk_pages == PAGES
        # One tampering a page from first_bad on, every other page, round robin over TAMPER.
        bad = list(range(first_bad, PAGES - 1, 2))
        for n, page in enumerate(bad):
            kind = list(TAMPER)[n % len(TAMPER)]
            TAMPER[kind](disk.files.path(keys[page]), disk.files.path(keys[page + 1]), outside)
        outside_before = outside.read_bytes() if outside.exists() else None
        async with asyncio.timeout(BOUND_S):  # the FIFO must not hang it
            result = await cache.load(match, torch.arange(N, 2 * N))
        assert result.tokens == first_bad * T, (result, cache.stats().errors)
        assert torch.equal(kv[:, N : N + first_bad * T], source[:, : first_bad * T])
        assert torch.equal(kv[:, N + first_bad * T : 2 * N], before[:, N + first_bad * T : 2 * N])
        stats = cache.stats()
        assert stats.errors["disk_read_failed"] >= 1 and stats.errors["load_shortened"] == 1, stats.errors
        await assert_quiescent(cache)
        if outside_before is not None:
            assert outside.read_bytes() == outside_before  # never written, never deleted
        # Whatever the load left in the pool or on disk serves only right KV.
        again = await cache.match(tokens)
        assert again.pages == first_bad, again
        async with asyncio.timeout(BOUND_S):
            reloaded = await cache.load(again, torch.arange(2 * N, 2 * N + again.tokens))
        assert reloaded.tokens == first_bad * T
        assert torch.equal(kv[:, 2 * N : 2 * N + first_bad * T], source[:, : first_bad * T])
        await assert_quiescent(cache)
