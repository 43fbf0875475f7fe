"""A store's ``clear()`` and a reader's staleness check over names planted or swapped for real.

Regressions: ``clear()`` removed its directory by name (``shutil.rmtree``): a directory put at that
name after the store started (the store's own renamed away) was emptied, whatever it held, and
every entry of the tree went, the lock file a reader may hold and entries that are not ours
included. A reader's staleness check (``_stale``: has the writer published a page the index
lacks?) looked the page file's path up by name, following a symlink planted at a directory on
the way or at the file's own name (a rescan for a file outside the cache).

Now both go through descriptors of the directory the tier was started over, one component at a
time with ``O_NOFOLLOW``; ``clear()`` deletes only regular files of ours and keeps the lock file.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import aiokv.adapters.storedirs as storedirs_module
from aiokv.adapters.store import PageFileStore, Sharing, StoreConfig, raw_layout
from aiokv.storage.pagefile import PageFiles
from aiokv.storage.safefiles import UnsafeDirectoryError

PAGE_BYTES = 4096
FACTS: dict[str, object] = {"model": "clear-planted"}
BOUND_S = 20.0


def _start(root: Path, sharing: Sharing = Sharing.ALONE) -> PageFileStore:
    config = StoreConfig(directory=root, capacity_bytes=1 << 20, reader_refresh_s=0)
    return PageFileStore(config, "sglang", FACTS, PAGE_BYTES, sharing=sharing)


def _files(store: PageFileStore) -> PageFiles:
    return PageFiles(store.directory, raw_layout(PAGE_BYTES))


def _page(value: int) -> list[torch.Tensor]:
    return [torch.full((PAGE_BYTES,), value, dtype=torch.uint8)]


def _store(store: PageFileStore, name: bytes, value: int) -> bytes:
    key = store.key(name)
    assert store.thread.run(store.store(key, _page(value)))
    return key


def _clear(store: PageFileStore) -> bool:
    done = store.thread.submit(store.clear())
    result = done.result(BOUND_S)
    assert isinstance(result, bool)
    return result


def test_clear_never_empties_a_directory_put_at_its_name(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    store = _start(root)
    try:
        key = _store(store, b"page", 3)
        files = _files(store)
        real_page = Path(files.path(key))
        assert real_page.is_file()
        # The store's directory renamed away and another directory (ours, 0700) put at its name.
        moved = store.directory.with_name(store.directory.name + ".moved")
        os.rename(store.directory, moved)
        os.mkdir(store.directory, 0o700)
        precious = store.directory / "precious"
        precious.write_bytes(b"not the cache's")
        assert _clear(store) is False  # refused: not the directory the tier used
        assert precious.read_bytes() == b"not the cache's", "clear() emptied a directory swapped in"
        assert (moved / real_page.relative_to(store.directory)).is_file()  # nothing deleted by name
    finally:
        store.close()


def test_clear_deletes_only_regular_files_of_ours_and_keeps_the_lock(tmp_path: Path) -> None:
    root, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"outside")
    store = _start(root)
    try:
        keys = [_store(store, bytes([i]), i + 1) for i in range(4)]
        files = _files(store)
        lock = files.layout_dir / ".lock"
        lock_inode = os.stat(lock).st_ino
        fan = Path(files.path(keys[0])).parent
        link = fan / "planted-link"
        link.symlink_to(outside / "victim")
        fifo = fan / "planted-fifo"
        os.mkfifo(fifo, 0o600)
        dir_link = files.layout_dir / "zz"
        dir_link.symlink_to(outside, target_is_directory=True)
        assert _clear(store) is True
        for key in keys:
            assert not os.path.lexists(files.path(key))
        assert (outside / "victim").read_bytes() == b"outside"
        assert link.is_symlink() and stat.S_ISFIFO(os.lstat(fifo).st_mode) and dir_link.is_symlink()
        assert os.stat(lock).st_ino == lock_inode, "clear() removed the lock file a reader may hold"
        assert not store.thread.run(store.fresh_contains([keys[0]]))[0]
        assert _store(store, b"after", 9) in [store.key(b"after")]  # the fresh tier serves
    finally:
        store.close()


def test_clear_walking_past_a_directory_swapped_for_a_link_mid_way(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The fan-out directory of a page is swapped for a symlink to another directory right before
    # clear() opens it (the real rename and symlink, at that moment): nothing there is deleted.
    root, outside = tmp_path / "cache", tmp_path / "outside"
    store = _start(root)
    try:
        key = _store(store, b"page", 5)
        files = _files(store)
        fan = Path(files.path(key)).parent
        outside.mkdir()
        (outside / key.hex()).write_bytes(b"same name, outside")
        real_open = storedirs_module._open_below
        swapped = threading.Event()

        def swap_then_open(dir_fd: int, name: str) -> Any:
            if name == fan.name and not swapped.is_set():
                swapped.set()
                os.rename(fan, fan.with_name(fan.name + ".gone"))
                fan.symlink_to(outside, target_is_directory=True)
            return real_open(dir_fd, name)

        monkeypatch.setattr(storedirs_module, "_open_below", swap_then_open)
        # The files are cleared; the fresh tier then refuses the link at its fan-out name (its own
        # check), and the store stays closed (writes refused, reads miss) rather than use it.
        with pytest.raises(UnsafeDirectoryError, match="not a directory"):
            _clear(store)
        assert swapped.is_set()
        assert (outside / key.hex()).read_bytes() == b"same name, outside"
        assert fan.is_symlink()  # left as it was found: not ours to delete
    finally:
        store.close()


@pytest.mark.parametrize("planted", ["file-link", "fanout-link"])
def test_a_readers_staleness_check_follows_no_planted_link(tmp_path: Path, planted: str) -> None:
    root, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    reader = _start(root, Sharing.READER)
    try:
        key = reader.key(b"never published")
        files = _files(reader)
        page = Path(files.path(key))
        if planted == "file-link":
            page.parent.mkdir(mode=0o700, exist_ok=True)
            (outside / "target").write_bytes(b"x")
            page.symlink_to(outside / "target")  # a link at the page file's own name
        else:
            (outside / key.hex()).write_bytes(b"x")
            if page.parent.exists():
                page.parent.rmdir()
            page.parent.symlink_to(outside, target_is_directory=True)  # a link at its fan-out directory
        attempted = reader._refreshed  # loop time of its last rescan (attempted, even if it failed)
        assert reader.thread.run(reader.fresh_prefix([key])) == 0
        assert reader._refreshed == attempted and reader.refreshes == 0, \
            "a planted link counted as a page the writer published (a rescan)"
        # A real page file of the writer's is still seen (and rescanned for).
        if planted == "fanout-link":
            page.parent.unlink()
        else:
            page.unlink()
        writer = _start(root, Sharing.WRITER)
        try:
            assert writer.thread.run(writer.store(key, _page(7)))
        finally:
            writer.close()
        assert reader.thread.run(reader.fresh_prefix([key])) == 1
        assert reader.refreshes == 1
    finally:
        reader.close()
