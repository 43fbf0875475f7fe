"""The hard stop (tests/hard_stop.py) ends a run whose test outlives pytest-timeout, and only then."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import hard_stop

TESTS = Path(__file__).resolve().parent

HANGS = '''
import time

def test_hangs_past_its_timeout():
    while True:  # swallows pytest-timeout's raise, as a clean-up stuck after it would
        try:
            time.sleep(60)
        except BaseException:
            pass

def test_never_runs():
    pass
'''

HANGS_WITH_A_CHILD = '''
import subprocess
import time

def test_hangs_waiting_for_a_child():
    subprocess.Popen(["sleep", "30"])  # a stuck tool (mkfs.ext4) the hang waits for
    while True:
        try:
            time.sleep(60)
        except BaseException:
            pass
'''

TIMES_OUT = '''
import time

def test_times_out():
    time.sleep(60)

def test_runs_after_it():
    pass
'''


STUCK_AT_EXIT = '''
import threading

def test_leaves_a_thread_stuck():
    threading.Thread(target=threading.Event().wait, name="stuck-for-good").start()  # not a daemon
'''


def _run(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess[str], float]:
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 1\n")
    (tmp_path / "test_case.py").write_text(body)
    env = dict(os.environ, PYTHONPATH=str(TESTS), AIOKV_HARD_STOP_MARGIN_S="2", AIOKV_HARD_STOP_EXIT_S="2")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "hard_stop", "-p", "no:cacheprovider", "-q",
                           "-rA", "test_case.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return done, time.monotonic() - start


def test_a_test_that_outlives_its_timeout_ends_the_run_with_every_threads_stack(tmp_path: Path) -> None:
    done, took = _run(tmp_path, HANGS)
    out = done.stdout + done.stderr
    assert done.returncode == hard_stop.EXIT_STATUS, out
    assert "hard stop: test_case.py::test_hangs_past_its_timeout still running 3 s" in out, out
    assert "test_hangs_past_its_timeout" in out.split("every thread's stack:", 1)[1], out  # the stack
    assert "test_never_runs" not in out
    assert took < 60, took


def test_the_hard_stop_also_says_where_the_kernel_holds_the_process_and_its_children(tmp_path: Path) -> None:
    done, _ = _run(tmp_path, HANGS_WITH_A_CHILD)
    out = done.stdout + done.stderr
    assert done.returncode == hard_stop.EXIT_STATUS, out
    kernel = out.split("kernel side (", 1)[1]
    child = re.search(r"pid (\d+) task \1 \(sleep\) state S wchan (\S+): sleep 30\n(.*)", kernel)
    assert child is not None, kernel
    if os.geteuid() == 0:  # /proc/<pid>/stack: root only
        assert child[2] != "0" and "nanosleep" in child[3], kernel
    assert re.search(r"pid (\d+) task \1 \(python[\d.]*\) state S ", kernel), kernel  # the stuck test's own


def test_the_kernel_report_skips_a_process_gone_while_it_reads() -> None:
    # A process that ends between the listing of /proc and the read of its stat (a busy host: the
    # GPU suite's 16 workers) made the report raise IndexError ("kernel side not reported").
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its /proc entry is gone
    assert hard_stop._stat(str(child.pid)) == ("", "", 0)
    assert hard_stop._stat(f"{os.getpid()}/task/{child.pid}") == ("", "", 0)
    assert hard_stop._stat(str(os.getpid()))[2] == os.getppid()


def test_a_timeout_that_ends_its_test_lets_the_run_go_on(tmp_path: Path) -> None:
    done, _ = _run(tmp_path, TIMES_OUT)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out  # one failed test, no hard stop
    assert "hard stop" not in out
    assert "PASSED test_case.py::test_runs_after_it" in out, out


def test_a_thread_left_running_cannot_hold_the_process_after_the_run(tmp_path: Path) -> None:
    done, took = _run(tmp_path, STUCK_AT_EXIT)
    out = done.stdout + done.stderr
    assert "1 passed" in out, out
    assert done.returncode == hard_stop.EXIT_STATUS, out
    assert "hard stop: the process still running 2 s after the run ended" in out, out
    assert "stuck-for-good" in out or "wait" in out.split("every thread's stack:", 1)[1], out
    assert took < 60, took
