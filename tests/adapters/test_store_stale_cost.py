"""What a reader's staleness check costs, and that it still follows nothing planted.

Regression: since 8c1078f a reader whose ``reader_refresh_s`` had passed with nothing new published
ran, on every lookup that missed, a check on a new OS thread that reopened the store's parent,
the store's directory, the layout directory and the fan-out directory for each missing key
(~3.5x slower a call than before). Now the check runs at most every ``reader_refresh_s`` (as the
rescans), on one worker thread the reader keeps, through a descriptor of the layout directory
its tier indexes (opened ``O_NOFOLLOW`` and checked at the tier's start, closed at close); a call
opens each fan-out directory it needs once. Counted with spies on ``threading.Thread.start`` and
``os.open``, never timed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from aiokv.adapters.store import PageFileStore, Sharing, StoreConfig, raw_layout
from aiokv.storage import backends
from aiokv.storage.pagefile import PageFiles

PAGE_BYTES = 4096
FACTS: dict[str, object] = {"model": "stale-cost"}
BOUND_S = 20.0
CALLS = 20
MISSING = 64
POOL_THREADS = "aiokv-pool"


def _start(root: Path, sharing: Sharing, refresh_s: float = 0.0) -> PageFileStore:
    config = StoreConfig(directory=root, capacity_bytes=1 << 20, reader_refresh_s=refresh_s)
    return PageFileStore(config, "sglang", FACTS, PAGE_BYTES, sharing=sharing)


def _files(store: PageFileStore) -> PageFiles:
    return PageFiles(store.directory, raw_layout(PAGE_BYTES))


def _publish(root: Path, keys: list[bytes]) -> None:
    """The writer of ``root`` stores a page under each key (and closes)."""
    writer = _start(root, Sharing.WRITER)
    try:
        for i, key in enumerate(keys):
            assert writer.thread.run(writer.store(key, [torch.full((PAGE_BYTES,), i % 251, dtype=torch.uint8)]))
    finally:
        writer.close()


def _missing(store: PageFileStore, count: int = MISSING) -> list[bytes]:
    return [store.key(b"never-published-%d" % i) for i in range(count)]


def _fds_at(path: str) -> int:
    """This process's open descriptors of ``path``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            count += os.readlink(f"/proc/self/fd/{fd}") == path
    return count


@pytest.fixture
def threads_started(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the ``threading.Thread`` objects started while the test runs (every helper that
    starts an OS thread here goes through ``Thread.start``: ``run_in_new_thread``'s included)."""
    started: list[str] = []
    real_start = threading.Thread.start

    def spy(self: threading.Thread) -> None:
        started.append(self.name)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", spy)
    return started


class OpenSpy:
    """Records every ``os.open`` (name, ``dir_fd``) made while armed; can hold the first open of a
    chosen name until released."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int | None]] = []
        self.armed = False
        self.hold_name: str | None = None
        self.entered = threading.Event()
        self.release = threading.Event()
        self.went_on = threading.Event()
        self.held_fd_identity: tuple[int, int] | None = None
        self._real = os.open

    def __call__(self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        # The pool's threads run the tier's background io_uring registration (it opens
        # /proc/self/pagemap whenever it gets to it): not a lookup's work.
        if self.armed and not threading.current_thread().name.startswith(POOL_THREADS):
            self.calls.append((os.fsdecode(path), dir_fd))
            if self.hold_name is not None and os.fsdecode(path) == self.hold_name and not self.entered.is_set():
                self.entered.set()
                assert self.release.wait(BOUND_S)
                try:
                    if dir_fd is not None:
                        # What the held call's directory descriptor is now (a replaced one closed
                        # early would be gone, or reused for another file).
                        st = os.fstat(dir_fd)
                        self.held_fd_identity = (st.st_dev, st.st_ino)
                finally:
                    self.went_on.set()
        return self._real(path, flags, mode, dir_fd=dir_fd)


@pytest.fixture
def opens(monkeypatch: pytest.MonkeyPatch) -> Iterator[OpenSpy]:
    spy = OpenSpy()
    monkeypatch.setattr(os, "open", spy)
    yield spy
    spy.release.set()


def test_missing_lookups_start_no_thread(tmp_path: Path, threads_started: list[str]) -> None:
    # reader_refresh_s=0: every call looks for the missing keys' files (the worst case).
    reader = _start(tmp_path / "cache", Sharing.READER)
    try:
        keys = _missing(reader)
        threads_started.clear()
        for _ in range(CALLS):
            assert reader.thread.run(reader.fresh_contains(keys)) == [False] * MISSING
            assert reader.thread.run(reader.fresh_prefix(keys)) == 0
        assert threads_started == [], f"threads started by {2 * CALLS} lookups: {len(threads_started)}"
        assert reader.refreshes == 0
    finally:
        reader.close()


def _late_registration() -> None:
    """What the tier's background io_uring registration does on a pool thread when it gets to it."""
    fd = backends._open_pagemap()
    if fd is not None:
        os.close(fd)


def test_a_check_opens_only_the_fan_out_directories_once(tmp_path: Path, opens: OpenSpy) -> None:
    root = tmp_path / "cache"
    reader = _start(root, Sharing.READER)
    try:
        keys = _missing(reader)
        # Half of the fan-out directories of the missing keys exist (other pages live there).
        _publish(root, [reader.key(b"elsewhere-%d" % i) for i in range(MISSING)])
        assert reader.thread.run(reader.fresh_prefix([reader.key(b"elsewhere-0")])) == 1  # rescanned
        files = _files(reader)
        fans = {files.rel(key).split("/")[0] for key in keys}
        opens.armed = True
        # The registration runs on the pool's threads at nice +10: on a loaded 16-core host it
        # opened /proc/self/pagemap during the checks. Not theirs to count.
        late = threading.Thread(target=_late_registration, name=f"{POOL_THREADS}_late")
        late.start()
        for _ in range(CALLS):
            assert reader.thread.run(reader.fresh_contains(keys)) == [False] * MISSING
        late.join(BOUND_S)
        opens.armed = False
        names = [name for name, _ in opens.calls]
        above = {str(root), str(reader.directory), reader.directory.name, files.layout_dir.name, str(files.layout_dir)}
        assert not above & set(names), "a check reopened the directories above the fan-out ones"
        assert set(names) <= fans
        assert len(names) <= CALLS * len(fans), f"{len(names)} opens for {CALLS} calls over {len(fans)} fan-outs"
        assert len(names) >= CALLS  # each call did look (reader_refresh_s=0)
    finally:
        reader.close()


def test_misses_look_for_files_at_most_every_reader_refresh_s(
        tmp_path: Path, opens: OpenSpy, threads_started: list[str]) -> None:
    root = tmp_path / "cache"
    reader = _start(root, Sharing.READER, refresh_s=3600.0)
    try:
        keys = _missing(reader)
        reader._refreshed = -math.inf  # as if an hour had passed since its last rescan
        threads_started.clear()
        opens.armed = True
        assert reader.thread.run(reader.fresh_contains(keys)) == [False] * MISSING
        first = len(opens.calls)
        assert first > 0  # the first miss looked
        for _ in range(CALLS):
            assert reader.thread.run(reader.fresh_contains(keys)) == [False] * MISSING
        assert len(opens.calls) == first, "misses within reader_refresh_s of the last look looked again"
        assert threads_started == []
        opens.armed = False
        # Published now: not looked for before reader_refresh_s has passed since the last look...
        _publish(root, keys[5:6])
        assert reader.thread.run(reader.fresh_contains(keys))[5] is False
        # ...and seen once it has (the loop clock moved back by the interval instead of sleeping).
        reader._checked -= 3600.0
        assert reader.thread.run(reader.fresh_contains(keys))[5] is True
        assert reader.refreshes == 1
    finally:
        reader.close()


def test_a_page_published_later_is_seen_and_no_descriptor_leaks(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    reader = _start(root, Sharing.READER)
    try:
        layout_dir = str(_files(reader).layout_dir)
        keys = _missing(reader, 4)
        held = _fds_at(layout_dir)
        assert held >= 2  # the tier's and the checks'
        for round_, key in enumerate(keys, start=1):
            # Its fan-out directory does not exist at the first look: the writer creates it.
            assert reader.thread.run(reader.fresh_prefix([key])) == 0
            _publish(root, [key])
            assert reader.thread.run(reader.fresh_prefix([key])) == 1
            assert reader.refreshes == round_
            # Each rescan replaces the layout descriptor the checks use; the worker closes the old
            # one in order, before a later check (this miss) is answered.
            assert reader.thread.run(reader.fresh_prefix([reader.key(b"in order")])) == 0
            assert _fds_at(layout_dir) == held
    finally:
        reader.close()
    assert _fds_at(layout_dir) == 0, "close() left a descriptor of the layout directory open"


def test_a_store_directory_swapped_after_start_is_not_followed(tmp_path: Path) -> None:
    root, outside = tmp_path / "cache", tmp_path / "outside"
    writer = _start(root, Sharing.WRITER)
    reader = _start(root, Sharing.READER)
    try:
        old_key, key = reader.key(b"before the swap"), reader.key(b"after the swap")
        assert writer.thread.run(writer.store(old_key, [torch.full((PAGE_BYTES,), 1, dtype=torch.uint8)]))
        assert reader.thread.run(reader.fresh_prefix([old_key])) == 1
        attempted = reader._refreshed
        # The store's directory renamed away and a symlink put at its name, to a tree that holds
        # a regular file at the missing key's page file name.
        files = _files(reader)
        planted = outside / files.rel(key)
        planted.parent.mkdir(parents=True)
        planted.write_bytes(b"x" * PAGE_BYTES)
        os.rename(reader.directory, reader.directory.with_name(reader.directory.name + ".moved"))
        reader.directory.symlink_to(outside, target_is_directory=True)
        tree = sorted(str(p) for p in outside.rglob("*"))
        assert reader.thread.run(reader.fresh_prefix([key])) == 0
        assert reader._refreshed == attempted, "the planted file counted as published (a rescan)"
        # The writer (its own descriptors) publishes it in the real directory: the reader sees the
        # file where its tier indexes, and its rescan refuses the link at the name.
        assert writer.thread.run(writer.store(key, [torch.full((PAGE_BYTES,), 2, dtype=torch.uint8)]))
        assert reader.thread.run(reader.fresh_prefix([key])) == 0
        assert reader.refreshes == 1  # the refused rescan kept the index it had
        assert reader.thread.run(reader.fresh_prefix([old_key])) == 1
        assert sorted(str(p) for p in outside.rglob("*")) == tree, "something was created through the link"
    finally:
        reader.close()
        writer.close()


def test_a_layout_directory_swapped_after_start_is_not_followed(tmp_path: Path) -> None:
    root, outside = tmp_path / "cache", tmp_path / "outside"
    reader = _start(root, Sharing.READER)
    try:
        key = reader.key(b"planted")
        files = _files(reader)
        fan, name = files.rel(key).split("/")
        (outside / fan).mkdir(parents=True)
        (outside / fan / name).write_bytes(b"x" * PAGE_BYTES)
        os.rename(files.layout_dir, files.layout_dir.with_name(files.layout_dir.name + ".moved"))
        files.layout_dir.symlink_to(outside, target_is_directory=True)
        attempted = reader._refreshed
        assert reader.thread.run(reader.fresh_prefix([key])) == 0
        assert reader._refreshed == attempted and reader.refreshes == 0, \
            "a page file reached through a planted layout link counted as published"
    finally:
        reader.close()


def test_a_check_on_the_worker_never_holds_up_the_loop_and_a_cancelled_one_is_dropped(
        tmp_path: Path, opens: OpenSpy) -> None:
    root = tmp_path / "cache"
    reader = _start(root, Sharing.READER)
    try:
        shown = reader.key(b"indexed")
        _publish(root, [shown])
        assert reader.thread.run(reader.fresh_prefix([shown])) == 1
        layout = os.stat(_files(reader).layout_dir)
        key = reader.key(b"looked for")
        opens.hold_name = _files(reader).rel(key).split("/")[0]
        opens.armed = True
        lookup = reader.thread.submit(reader.fresh_contains([key]))
        assert opens.entered.wait(BOUND_S)  # the check is held in its open of the fan-out directory
        # The loop serves meanwhile: lookups, and a rescan that replaces the layout descriptor.
        assert reader.thread.call(lambda: reader.contains([shown, key])).result(BOUND_S) == [True, False]
        assert reader.thread.submit(reader.clear()).result(BOUND_S) is True
        assert reader.refreshes == 2
        assert lookup.cancel()
        opens.release.set()
        with pytest.raises(concurrent.futures.CancelledError):
            lookup.result(BOUND_S)
        assert opens.went_on.wait(BOUND_S)
        # The held check's descriptor was still the layout directory when it went on: the one
        # replaced by the rescan is closed only after the checks queued before.
        assert opens.held_fd_identity == (layout.st_dev, layout.st_ino)
        opens.armed = False
        # The worker goes on: a page published now is seen.
        _publish(root, [key])
        assert reader.thread.run(reader.fresh_contains([key])) == [True]
    finally:
        reader.close()
