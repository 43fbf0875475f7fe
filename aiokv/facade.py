"""What `KVCache` and `TPCache` share: the calls that go straight to their `CacheManager`."""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Self

from aiokv.costs import LoadEstimate
from aiokv.keys import PageKey, Salt, Tokens
from aiokv.manager import CacheManager
from aiokv.pool import PagePool
from aiokv.results import CacheStatistics, Match, PrefetchResult
from aiokv.storage import DiskTier


class CacheFacade(abc.ABC):
    """Base of the public caches: lifetime through ``async with`` and the manager's plain calls."""

    _manager: CacheManager

    @abc.abstractmethod
    async def start(self) -> None:
        """Start the manager and this cache's worker side."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close everything; idempotent."""

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    @property
    def pool(self) -> PagePool:
        """The CPU page pool (after start)."""
        return self._manager.pool

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier, or None when there is none (not configured, or it could not start)."""
        return self._manager.disk

    @property
    def manager(self) -> CacheManager:
        """The bookkeeping half (keys, page table, tiers, counters)."""
        return self._manager

    def keys(self, tokens: Tokens, salt: Salt = None) -> list[PageKey]:
        """Page keys of the full pages of ``tokens`` under this cache's namespace and ``salt``."""
        return self._manager.keys(tokens, salt)

    async def match(self, tokens: Tokens, salt: Salt = None) -> Match:
        """The longest prefix of full pages cached in the pool, then on disk.

        Waits for pages another call is writing into the pool right now rather than stopping at
        them. Raises ``TypeError``/``ValueError`` for bad tokens or salt.
        """
        return await self._manager.match(tokens, salt)

    async def prefetch(self, tokens: Tokens, *, salt: Salt = None) -> PrefetchResult:
        """Read the disk pages that follow the pool's prefix of ``tokens`` into the pool.

        For requests waiting in a queue; the GPU is not touched. Faults stop the promotion at the
        first page that failed (counted, never raised).
        """
        return await self._manager.prefetch(tokens, salt)

    async def flush(self) -> None:
        """Wait until every page queued for disk so far is written (or dropped)."""
        await self._manager.flush()

    def estimate(self, match: Match) -> LoadEstimate:
        """What loading ``match`` would cost (pool copies, disk reads, recomputing) by the rates
        measured so far, and where a compute-or-load split is expected to meet."""
        return self._manager.estimate(match)

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """Report that the engine prefilled ``tokens`` tokens in ``seconds`` (feeds the cost model)."""
        self._manager.costs.prefill.update(tokens, seconds)

    def stats(self) -> CacheStatistics:
        """A frozen snapshot of the counters."""
        return self._manager.stats()
