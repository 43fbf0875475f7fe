"""Review 278 of 45bf1e2: the start's O_DIRECT probe (``layoutdir._probe_direct``) met something
planted at the page name it probes (the scan listed a regular file there; another program put a
FIFO, a directory or a symlink in its place before the probe).

It opened the name with ``O_DIRECT``, which the kernel refuses on a FIFO or a directory with
``EINVAL``: the answer the probe reads as "this file system refuses O_DIRECT" (tmpfs before 6.6).
So a planted FIFO turned a start on ext4 buffered, and refused one configured ``direct_io=True``
outright ("refuses O_DIRECT (tmpfs?)"), against the rule of :mod:`storage.safefiles` (open
without ``O_DIRECT``, check, then ``F_SETFL``). A symlink there (``O_NOFOLLOW``: ``ELOOP``) was
already passed over.

All real: the cache on this host's ext4 (O_DIRECT works there), seen through a read-only bind
mount (a read-only start: no lock file made, the probe goes to the page), the swap done through
the writable path between the scan and the probe (at ``apply_deletes``, which runs between them).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of, write_page
from fs_helpers import bind_mount, remount

import aiokv.storage.layoutdir as layoutdir
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly


def _plant(kind: str, where: Path, outside: Path) -> None:
    if kind == "fifo":
        os.mkfifo(where, 0o600)
    elif kind == "directory":
        where.mkdir(mode=0o700)
    else:
        os.symlink(outside, where)


@pytest.mark.root
@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
@pytest.mark.parametrize("direct_io", [None, True], ids=["auto", "direct"])
async def test_a_planted_page_name_does_not_answer_for_the_file_system(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, kind: str,
        direct_io: bool | None) -> None:
    writable = tmp_path / "cache"
    async with DiskTier(config(writable, backend, min_free_bytes=0), layout, pool) as writer:
        ok, _ = await write_page(writer, pool, 0)
        assert ok
        layout_dir = writer.files.layout_dir
    os.unlink(layout_dir / ".lock")
    key = key_of(0)
    page = layout_dir / key.hex()[:2] / key.hex()
    outside = tmp_path / "outside"
    outside.write_bytes(page.read_bytes())
    planted: list[Path] = []
    real_apply = layoutdir.apply_deletes

    def plant_then_apply(state: layoutdir.Prepared, shown: Path) -> None:
        # After the scan listed the page as a regular file, before the probe opens it.
        os.rename(page, layout_dir / "moved-away")
        _plant(kind, page, outside)
        planted.append(page)
        real_apply(state, shown)

    monkeypatch.setattr(layoutdir, "apply_deletes", plant_then_apply)
    caplog.set_level(logging.WARNING, logger="aiokv.storage.disk")
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    with bind_mount(writable, read_only):
        remount(read_only, "bind,ro")
        # Before, for a FIFO or a directory: direct_io=True refused the start (OSError EINVAL,
        # "refuses O_DIRECT"), and the automatic choice went buffered on ext4.
        async with DiskTier(config(read_only, backend, min_free_bytes=0, direct_io=direct_io), layout,
                            pool) as tier:
            assert planted
            assert tier.read_only is ReadOnly.FILE_SYSTEM
            assert tier._dir is not None and tier._dir.lock_fd is None  # the probe went to the page
            if direct_io is True:
                assert tier.statistics().direct_io
            else:
                # Nothing regular left to probe with: the automatic choice is buffered ("no file to
                # probe O_DIRECT with"), as a start without pages, never "refuses O_DIRECT".
                assert not tier.statistics().direct_io
                assert "has no file to probe O_DIRECT with" in caplog.text
            assert "refuses O_DIRECT" not in caplog.text
    assert_clean(pool)
