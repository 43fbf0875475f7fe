"""What `KVCache` and `TPCache` share: the calls that go straight to their `CacheManager`."""

from __future__ import annotations

import abc
import math
from types import TracebackType
from typing import Self

from aiokv.costs import LoadEstimate
from aiokv.keys import PageKey, Salt, Tokens, check_salt
from aiokv.manager import CacheManager
from aiokv.pool import PagePool
from aiokv.rates_file import RATE_BOUNDS
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
        """Page keys of the full pages of ``tokens`` under this cache's namespace and ``salt``.
        Raises ``RuntimeError`` once the cache's close began, as :meth:`match` does."""
        self._refuse_closed()
        check_salt(salt)
        return self._manager.keys(tokens, salt)

    async def match(self, tokens: Tokens, salt: Salt = None) -> Match:
        """The longest prefix of full pages cached in the pool, then on disk.

        Waits for pages another call is writing into the pool right now rather than stopping at
        them, for at most ``CacheConfig.commit_wait`` in all; then the match ends there (a shorter
        hit, counted ``commit_wait_expired``). Raises ``TypeError``/``ValueError`` for bad tokens or salt.
        """
        check_salt(salt)  # before the manager looks it up among its seeds (an unhashable salt)
        return await self._manager.match(tokens, salt)

    async def prefetch(self, tokens: Tokens, *, salt: Salt = None) -> PrefetchResult:
        """Read the disk pages that follow the pool's prefix of ``tokens`` into the pool.

        For requests waiting in a queue; the GPU is not touched. Pages another call is writing
        into the pool are waited for as :meth:`match` does (``commit_wait`` at most, in all), so
        the result says what a match finds in the pool next. Faults stop the promotion at the
        first page that failed (counted, never raised). Raises ``TypeError``/``ValueError`` for bad
        tokens or salt.
        """
        check_salt(salt)
        return await self._manager.prefetch(tokens, salt)

    async def flush(self) -> None:
        """Wait until every page queued for disk so far is written (or dropped)."""
        await self._manager.flush()

    def estimate(self, match: Match) -> LoadEstimate:
        """What loading ``match`` would cost (pool copies, disk reads, recomputing) by the rates
        measured so far, and where a compute-or-load split is expected to meet. Raises
        ``ValueError`` for another cache's match, ``StaleHandleError`` (a ``ValueError``) for one
        already loaded or released; ``RuntimeError`` once the cache's close began."""
        self._refuse_closed()
        return self._manager.estimate(match)

    def note_prefill(self, tokens: int, seconds: float, prefix: int = 0) -> None:
        """Report that the engine prefilled ``tokens`` tokens in ``seconds`` on top of ``prefix``
        tokens already in its KV cache (which they attended over); feeds the cost model.

        Raises ``TypeError`` unless ``tokens`` and ``prefix`` are ints and ``seconds`` a number,
        ``ValueError`` for no tokens, a negative prefix, either beyond 2**53, a time that is not
        positive and finite, or a rate outside what a rates file may hold
        (``RATE_BOUNDS["prefill"]``); nothing is folded in then. Raises ``RuntimeError`` once the
        cache's close began (the close saves the rates file: a report after it may never be kept).
        """
        self._refuse_closed()
        if isinstance(tokens, bool) or not isinstance(tokens, int):
            raise TypeError(f"tokens must be an int, got {type(tokens).__name__}")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise TypeError(f"seconds must be a number, got {type(seconds).__name__}")
        if isinstance(prefix, bool) or not isinstance(prefix, int):
            raise TypeError(f"prefix must be an int, got {type(prefix).__name__}")
        if not 0 < tokens <= 1 << 53:  # (beyond, tokens / seconds may not fit a float)
            raise ValueError(f"tokens must be positive and at most 2**53, got {tokens}")
        if not 0 <= prefix <= 1 << 53:
            raise ValueError(f"prefix must be at least 0 and at most 2**53, got {prefix}")
        if not (0 < seconds < math.inf):
            raise ValueError(f"seconds must be positive and finite, got {seconds!r}")
        low, high = RATE_BOUNDS["prefill"]
        if not low <= tokens / seconds <= high:
            raise ValueError(f"{tokens} tokens in {seconds!r} s is outside [{low:g}, {high:g}] tokens/s")
        self._manager.costs.prefill.update(tokens, seconds, prefix)

    def _refuse_closed(self) -> None:
        """Raise as the manager's running calls do once the close began (``match``, ``offload``...):
        a call that needs no pool (keys, the cost model) must not answer as if the cache served."""
        if self._manager.closing:
            raise RuntimeError("the cache is closed")

    def stats(self) -> CacheStatistics:
        """A frozen snapshot of the counters, in every state (before the start, after a failed or
        cancelled one, after the close); without a pool, its counts are zeros."""
        return self._manager.stats()
