"""Adversarial: real EIO on the reads of chosen page files, through the public KVCache API.

A small ext4 on a loop device; once the pages are on disk, the loop device is shrunk under the
mounted file system (``losetup -c`` after truncating its image), so every block past the cut
answers a real EIO from the block layer ("attempt to access beyond end of device"). The page file
cut off is placed past all others (written last, after a filler), so it sits in the middle of a
prompt: pages before and after it stay readable. Plain loads, streaming loads (which read from
the back) and prefetch promotions must serve only right KV, stop at the bad page, count it, never
raise, never hang. Root only (loop devices).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import os
import shutil
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, prompt
from test_adv_crash_restart import prefix_oracle

from aiokv import CacheConfig, KVCache
from aiokv.storage import DiskConfig

T = LAYOUT.page_tokens
PAGES = 8
SLOTS = 256
FS_IOC_FIEMAP = 0xC020660B


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=False)


@contextlib.contextmanager
def _shrinkable_ext4(tmp: Path) -> Iterator[tuple[Path, Path, str]]:
    """(mount point, image, loop device) of a fresh 64 MiB ext4 with 4 KiB blocks."""
    if os.geteuid() != 0:
        pytest.skip("loop devices need root")
    for tool in ("mkfs.ext4", "losetup", "mount", "umount"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    image, mount = tmp / "ext4.img", tmp / "mnt"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", str(image)], check=True, capture_output=True)
    attach = _run("losetup", "--find", "--show", str(image))
    if attach.returncode != 0:
        pytest.skip(f"no loop device here: {attach.stderr.strip()}")
    device = attach.stdout.strip()
    try:
        done = _run("mount", device, str(mount))
        if done.returncode != 0:
            pytest.skip(f"mounting a loop device is not possible here: {done.stderr.strip()}")
        try:
            yield mount, image, device
        finally:
            if _run("umount", str(mount)).returncode != 0:
                _run("umount", "-l", str(mount))
    finally:
        _run("losetup", "-d", device)


def _extents(path: Path) -> list[tuple[int, int]]:
    """(physical byte offset, length) of each extent of ``path`` (FIEMAP, synced first)."""
    count = 32
    request = bytearray(struct.pack("=QQIIII", 0, 2**64 - 1, 1, 0, count, 0) + bytes(56 * count))
    buf = array.array("B", request)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, FS_IOC_FIEMAP, buf, True)
    finally:
        os.close(fd)
    mapped = struct.unpack_from("=I", buf, 20)[0]
    out = []
    for i in range(mapped):
        _logical, physical, length = struct.unpack_from("=QQQ", buf, 32 + 56 * i)
        out.append((physical, length))
    return out


def _end(path: Path) -> int:
    return max(p + n for p, n in _extents(path))


def _cut(image: Path, device: str, at: int) -> None:
    """Shrink the loop device to ``at`` bytes: every block from there on fails with EIO."""
    os.truncate(image, at)
    assert _run("losetup", "-c", device).returncode == 0
    Path("/proc/sys/vm/drop_caches").write_text("3")  # later reads go to the (shrunk) device


def _choose_cut(layout: list[list[tuple[int, int]]], floor: int) -> tuple[int, set[int]]:
    """A cut above every directory block (``floor``) that fails the most interesting pages: the
    first bad page as late as possible, then a readable page after the last bad one."""
    best: tuple[tuple[int, int], int, set[int]] | None = None
    for cut in sorted({p for extents in layout for p, _n in extents}):
        if cut < floor:
            continue
        bad = {i for i, extents in enumerate(layout) if any(p + n > cut for p, n in extents)}
        if not bad:
            continue
        score = (min(bad), int(max(bad) < len(layout) - 1))
        if best is None or score > best[0]:
            best = (score, cut, bad)
    assert best is not None, f"no page file lies above the directories: {layout}"
    return best[1], best[2]


def _cfg(directory: Path) -> CacheConfig:
    tier = DiskConfig(directory=directory, capacity_bytes=200 * (LAYOUT.page_bytes + 4096), min_free_bytes=0)
    return CacheConfig(cpu_bytes=16 * LAYOUT.page_bytes, disk=tier, namespace="test-model",
                       pool_chunk_bytes=4 * LAYOUT.page_bytes, launch_pages=1, launch_turn_s=0)


@pytest.mark.root
@pytest.mark.asyncio
async def test_real_eio_on_one_page_file_stops_loads_streams_and_prefetch_at_it(tmp_path: Path) -> None:
    tokens = prompt(77, PAGES * T)
    oracle = prefix_oracle(tokens)
    kv = torch.zeros(LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    with _shrinkable_ext4(tmp_path) as (mount, image, device):
        async with KVCache(_cfg(mount), LAYOUT, kv) as cache:
            assert cache.disk is not None
            files = cache.disk.files
            keys = cache.keys(tokens)
            kv[:, : PAGES * T] = oracle
            await cache.offload(tokens, torch.arange(PAGES * T))
            await cache.flush()
        os.sync()
        paths = [Path(files.path(k)) for k in keys]
        layout = [_extents(p) for p in paths]
        floor = max(_end(d) for d in [files.layout_dir, *{p.parent for p in paths}])
        start, bad = _choose_cut(layout, floor)
        _cut(image, device, start)

        async def fresh() -> KVCache:
            kv.zero_()
            cache = KVCache(_cfg(mount), LAYOUT, kv)
            await cache.start()  # a restart: the index lists the bad page again
            return cache

        # A plain load stops exactly at the bad page; nothing past it is written.
        cache = await fresh()
        try:
            match = await cache.match(tokens)
            assert match.tokens == PAGES * T and match.disk_pages == PAGES
            loaded = await asyncio.wait_for(cache.load(match, torch.arange(PAGES * T)), 20)
            first, last = min(bad), max(bad)
            assert loaded.tokens == first * T and loaded.shortened, (loaded, bad)
            assert torch.equal(kv[:, : first * T], oracle[:, : first * T])
            assert torch.all(kv[:, first * T : PAGES * T] == 0)
            errors = cache.stats().errors
            assert errors.get("load_shortened") == 1, errors
            assert any(kind.startswith("disk_") and count for kind, count in errors.items()), errors
            await assert_quiescent(cache)
        finally:
            await asyncio.wait_for(cache.aclose(), 30)

        # A streaming load reads from the back: pages past the bad one arrive, the bad one ends it.
        cache = await fresh()
        try:
            match = await cache.match(tokens)
            stream = await cache.start_load(match, torch.arange(PAGES * T))
            result = await asyncio.wait_for(stream.finish(), 20)
            assert result.loaded_from == (last + 1) * T, (result, bad)
            assert torch.equal(kv[:, result.loaded_from : PAGES * T], oracle[:, result.loaded_from : PAGES * T])
            assert torch.all(kv[:, : result.loaded_from] == 0)  # the engine computes these
            await assert_quiescent(cache)
        finally:
            await asyncio.wait_for(cache.aclose(), 30)

        # Prefetch promotes up to the bad page; a later load serves that prefix from the pool.
        cache = await fresh()
        try:
            fetched = await asyncio.wait_for(cache.prefetch(tokens), 20)
            assert fetched.pool_pages + fetched.promoted == first, (fetched, bad)
            match = await cache.match(tokens)
            assert match.pool_pages == first
            loaded = await asyncio.wait_for(cache.load(match, torch.arange(PAGES * T)), 20)
            assert first * T <= loaded.tokens
            assert torch.equal(kv[:, : loaded.tokens], oracle[:, : loaded.tokens])
            await assert_quiescent(cache)
        finally:
            await asyncio.wait_for(cache.aclose(), 30)
