"""Child processes for the tests: a fork server that has imported torch and aiokv once.

A spawned child imports torch and aiokv itself (2-4 s on the development VM, ~12 s with a CUDA
torch on a loaded GPU host): tests that start a child per round spent most of their time there.
A child forked from this server starts in ~0.05 s and is as clean as a spawned one (the server runs
no threads, holds no CUDA context, pool or loop). Preloads are installed modules only: Python 3.11's
fork server ignores the parent's sys.path, so a test folder's module fails to import there
(silently); the children themselves get the parent's sys.path and import such modules quickly.
Use it for children that do not use CUDA themselves.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.process

PRELOAD = ["torch", "pytest", "aiokv.pool", "aiokv.storage"]


def fork_context() -> multiprocessing.context.BaseContext:
    """The fork-server context with :data:`PRELOAD` imported in the server."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def end_child(proc: multiprocessing.process.BaseProcess, timeout: float | None = None) -> None:
    """SIGKILL ``proc`` unless it has ended, then reap it (within ``timeout``).

    Not ``if proc.is_alive(): os.kill(proc.pid, SIGKILL)``: a fork-server child that exited is
    reaped by the server, which writes its status to the parent a moment later; in between
    ``is_alive()`` is still true and the kill fails with ProcessLookupError (a CI run failed so).
    ``Process.kill`` sends nothing once the status is known and tolerates a pid already gone."""
    proc.kill()
    proc.join(timeout)
