"""What the cache hands back: matches, results of load/offload/prefetch, statistics."""

from __future__ import annotations

import asyncio
import enum
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType

from aiokv.keys import PageKey
from aiokv.pagetable import PageHandle, StaleHandleError
from aiokv.pool import PoolStatistics
from aiokv.storage import DiskStatistics


class Tier(enum.Enum):
    """Where a cached page was found."""

    POOL = "pool"
    DISK = "disk"


class Match:
    """The longest cached prefix of a prompt: pool pages first, then disk pages.

    Holds references on its pool pages until :meth:`KVCache.load` consumes it or :meth:`release`
    is called (also on leaving ``async with``). Disk pages are not pinned: a disk page deleted
    before the load shortens the load instead.
    """

    def __init__(
        self,
        owner: object,
        keys: tuple[PageKey, ...],
        handles: list[PageHandle],
        disk_pages: int,
        page_tokens: int,
        release: Callable[[list[PageHandle]], None],
    ) -> None:
        self._owner = owner
        self._keys = keys
        self._handles = handles
        self._release_fn = release
        self.pool_pages = len(handles)
        """Pages of the prefix found in the CPU pool (referenced by this match)."""
        self.disk_pages = disk_pages
        """Pages after the pool part found on disk."""
        self.pages = self.pool_pages + disk_pages
        """Pages in the match."""
        self.tokens = self.pages * page_tokens
        """Tokens in the match (a multiple of the page size)."""
        self._done = False
        # The page table belongs to this loop: a finalizer (any thread) hands its release there.
        self._loop = asyncio.get_running_loop() if handles else None

    @property
    def released(self) -> bool:
        """True once loaded or released."""
        return self._done

    def belongs_to(self, owner: object) -> bool:
        """Whether this match was made by ``owner`` (only its own cache may load or take it)."""
        return owner is self._owner

    def take(self, owner: object) -> tuple[tuple[PageKey, ...], list[PageHandle]]:
        """Hand the keys and page references to ``owner``'s load (the match is used up)."""
        if owner is not self._owner:
            raise ValueError("this Match belongs to another KVCache")
        if self._done:
            raise StaleHandleError("this Match was already loaded or released")
        self._done = True
        handles, self._handles = self._handles, []
        return self._keys, handles

    def release(self) -> None:
        """Give back the page references without loading. Idempotent."""
        if self._done:
            return
        self._done = True
        handles, self._handles = self._handles, []
        self._release_fn(handles)

    async def __aenter__(self) -> Match:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __del__(self, _warn: Callable[..., None] = warnings.warn) -> None:
        # A Match dropped while holding pool pages would pin them forever: give them back on its
        # loop and warn, as asyncio does for an unclosed transport.
        if self._done or not self._handles or self._loop is None:
            return
        self._done = True
        handles, self._handles = self._handles, []
        _warn(f"unreleased {self!r}: call release() or load() (or use `async with`)", ResourceWarning,
              source=self, stacklevel=2)
        if not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._release_fn, handles)
            except RuntimeError:
                pass  # the loop closed meanwhile: its pool is gone with it

    def __repr__(self) -> str:
        state = "released" if self._done else "held"
        return f"Match(tokens={self.tokens}, pool_pages={self.pool_pages}, disk_pages={self.disk_pages}, {state})"


@dataclass(frozen=True)
class LoadResult:
    """Outcome of :meth:`KVCache.load`: tokens ``[from_token, tokens)`` are in the KV buffer."""

    tokens: int
    """End of the valid loaded prefix; less than ``requested`` when a lower tier failed."""
    requested: int
    """``match.tokens``: what the load was asked to bring."""
    from_token: int
    """First token copied (earlier tokens were already in the engine's buffer)."""
    pool_pages: int
    """Pages copied straight from the pool."""
    disk_pages: int
    """Pages read from disk into the pool, then copied."""

    @property
    def shortened(self) -> bool:
        """True when the load stopped before ``requested``: a fault below (counted in
        ``stats().errors``), or a disk page the tier evicted for room since the match (not a
        fault: ``stats().disk.evictions``)."""
        return self.tokens < self.requested


@dataclass(frozen=True)
class OffloadResult:
    """Outcome of :meth:`KVCache.offload`, in pages."""

    stored: int
    """New pages copied into the pool."""
    skipped: int
    """Pages already cached, or stored by another call that was writing them (or still writing
    them after ``commit_wait``)."""
    dropped: int
    """Pages not stored: pool full of referenced pages, the copy failed, or the cache began closing
    before their copy was launched (withdrawn: see ``CacheStatistics.pages_withdrawn``)."""


@dataclass(frozen=True)
class PrefetchResult:
    """Outcome of :meth:`KVCache.prefetch`, in pages."""

    pool_pages: int
    """Pages of the prefix that were in the pool already."""
    promoted: int
    """Pages read from disk into the pool by this call."""


@dataclass(frozen=True)
class CacheStatistics:
    """A snapshot of a cache's counters (``KVCache.stats()``)."""

    lookups: int
    """Calls to match."""
    hit_tokens: Mapping[Tier, int]
    """Tokens matched, by the tier they were found in."""
    miss_tokens: int
    """Full-page tokens looked up and not found in any tier."""
    loaded_tokens: Mapping[Tier, int]
    """Tokens copied into the KV buffer by load, by source tier."""
    bytes_moved: Mapping[str, int]
    """Bytes by direction: gpu_to_pool, pool_to_gpu, pool_to_disk, disk_to_pool."""
    pages_stored: int
    """Pages offloaded into the pool."""
    pages_skipped: int
    """Pages offload found cached already."""
    pages_dropped: int
    """Pages offload could not store (withdrawn ones included)."""
    pages_promoted: int
    """Pages read from disk into the pool (load and prefetch)."""
    pages_withdrawn: int
    """Pages a load or offload in flight did not copy because the cache began closing before their
    copy was launched (a paced offload still waiting for its turn, a launch group not reached).
    Nothing of them ran: an offload's are aborted (never served), a load's are not reported
    loaded. Not a fault: never counted in ``errors`` (not ``copy_failed``, ``load_shortened``)."""
    pool_free: int
    pool_reserved: int
    pool_ready: int
    pool_referenced: int
    write_behind_queue: int
    """Pages waiting for their disk write."""
    background_jobs: int
    """Copies and reads still finishing for cancelled callers."""
    errors: Mapping[str, int]
    """Faults by kind (pool_exhausted, copy_failed, disk_read_failed, write_behind_full, disk_*)."""
    pool: PoolStatistics
    disk: DiskStatistics | None
    """The disk tier's own statistics, or None without a disk tier."""
