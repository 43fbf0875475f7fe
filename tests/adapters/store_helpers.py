"""Helpers shared by the page-file store's stuck-I/O tests (frozen or gated file systems)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def wait_for(condition: Callable[[], bool], what: str, bound_s: float) -> None:
    """Until ``condition()`` holds, at most ``bound_s``: state in the kernel or on the store's loop
    thread that gives no event to wait on (I/O stuck in a frozen file system, a task's progress)."""
    deadline = time.monotonic() + bound_s
    pause = threading.Event()
    while not condition():
        assert time.monotonic() < deadline, f"not within {bound_s} s: {what}"
        pause.wait(0.01)
