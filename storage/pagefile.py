"""The page-file format and the directory layout of a disk tier.

A page file is a 4096-byte header followed by the page: ``page_bytes`` bytes, the payload padded
with whatever the pool page holds past ``payload_bytes`` (the checksum covers the payload only).
Both parts are multiples of 4096, so O_DIRECT can move them straight from pool memory.

Header (little-endian), then zeros to 4096 bytes::

    magic        8s   b"AIOKVPG\\x00"
    version      u32  FORMAT_VERSION
    header_size  u32  4096
    fingerprint  16s  layout fingerprint
    key          16s  page key
    payload      u64  payload length in bytes
    page         u64  padded page length in bytes (the bytes after the header)
    checksum     u64  xxh3-64 of the payload
    created_ns   u64  creation time, ns since the epoch
    header_sum   u64  xxh3-64 of the 4096 header bytes with this field zeroed

Names: ``<root>/<fingerprint hex>/<first 2 hex of key>/<key hex>`` (dirs 0700, files 0600); the
layout directory also holds ``.lock`` (see :mod:`.layoutdir`).
Temporary files live next to their final name as ``.tmp-<key hex>-<process tag><counter>`` so the rename that
publishes them is atomic (same directory, same file system).
"""

from __future__ import annotations

import enum
import itertools
import os
import struct
import time
from pathlib import Path
from typing import NamedTuple

import xxhash

from aiokv.keys import PageKey
from aiokv.layout import KVLayout

HEADER_BYTES = 4096
MAGIC = b"AIOKVPG\x00"
FORMAT_VERSION = 1
TEMP_PREFIX = ".tmp-"
_FIELDS = struct.Struct("<8sII16s16sQQQQQ")
_SUM_OFFSET = _FIELDS.size - 8
_ZEROS = bytes(HEADER_BYTES)
_SUM = struct.Struct("<Q")


class _TempNames:
    """Temporary-file suffixes: a random per-process tag and a counter.

    Why not ``os.urandom`` per file (~50 us a call on this VM): the suffix only has to make the
    name fresh, never secret. Safety does not rest on it: a temp file is created
    ``O_CREAT|O_EXCL|O_NOFOLLOW`` in a 0700 directory of ours, so a name someone planted (only our
    own uid could) fails the create (EEXIST, counted UNSAFE) and is never followed or opened. Guessing
    is as hard as before: the 64-bit tag comes from ``os.urandom`` once per process (and again in a
    forked child, which must not repeat its parent's names), and a counter never repeats within it.
    """

    def __init__(self) -> None:
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        self.tag = os.urandom(8).hex()
        self.counter = itertools.count()

    def next(self) -> str:
        return f"{self.tag}{next(self.counter):x}"


_TEMP = _TempNames()


class HeaderFault(enum.Enum):
    """Why a header was refused."""

    MAGIC = "bad magic"
    VERSION = "unknown format version"
    HEADER_SUM = "header checksum mismatch"
    FINGERPRINT = "layout fingerprint mismatch"
    KEY = "key mismatch"
    LENGTH = "payload or page length mismatch"


class PageHeader(NamedTuple):
    """Decoded header fields (a named tuple: built once per read, where a frozen dataclass's
    ``__init__`` cost a call per field)."""

    fingerprint: bytes
    key: PageKey
    payload_bytes: int
    page_bytes: int
    checksum: int
    created_ns: int


def payload_checksum(payload: memoryview) -> int:
    """xxh3-64 of the payload bytes."""
    return xxhash.xxh3_64_intdigest(payload)


def pack_header(into: memoryview, layout: KVLayout, key: PageKey, checksum: int) -> None:
    """Write a complete header for ``key`` into ``into`` (``HEADER_BYTES`` long)."""
    fingerprint, payload, page = layout.fingerprint, layout.payload_bytes, layout.page_bytes
    into[:HEADER_BYTES] = _ZEROS
    _FIELDS.pack_into(into, 0, MAGIC, FORMAT_VERSION, HEADER_BYTES, fingerprint, key, payload, page, checksum,
                      time.time_ns(), 0)
    total = xxhash.xxh3_64_intdigest(into[:HEADER_BYTES])
    _SUM.pack_into(into, _SUM_OFFSET, total)


def parse_header(data: memoryview, layout: KVLayout, key: PageKey) -> PageHeader | HeaderFault:
    """Decode and check a header read for ``key`` into ``data`` (exactly ``HEADER_BYTES``, writable:
    a scratch buffer, whose header-sum field this zeroes); a :class:`HeaderFault` says what is wrong.

    The sum is checked over ``data`` itself with that field zeroed in place: a copy of the 4096
    bytes per read cost an allocation and a copy on the loop (#14)."""
    (magic, version, size, fingerprint, got_key, payload, page, checksum, created, header_sum) = (
        _FIELDS.unpack_from(data, 0)
    )
    if magic != MAGIC:
        return HeaderFault.MAGIC
    if version != FORMAT_VERSION or size != HEADER_BYTES:
        return HeaderFault.VERSION
    _SUM.pack_into(data, _SUM_OFFSET, 0)
    if xxhash.xxh3_64_intdigest(data) != header_sum:
        return HeaderFault.HEADER_SUM
    want_fingerprint, want_payload, want_page = layout.fingerprint, layout.payload_bytes, layout.page_bytes
    if fingerprint != want_fingerprint:
        return HeaderFault.FINGERPRINT
    if got_key != key:
        return HeaderFault.KEY
    if payload != want_payload or page != want_page:
        return HeaderFault.LENGTH
    return PageHeader(fingerprint, got_key, payload, page, checksum, created)


def file_bytes(layout: KVLayout) -> int:
    """Size of one page file on disk."""
    return HEADER_BYTES + layout.page_bytes


class PageFiles:
    """Names of the page files of one layout under ``root``.

    I/O uses names relative to a fan-out directory (``name``, ``temp_name``), resolved from a
    descriptor of that directory checked when opened, so a path component swapped later cannot
    redirect it; ``rel`` is relative to the layout directory and ``path`` the absolute name, for
    messages, tools and tests.
    """

    def __init__(self, root: Path, layout: KVLayout) -> None:
        self.root = root
        self.layout_dir = root / layout.fingerprint.hex()

    def name(self, key: PageKey) -> str:
        """``<key hex>``: the final name relative to the fan-out directory ``key[0]``.

        ``bytes.hex``, never ``key.hex()``: a key may be a ``bytes`` subclass (callers' checks
        accept one), whose own ``hex`` could name any path (``../..``): a read refusing that file
        then deleted it, outside the cache (review of #14). Every name here is built so."""
        return bytes.hex(key)

    def temp_name(self, key: PageKey) -> str:
        """A fresh temporary name for ``key``, relative to its fan-out directory."""
        return f"{TEMP_PREFIX}{bytes.hex(key)}-{_TEMP.next()}"

    @staticmethod
    def own_temp(name: str) -> bool:
        """Whether ``name`` is a temporary name this process made (a write of it may be in flight)."""
        return name.startswith(TEMP_PREFIX) and name.rpartition("-")[2].startswith(_TEMP.tag)

    def rel(self, key: PageKey) -> str:
        """``<fan-out>/<key hex>``: the final name relative to the layout directory."""
        name = bytes.hex(key)
        return f"{name[:2]}/{name}"

    def path(self, key: PageKey) -> str:
        """Absolute final name of ``key``'s page file."""
        return f"{self.layout_dir}/{self.rel(key)}"
