"""The demo's CPU per thread names the event loop's thread and the model's threads apart.

On the H200 the misses' extra CPU showed as ``asyncio_#``, read as aiokv's event loop: those are
the default executor's threads, where the demo ran the model (the loop runs on the thread that
called ``asyncio.run``). The model now runs on ``demo-model_#`` and the probe names the loop's
thread ``demo-loop``; a request's own model work is told apart from other requests'.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import demo
from demo_engine import MODEL_THREAD_PREFIX, RequestResult, on_model_thread
from demo_probe import thread_run_times


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_labelled_thread_is_reported_under_its_label_with_its_cpu() -> None:
    ready, stop = threading.Event(), threading.Event()
    ids: list[int] = []

    def busy() -> None:
        ids.append(threading.get_native_id())
        _spin(0.05)
        ready.set()
        stop.wait()

    thread = threading.Thread(target=busy, name="plain-name")
    thread.start()
    try:
        ready.wait()
        times = thread_run_times({ids[0]: "the-label"})
    finally:
        stop.set()
        thread.join()
    assert times["the-label"] >= 0.04
    assert "plain-name" not in times


@pytest.mark.asyncio
async def test_model_work_runs_on_named_model_threads_off_the_loop() -> None:
    loop_thread = threading.current_thread().name
    name = await on_model_thread(lambda: threading.current_thread().name)
    assert name.startswith(f"{MODEL_THREAD_PREFIX}_") and name != loop_thread


def test_extra_cpu_splits_the_requests_own_model_work_from_other_requests() -> None:
    model = f"{MODEL_THREAD_PREFIX}_#"
    cached = RequestResult("r", "t", "chat", index=0, prompt_tokens=8, model_cpu_s=0.7,
                           threads_s={model: 1.5, demo.LOOP_THREAD: 0.25, "aiokv-checksum-#": 0.125})
    scratch = RequestResult("r", "t", "chat", index=0, prompt_tokens=8, model_cpu_s=0.4,
                            threads_s={model: 0.5, demo.LOOP_THREAD: 0.125})
    extra = demo.extra_run_s(cached, scratch)
    assert extra[demo.OWN_MODEL] == pytest.approx(0.3)
    assert extra[demo.OTHER_MODEL] == pytest.approx(0.7)  # 1.0 more on model threads, 0.3 of it its own
    assert extra[demo.LOOP_THREAD] == pytest.approx(0.125)
    assert extra["aiokv-checksum-#"] == pytest.approx(0.125)
    assert model not in extra


@pytest.mark.asyncio
async def test_the_demo_probe_reports_the_loop_and_model_threads_by_name() -> None:
    cfg = demo.config_from_args(demo.parse_args(["--preset", "tiny", "--no-disk", "--probe-gil", "--quiet"]))
    out = await demo.run_demo(cfg, progress=False)
    assert out.oracle.mismatches == ()
    seen = set().union(*(r.threads_s for r in (*out.cached, *out.scratch)))
    assert demo.LOOP_THREAD in seen
    assert f"{MODEL_THREAD_PREFIX}_#" in seen
    assert not any(name.startswith("asyncio_") for name in seen)  # no model work on the default executor
    per_miss = out.summary["gil_probe"]["miss_extra_run_s"]
    assert demo.OWN_MODEL in per_miss and demo.LOOP_THREAD in per_miss
    line = demo.probe_line(out.summary)
    assert line is not None and "per miss" in line and demo.LOOP_THREAD in line
