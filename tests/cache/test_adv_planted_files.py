"""Adversarial: a page file replaced behind an open cache's back, after ``match`` found it on disk
and before the load reads it (truncated, swapped with another page's file, a FIFO, a symlink to
a copy of the right bytes, a directory, a flipped payload byte).

Plain loads stop at the bad page; streaming loads (reading from the back) keep the pages after it
and stop there; prefetch promotes up to it. Every byte served matches the prefix oracle, the fault
is counted, nothing raises or hangs, and no reference or reservation leaks.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config, prompt
from test_adv_crash_restart import prefix_oracle

from aiokv import DiskBackend, KVCache

T = LAYOUT.page_tokens
PAGES = 8
BAD = 4
SLOTS = 256


def _truncate_to_header(path: Path, _other: Path, _aside: Path) -> None:
    os.truncate(path, 4096)


def _truncate_to_zero(path: Path, _other: Path, _aside: Path) -> None:
    os.truncate(path, 0)


def _swap_with_another_page(path: Path, other: Path, aside: Path) -> None:
    shutil.copyfile(other, aside)
    os.replace(aside, path)  # a valid page file, of another key


def _fifo(path: Path, _other: Path, _aside: Path) -> None:
    path.unlink()
    os.mkfifo(path, 0o600)


def _symlink_to_a_copy(path: Path, _other: Path, aside: Path) -> None:
    shutil.copyfile(path, aside)  # the right bytes, outside the cache: still never followed
    path.unlink()
    path.symlink_to(aside)


def _directory(path: Path, _other: Path, _aside: Path) -> None:
    path.unlink()
    path.mkdir()


def _flip_payload(path: Path, _other: Path, _aside: Path) -> None:
    data = bytearray(path.read_bytes())
    data[4096 + 10] ^= 0x5A  # the payload (after the 4096-byte header; the tail is padding)
    path.write_bytes(bytes(data))


MUTATIONS: dict[str, Callable[[Path, Path, Path], None]] = {
    "truncated_to_header": _truncate_to_header,
    "truncated_to_zero": _truncate_to_zero,
    "swapped": _swap_with_another_page,
    "fifo": _fifo,
    "symlink": _symlink_to_a_copy,
    "directory": _directory,
    "flipped": _flip_payload,
}


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", [DiskBackend.URING_FIXED, DiskBackend.THREADS], ids=lambda b: b.value)
@pytest.mark.parametrize("mutation", list(MUTATIONS))
async def test_page_file_replaced_between_match_and_read(tmp_path: Path, backend: DiskBackend,
                                                          mutation: str) -> None:
    disk = tmp_path / "disk"
    tokens = prompt(31, PAGES * T)
    oracle = prefix_oracle(tokens)
    kv = torch.zeros(LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    cfg = config(disk, pool_pages=16, disk_pages=64, backend=backend, launch_pages=1, launch_turn_s=0)
    async with KVCache(cfg, LAYOUT, kv) as cache:
        kv[:, : PAGES * T] = oracle
        await cache.offload(tokens, torch.arange(PAGES * T))
        await cache.flush()
        assert cache.disk is not None
        keys = cache.keys(tokens)
        paths = [Path(cache.disk.files.path(k)) for k in keys]
    pristine = tmp_path / "pristine"
    shutil.copyfile(paths[BAD], pristine)

    for way in ("load", "stream", "prefetch"):
        kv.zero_()
        if paths[BAD].is_dir() and not paths[BAD].is_symlink():
            paths[BAD].rmdir()
        elif paths[BAD].exists() or paths[BAD].is_symlink():
            paths[BAD].unlink()
        shutil.copyfile(pristine, paths[BAD])  # as written (the last round's fault may have removed it)
        async with KVCache(cfg, LAYOUT, kv) as cache:  # a restart: every page is on disk only
            match = await cache.match(tokens)
            assert match.disk_pages == PAGES
            if way == "prefetch":
                match.release()
            MUTATIONS[mutation](paths[BAD], paths[BAD - 2], tmp_path / f"aside-{way}")
            if way == "load":
                loaded = await asyncio.wait_for(cache.load(match, torch.arange(PAGES * T)), 20)
                assert loaded.tokens == BAD * T and loaded.shortened, loaded
                assert torch.equal(kv[:, : BAD * T], oracle[:, : BAD * T])
                assert torch.all(kv[:, BAD * T : PAGES * T] == 0)
            elif way == "stream":
                stream = await cache.start_load(match, torch.arange(PAGES * T))
                result = await asyncio.wait_for(stream.finish(), 20)
                assert result.loaded_from == (BAD + 1) * T, result
                assert torch.equal(kv[:, result.loaded_from : PAGES * T], oracle[:, result.loaded_from : PAGES * T])
                assert torch.all(kv[:, : result.loaded_from] == 0)
            else:
                fetched = await asyncio.wait_for(cache.prefetch(tokens), 20)
                assert fetched.promoted == BAD, fetched
                async with await cache.match(tokens) as again:
                    assert again.tokens == BAD * T  # the bad page left the index
                    assert again.pool_pages == BAD
            stats = cache.stats()
            assert stats.disk is not None
            faults = stats.disk.corrupt + sum(stats.errors.values())
            assert faults > 0, stats  # the bad page was counted
            await asyncio.wait_for(assert_quiescent(cache), 20)
        if mutation == "symlink":  # nothing wrote through the link
            assert (tmp_path / f"aside-{way}").read_bytes() == pristine.read_bytes()
