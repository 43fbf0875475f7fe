"""Faults below the caller: counted by kind, the first of each kind logged once.

Faults (pool exhausted, a failed copy, a disk page that does not verify, ...) never raise out of
the cache's calls: they shorten a match or a load, or drop a page, and are counted here so that
``stats().errors`` and the metrics show them. Logging each kind once keeps a failing disk from
flooding the engine's log.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from types import MappingProxyType


class FaultLog:
    """Counts faults by kind; logs the first of each kind at WARNING on ``logger``."""

    def __init__(self, logger: logging.Logger) -> None:
        self._log = logger
        self._counts: Counter[str] = Counter()
        self._logged: set[str] = set()

    def record(self, kind: str, message: str, count: int = 1) -> None:
        """Count ``count`` faults of ``kind``; log ``message`` when it is the kind's first."""
        self._counts[kind] += count
        if kind not in self._logged:
            self._logged.add(kind)
            self._log.warning("aiokv: %s (%s; further ones are only counted)", message, kind)

    def __getitem__(self, kind: str) -> int:
        return self._counts[kind]

    def counts(self) -> Mapping[str, int]:
        """A read-only snapshot of the counts."""
        return MappingProxyType(dict(self._counts))
