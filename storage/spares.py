"""Spare page files: a small stock of pre-created, pre-sized files that new pages are written into.

Creating a file is most of a new page's cost on ext4 (the create is punted to io-wq, allocates an
inode, and on a file system without a journal scans recently deleted inodes). A new-page write
takes a spare the way a recycling write takes an evicted page's file (``PageIO.start_recycle``):
header and payload overwrite it, then it is renamed to the page's name. The files are made off the
loop, in batches, on a thread of their own (:func:`make_spares`, started by ``run_in_new_thread``):
``O_CREAT|O_EXCL|O_NOFOLLOW`` in a fan-out directory, then ``fallocate`` to a page file's size, so
the page's write neither extends the file nor allocates blocks.

- Budget: each spare holds one page file's room in the index (:class:`~.index.PageIndex`) from the
  moment it is asked for; a write that takes one passes that room to its page. Spares are only
  made into free room, never by evicting pages; a write that finds no spare and no free room
  while a batch holds it waits for that batch instead of evicting. The budget in force never
  drops below what is held, spares included (their blocks are allocated): writes take them first.
- Names: ``.spare-<tag><n>`` (:data:`SPARE_PREFIX`), round robin over the fan-out directories.
  The next start removes every such name (:mod:`.layoutdir`): spares left by a crash are never
  indexed (they are no key's name) and never reused (they may hold a torn page).
- Faults: a batch that meets a fault (ENOSPC, EIO, EROFS...) keeps the files it made, is counted
  (:attr:`SpareStatistics.failed`, and the fault by kind in the tier's errors) and no batch starts
  for a back-off time; writes meanwhile create their files in their own chain, as without spares.
- Close: the stock is unlinked once the batch in flight has landed; a tier that became read-only
  leaves its spares to the next start.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import errno
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass

from .safefiles import OPEN_FLAGS

SPARE_PREFIX = ".spare-"
"""Names of spare files (in fan-out directories): never a page's name, removed at start."""


@dataclass(frozen=True)
class Spare:
    """A spare file: its fan-out directory's descriptor (the tier's, open until close) and name."""

    dir_fd: int
    name: str


@dataclass(frozen=True)
class SpareStatistics:
    """A snapshot of the spare files of a tier."""

    target: int
    """Spare files the tier keeps in stock (0: none are made)."""
    stock: int
    """Spares ready to be taken."""
    making: int
    """Spares being made by the batch in flight (their room is held)."""
    made: int
    """Spares made so far."""
    taken: int
    """Spares a write took over (written into and renamed to the page's name, or removed on a fault)."""
    not_taken: int
    """Spares a write could not take over (gone, not ours, the open failed): it created a file instead."""
    failed: int
    """Batches that stopped on a fault (none started for a back-off time after each)."""
    removed: int
    """Spares unlinked: at close, or after a write could not take them over."""
    batches: int
    """Batches started (each on a thread of its own)."""


@dataclass(frozen=True)
class Made:
    """What a batch made (in order), and the fault that stopped it, if any."""

    spares: list[Spare]
    error: OSError | None


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_fallocate = _libc.fallocate
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_fallocate.restype = ctypes.c_int


def _allocate(fd: int, size: int) -> None:
    """Allocate ``size`` bytes (the file's size becomes ``size``); where the file system cannot
    (EOPNOTSUPP), the spare stays empty: it still spares the page its create."""
    if _fallocate(fd, 0, 0, size) == 0:
        return
    err = ctypes.get_errno()
    if err not in (errno.EOPNOTSUPP, errno.ENOSYS):
        raise OSError(err, os.strerror(err))


def make_spares(batch: Sequence[Spare], file_bytes: int) -> Made:
    """Create and allocate ``batch``'s files (blocking: on a thread of its own). Stops at the first
    fault: what was made so far is returned with it (a file whose allocation failed is removed)."""
    made: list[Spare] = []
    for spare in batch:
        try:
            fd = os.open(spare.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o600, dir_fd=spare.dir_fd)
        except OSError as exc:
            return Made(made, exc)
        try:
            _allocate(fd, file_bytes)
        except OSError as exc:
            os.close(fd)
            try:
                os.unlink(spare.name, dir_fd=spare.dir_fd)
            except OSError:
                pass  # left for the next start to remove
            return Made(made, exc)
        os.close(fd)
        made.append(spare)
    return Made(made, None)


class SpareStock:
    """The bookkeeping of a tier's spare files (plain synchronous code on the loop): the stock,
    the batch in flight, the back-off after a fault, the counters. The tier holds their room."""

    def __init__(self, target: int, backoff_s: float) -> None:
        self.target = target
        self.backoff_s = backoff_s
        self.making = 0
        self.retry_at = 0.0
        self.made = self.taken = self.not_taken = self.failed = self.removed = self.batches = 0
        self._stock: collections.deque[Spare] = collections.deque()
        self._tag = os.urandom(6).hex()  # fresh names per tier (as temp names: not a secret)
        self._counter = itertools.count()
        self._next_dir = 0

    def __len__(self) -> int:
        return len(self._stock)

    def take(self) -> Spare | None:
        """The oldest spare in stock, or None."""
        return self._stock.popleft() if self._stock else None

    def wanted(self, now: float) -> int:
        """How many spares a new batch should make now: none while one is in flight, after a fault
        within the back-off time, or while at least half the stock is left (a batch costs a thread
        start and its GIL hand-offs: few large batches, not one per write)."""
        if self.making or now < self.retry_at or len(self._stock) > self.target // 2:
            return 0
        return self.target - len(self._stock)

    def plan(self, dirs: Sequence[int], count: int) -> list[Spare]:
        """Names for a batch of ``count`` spares, round robin over the directories ``dirs``."""
        batch: list[Spare] = []
        for _ in range(count):
            fd = dirs[self._next_dir % len(dirs)]
            self._next_dir += 1
            batch.append(Spare(fd, f"{SPARE_PREFIX}{self._tag}{next(self._counter):x}"))
        self.making = count
        self.batches += 1
        return batch

    def landed(self, made: Made, now: float) -> None:
        """The batch in flight is over: its spares go into stock; a fault starts the back-off."""
        self.making = 0
        self._stock.extend(made.spares)
        self.made += len(made.spares)
        if made.error is not None:
            self.failed += 1
            self.retry_at = now + self.backoff_s

    def named(self, name: str) -> bool:
        """Whether ``name`` is a spare file's name of this stock (in it, or being made)."""
        return name.startswith(f"{SPARE_PREFIX}{self._tag}")

    def drop_in(self, dir_fd: int) -> list[Spare]:
        """Take the spares in the directory ``dir_fd`` out of stock (it was removed or replaced)."""
        out = [spare for spare in self._stock if spare.dir_fd == dir_fd]
        if out:
            self._stock = collections.deque(spare for spare in self._stock if spare.dir_fd != dir_fd)
        return out

    def drain(self) -> list[Spare]:
        """Take every spare out of stock (the tier removes them)."""
        out = list(self._stock)
        self._stock.clear()
        return out

    def statistics(self) -> SpareStatistics:
        return SpareStatistics(self.target, len(self._stock), self.making, self.made, self.taken, self.not_taken,
                               self.failed, self.removed, self.batches)
