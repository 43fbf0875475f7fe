"""A store's start over names another user planted in a shared root (``/tmp/aiokv``: the names are
predictable): a FIFO, a symlink or a file of another owner at the lock's name, a symlink or a
directory of another owner at the store's or the layout's directory. Every start ends within a
bound, refused with ``UnsafeDirectoryError`` naming what was found, having created nothing in
what is not ours and nothing outside the cache. Everything is planted for real (``os.mkfifo``,
symlinks, ``chown`` to another uid: those tests need root).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import aiokv.adapters.storedirs as storedirs_module
import aiokv.storage.disk as disk_module
from aiokv.adapters.store import PageFileStore, Sharing, StoreConfig, fingerprint, raw_layout
from aiokv.storage.config import ReadOnly
from aiokv.storage.layoutdir import Prepared
from aiokv.storage.pagefile import PageFiles
from aiokv.storage.safefiles import UnsafeDirectoryError

PAGE_BYTES = 4096
FACTS: dict[str, object] = {"model": "planted", "tp": None}
BOUND_S = 20.0
"""Longest a start may take here (a normal one takes well under a second)."""
OTHER_UID = 65534  # nobody

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def store_dir(root: Path) -> Path:
    """The directory a store of ``FACTS`` uses under ``root`` (as ``PageFileStore`` names it)."""
    return root / f"sglang-{fingerprint('sglang', {**FACTS, 'page_bytes': PAGE_BYTES}).hex()}"


def layout_dir(root: Path) -> Path:
    return PageFiles(store_dir(root), raw_layout(PAGE_BYTES)).layout_dir


def aiokv_threads() -> set[threading.Thread]:
    """The stores' loop threads (joined when a start fails; the staging pool's idle workers exit by
    themselves a moment later and are not counted)."""
    return {t for t in threading.enumerate() if t.name == "aiokv-sglang"}


def start(root: Path, sharing: Sharing, fifo: Path | None = None) -> PageFileStore:
    """``PageFileStore(...)`` built in a thread of its own; fails the test (instead of hanging it)
    when the constructor has not returned within ``BOUND_S``. Its exception is raised here."""
    outcome: list[PageFileStore | BaseException] = []

    def build() -> None:
        try:
            config = StoreConfig(directory=root, capacity_bytes=1 << 20, reader_refresh_s=0)
            outcome.append(PageFileStore(config, "sglang", FACTS, PAGE_BYTES, sharing=sharing))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=build, name="planted-start", daemon=True)
    thread.start()
    thread.join(BOUND_S)
    if thread.is_alive():
        if fifo is not None:  # a thread stuck opening the FIFO for reading goes once a writer opens it
            fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
            thread.join(BOUND_S)
            os.close(fd)
        if outcome and isinstance(outcome[0], PageFileStore):
            outcome[0].close()
        pytest.fail(f"the store's start ({sharing.name}) did not return within {BOUND_S} s")
    result = outcome[0]
    if isinstance(result, BaseException):
        raise result
    return result


def _made_layout_dir(root: Path) -> Path:
    layout = layout_dir(root)
    layout.mkdir(mode=0o700, parents=True)
    return layout


def fifo_lock(root: Path, outside: Path) -> Path:
    lock = _made_layout_dir(root) / ".lock"
    os.mkfifo(lock, 0o600)
    return lock


def symlink_lock(root: Path, outside: Path) -> Path:
    lock = _made_layout_dir(root) / ".lock"
    lock.symlink_to(outside / "victim")
    return lock


def symlink_store_dir(root: Path, outside: Path) -> Path:
    root.mkdir(mode=0o700)
    store_dir(root).symlink_to(outside, target_is_directory=True)
    return store_dir(root)


def symlink_layout_dir(root: Path, outside: Path) -> Path:
    store_dir(root).mkdir(mode=0o700, parents=True)
    layout_dir(root).symlink_to(outside, target_is_directory=True)
    return layout_dir(root)


def foreign_store_dir(root: Path, outside: Path) -> Path:
    store_dir(root).mkdir(mode=0o700, parents=True)
    os.chown(store_dir(root), OTHER_UID, OTHER_UID)
    return store_dir(root)


def foreign_layout_dir(root: Path, outside: Path) -> Path:
    layout = _made_layout_dir(root)
    os.chown(layout, OTHER_UID, OTHER_UID)
    return layout


def foreign_lock(root: Path, outside: Path) -> Path:
    lock = _made_layout_dir(root) / ".lock"
    lock.write_bytes(b"")
    os.chown(lock, OTHER_UID, OTHER_UID)
    return lock


Plant = Callable[[Path, Path], Path]
PLANTED: list[tuple[Plant, str]] = [
    (fifo_lock, "is a FIFO"),
    (symlink_lock, "is a symbolic link"),
    (symlink_store_dir, r"is not a directory \(a symlink"),
    (symlink_layout_dir, r"is not a directory \(a symlink"),
    pytest.param(foreign_store_dir, f"belongs to uid {OTHER_UID}", marks=needs_root),  # type: ignore[list-item]
    pytest.param(foreign_layout_dir, f"belongs to uid {OTHER_UID}", marks=needs_root),  # type: ignore[list-item]
    pytest.param(foreign_lock, f"belongs to uid {OTHER_UID}", marks=needs_root),  # type: ignore[list-item]
]


def tree(path: Path) -> list[str]:
    """Every name under ``path`` (not following symlinks)."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize(("plant", "message"), PLANTED)
def test_a_reader_refuses_what_was_planted_within_a_bound(
        tmp_path: Path, plant: Plant, message: str) -> None:
    """Regression: the reader's start-up guard opened the lock file blocking (a FIFO there hung the
    start for ever, in a worker thread nothing can cancel) and created directories and the lock
    file through a symlink or in another user's directory before anything checked them."""
    root, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir(mode=0o700)
    (outside / "victim").write_bytes(b"not the cache's")
    planted = plant(root, outside)
    foreign = sorted(planted.rglob("*")) if planted.is_dir() and not planted.is_symlink() else None
    before = aiokv_threads()

    with pytest.raises(UnsafeDirectoryError, match=message):
        start(root, Sharing.READER, fifo=planted if stat.S_ISFIFO(planted.lstat().st_mode) else None)

    assert tree(outside) == ["victim"] and (outside / "victim").read_bytes() == b"not the cache's"
    if foreign is not None:  # another user's directory: nothing created in it
        assert sorted(planted.rglob("*")) == foreign
    assert aiokv_threads() == before


@pytest.mark.parametrize("sharing", [Sharing.ALONE, Sharing.WRITER])
def test_a_store_never_follows_a_symlink_at_its_directory(tmp_path: Path, sharing: Sharing) -> None:
    """Regression: the tier follows a symlink at its root (the operator's choice, but a store's
    directory is named by the store): a link planted there to a directory of ours had the tier
    create its layout and fan-out directories wherever it pointed."""
    root, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir(mode=0o700)
    symlink_store_dir(root, outside)
    with pytest.raises(UnsafeDirectoryError, match=r"is not a directory \(a symlink"):
        start(root, sharing)
    assert tree(outside) == []


def test_a_store_directory_others_could_write_is_made_ours_and_used(tmp_path: Path) -> None:
    """What is ours but too open is fixed as the tier fixes its own (0700), then used."""
    root = tmp_path / "cache"
    directory = store_dir(root)
    directory.mkdir(parents=True)
    os.chmod(directory, 0o777)
    reader = start(root, Sharing.READER)
    try:
        assert reader.directory == directory
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert reader.statistics().read_only is ReadOnly.LOCKED  # its guard held the lock shared
        assert (layout_dir(root) / ".lock").is_file()
    finally:
        reader.close()
    writer = start(root, Sharing.WRITER)
    try:
        assert writer.statistics().read_only is None
    finally:
        writer.close()


def test_a_fifo_planted_after_a_reader_started_never_hangs_its_rescan(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Regression: a reader's rescan (a lookup missing a page the writer published since) takes the
    shared lock again: a FIFO planted at the lock's name meanwhile hung it, and the engine's lookup
    with it. The rescan now fails at once (logged) and the reader serves the index it had."""
    root = tmp_path / "cache"
    reader = start(root, Sharing.READER)
    writer = start(root, Sharing.WRITER)
    try:
        key = writer.key(b"published later")
        assert writer.thread.run(writer.store(key, [torch.full((PAGE_BYTES,), 7, dtype=torch.uint8)]))
        lock = layout_dir(root) / ".lock"
        lock.unlink()  # the writer keeps its lock through its descriptor
        os.mkfifo(lock, 0o600)
        with caplog.at_level(logging.ERROR):
            lookup = reader.thread.submit(reader.fresh_prefix([key]))
            try:
                found = lookup.result(BOUND_S)
            except concurrent.futures.TimeoutError:
                fd = os.open(lock, os.O_RDWR | os.O_NONBLOCK)  # a writer lets the stuck open go
                lookup.result(BOUND_S)
                os.close(fd)
                pytest.fail(f"a reader's lookup did not return within {BOUND_S} s")
        assert found == 0 and reader.refreshes == 0  # the index it had: the page is not in it
        assert "is a FIFO" in caplog.text and "serving the index it had" in caplog.text
    finally:
        writer.close()
        reader.close()


def _swap(directory: Path, outside: Path) -> Path:
    """Another user's swap at the store's directory name: the directory renamed away (to a name
    beside it) and a symlink to ``outside`` put in its place. Returns where the directory went."""
    moved = directory.with_name(directory.name + ".moved")
    os.rename(directory, moved)
    os.symlink(outside, directory, target_is_directory=True)
    return moved


@pytest.mark.parametrize("moment", ["after the store's check", "as the tier prepares"])
@pytest.mark.parametrize("sharing", [Sharing.ALONE, Sharing.WRITER, Sharing.READER])
def test_a_store_directory_swapped_after_its_check_redirects_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        sharing: Sharing, moment: str) -> None:
    """Regression (#11): the store checked its directory (``O_NOFOLLOW``, ours, 0700) and closed
    it; the tier then opened it again by its name. The name swapped in between (renamed away, a
    symlink to another directory in its place) had the tier create its layout and fan-out
    directories and its lock file there, and write its pages there. The swap is made for real at
    the exact moment (right after the store's check, or as the tier's start-up thread begins): the
    tier now works only in the directory that was checked, and the store, finding the name changed
    once the tier started, refuses to start, saying why. A restart then refuses the link."""
    root, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir(mode=0o700)
    directory = store_dir(root)
    moved: list[Path] = []
    if moment == "after the store's check":
        real_open = storedirs_module._open_own_dir

        def open_then_swap(path: Path) -> int:
            fd = real_open(path)
            if not moved:
                moved.append(_swap(path, outside))
            return fd

        monkeypatch.setattr(storedirs_module, "_open_own_dir", open_then_swap)
    else:
        real_prepare = disk_module.prepare

        def swap_then_prepare(*args: Any) -> Prepared:
            if not moved:
                moved.append(_swap(directory, outside))
            return real_prepare(*args)

        monkeypatch.setattr(disk_module, "prepare", swap_then_prepare)
    before = aiokv_threads()

    with caplog.at_level(logging.ERROR):
        try:
            outcome: PageFileStore | Exception = start(root, sharing)
        except Exception as exc:
            outcome = exc
    if isinstance(outcome, PageFileStore):
        outcome.close()  # started over the swapped name (the old code): closed before failing

    assert moved, "the swap was not made"
    assert tree(outside) == []  # nothing created, nothing written through the link
    assert isinstance(outcome, UnsafeDirectoryError) and "was replaced" in str(outcome), outcome
    checked = moved[0] / layout_dir(root).name
    assert (checked / ".lock").is_file() and stat.S_IMODE(checked.stat().st_mode) == 0o700
    assert "was replaced" in caplog.text
    assert aiokv_threads() == before
    monkeypatch.undo()
    with pytest.raises(UnsafeDirectoryError, match=r"is not a directory \(a symlink"):
        start(root, sharing)
    assert tree(outside) == []


def test_pages_stored_after_the_directory_was_swapped_stay_in_it(tmp_path: Path) -> None:
    """Once started, a store writes only through the descriptors its tier checked: its directory
    swapped for a link to another directory under a running store, pages still land (and load)
    where the store checked, and nothing appears where the link points."""
    root, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir(mode=0o700)
    store = start(root, Sharing.ALONE)
    try:
        moved = _swap(store.directory, outside)
        keys = [store.key(bytes([i])) for i in range(4)]
        for i, key in enumerate(keys):
            assert store.thread.run(store.store(key, [torch.full((PAGE_BYTES,), i, dtype=torch.uint8)]))
        for i, key in enumerate(keys):
            page = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
            assert store.thread.run(store.load(key, [page]))
            assert torch.equal(page, torch.full((PAGE_BYTES,), i, dtype=torch.uint8))
        names = {p.name for p in moved.rglob("*") if p.is_file()}
        assert {key.hex() for key in keys} <= names
        assert tree(outside) == []
    finally:
        store.close()
