"""A hard stop for a test that hangs past pytest-timeout: print every thread's stack, end the run.

pytest-timeout's signal method raises inside the test, which ends most hangs and lets the run go
on. It cannot end one stuck in C without returning to the interpreter, nor one whose clean-up
hangs after the raise (a loop's close joining a thread that waits forever): CI then ran to its
hard limit and printed nothing of where. One watching thread times each test, from setup to
teardown; HARD_STOP_MARGIN_S past the test's timeout it prints which test, every thread's stack,
the kernel side (:func:`kernel_report`: what each thread of the process and of its children waits
for in the kernel, and every task in D state) and exits the process (status 3), so the run ends
with the hang's location as the last thing it printed (under pytest-xdist the worker ends: the
controller reports the test failed, "worker crashed", and goes on with a new worker).

``tests/conftest.py`` registers this module as a plugin; ``-p hard_stop`` loads it into another
pytest run.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Generator

import pytest

HARD_STOP_MARGIN_S = float(os.environ.get("AIOKV_HARD_STOP_MARGIN_S", "120"))
UNBOUNDED_TIMEOUT_S = 900.0
"""The limit used for a test with no pytest-timeout limit (timeout 0)."""
EXIT_LIMIT_S = float(os.environ.get("AIOKV_HARD_STOP_EXIT_S", "600"))
"""How long the process may take to exit once the run ended (pytest's removal of old temporary
directories runs then: 57 s once here, with 1.5 GB of them)."""
EXIT_STATUS = 3


def _timeout_s(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    given = marker.args[0] if marker is not None and marker.args else item.config.getini("timeout")
    value = float(given or 0)
    return value if value > 0 else UNBOUNDED_TIMEOUT_S


def _stop(config: pytest.Config, what: str) -> None:
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=True)  # the real stderr back, for what follows
    stream = sys.stderr
    stream.write(f"\n\nhard stop: {what}; every thread's stack:\n")
    stream.flush()
    faulthandler.dump_traceback(file=stream, all_threads=True)
    stream.flush()
    try:
        stream.write(kernel_report())
    except Exception as exc:  # (a report that cannot be made must not keep the run from ending)
        stream.write(f"\nkernel side not reported: {exc!r}\n")
    stream.flush()
    os._exit(EXIT_STATUS)


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as exc:
        return f"({exc.strerror})"


def _stat(pid: str) -> tuple[str, str, int]:
    """comm, state letter, parent pid of /proc/<pid> (or of a task path); ("", "", 0) if gone."""
    raw = _read(f"/proc/{pid}/stat")
    comm_end = raw.rfind(")")
    if comm_end < 0:
        return "", "", 0
    fields = raw[comm_end + 2 :].split()
    if len(fields) < 2:  # gone meanwhile: _read's "(No such file or directory)" has a ")" too
        return "", "", 0
    return raw[raw.find("(") + 1 : comm_end], fields[0], int(fields[1])


def _tasks(pid: str) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:  # ended meanwhile
        return []


def kernel_report() -> str:
    """Where the kernel holds what is stuck: each thread of this process, of its descendants (a mkfs, a
    FUSE server) and every task in D state on the host (a loop device's worker, jbd2, another
    test's process), with its wait channel and kernel stack (``/proc/*/stack`` needs root).
    A hang in a system call shows in the Python stacks only as the call; this says what it waits
    for (an ext4 journal, a held FUSE request, a block device) and who else waits with it."""
    me = str(os.getpid())
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    parents = {p: _stat(p)[2] for p in pids}
    ours = {me}
    grew = True
    while grew:  # descendants, to any depth
        grew = False
        for p, parent in parents.items():
            if p not in ours and str(parent) in ours:
                ours.add(p)
                grew = True
    lines = ["\nkernel side (threads of this process and its descendants, then every task in D state):\n"]
    for p in sorted(pids, key=lambda p: (p not in ours, int(p))):
        for t in sorted(_tasks(p), key=int):
            comm, state, _ = _stat(f"{p}/task/{t}")
            if p not in ours and state != "D":
                continue
            cmd = _read(f"/proc/{p}/cmdline").replace("\0", " ").strip()[:160]
            wchan = _read(f"/proc/{p}/task/{t}/wchan")
            stack = _read(f"/proc/{p}/task/{t}/stack").rstrip()
            lines.append(f"pid {p} task {t} ({comm}) state {state} wchan {wchan}: {cmd}\n{stack}\n")
    return "".join(lines)


class _Watch:
    """One thread for the whole run (tests that count threads see it before and after alike),
    armed with each test's deadline, then with the end of the run's."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: tuple[pytest.Config, str, float] | None = None  # config, what, deadline
        self._thread: threading.Thread | None = None

    def arm(self, config: pytest.Config, what: str, limit_s: float) -> None:
        with self._cond:
            self._armed = (config, what, time.monotonic() + limit_s)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pytest-hard-stop", daemon=True)
                self._thread.start()
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._armed = None
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                if self._armed is None:
                    self._cond.wait()
                    continue
                config, what, deadline = self._armed
                left = deadline - time.monotonic()
                if left <= 0:
                    _stop(config, what)
                self._cond.wait(left)


_WATCH = _Watch()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    limit_s = _timeout_s(item) + HARD_STOP_MARGIN_S
    _WATCH.arm(item.config, f"{item.nodeid} still running {limit_s:.0f} s after it started (pytest-timeout "
                            "did not end it)", limit_s)
    try:
        yield
    finally:
        _WATCH.disarm()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """The run's end is watched too: the interpreter's exit joins every non-daemon thread, and one
    a test left stuck (a close waiting on the kernel) held the process after its summary."""
    _WATCH.arm(config, f"the process still running {EXIT_LIMIT_S:.0f} s after the run ended (a thread "
                       "left running keeps the interpreter from exiting)", EXIT_LIMIT_S)
    # A crash in the interpreter's exit (CI once ended "Segmentation fault" after the summary, with
    # nothing else printed: pytest's own fault handler is off by then) prints every thread's stack.
    stderr = sys.__stderr__
    if stderr is None:
        return
    faulthandler.enable(file=stderr, all_threads=True)
    left = sorted(t.name for t in threading.enumerate() if t.name.startswith("aiokv") and t.is_alive())
    if left:
        stderr.write(f"\naiokv threads still running as the run ends: {left}\n")
