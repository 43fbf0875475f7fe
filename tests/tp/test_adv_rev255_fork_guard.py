"""Review 255 of 6e68b6e (the start lock's descriptors are listed under a guard a fork takes, so a
forked child closes its copies).

The guard was a plain lock, taken by ``os.register_at_fork``'s ``before`` in the forking thread. A
signal handler that forks (a SIGCHLD handler respawning a worker through multiprocessing's fork) runs
in the main thread between two bytecodes, and so may run inside the guard (``_open_directory``,
``_close_directory``) in the very thread that holds it: the fork then waited for that thread, which
waited for the handler, for good, and the whole process hung (its event loop, its manager). Now the
guard is reentrant, and a forked child gets a new one.

Real signal, real fork (multiprocessing's), real flock. Run in a process of its own, bounded: a hang
there is a failure here. The signal is sent from the guarded listing's ``add`` (its only hook), so
the handler runs inside the guard every time, never by chance.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BOUND_S = 30

_SCENARIO = r"""
import multiprocessing, os, signal, sys
from pathlib import Path
from aiokv.tp import endpoint

directory = Path(sys.argv[1])
reader, writer = os.pipe()
children = []

def worker() -> None:
    os.close(writer)
    os.read(reader, 1)  # lives until the scenario closes the pipe

def respawn(signum, frame) -> None:  # a worker forked from a signal handler
    child = multiprocessing.get_context("fork").Process(target=worker)
    child.start()
    children.append(child)

def nothing() -> None:
    pass

class Listing(set):
    def add(self, fd: int) -> None:
        super().add(fd)
        if not children:  # the first start's only
            os.kill(os.getpid(), signal.SIGUSR1)
        nothing()  # a Python call: the handler runs here, inside the guard

signal.signal(signal.SIGUSR1, respawn)
endpoint._held_locks = Listing()
with endpoint.start_lock(directory) as found:
    assert len(children) == 1, children
# The worker lives on: it kept no lock (a start there again is not refused "another manager is starting").
assert children[0].is_alive()
with endpoint.start_lock(directory) as again:
    assert again.directory == found.directory
os.close(writer)
for child in children:
    child.join(30)
    assert child.exitcode == 0, child.exitcode
print("ok")
"""


def test_a_fork_from_a_signal_handler_inside_the_guard_does_not_hang(tmp_path: Path) -> None:
    directory = tmp_path / "mgr"
    directory.mkdir(mode=0o700)  # the user's: it stays, and so do the lock's chances to linger
    run = subprocess.run([sys.executable, "-c", _SCENARIO, os.fspath(directory)], capture_output=True, text=True,
                         timeout=BOUND_S, cwd=Path(__file__).resolve().parents[2])
    assert (run.returncode, run.stdout) == (0, "ok\n"), run.stderr[-3000:]
