"""Review 264: planted entries at page names inside one ``read_many_into`` batch, every backend, warm
(names in the lookup caches: opened on the loop) and cold (every read through the ring's open
chain): a FIFO, a socket, a character device with /dev/zero's numbers, a symlink to /dev/zero, a
symlink to a FIFO outside, a dangling symlink, a directory, a hard link of a file outside with
another key's valid page, a forged valid header over another page's bytes (right key, sums
recomputed, payload length 0), between valid pages. The planted-file tests read them one at a
time; in a batch, a page's refusal must not leak into its neighbours' slots or buffers.

What must hold: the batch returns (no open blocks on the FIFOs), each planted page is a miss, each
valid page is served bit for bit (buffers poisoned first), nothing outside changes, and the same
batch read again gives the same answers."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash
from disk_helpers import assert_clean, config, is_root, key_of
from planted_helpers import snapshot as _snapshot
from test_adv_rev264_crafted_headers import _forge

from aiokv.keys import PageKey
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier

TAG = 0x64


def _bytes_of(key: PageKey, size: int) -> bytes:
    return b"".join(xxhash.xxh3_128_digest(key + i.to_bytes(4, "little")) for i in range(size // 16))


def _fifo(path: str, outside: Path, other: str) -> None:
    os.mkfifo(path, 0o600)


def _socket(path: str, outside: Path, other: str) -> None:
    # Bound by its name relative to its directory: the whole path is past AF_UNIX's 108 bytes.
    here = os.getcwd()
    os.chdir(os.path.dirname(path))
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(os.path.basename(path))
    finally:
        os.chdir(here)


def _char_device(path: str, outside: Path, other: str) -> None:
    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))


def _to_dev_zero(path: str, outside: Path, other: str) -> None:
    os.symlink("/dev/zero", path)


def _to_outside_fifo(path: str, outside: Path, other: str) -> None:
    os.symlink(outside / "fifo", path)


def _dangling(path: str, outside: Path, other: str) -> None:
    os.symlink(outside / "nothing-here", path)


def _directory(path: str, outside: Path, other: str) -> None:
    os.mkdir(path, 0o700)


def _outside_hardlink(path: str, outside: Path, other: str) -> None:
    os.link(outside / "other-page", path)


def _forged(path: str, outside: Path, other: str) -> None:
    with open(other, "rb") as f, open(path, "wb") as g:
        g.write(f.read())

    def zero(fields: list[object], body: bytearray) -> None:
        fields[4] = bytes.fromhex(os.path.basename(path))  # this key's header
        fields[5], fields[7] = 0, xxhash.xxh3_64_intdigest(b"")

    _forge(path, zero)


PLANTS: list[Callable[[str, Path, str], None]] = [
    _fifo, _socket, _char_device, _to_dev_zero, _to_outside_fifo, _dangling, _directory, _outside_hardlink, _forged,
]
BACKENDS = [DiskBackend.URING_FIXED, DiskBackend.URING, DiskBackend.THREADS]


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
async def test_planted_entries_in_one_batch_miss_alone(tmp_path: Path, backend: DiskBackend, layout: KVLayout,
                                                       pool: PagePool, warm: bool) -> None:
    if not is_root():
        pytest.skip("mknod needs root")
    if backend is DiskBackend.THREADS and not warm:
        pytest.skip("the threads backend has one way of opening a page file")
    size = layout.page_bytes
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o700)
    os.mkfifo(outside / "fifo", 0o600)
    n = 2 * len(PLANTS) + 1
    keys = [key_of(i, TAG) for i in range(n)]  # odd i: planted, even i: valid
    other = key_of(999, TAG)
    async with DiskTier(config(tmp_path / "disk", backend, queue_depth=4), layout, pool) as tier:
        for key in [*keys, other]:
            assert await tier.write_from(key, memoryview(_bytes_of(key, size)))
        os.link(tier.files.path(other), outside / "other-page")
        for j, plant in enumerate(PLANTS):
            path = tier.files.path(keys[2 * j + 1])
            os.unlink(path)
            plant(path, outside, tier.files.path(other))
        if not warm:
            cached = getattr(tier.backend, "_cached", None)
            if cached is not None:
                cached.available = False
        before = _snapshot(outside)
        for _ in range(2):
            buffers = [bytearray(b"\x5a" * size) for _ in keys]
            async with asyncio.timeout(30):
                oks = await tier.read_many_into(keys, [memoryview(b) for b in buffers])
            for i, (key, ok, buf) in enumerate(zip(keys, oks, buffers, strict=True)):
                if i % 2:
                    assert not ok, f"planted {PLANTS[i // 2].__name__} was served"
                else:
                    assert ok and bytes(buf) == _bytes_of(key, size), f"valid page {i} not served right"
        assert _snapshot(outside) == before, "something outside the cache directory changed"
    assert_clean(pool)
