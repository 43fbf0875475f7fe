"""How many pages one loop turn launches: a load's or an offload's launch group.

A long transfer is launched in groups, one per loop turn, so that the loop keeps serving other
requests between them. Counted in pages alone (``CacheConfig.launch_pages``, sized for an 8B
model's 32 MiB pages), a hit of small pages is many turns: a 16-token block of an 8B model is
2 MiB, so a 32K-token hit was 1,024 groups, and on the CPU each group is also a round trip to the
copy thread (a CPU pool hit of 39 pages of 64 KiB took 34.6-39.0 ms in groups of 2 and 5.7-7.6 ms
in one group; docs/measurements.md). :class:`LaunchSizer` grows a group beyond ``launch_pages``
while the loop's measured host time per page lets it fit ``launch_turn_s`` and its bytes fit
``launch_bytes``: the loop's stall per turn stays bounded by what it measured, on any device, and
a group is never smaller than ``launch_pages``.
"""

from __future__ import annotations

DEFAULT_LAUNCH_BYTES = 64 << 20
"""``CacheConfig.launch_bytes``: an 8B model's two 32 MiB pages, what ``launch_pages`` gave it."""

DEFAULT_LAUNCH_TURN_S = 250e-6
"""``CacheConfig.launch_turn_s``: a fifth of the loop-lag budget (p99 1.2 ms). On the H200 a group
of two 32 MiB pages took ~0.5 ms of launch wrappers (docs/measurements.md), so GPU groups of such
pages stay at ``launch_pages``; a CPU group hands its pages to the copy thread in microseconds."""

EWMA_WEIGHT = 0.5
"""Weight of the newest group in the moving estimate of host seconds per page: a slow group (a
first launch that compiles, a GIL hand-over in the middle) shrinks the next groups at once and is
forgotten within a few groups."""


class LaunchSizer:
    """Pages per launch group for one kind of transfer (loads or offloads) of one manager.

    ``min_pages`` is the floor (``launch_pages``); ``max_bytes // page_bytes`` the ceiling (at least
    the floor); ``turn_s`` the host time a group may take on the loop (0: groups stay at the floor).
    Used from the loop thread only: :meth:`pages` before a group's launch, :meth:`record` after it
    with the loop time the group took (validation, the launch call, the bookkeeping).
    """

    __slots__ = ("_ceiling", "_floor", "_per_page", "_turn_s")

    def __init__(self, min_pages: int, max_bytes: int, turn_s: float, page_bytes: int) -> None:
        if min_pages <= 0 or max_bytes <= 0 or page_bytes <= 0 or not turn_s >= 0:
            raise ValueError(f"bad launch sizes: {min_pages} pages, {max_bytes} bytes, {turn_s} s, page {page_bytes}")
        self._floor = min_pages
        self._ceiling = max(min_pages, max_bytes // page_bytes)
        self._turn_s = turn_s
        self._per_page: float | None = None  # nothing measured yet: the floor

    def pages(self) -> int:
        """How many pages the next group launches."""
        per_page = self._per_page
        if per_page is None or self._turn_s <= 0:
            return self._floor
        if per_page <= 0:  # a clock too coarse to see the group: the byte ceiling bounds it
            return self._ceiling
        fit = self._turn_s / per_page
        return self._ceiling if fit >= self._ceiling else max(self._floor, int(fit))  # (an infinite budget too)

    def record(self, pages: int, seconds: float) -> None:
        """Fold a group of ``pages`` that held the loop ``seconds`` into the estimate."""
        if pages <= 0:
            return
        # Capped at a whole turn's budget per page: one stalled group (a compile, a page fault
        # storm) sends the next groups to the floor, and a few fast ones bring them back.
        sample = min(max(seconds, 0.0) / pages, self._turn_s)
        current = self._per_page
        self._per_page = sample if current is None else current + EWMA_WEIGHT * (sample - current)

    @property
    def per_page_s(self) -> float | None:
        """The moving estimate of loop seconds per page launched (None before the first group)."""
        return self._per_page
