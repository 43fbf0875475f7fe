"""Optional Prometheus export of ``KVCache.stats()`` (install the ``metrics`` extra).

Metric names (all prefixed ``aiokv_``; ``tier`` is ``pool`` or ``disk``). Every series also carries
the labels ``cache`` (a name given at registration; the namespace by default), ``namespace`` and
``tp_rank`` (``all`` for a :class:`aiokv.tp.cache.TPCache`), so several caches of one process share a
registry without clashing:

| name | type | labels | meaning |
| --- | --- | --- | --- |
| ``aiokv_lookups_total`` | counter | | calls to match |
| ``aiokv_hit_tokens_total`` | counter | tier | tokens matched per tier |
| ``aiokv_miss_tokens_total`` | counter | | full-page tokens looked up and not found |
| ``aiokv_loaded_tokens_total`` | counter | tier | tokens copied into the KV buffer per source tier |
| ``aiokv_bytes_total`` | counter | direction | bytes moved: gpu_to_pool, pool_to_gpu, pool_to_disk, disk_to_pool |
| ``aiokv_pages_total`` | counter | outcome | pages: stored, skipped, dropped, promoted, withdrawn (see below) |
| ``aiokv_pool_pages`` | gauge | state | pool pages: free, reserved, ready, referenced |
| ``aiokv_queue_depth`` | gauge | queue | write_behind, background_jobs |
| ``aiokv_errors_total`` | counter | kind | faults by kind |
| ``aiokv_disk_pages`` | gauge | | page files on disk |
| ``aiokv_disk_bytes`` | gauge | | bytes of page files on disk |

``outcome="withdrawn"``: pages a load or offload in flight did not copy because the close began
(``CacheStatistics.pages_withdrawn``; not a fault; an offload's are also counted ``dropped``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

from aiokv.config import CacheConfig
from aiokv.results import CacheStatistics


class _Observable(Protocol):
    config: CacheConfig

    def stats(self) -> CacheStatistics: ...


_LABELS = ["cache", "namespace", "tp_rank"]


class CacheCollector:
    """A Prometheus collector that reads the statistics of every cache registered to it at each scrape."""

    def __init__(self, namespace: str = "aiokv") -> None:
        self._ns = namespace
        self._caches: dict[tuple[str, str, str], _Observable] = {}
        self._lock = threading.Lock()  # scrapes run on the exporter's thread

    def add(self, cache: _Observable, labels: tuple[str, str, str]) -> None:
        """Export ``cache`` under ``labels``; ``ValueError`` when a cache already has them."""
        with self._lock:
            if labels in self._caches:
                raise ValueError(f"a cache labelled {dict(zip(_LABELS, labels, strict=True))} is already registered; "
                                 "pass register(..., name=...) to tell them apart")
            self._caches[labels] = cache

    def remove(self, cache: _Observable) -> None:
        """Stop exporting ``cache`` (e.g. after it was closed)."""
        with self._lock:
            for labels in [k for k, v in self._caches.items() if v is cache]:
                del self._caches[labels]

    def collect(self) -> Iterator[Any]:
        """Yield the metric families (called by prometheus_client at scrape time)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            caches = list(self._caches.items())
        ns = self._ns
        families: dict[str, Any] = {}

        def add(kind: type[Any], name: str, doc: str, label: str | None, base: tuple[str, str, str],
                values: dict[str, int]) -> None:
            family = families.get(name)
            if family is None:
                family = kind(f"{ns}_{name}", doc, labels=[*_LABELS, label] if label else _LABELS)
                families[name] = family
            for key, value in values.items():
                family.add_metric([*base, key] if label else list(base), value)

        for base, cache in caches:
            s = cache.stats()  # in every state: zeros before the pool opened
            c, g = CounterMetricFamily, GaugeMetricFamily
            add(c, "lookups", "Calls to match.", None, base, {"": s.lookups})
            add(c, "hit_tokens", "Tokens matched, by tier.", "tier", base,
                {t.value: n for t, n in s.hit_tokens.items()})
            add(c, "miss_tokens", "Full-page tokens not found in any tier.", None, base, {"": s.miss_tokens})
            add(c, "loaded_tokens", "Tokens loaded into the KV buffer, by source tier.", "tier", base,
                {t.value: n for t, n in s.loaded_tokens.items()})
            add(c, "bytes", "Bytes moved, by direction.", "direction", base, dict(s.bytes_moved))
            add(c, "pages", "Pages by offload/promotion outcome.", "outcome", base,
                {"stored": s.pages_stored, "skipped": s.pages_skipped, "dropped": s.pages_dropped,
                 "promoted": s.pages_promoted, "withdrawn": s.pages_withdrawn})
            add(g, "pool_pages", "Pool pages by state.", "state", base,
                {"free": s.pool_free, "reserved": s.pool_reserved, "ready": s.pool_ready,
                 "referenced": s.pool_referenced})
            add(g, "queue_depth", "Queue depths.", "queue", base,
                {"write_behind": s.write_behind_queue, "background_jobs": s.background_jobs})
            add(c, "errors", "Faults by kind.", "kind", base, dict(s.errors))
            if s.disk is not None:
                add(g, "disk_pages", "Page files on disk.", None, base, {"": s.disk.pages})
                add(g, "disk_bytes", "Bytes of page files on disk.", None, base, {"": s.disk.bytes_stored})
        yield from families.values()


_collectors: weakref.WeakKeyDictionary[Any, CacheCollector] = weakref.WeakKeyDictionary()


def register(cache: _Observable, registry: Any = None, *, name: str | None = None) -> CacheCollector:
    """Export ``cache``'s statistics to ``registry`` (default: prometheus_client's global registry).

    ``name`` labels its series (``cache=...``; default: the namespace); caches of one process share
    one collector per registry. Raises ``ValueError`` when a cache with the same labels is
    registered already, ``TypeError`` for a name that is not a str.
    """
    try:
        from prometheus_client import REGISTRY
    except ImportError as exc:  # pragma: no cover - depends on the optional extra
        raise ImportError("Prometheus export needs the 'metrics' extra: pip install 'aiokv[metrics]'") from exc
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    target = registry if registry is not None else REGISTRY
    config = cache.config
    rank = str(config.tp_rank) if getattr(cache, "tp_size", None) is None else "all"
    labels = (name if name is not None else config.namespace, config.namespace, rank)
    collector = _collectors.get(target)
    if collector is None:
        collector = CacheCollector()
        collector.add(cache, labels)
        target.register(collector)
        _collectors[target] = collector
    else:
        collector.add(cache, labels)
    return collector
