"""A GIL probe for the demo: how long a Python thread waits to run again, over each timed run.

The model's launching thread is launch-bound on a GPU (Python work per kernel): any other thread
holding the GIL slows it by about as much. The probe sleeps ``interval_s`` at a time on a thread of
its own and records how late it woke up (the sleep releases the GIL; waking needs it back): on an
idle machine the lag is the OS's wake-up latency (tens of µs), and it grows by however long other
threads hold the GIL. Lags are kept with their time, so a request's prefill window can be looked up.
The model's own thread holds the GIL between its launches too, so read a lag against the same
request's lag in the other run (the demo's summary does), not as an absolute.

Every ``snapshot_every`` wake-ups the probe also reads how long each thread of the process has run
on a CPU (``/proc/self/task/<tid>/schedstat``, by thread name): :meth:`thread_run_s` gives what each
ran over a span, which names the thread that was busy while a request was slower than from scratch.
"""

from __future__ import annotations

import bisect
import os
import re
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

    def __init__(self, interval_s: float = 0.001, snapshot_every: int = 50,
                 labels: dict[int, str] | None = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s!r}")
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be at least 1, got {snapshot_every!r}")
        self.interval_s = interval_s
        self.snapshot_every = snapshot_every
        self.labels = dict(labels or {})
        """Thread names by native id that win over the threads' own (the demo names its loop thread)."""
        self._snap_times: list[float] = []
        self._snaps: list[dict[str, float]] = []
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
        n = 0
        t = time.perf_counter()
        cpu = time.thread_time()
        while not self._stop.is_set():
            if n % self.snapshot_every == 0:
                snap = thread_run_times(self.labels)
                self._snap_times.append(time.perf_counter())
                self._snaps.append(snap)
            n += 1
            time.sleep(interval)
            now = time.perf_counter()
            self._times.append(now)  # list.append is atomic under the GIL: readers see a prefix
            # From the previous wake-up, not from this sleep: the snapshot's file reads release the
            # GIL, and waiting to get it back behind a busy thread is lag too (else it goes missing).
            # The probe's own CPU time (the snapshot reads a file per thread: ms in a process with
            # a hundred threads) is not another thread's hold.
            own = time.thread_time() - cpu
            self._lags.append(max(0.0, now - t - interval - own))
            t, cpu = now, time.thread_time()

    def _span(self, begin: float, end: float) -> list[float]:
        times = self._times[: len(self._lags)]
        lo, hi = bisect.bisect_left(times, begin), bisect.bisect_right(times, end)
        return self._lags[lo:hi]

    def thread_run_s(self, begin: float, end: float) -> dict[str, float]:
        """CPU seconds each thread name ran between the snapshots nearest ``begin`` and ``end``."""
        times = self._snap_times[: len(self._snaps)]
        if not times:
            return {}
        lo = max(0, bisect.bisect_right(times, begin) - 1)
        hi = min(len(times) - 1, bisect.bisect_left(times, end))
        first, last = self._snaps[lo], self._snaps[hi]
        return {name: run - first.get(name, 0.0) for name, run in last.items() if run > first.get(name, 0.0)}

    def mean_lag(self, begin: float, end: float) -> float | None:
        """Mean wake-up lag (s) of the samples in ``[begin, end]``; None when there are none."""
        lags = self._span(begin, end)
        return sum(lags) / len(lags) if lags else None

    def summary(self, begin: float, end: float) -> LagSummary:
        """:class:`LagSummary` of the samples in ``[begin, end]`` (zeros when there are none)."""
        if end <= begin:
            return LagSummary(0, 0.0, 0.0, 0.0, 0.0)
        # Counted even with no sample in the span: one wait can cover all of it (a snapshot of a
        # process with many threads, behind a busy thread, took longer than the span in a full run).
        busy = min(1.0, self._late_s(begin, end) / (end - begin))
        lags = sorted(self._span(begin, end))
        if not lags:
            return LagSummary(0, 0.0, 0.0, 0.0, busy)
        return LagSummary(len(lags), sum(lags) / len(lags), lags[min(len(lags) - 1, int(0.99 * len(lags)))],
                          lags[-1], busy)

    def _late_s(self, begin: float, end: float) -> float:
        """Seconds of ``[begin, end]`` the probe spent late: each lag is the stretch ending at its
        wake-up, clipped to the span, so a long wait that ends after ``end`` still counts its part."""
        n = len(self._lags)
        times, lags = self._times[:n], self._lags[:n]
        late = 0.0
        for i in range(bisect.bisect_left(times, begin), n):
            wake = times[i]
            late += max(0.0, min(wake, end) - max(wake - lags[i], begin))
            if wake >= end:
                break
        return late


_DIGITS = re.compile(r"\d+")


def thread_run_times(labels: dict[int, str] | None = None) -> dict[str, float]:
    """Seconds each thread of this process has run on a CPU, summed by name (digits as ``#``, so a
    pool's workers add up), and under ``"<name> (queued)"`` the seconds it waited runnable for a
    CPU; threads in ``labels`` (native id: name) by that name, other Python threads by their
    ``threading`` name, the rest by ``comm``. Threads that ended drop out (a span's delta counts
    only threads alive at both ends). Empty off Linux."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    names.update(labels or {})
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                fields = f.read().split()
                run_ns, queued_ns = int(fields[0]), int(fields[1])
            name = names.get(int(tid))
            if name is None:
                with open(f"/proc/self/task/{tid}/comm", encoding="utf-8", errors="replace") as f:
                    name = f.read().strip()
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
        key = _DIGITS.sub("#", name)
        out[key] = out.get(key, 0.0) + run_ns / 1e9
        # Runnable but waiting for a CPU (other threads or processes had them): not the GIL.
        out[key + " (queued)"] = out.get(key + " (queued)", 0.0) + queued_ns / 1e9
    return out
