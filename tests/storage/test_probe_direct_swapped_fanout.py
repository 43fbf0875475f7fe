"""The start's O_DIRECT probe (``layoutdir._probe_direct``) opened a page file by a path of two
names (``<fan-out>/<page>``) from the layout directory's descriptor: reached in a read-only start
that finds no lock file, after the scan. A fan-out directory swapped for a symlink since the scan
led that open outside the cache (``O_NOFOLLOW`` guards the last name only), against the tier's rule
of opening names in the descriptor of their own directory. It now opens the page file in the
fan-out directory's descriptor the scan kept.

All real: a small ext4 on a loop device (O_DIRECT works there), the cache seen through a read-only
bind mount (a read-only start: no lock file is created), the swap done through the writable mount
between the scan and the probe (at ``apply_deletes``, which runs between them), and the opens
outside the cache watched by inotify (``IN_OPEN``, queued by the kernel at each open)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of, write_page
from fs_helpers import bind_mount, loop_ext4, remount

import aiokv.storage.layoutdir as layoutdir
from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly

IN_OPEN = 0x20
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _watch_opens(directory: Path) -> int:
    """An inotify descriptor (non-blocking) that queues an event for each open in ``directory``."""
    fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0:
        pytest.skip(f"no inotify here: {os.strerror(ctypes.get_errno())}")
    if _libc.inotify_add_watch(fd, os.fsencode(directory), IN_OPEN) < 0:
        err = ctypes.get_errno()
        os.close(fd)
        raise OSError(err, os.strerror(err))
    return fd


def _opened(fd: int) -> bool:
    try:
        return bool(os.read(fd, 4096))
    except BlockingIOError:
        return False


@pytest.mark.root
@pytest.mark.asyncio
async def test_read_only_probe_stays_in_the_fanout_directory_it_scanned(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    with loop_ext4(tmp_path, 24) as mount:
        writable = mount / "cache"
        async with DiskTier(config(writable, backend, min_free_bytes=0), layout, pool) as writer:
            ok, _ = await write_page(writer, pool, 0)
            assert ok
            layout_dir = writer.files.layout_dir
        os.unlink(layout_dir / ".lock")
        key = key_of(0)
        fanout = layout_dir / key.hex()[:2]
        outside = mount / "outside"
        outside.mkdir(mode=0o700)
        (outside / key.hex()).write_bytes((fanout / key.hex()).read_bytes())  # a file the probe could open
        watch = _watch_opens(outside)
        try:
            swapped: list[Path] = []
            real_apply = layoutdir.apply_deletes

            def swap_then_apply(state: layoutdir.Prepared, shown: Path) -> None:
                # After the scan opened and listed the fan-out directory, before the probe.
                os.rename(fanout, layout_dir / "moved-away")
                os.symlink(outside, fanout)
                swapped.append(fanout)
                real_apply(state, shown)

            monkeypatch.setattr(layoutdir, "apply_deletes", swap_then_apply)
            read_only = tmp_path / "read-only"
            read_only.mkdir()
            with bind_mount(writable, read_only):
                remount(read_only, "bind,ro")
                async with DiskTier(config(read_only, backend, min_free_bytes=0), layout, pool) as tier:
                    assert swapped and fanout.is_symlink()
                    assert tier.read_only is ReadOnly.FILE_SYSTEM
                    assert tier._dir is not None and tier._dir.lock_fd is None  # the probe tried the page
                    # Before: the probe opened <outside>/<page> through the symlink.
                    assert not _opened(watch), "the start opened a file outside the cache"
                    assert tier._io is not None and tier._io.direct  # it opened the scanned page (ext4)
                assert not _opened(watch), "the tier opened a file outside the cache"
        finally:
            os.close(watch)
    assert_clean(pool)
