"""Review 264: page files whose header is forged whole — the right magic, key and layout fingerprint,
and a header checksum computed again over the forged fields, so only the field checks can refuse
them — on every backend, warm and cold reads: a payload length of 0 with the checksum of no bytes
(a reader that trusted the header's length would verify nothing and serve whatever the page held),
a payload or page length claiming far more than the layout's (a reader sizing its read from the
header would read past the page or allocate without bound), a header size claiming more than 4 KiB,
another format version. Also a valid file grown after its checksum (bytes appended) and one
whose payload was rewritten with the payload checksum in its header forged to match it (a page
someone computed a valid file for: verified, so served — but only under its own key's name and
header, checked against the oracle). Each forged read is a counted miss (corrupt), the file
removed, never the forged bytes; the key stored again reads back bit for bit."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash
from disk_helpers import assert_clean, config, key_of

from aiokv.keys import PageKey
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.pagefile import _FIELDS, _SUM, _SUM_OFFSET, HEADER_BYTES

Fields = list[object]


def _bytes_of(key: PageKey, size: int, salt: int = 0) -> bytes:
    """The one content of ``key`` (the oracle); ``salt`` gives other bytes of the same size."""
    return b"".join(xxhash.xxh3_128_digest(key + bytes([salt]) + i.to_bytes(4, "little")) for i in range(size // 16))


def _forge(path: str, change: Callable[[Fields, bytearray], None]) -> None:
    """Rewrite the file at ``path``: its header's fields changed by ``change`` (which may also
    change the page bytes after it), the header checksum computed again so it passes."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    fields: Fields = list(_FIELDS.unpack_from(data, 0))
    body = data[HEADER_BYTES:]
    change(fields, body)
    header = bytearray(HEADER_BYTES)
    fields[-1] = 0
    _FIELDS.pack_into(header, 0, *fields)
    _SUM.pack_into(header, _SUM_OFFSET, xxhash.xxh3_64_intdigest(bytes(header)))
    tmp = path + ".forged"
    with open(tmp, "wb") as f:
        f.write(bytes(header) + bytes(body))
    os.rename(tmp, path)


# Field order: magic, version, size, fingerprint, key, payload, page, checksum, created, sum.
def _payload_zero(fields: Fields, body: bytearray) -> None:
    body[:] = os.urandom(len(body))  # not the page: only a check of the length refuses it
    fields[5], fields[7] = 0, xxhash.xxh3_64_intdigest(b"")


def _payload_short(fields: Fields, body: bytearray) -> None:
    body[4096:] = os.urandom(len(body) - 4096)  # the first 4 KiB stay right, the rest is not the page
    fields[5], fields[7] = 4096, xxhash.xxh3_64_intdigest(bytes(body[:4096]))


def _payload_huge(fields: Fields, body: bytearray) -> None:
    fields[5] = 1 << 62


def _page_huge(fields: Fields, body: bytearray) -> None:
    fields[6] = 1 << 62


def _header_size_huge(fields: Fields, body: bytearray) -> None:
    fields[2] = 1 << 31


def _version(fields: Fields, body: bytearray) -> None:
    fields[1] = int(fields[1]) + 1  # type: ignore[call-overload]


FORGED: dict[str, Callable[[Fields, bytearray], None]] = {
    "payload-0": _payload_zero,
    "payload-4k": _payload_short,
    "payload-huge": _payload_huge,
    "page-huge": _page_huge,
    "header-size-huge": _header_size_huge,
    "version": _version,
}

BACKENDS = [DiskBackend.URING_FIXED, DiskBackend.URING, DiskBackend.THREADS]


def _lexists(path: str) -> bool:
    return os.path.lexists(path)


async def _read(tier: DiskTier, key: PageKey, size: int) -> bytes | None:
    """The page served for ``key`` (None: a miss); the buffer poisoned first."""
    buf = bytearray(b"\xa5" * size)
    ok = await tier.read_into(key, memoryview(buf))
    return bytes(buf) if ok else None


@pytest.mark.asyncio
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
@pytest.mark.parametrize("forged", list(FORGED))
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
async def test_a_forged_header_with_a_valid_checksum_is_refused(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, forged: str, warm: bool) -> None:
    if backend is DiskBackend.THREADS and not warm:
        pytest.skip("the threads backend has one way of opening a page file")
    size = layout.page_bytes
    key, other = key_of(1, 0x64), key_of(2, 0x64)
    cfg = config(tmp_path / "disk", backend)
    async with DiskTier(cfg, layout, pool) as tier:
        for k in (key, other):
            assert await tier.write_from(k, memoryview(_bytes_of(k, size)))
        path = tier.files.path(key)
        _forge(path, FORGED[forged])
        if not warm:
            io = tier.backend
            cached = getattr(io, "_cached", None)
            if cached is not None:
                cached.available = False  # every read through the ring's open
        assert await _read(tier, key, size) is None, f"a forged header ({forged}) was served"
        stats = tier.statistics()
        assert (stats.misses, stats.corrupt) == (1, 1), stats
        assert not tier.contains(key)
        assert await _read(tier, other, size) == _bytes_of(other, size)
        assert await tier.write_from(key, memoryview(_bytes_of(key, size)))
        assert await _read(tier, key, size) == _bytes_of(key, size)
    # Forged again between restarts: the start indexes it (its name and owner are right); its read refuses it.
    _forge(path, FORGED[forged])
    async with DiskTier(cfg, layout, pool) as tier:
        assert await _read(tier, key, size) is None
        assert tier.statistics().corrupt == 1 and not tier.contains(key)
        assert await _read(tier, other, size) == _bytes_of(other, size)
    assert not _lexists(path), "the refused file was kept"  # the close waits for its unlink
    assert_clean(pool)


def _grown(path: str) -> None:
    with open(path, "ab") as f:
        f.write(os.urandom(3 * 4096 + 17))


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
async def test_a_file_grown_after_its_checksum_serves_only_the_page_or_nothing(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    key = key_of(3, 0x64)
    async with DiskTier(config(tmp_path / "disk", backend), layout, pool) as tier:
        assert await tier.write_from(key, memoryview(_bytes_of(key, size)))
        _grown(tier.files.path(key))
        got = await _read(tier, key, size)
        assert got is None or got == _bytes_of(key, size), "bytes past the page were served"
        if got is None:
            assert tier.statistics().corrupt == 1
    assert_clean(pool)


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS, ids=[b.value for b in BACKENDS])
async def test_another_keys_page_under_a_forged_header_of_this_key_is_served_as_forged(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    """The limit of a cache's verification, pinned: a file whose header was forged whole for its key
    (payload checksum of the bytes after it) is a valid page file; the tier cannot know the bytes are
    not that key's. What it must do: serve exactly the file's bytes, only under that key, and only
    from a regular file of ours at the key's name (the other checks are the planted-file tests)."""
    size = layout.page_bytes
    key = key_of(4, 0x64)
    forged = _bytes_of(key, size, salt=1)

    def _swap(fields: Fields, body: bytearray) -> None:
        body[:size] = forged
        fields[7] = xxhash.xxh3_64_intdigest(bytes(forged))

    async with DiskTier(config(tmp_path / "disk", backend), layout, pool) as tier:
        assert await tier.write_from(key, memoryview(_bytes_of(key, size)))
        _forge(tier.files.path(key), _swap)
        assert await _read(tier, key, size) == forged
        assert tier.statistics().corrupt == 0
    assert_clean(pool)
