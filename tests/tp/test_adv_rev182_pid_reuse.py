"""A rank's process is watched through a pidfd of the process that connected, not of its pid.

Regression (review 182): the group took the peer's pid from ``SO_PEERCRED`` at the hello and
opened a pidfd of that pid (``pidfd_open``). When the connecting process had exited by then (a
child it forked holds the socket and speaks for it) and its pid was reused, the group watched an
unrelated process: the rank's connection, ended while the rank owed a report, was held as a
severed live rank (27539be) until that stranger exited, and the job (a load, the close) waited
for it. Now the pidfd comes from the socket itself (``SO_PEERPIDFD``, Linux 6.5): it names the
process that connected, so an exited one reads as exited and its link ends at once.

The reuse is real: the scenario runs in a fresh user and pid namespace, where the test may set
``ns_last_pid`` and hand the exited process's pid to ``sleep`` (``pid_reuse_scenario.py``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCENARIO = Path(__file__).with_name("pid_reuse_scenario.py")
BOUND_S = 120.0


def _namespaces() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-Urpf", "--mount-proc", "sh", "-c",
                            "echo 100 > /proc/sys/kernel/ns_last_pid"], capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.slow(seconds=13)
def test_a_reused_pid_of_the_connecting_process_is_not_watched(tmp_path: Path) -> None:
    release = tuple(int(part) for part in os.uname().release.split("-")[0].split(".")[:2])
    if release < (6, 5):
        pytest.skip(f"Linux {os.uname().release} has no SO_PEERPIDFD")
    if not _namespaces():
        pytest.skip("no unprivileged user and pid namespaces (unshare -Urpf)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run(["unshare", "-Urpf", "--mount-proc", sys.executable, os.fspath(SCENARIO)],
                         capture_output=True, text=True, timeout=BOUND_S, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
