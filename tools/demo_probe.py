"""A GIL probe for the demo: how long a Python thread waits to run again, over each timed run.

The model's launching thread is launch-bound on a GPU (Python work per kernel): any other thread
holding the GIL slows it by about as much. The probe sleeps ``interval_s`` at a time on a thread of
its own and records how late it woke up (the sleep releases the GIL; waking needs it back): on an
idle machine the lag is the OS's wake-up latency (tens of µs), and it grows by however long other
threads hold the GIL. Lags are kept with their time, so a request's prefill window can be looked up.
The model's own thread holds the GIL between its launches too, so read a lag against the same
request's lag in the other run (the demo's summary does), not as an absolute.
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class LagSummary:
    """Wake-up lags of one probed span (seconds)."""

    samples: int
    mean_s: float
    p99_s: float
    max_s: float
    busy_fraction: float
    """Sum of lags over the span's length: roughly the share of time another thread held the GIL."""


class GilProbe:
    """A thread that measures its own wake-up lag every ``interval_s`` seconds while running.

    ``with GilProbe() as probe:`` (or ``start()``/``stop()``); :meth:`summary` and :meth:`mean_lag`
    over any span of ``time.perf_counter()`` seconds, once stopped or while running.
    """

    def __init__(self, interval_s: float = 0.001) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s!r}")
        self.interval_s = interval_s
        self._times: list[float] = []  # wake-up times, increasing
        self._lags: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start sampling (once)."""
        if self._thread is not None:
            raise RuntimeError("probe already started")
        self._thread = threading.Thread(target=self._run, name="demo-gil-probe", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling and wait for the thread (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> GilProbe:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        interval = self.interval_s
        while not self._stop.is_set():
            t = time.perf_counter()
            time.sleep(interval)
            now = time.perf_counter()
            self._times.append(now)  # list.append is atomic under the GIL: readers see a prefix
            self._lags.append(max(0.0, now - t - interval))

    def _span(self, begin: float, end: float) -> list[float]:
        times = self._times[: len(self._lags)]
        lo, hi = bisect.bisect_left(times, begin), bisect.bisect_right(times, end)
        return self._lags[lo:hi]

    def mean_lag(self, begin: float, end: float) -> float | None:
        """Mean wake-up lag (s) of the samples in ``[begin, end]``; None when there are none."""
        lags = self._span(begin, end)
        return sum(lags) / len(lags) if lags else None

    def summary(self, begin: float, end: float) -> LagSummary:
        """:class:`LagSummary` of the samples in ``[begin, end]`` (zeros when there are none)."""
        lags = sorted(self._span(begin, end))
        if not lags or end <= begin:
            return LagSummary(0, 0.0, 0.0, 0.0, 0.0)
        return LagSummary(len(lags), sum(lags) / len(lags), lags[min(len(lags) - 1, int(0.99 * len(lags)))],
                          lags[-1], min(1.0, sum(lags) / (end - begin)))
