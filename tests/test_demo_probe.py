"""The demo's diagnostics for requests slower with the cache: the GIL probe and a cache without disk."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import demo
from demo_probe import GilProbe


@pytest.fixture
def long_switch_interval() -> Iterator[float]:
    """A 20 ms switch interval: a thread holding the GIL delays a waiting one by about that much."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.02)
    try:
        yield 0.02
    finally:
        sys.setswitchinterval(before)


@pytest.mark.timing
def test_the_probe_sees_a_thread_that_holds_the_gil(long_switch_interval: float) -> None:
    with GilProbe(0.001) as probe:
        idle_begin = time.perf_counter()
        time.sleep(0.2)  # releases the GIL: the probe wakes on time, bar the OS's latency
        idle_end = busy_begin = time.perf_counter()
        n = 0
        while time.perf_counter() - busy_begin < 0.3:  # pure Python: holds the GIL until forced off
            n += 1
        busy_end = time.perf_counter()
    idle, busy = probe.summary(idle_begin, idle_end), probe.summary(busy_begin, busy_end)
    assert idle.samples > busy.samples > 0
    assert busy.mean_s > long_switch_interval / 4
    assert busy.mean_s > 4 * idle.mean_s
    assert busy.busy_fraction > 0.5
    mean = probe.mean_lag(busy_begin, busy_end)
    assert mean is not None and mean == pytest.approx(busy.mean_s)
    assert probe.mean_lag(busy_end + 10, busy_end + 11) is None
    assert probe.summary(busy_end + 10, busy_end + 11).samples == 0


@pytest.mark.timing
def test_an_idle_process_with_many_threads_reads_idle_when_the_probe_reads_proc_every_sample(
        long_switch_interval: float) -> None:
    # Regression (GPU suite): in a process with hundreds of threads a snapshot reads two files per
    # thread, milliseconds of the probe's own CPU, and that was counted as another thread's hold
    # (busy fraction 0.81 over an idle span with 300 threads; 0.54-0.76 on the GPU host).
    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait, daemon=True) for _ in range(300)]
    for thread in threads:
        thread.start()
    try:
        with GilProbe(0.001, snapshot_every=1) as probe:
            time.sleep(0.3)
            begin = time.perf_counter()
            # 0.3 s: a snapshot of 300 threads takes ~10 ms on a loaded 2-core host, and a 0.1 s
            # span held exactly 10 samples there (a full run with two helpers testing alongside).
            time.sleep(0.3)
            end = time.perf_counter()
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    idle = probe.summary(begin, end)
    assert idle.samples > 10
    assert idle.busy_fraction < 0.3


@pytest.mark.timing
def test_a_busy_thread_counts_in_full_when_the_probe_reads_proc_every_sample(long_switch_interval: float) -> None:
    # Regression (CI failure): the snapshot's file reads release the GIL, and waiting to get it back
    # behind the busy thread went uncounted (busy fraction 0.07 here, 0.47 in CI where a snapshot
    # fell in the busy span); a wait that ends after the span must still count its part.
    with GilProbe(0.001, snapshot_every=1) as probe:
        time.sleep(0.2)
        busy_begin = time.perf_counter()
        while time.perf_counter() - busy_begin < 0.3:
            pass
        busy_end = time.perf_counter()
        time.sleep(0.1)  # the probe wakes after the span: its last wait straddles busy_end
    busy = probe.summary(busy_begin, busy_end)
    assert busy.busy_fraction > 0.8
    idle = probe.summary(busy_end + 0.05, busy_end + 0.1)
    assert idle.busy_fraction < 0.5


def test_the_probe_refuses_a_bad_interval_and_a_second_start() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        GilProbe(0.0)
    probe = GilProbe()
    with probe, pytest.raises(RuntimeError, match="already started"):
        probe.start()
    probe.stop()  # idempotent


@pytest.mark.asyncio
async def test_tiny_demo_without_disk_and_with_the_probe_stays_exact(tmp_path: Path) -> None:
    cfg = demo.config_from_args(demo.parse_args(["--preset", "tiny", "--no-disk", "--probe-gil", "--quiet"]))
    out = await demo.run_demo(cfg, progress=False)
    assert out.oracle.mismatches == ()
    assert out.oracle.logits_bit_exact
    assert out.stats is not None and out.stats.disk is None
    assert out.summary["disk_tokens"] == 0
    assert out.summary["pool_tokens"] > 0
    probe = out.summary["gil_probe"]
    assert probe["scratch"]["samples"] > 0 and probe["cached"]["samples"] > 0
    assert probe["miss_prefill_lag_s"]["requests"] == out.summary["miss_requests"] > 0
    assert all(r.gil_lag_s is not None for r in out.cached if r.prefill_s > 0.01)
    assert demo.probe_line(out.summary) is not None
    assert demo.probe_line({}) is None


def test_no_disk_is_refused_beside_a_disk_setting(tmp_path: Path) -> None:
    for extra in (["--disk-dir", str(tmp_path)], ["--disk-bytes", "4096"], ["--ttft"]):
        with pytest.raises(SystemExit, match="--no-disk"):
            demo.main(["--preset", "tiny", "--no-disk", *extra])


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("when", ["open", "after"])
async def test_the_scratch_run_can_follow_or_share_the_cache_and_still_compares_like_for_like(
    when: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spans: list[demo.Runs] = []
    serve = demo._serve_one_process

    async def recorded(*args: object) -> demo.Runs:
        runs = await serve(*args)  # type: ignore[arg-type]
        spans.append(runs)
        return runs

    monkeypatch.setattr(demo, "_serve_one_process", recorded)
    cfg = demo.config_from_args(demo.parse_args(["--preset", "tiny", "--scratch-run", when, "--quiet"]))
    out = await demo.run_demo(cfg, progress=False)
    assert out.oracle.mismatches == ()
    assert out.oracle.logits_bit_exact
    assert out.summary["admitted_elsewhere"] == 0
    assert out.summary["pool_tokens"] > 0
    (scratch_begin, scratch_end), (cached_begin, cached_end) = spans[0].spans["scratch"], spans[0].spans["cached"]
    assert (scratch_begin > cached_end) if when == "after" else (scratch_end < cached_begin)


def test_the_scratch_run_moves_only_in_one_process() -> None:
    with pytest.raises(SystemExit, match="--scratch-run"):
        demo.main(["--preset", "tiny", "--tp", "2", "--scratch-run", "after"])


@pytest.mark.slow
def test_the_json_gives_each_requests_scratch_prefill_beside_its_cached_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "wl.json"
    assert demo.main(["--preset", "tiny", "--quiet", "--probe-gil", "--json", str(out)]) == 0
    assert "GIL probe" in capsys.readouterr().out
    payload = json.loads(out.read_text())
    requests = payload["requests"]
    assert len(requests) == payload["summary"]["requests"] > 10
    for r in requests:
        assert r["index_scratch"] == r["index"]  # replayed order
        assert 0 < r["launch_s_scratch"] <= r["prefill_s_scratch"]
        assert 0 < r["launch_s"] <= r["prefill_s"]
        assert r["model_cpu_s"] > 0 and r["model_cpu_s_scratch"] > 0
    assert payload["summary"]["gil_probe"]["cached"]["samples"] > 0


def test_a_wait_that_covers_the_whole_span_counts_it_busy_without_a_sample_in_it() -> None:
    # Regression (full-suite failure): with many threads in the process, one snapshot behind the
    # busy thread outlasted the span; no sample fell in it and the summary said 0% busy.
    probe = GilProbe(0.001)
    probe._times, probe._lags = [0.0, 1.0], [0.0, 0.9]  # woke at 1.0, late since 0.1
    span = probe.summary(0.2, 0.5)
    assert span.samples == 0 and span.busy_fraction == 1.0
    assert probe.summary(0.0, 0.05).busy_fraction == 0.0
