"""The child-process helpers end a fork-server child that already exited without failing.

A CI run failed in ``follow_helpers.child``'s cleanup: the child had exited, the fork server had
reaped it, and ``is_alive()`` still said alive (the server writes the status a moment later), so
``os.kill(pid, SIGKILL)`` raised ProcessLookupError. The tests recreate that window by holding
``is_alive()`` true once the pid is gone."""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection

from child_procs import end_child, fork_context
from follow_helpers import child


def _exits(conn: Connection) -> None:
    conn.close()


def _until_reaped(pid: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return  # the fork server reaped it
        assert time.monotonic() < deadline, "the child never ended"
        time.sleep(0.005)


def test_child_cleanup_ends_a_child_the_fork_server_already_reaped() -> None:
    with child(_exits) as (_conn, proc):
        assert proc.pid is not None
        _until_reaped(proc.pid)
        proc.is_alive = lambda: True  # the server's status not read yet
    assert proc.exitcode == 0


def test_end_child_kills_a_live_child_and_tolerates_a_reaped_one() -> None:
    ctx = fork_context()
    parent, theirs = ctx.Pipe()
    live = ctx.Process(target=time.sleep, args=(60,), daemon=True)
    live.start()
    end_child(live, 30)
    assert live.exitcode == -9
    gone = ctx.Process(target=_exits, args=(theirs,), daemon=True)
    gone.start()
    assert gone.pid is not None
    _until_reaped(gone.pid)
    end_child(gone, 30)
    assert gone.exitcode == 0
    parent.close()
