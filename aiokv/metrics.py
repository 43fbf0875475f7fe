"""Optional Prometheus export of ``KVCache.stats()`` (install the ``metrics`` extra).

Metric names (all prefixed ``aiokv_``; ``tier`` is ``pool`` or ``disk``):

| name | type | labels | meaning |
| --- | --- | --- | --- |
| ``aiokv_lookups_total`` | counter | | calls to match |
| ``aiokv_hit_tokens_total`` | counter | tier | tokens matched per tier |
| ``aiokv_miss_tokens_total`` | counter | | full-page tokens looked up and not found |
| ``aiokv_loaded_tokens_total`` | counter | tier | tokens copied into the KV buffer per source tier |
| ``aiokv_bytes_total`` | counter | direction | bytes moved: gpu_to_pool, pool_to_gpu, pool_to_disk, disk_to_pool |
| ``aiokv_pages_total`` | counter | outcome | offload/promotion outcomes: stored, skipped, dropped, promoted |
| ``aiokv_pool_pages`` | gauge | state | pool pages: free, reserved, ready, referenced |
| ``aiokv_queue_depth`` | gauge | queue | write_behind, background_jobs |
| ``aiokv_errors_total`` | counter | kind | faults by kind |
| ``aiokv_disk_pages`` | gauge | | page files on disk |
| ``aiokv_disk_bytes`` | gauge | | bytes of page files on disk |
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiokv.cache import KVCache


class CacheCollector:
    """A Prometheus collector that reads a cache's statistics at every scrape."""

    def __init__(self, cache: KVCache, namespace: str = "aiokv") -> None:
        self._cache = cache
        self._ns = namespace

    def collect(self) -> Iterator[Any]:
        """Yield the metric families (called by prometheus_client at scrape time)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self._cache.stats()
        ns = self._ns

        def counter(name: str, doc: str, label: str | None, values: dict[str, int]) -> CounterMetricFamily:
            family = CounterMetricFamily(f"{ns}_{name}", doc, labels=[label] if label else None)
            for key, value in values.items():
                family.add_metric([key] if label else [], value)
            return family

        def gauge(name: str, doc: str, label: str | None, values: dict[str, int]) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"{ns}_{name}", doc, labels=[label] if label else None)
            for key, value in values.items():
                family.add_metric([key] if label else [], value)
            return family

        yield counter("lookups", "Calls to match.", None, {"": s.lookups})
        yield counter("hit_tokens", "Tokens matched, by tier.", "tier", {t.value: n for t, n in s.hit_tokens.items()})
        yield counter("miss_tokens", "Full-page tokens not found in any tier.", None, {"": s.miss_tokens})
        yield counter(
            "loaded_tokens", "Tokens loaded into the KV buffer, by source tier.", "tier",
            {t.value: n for t, n in s.loaded_tokens.items()},
        )
        yield counter("bytes", "Bytes moved, by direction.", "direction", dict(s.bytes_moved))
        yield counter(
            "pages", "Pages by offload/promotion outcome.", "outcome",
            {"stored": s.pages_stored, "skipped": s.pages_skipped, "dropped": s.pages_dropped,
             "promoted": s.pages_promoted},
        )
        yield gauge(
            "pool_pages", "Pool pages by state.", "state",
            {"free": s.pool_free, "reserved": s.pool_reserved, "ready": s.pool_ready,
             "referenced": s.pool_referenced},
        )
        yield gauge(
            "queue_depth", "Queue depths.", "queue",
            {"write_behind": s.write_behind_queue, "background_jobs": s.background_jobs},
        )
        yield counter("errors", "Faults by kind.", "kind", dict(s.errors))
        if s.disk is not None:
            yield gauge("disk_pages", "Page files on disk.", None, {"": s.disk.pages})
            yield gauge("disk_bytes", "Bytes of page files on disk.", None, {"": s.disk.bytes_stored})


def register(cache: KVCache, registry: Any = None) -> CacheCollector:
    """Register a :class:`CacheCollector` for ``cache`` (default: prometheus_client's global registry)."""
    try:
        from prometheus_client import REGISTRY
    except ImportError as exc:  # pragma: no cover - depends on the optional extra
        raise ImportError("Prometheus export needs the 'metrics' extra: pip install 'aiokv[metrics]'") from exc
    collector = CacheCollector(cache)
    (registry if registry is not None else REGISTRY).register(collector)
    return collector
