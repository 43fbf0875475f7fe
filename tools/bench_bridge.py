"""Where the CUDA event -> asyncio future latency goes, on any machine (no GPU).

The completion bridge (``aiokv.cuda.CompletionBridge``) is driven with host stand-ins for CUDA
events that behave like CUDA's where it matters: each completes at a chosen ``time.monotonic()``
instant; ``query()`` is a cheap call that holds the GIL (torch's does); ``synchronize()`` blocks
in C with the GIL released and is woken by the kernel's timer at that instant (timer slack 1 ns):
a blocking-sync event, what the mover gives the bridge. A sampler task waits for one event at a
time (``--burst`` events completing together), each completing ``--interval-us`` after its wait,
as ``bench_cache``'s sampler does, while the loop also runs an engine shaped like a layer-wise
streaming one: per hit ``--layers`` steps of ``--step-us`` of Python (a layer's launches), each
followed by a loop turn, then ``--gap-ms`` of Python in one step (``finish``, the next ``match``'s
hashing, ``start_load``), then ``--idle-ms`` awaiting the GPU; a "copy thread" runs
``--feeder-us`` of Python every ``--feeder-period-us`` (the paced feeder).

Columns, per event (µs): ``wake`` completion -> the waiter thread runs Python again (the blocking
wake, then the GIL); ``deliver`` -> the awaiting task resumed (``call_soon_threadsafe``'s self-pipe
write, the loop thread's wake from epoll, its callback, one more loop turn for the task); ``total``
both; ``excess`` total less what remained of the engine's step under way at completion (no waiter
can hand over sooner: the part a bridge can change). The 1 ms probe's lag (ms, target p99 <= 1.2)
and ``own``: the same less the loop thread's wait for a CPU other processes had (schedstat; a GIL
holder preempted still counts). ``writes/ev``: self-pipe writes per event; ``cs w/l``: context
switches per event of the waiter threads / the loop thread; ``cpu/s``: the waiters' CPU per second
(a spinning one: ~1).

Waiters compared in the same run, alternated ``--rounds`` times:
- ``bare``: the shortest chain, the baseline every ratio is against: one thread that blocks in
  ``synchronize()`` and calls ``loop.call_soon_threadsafe(future.set_result, None)``.
- ``poll``: a thread that spins on ``query()`` (holds the GIL in each call): what spinning costs
  the loop (a thread wanting the GIL makes the loop thread give it up and wait to get it back).
- ``bridge``: the working tree's ``CompletionBridge``; ``--against REV`` adds ``REV``'s as ``REV``.

Scenarios: ``stream`` (the load above), ``convoy`` (the same with ``--step-calls`` GIL-releasing C
calls in each engine step and ``--feeder-calls`` in each feeder burst: each release lets another
thread take the GIL, and a thread that gives it back and retakes it faster than the loop thread
wakes keeps it up to the switch interval) and ``idle`` (events 5 ms apart, nothing else running: the
chain alone, the loop asleep in epoll when each completes). Timings need a quiet machine: on a
2-core VM shared with other work the p99s are the other work's.

    python tools/bench_bridge.py
    python tools/bench_bridge.py --against 625c286~1 --rounds 5 --json out.json
    python tools/bench_bridge.py --scenario stream --burst 8 --waiters bare bridge
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import ctypes
import importlib.util
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_PR_SET_TIMERSLACK = 29
_libc: Any = None
_slack = threading.local()


def _tight_timer_slack() -> None:
    """Timer wake-ups of this thread to the ns, not Linux's default 50 µs slack: a stand-in that
    wakes late would charge the bridge for the kernel's timer coalescing, which a GPU's completion
    interrupt does not have."""
    global _libc
    if getattr(_slack, "set", False):
        return
    _slack.set = True
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        _libc.prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the default slack stays


class FakeEvent:
    """A CUDA event stand-in that completes at ``deadline`` (``time.monotonic()`` seconds).

    ``synchronize`` sleeps in C until then with the GIL released (``cudaEventBlockingSync``) and
    raises if ``fail``; ``query`` is cheap and holds the GIL (torch's ``Event.query``).
    ``noticed`` is when the waiting thread ran Python again after the wait (it had the GIL).
    """

    __slots__ = ("deadline", "fail", "noticed")

    def __init__(self, deadline: float, fail: bool = False) -> None:
        self.deadline = deadline
        self.fail = fail
        self.noticed = 0.0

    def query(self) -> bool:
        now = time.monotonic()
        if now < self.deadline:
            return False
        if not self.noticed:
            self.noticed = now
        return True

    def synchronize(self) -> None:
        _tight_timer_slack()
        delay = self.deadline - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        self.noticed = time.monotonic()
        if self.fail:
            raise RuntimeError("injected CUDA error")


class Waiter(Protocol):
    """What a scenario needs of a bridge: ``wait`` on the loop, ``close`` off it."""

    def wait(self, event: Any, lane: Any) -> asyncio.Future[None]: ...

    def close(self) -> None: ...


class BareWaiter:
    """The baseline: block in ``synchronize()``, then one ``call_soon_threadsafe`` per event."""

    def __init__(self, name: str = "bench-bare") -> None:
        self._queue: queue.SimpleQueue[tuple[Any, asyncio.AbstractEventLoop, asyncio.Future[None]] | None] = (
            queue.SimpleQueue())
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            event, loop, future = item
            event.synchronize()
            loop.call_soon_threadsafe(future.set_result, None)

    def wait(self, event: Any, lane: Any) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._queue.put((event, loop, future))
        return future

    def close(self) -> None:
        self._queue.put(None)
        self.thread.join()


class PollWaiter(BareWaiter):
    """A waiter that spins on ``query()`` (each call holds the GIL) instead of blocking."""

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            event, loop, future = item
            while not event.query():
                pass
            event.noticed = time.monotonic()
            loop.call_soon_threadsafe(future.set_result, None)


def load_bridge_module(rev: str | None) -> ModuleType:
    """``aiokv.cuda`` of the working tree, or of git revision ``rev`` (loaded from its text)."""
    if rev is None:
        import aiokv.cuda

        return aiokv.cuda
    root = Path(__file__).resolve().parent.parent
    text = subprocess.run(["git", "show", f"{rev}:aiokv/cuda.py"], cwd=root, check=True, capture_output=True,
                          text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="bench-bridge-")) / "cuda_rev.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"bench_bridge_rev_{abs(hash(rev))}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _started(module: ModuleType) -> Callable[[], Waiter]:
    def make() -> Waiter:
        bridge = module.CompletionBridge()
        bridge.prestart(True)  # its waiter threads exist before the measurement
        return bridge  # type: ignore[no-any-return]

    return make


_release: Callable[[], object] | None = None


def _c_call() -> None:
    """A C call that releases the GIL and gives it back (ctypes does, as for ``cudaMemcpy2DAsync``;
    torch's ``record``/``wait_event`` too): where another thread can take the GIL from this one."""
    global _release
    if _release is None:
        _release = ctypes.CDLL(None).getppid
    _release()


def busy(seconds: float, spans: list[tuple[float, float]] | None = None, calls: int = 0) -> None:
    """Python work holding the GIL (what an engine step or a hash loop does), cut by ``calls`` C
    calls that release it; its monotonic start and end appended to ``spans``."""
    start = time.monotonic()
    chunk = seconds / (calls + 1)
    for i in range(calls + 1):
        if i:
            _c_call()
        end = time.perf_counter() + chunk
        while time.perf_counter() < end:
            pass
    if spans is not None:
        spans.append((start, time.monotonic()))


def _residual(spans: list[tuple[float, float]], instant: float) -> float:
    """How long the loop thread still had to run the engine's step under way at ``instant`` (0 if
    none was): no waiter can hand a completion over to the loop before that."""
    i = bisect.bisect_right(spans, (instant, float("inf"))) - 1
    if i >= 0 and spans[i][0] <= instant < spans[i][1]:
        return spans[i][1] - instant
    return 0.0


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


@dataclass
class Samples:
    wake: list[float] = field(default_factory=list)
    """completion -> the waiter thread runs Python (µs)"""
    deliver: list[float] = field(default_factory=list)
    """the waiter runs Python -> the awaiting task resumed (µs)"""
    total: list[float] = field(default_factory=list)
    """completion -> the awaiting task resumed (µs)"""
    excess: list[float] = field(default_factory=list)
    """``total`` less what remained of the engine step under way at completion (µs): the chain's
    own share, what a bridge can change"""
    lag: list[float] = field(default_factory=list)
    """the 1 ms probe's lateness (ms)"""
    own_lag: list[float] = field(default_factory=list)
    """``lag`` less the loop thread's wait for a CPU (ms)"""
    events: int = 0
    writes: int = 0
    waiter_cpu: float = 0.0
    waiter_switches: int = 0
    loop_switches: int = 0
    wall: float = 0.0


def _run_delay() -> float:
    """Seconds this thread has waited, runnable, for a CPU (``/proc/thread-self/schedstat``; 0 where
    unreadable). Waiting for the GIL is not in it: a thread waiting for the GIL sleeps."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as stat:
            return int(stat.read().split()[1]) * 1e-9
    except (OSError, ValueError, IndexError):
        return 0.0


class LagProbe:
    """Lateness of a 1 ms periodic callback (``out``, ms), and the same less the time the loop's
    thread waited for a CPU that other processes had meanwhile (``own``, ms): on a shared machine
    the second is the part this process made (its GIL and its loop's steps)."""

    def __init__(self, out: list[float], own: list[float], period: float = 0.001) -> None:
        self._out = out
        self._own = own
        self._period = period

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        expected = loop.time() + self._period
        delay = _run_delay()
        while True:
            await asyncio.sleep(max(0.0, expected - loop.time()))
            now = loop.time()
            waited = _run_delay()
            late = max(0.0, now - expected)
            self._out.append(late * 1e3)
            self._own.append(max(0.0, late - (waited - delay)) * 1e3)
            expected, delay = now + self._period, waited


def _feeder(stop: threading.Event, work_s: float, period_s: float, calls: int) -> None:
    """The paced feeder's shape: Python work issuing units (``calls`` C calls), then a wait with the
    GIL released."""
    _tight_timer_slack()
    while not stop.wait(period_s):
        busy(work_s, calls=calls)


def _thread_cpu(threads: list[threading.Thread]) -> float:
    total = 0.0
    for thread in threads:
        if thread.ident is not None and thread.is_alive():
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            except OSError:
                pass
    return total


def _switches(threads: list[threading.Thread]) -> int:
    """Context switches (voluntary and not) of ``threads`` so far: each blocking wake-up, GIL
    hand-over and preemption is one (Linux; 0 elsewhere)."""
    total = 0
    for thread in threads:
        try:
            with open(f"/proc/self/task/{thread.native_id}/status", encoding="ascii") as status:
                total += sum(int(line.split()[1]) for line in status if "ctxt_switches" in line)
        except (OSError, ValueError):
            pass
    return total


def _waiter_threads(before: set[int]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.ident not in before and t is not threading.current_thread()
            and not t.name.startswith(("bench-feeder", "asyncio_"))]


async def _engine(args: argparse.Namespace, spans: list[tuple[float, float]], calls: int) -> None:
    """The engine's shape on the loop: per hit, ``--layers`` steps of ``--step-us`` (a layer's
    launches after its ``wait_layer``; ``calls`` C calls in each), each followed by a loop turn,
    then ``--gap-ms`` in one step (``finish``, the next ``match``'s hashing, ``start_load``), then
    ``--idle-ms`` awaiting the GPU."""
    while True:
        for _ in range(args.layers):
            busy(args.step_us * 1e-6, spans, calls)
            await asyncio.sleep(0)
        busy(args.gap_ms * 1e-3, spans)
        await asyncio.sleep(args.idle_ms * 1e-3)


async def scenario(make: Callable[[], Waiter], lane: Any, args: argparse.Namespace, kind: str) -> Samples:
    """One waiter under one scenario; returns its samples."""
    idle = kind == "idle"
    convoy = kind == "convoy"
    out = Samples()
    loop = asyncio.get_running_loop()
    writes = [0]
    write_to_self = loop._write_to_self  # type: ignore[attr-defined]

    def counted() -> None:
        writes[0] += 1
        write_to_self()

    before = {t.ident for t in threading.enumerate() if t.ident is not None}
    waiter = await asyncio.to_thread(make)  # threads start off the loop
    threads = _waiter_threads(before)
    stop = threading.Event()
    feeder = None
    if not idle and args.feeder_us > 0:
        feeder = threading.Thread(target=_feeder, args=(stop, args.feeder_us * 1e-6, args.feeder_period_us * 1e-6,
                                        args.feeder_calls if convoy else 0),
                                  name="bench-feeder", daemon=True)
        feeder.start()
    probe = asyncio.ensure_future(LagProbe(out.lag, out.own_lag).run())
    loop._write_to_self = counted  # type: ignore[attr-defined]
    me = [threading.current_thread()]
    cpu0, wall0 = _thread_cpu(threads), time.perf_counter()
    switches0, loop0 = _switches(threads), _switches(me)
    spans: list[tuple[float, float]] = []
    engine = None if idle else asyncio.ensure_future(_engine(args, spans, args.step_calls if convoy else 0))
    try:
        interval = (5000 if idle else args.interval_us) * 1e-6
        for _ in range(args.samples // args.burst):
            deadline = time.monotonic() + interval
            events = [FakeEvent(deadline) for _ in range(args.burst)]
            futures = [waiter.wait(event, lane) for event in events]
            resumed = []
            for future in futures:
                await future
                resumed.append(time.monotonic())
            for event, at in zip(events, resumed, strict=True):
                out.wake.append((event.noticed - event.deadline) * 1e6)
                out.deliver.append((at - event.noticed) * 1e6)
                out.total.append((at - event.deadline) * 1e6)
                out.excess.append((at - event.deadline - _residual(spans, event.deadline)) * 1e6)
            out.events += len(events)
    finally:
        out.wall = time.perf_counter() - wall0
        out.waiter_cpu = _thread_cpu(threads) - cpu0
        out.waiter_switches = _switches(threads) - switches0
        out.loop_switches = _switches(me) - loop0
        loop._write_to_self = write_to_self  # type: ignore[attr-defined]
        out.writes = writes[0]
        probe.cancel()
        if engine is not None:
            engine.cancel()
        stop.set()
        if feeder is not None:
            await asyncio.to_thread(feeder.join)
        await asyncio.to_thread(waiter.close)
    return out


def summarize(runs: list[Samples]) -> dict[str, float]:
    total = [v for r in runs for v in r.total]
    return {
        "events": sum(r.events for r in runs),
        "wake_p50_us": pct([v for r in runs for v in r.wake], 0.5),
        "wake_p99_us": pct([v for r in runs for v in r.wake], 0.99),
        "deliver_p50_us": pct([v for r in runs for v in r.deliver], 0.5),
        "deliver_p99_us": pct([v for r in runs for v in r.deliver], 0.99),
        "total_p50_us": pct(total, 0.5),
        "total_p99_us": pct(total, 0.99),
        "total_max_us": max(total, default=0.0),
        "excess_p50_us": pct([v for r in runs for v in r.excess], 0.5),
        "excess_p99_us": pct([v for r in runs for v in r.excess], 0.99),
        "lag_p50_ms": pct([v for r in runs for v in r.lag], 0.5),
        "lag_p99_ms": pct([v for r in runs for v in r.lag], 0.99),
        "lag_max_ms": max((v for r in runs for v in r.lag), default=0.0),
        "own_lag_p99_ms": pct([v for r in runs for v in r.own_lag], 0.99),
        "own_lag_max_ms": max((v for r in runs for v in r.own_lag), default=0.0),
        "writes_per_event": sum(r.writes for r in runs) / max(1, sum(r.events for r in runs)),
        "waiter_switches_per_event": sum(r.waiter_switches for r in runs) / max(1, sum(r.events for r in runs)),
        "loop_switches_per_event": sum(r.loop_switches for r in runs) / max(1, sum(r.events for r in runs)),
        "waiter_cpu_share": sum(r.waiter_cpu for r in runs) / max(1e-9, sum(r.wall for r in runs)),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    current = load_bridge_module(None)
    makers: dict[str, tuple[Callable[[], Waiter], Any]] = {}
    for name in args.waiters:
        if name == "bare":
            makers[name] = (BareWaiter, None)
        elif name == "poll":
            makers[name] = (PollWaiter, None)
        elif name == "bridge":
            makers[name] = (_started(current), current.Lane.LOAD)
    for rev in args.against:
        module = load_bridge_module(rev)
        makers[rev] = (_started(module), module.Lane.LOAD)
    results: dict[str, Any] = {}
    for kind in args.scenario:
        runs: dict[str, list[Samples]] = {name: [] for name in makers}
        for _ in range(args.rounds):
            for name, (make, lane) in makers.items():
                runs[name].append(await scenario(make, lane, args, kind))
        results[kind] = {name: summarize(r) for name, r in runs.items()}
    return results


def report(results: dict[str, Any], baseline: str) -> None:
    columns = ("waiter", "events", "wake p50/p99", "deliver p50/p99", "total p50/p99/max", "excess p50/p99",
               "x base", "lag ms p50/p99/max", "x base", "own p99/max", "writes/ev",
               "cs w/l", "cpu/s")
    widths = (12, 6, 13, 15, 19, 15, 6, 18, 6, 11, 9, 9, 6)
    for kind, table in results.items():
        base = table.get(baseline)
        print(f"\n{kind}: event completion -> awaiting task resumed (µs); ratios of p99 against '{baseline}'")
        print(" ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)))
        for name, s in table.items():
            ratio = s["total_p99_us"] / base["total_p99_us"] if base and base["total_p99_us"] else float("nan")
            lag = s["lag_p99_ms"] / base["lag_p99_ms"] if base and base["lag_p99_ms"] else float("nan")
            cells = (name, str(s["events"]), f"{s['wake_p50_us']:.0f}/{s['wake_p99_us']:.0f}",
                     f"{s['deliver_p50_us']:.0f}/{s['deliver_p99_us']:.0f}",
                     f"{s['total_p50_us']:.0f}/{s['total_p99_us']:.0f}/{s['total_max_us']:.0f}",
                     f"{s['excess_p50_us']:.0f}/{s['excess_p99_us']:.0f}", f"{ratio:.2f}",
                     f"{s['lag_p50_ms']:.2f}/{s['lag_p99_ms']:.2f}/{s['lag_max_ms']:.2f}", f"{lag:.2f}",
                     f"{s['own_lag_p99_ms']:.2f}/{s['own_lag_max_ms']:.2f}", f"{s['writes_per_event']:.2f}",
                     f"{s['waiter_switches_per_event']:.1f}/{s['loop_switches_per_event']:.1f}",
                     f"{s['waiter_cpu_share']:.2f}")
            print(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", nargs="+", choices=["stream", "convoy", "idle"],
                        default=["stream", "convoy", "idle"])
    parser.add_argument("--waiters", nargs="+", choices=["bare", "poll", "bridge"], default=["bare", "poll", "bridge"])
    parser.add_argument("--against", nargs="*", default=[], help="git revisions whose bridge to add")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the waiters")
    parser.add_argument("--samples", type=int, default=400, help="events per waiter and round")
    parser.add_argument("--burst", type=int, default=1, help="events completing together")
    parser.add_argument("--interval-us", type=float, default=1200.0, help="from one wait to its completion (stream)")
    parser.add_argument("--layers", type=int, default=32, help="engine steps per hit")
    parser.add_argument("--step-us", type=float, default=50.0, help="engine Python work per layer step")
    parser.add_argument("--gap-ms", type=float, default=1.6, help="engine Python work between hits, one step")
    parser.add_argument("--step-calls", type=int, default=3,
                        help="convoy: GIL-releasing C calls per engine step (order_layer's wait_event)")
    parser.add_argument("--feeder-calls", type=int, default=64, help="convoy: the feeder's C calls per burst")
    parser.add_argument("--idle-ms", type=float, default=5.0, help="engine awaiting the GPU per hit")
    parser.add_argument("--feeder-us", type=float, default=150.0, help="copy thread's Python work per unit (0: none)")
    parser.add_argument("--feeder-period-us", type=float, default=1000.0, help="copy thread's wait between units")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    meta = {"argv": sys.argv[1:], "cpus": os.cpu_count(), "load": os.getloadavg(),
            "switch_interval_s": sys.getswitchinterval(), "python": sys.version.split()[0]}
    print(json.dumps(meta))
    report(results, "bare" if "bare" in args.waiters else next(iter(results[args.scenario[0]])))
    if args.json is not None:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
