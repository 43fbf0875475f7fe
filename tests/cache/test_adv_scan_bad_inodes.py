"""Adversarial: a restart scan over an ext4 whose on-disk inodes of one page file and of one fan-out
directory are corrupt (their checksums fail: every lookup answers a real EBADMSG from the kernel),
done with the file system unmounted, as a torn write or a bad sector would leave them.

The cache starts, counts what it skipped, serves every other page with the right bytes (prefix
oracle), stops a load exactly at the unreadable page, and keeps offloading (pages bound for the
broken directory are counted faults, never raised). Root only (loop devices).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, prompt
from test_adv_crash_restart import prefix_oracle
from test_adv_disk_eio import _cfg, _shrinkable_ext4

from aiokv import KVCache

T = LAYOUT.page_tokens
PAGES = 8
BAD_FILE = 3
SLOTS = 256


def _corrupt_inode(image: Path, device: str, inode: int) -> None:
    """Overwrite the extent header of ``inode`` in the (unmounted) image: its checksum fails."""
    shown = subprocess.run(["debugfs", "-R", f"imap <{inode}>", device], capture_output=True, text=True,
                           check=True).stdout
    found = re.search(r"located at block (\d+), offset 0x([0-9a-f]+)", shown)
    assert found is not None, shown
    where = int(found.group(1)) * 4096 + int(found.group(2), 16) + 0x28
    fd = os.open(image, os.O_RDWR)
    try:
        os.pwrite(fd, b"\xa5" * 12, where)
        os.fsync(fd)
    finally:
        os.close(fd)


def _break_inodes(mount: Path, image: Path, device: str, inodes: list[int]) -> None:
    """Unmount, corrupt ``inodes`` in the image, drop the caches and mount again."""
    assert subprocess.run(["umount", str(mount)], check=False).returncode == 0
    for inode in inodes:
        _corrupt_inode(image, device, inode)
    Path("/proc/sys/vm/drop_caches").write_text("3")
    subprocess.run(["mount", device, str(mount)], check=True)


@pytest.mark.root
@pytest.mark.asyncio
async def test_restart_scan_over_corrupt_inodes_serves_the_rest(tmp_path: Path) -> None:
    tokens = prompt(55, PAGES * T)
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
        paths = [Path(files.path(k)) for k in keys]
        # A fan-out directory holding none of the prompt's pages (its pages would go through it).
        prompt_dirs = {p.parent.name for p in paths}
        bad_dir = next(files.layout_dir / f"{i:02x}" for i in range(256) if f"{i:02x}" not in prompt_dirs)
        victims = [paths[BAD_FILE].stat().st_ino, bad_dir.stat().st_ino]
        _break_inodes(mount, image, device, victims)
        with pytest.raises(OSError, match="Bad message"):
            paths[BAD_FILE].stat()  # the fault is real (EBADMSG)

        kv.zero_()
        async with KVCache(_cfg(mount), LAYOUT, kv) as cache:
            assert cache.disk is not None
            disk = cache.disk.statistics()
            assert disk.skipped_at_scan >= 1, disk
            match = await cache.match(tokens)
            loaded = await cache.load(match, torch.arange(match.tokens))
            assert loaded.tokens == BAD_FILE * T, loaded
            assert torch.equal(kv[:, : loaded.tokens], oracle[:, : loaded.tokens])
            assert torch.all(kv[:, loaded.tokens : PAGES * T] == 0)
            # Offloads go on: a stream of new prompts, some of whose pages belong in the broken
            # directory, never raises; the others reach the disk.
            before = disk.pages
            bad_index = int(bad_dir.name, 16)
            candidates = [prompt(600 + i, 4 * T) for i in range(400)]
            doomed = [c for c in candidates if any(k[0] == bad_index for k in cache.keys(c))][:3]
            others = doomed + candidates[:8]
            assert doomed
            for other in others:
                kv[:, : len(other)] = prefix_oracle(other)
                await cache.offload(other, torch.arange(len(other)))
            await cache.flush()
            stats = cache.stats()
            assert cache.disk.statistics().pages > before
            for other in others:
                for key in cache.keys(other):
                    if key[0] == bad_index:
                        assert not cache.disk.contains(key)
            assert sum(stats.errors.values()) > 0, stats.errors  # the refused writes were counted
            await assert_quiescent(cache)
        # A second restart: everything the faults left is served right.
        async with KVCache(_cfg(mount), LAYOUT, kv) as cache:
            for other in [tokens, *others]:
                kv.zero_()
                match = await cache.match(other)
                loaded = await cache.load(match, torch.arange(match.tokens))
                assert torch.equal(kv[:, : loaded.tokens], prefix_oracle(other)[:, : loaded.tokens])
