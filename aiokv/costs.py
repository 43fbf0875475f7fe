"""The cost model: how fast each tier delivers and how fast the engine prefills, measured online.

Rates are moving averages (EWMA) of what whole calls achieved — bytes over the wall time of a
load's pool copies, of its disk reads — so concurrency inside a call counts as it should. The
engine's prefill rate is given in the config, reported by the engine, or learned from the claims
of a :class:`aiokv.stream.LoadStream`. :meth:`CostModel.estimate` turns them into what a match
would cost to load, to recompute, and where a compute-or-load split would meet.
"""

from __future__ import annotations

from dataclasses import dataclass


class RateMeter:
    """An exponentially weighted moving average of a rate (amount per second)."""

    def __init__(self, weight: float = 0.3, initial: float | None = None) -> None:
        self._weight = weight
        self._rate = initial

    def update(self, amount: float, seconds: float) -> None:
        """Fold in one observation; ignored when it carries no information."""
        if amount <= 0 or seconds <= 0:
            return
        rate = amount / seconds
        self._rate = rate if self._rate is None else (1 - self._weight) * self._rate + self._weight * rate

    @property
    def rate(self) -> float | None:
        """The current estimate, or None before the first observation."""
        return self._rate


@dataclass(frozen=True)
class LoadEstimate:
    """What loading a match would cost, by the rates measured so far (None: not known yet)."""

    pool_seconds: float | None
    """Copying its pool pages into the KV buffer."""
    disk_seconds: float | None
    """Reading its disk pages into the pool (before they are copied)."""
    recompute_seconds: float | None
    """Prefilling its tokens instead."""
    split_token: int | None
    """Where a compute-or-load split is expected to meet: compute ``[0, split)``, load the rest."""

    @property
    def load_seconds(self) -> float | None:
        """Loading the whole match (disk reads and copies overlap: the slower of the two bounds it)."""
        if self.pool_seconds is None or self.disk_seconds is None:
            return None
        return max(self.pool_seconds, self.disk_seconds)

    @property
    def worth_loading(self) -> bool | None:
        """Whether a plain load is expected to beat recomputing (None: not known yet).

        False as soon as one known part alone (the disk reads, say) takes as long as recomputing,
        even while the other's rate is unknown: aiokv never picks a load it expects to lose.
        """
        compute = self.recompute_seconds
        if compute is None:
            return None
        known = [part for part in (self.pool_seconds, self.disk_seconds) if part is not None]
        if any(part >= compute for part in known):
            return False
        load = self.load_seconds
        return None if load is None else load < compute


class CostModel:
    """Per-tier delivered throughput and the engine's prefill rate, with estimates built on them."""

    def __init__(self, prefill_tokens_per_s: float | None = None) -> None:
        self.pool = RateMeter()
        """Bytes per second copied from the pool into the KV buffer."""
        self.disk = RateMeter()
        """Bytes per second read from disk into the pool."""
        self.prefill = RateMeter(initial=prefill_tokens_per_s)
        """Tokens per second the engine prefills."""

    def estimate(self, pool_pages: int, disk_pages: int, page_tokens: int, page_bytes: int) -> LoadEstimate:
        """Costs of a prefix of ``pool_pages`` pool pages followed by ``disk_pages`` disk pages."""
        pool_rate, disk_rate, prefill = self.pool.rate, self.disk.rate, self.prefill.rate
        pages = pool_pages + disk_pages
        copy = None if pool_rate is None else pages * page_bytes / pool_rate
        read = 0.0 if disk_pages == 0 else None if disk_rate is None else disk_pages * page_bytes / disk_rate
        recompute = None if prefill is None else pages * page_tokens / prefill
        split = None
        # Pages reaching disk: their reads bound the load whatever the copies cost, so an unknown
        # copy rate counts as free there (the split is then the latest the load can meet).
        copy_known = copy if copy is not None else 0.0 if disk_pages else None
        if pages and prefill is not None and copy_known is not None and read is not None:
            # Loading runs from the back, computing from the front: with the fronts meeting at page
            # k the prefix is ready after max(time to compute [0, k), time to load [k, P)).
            compute_page = page_tokens / prefill
            per_pool = copy_known / pages
            per_disk = read / disk_pages + per_pool if disk_pages else per_pool
            best_k, best = pages, pages * compute_page
            load = 0.0
            for k in range(pages - 1, -1, -1):
                load += per_disk if k >= pool_pages else per_pool
                ready = max(k * compute_page, load)
                if ready <= best:
                    best_k, best = k, ready
            k = best_k
            split = k * page_tokens
        return LoadEstimate(copy, read, recompute, split)
