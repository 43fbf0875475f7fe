"""A real call held on the thread that makes it, for tests that close or cancel around a copy.

Importable from every test folder (``tests/`` is on ``sys.path`` through ``tests/conftest.py``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

BOUND_S = 60.0
"""How long a held call waits for its release, and a test for the call to be made."""


class Hold:
    """Holds a real call on the thread that makes it: ``entered`` once it got there, ``returned``
    once the real call is over; it waits for :meth:`release` (bounded)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.returned = threading.Event()
        self._gate = threading.Event()

    def wrap(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def held(*args: Any, **kwargs: Any) -> Any:
            first = not self.entered.is_set()
            self.entered.set()
            if first:
                assert self._gate.wait(BOUND_S), "the test never released the held call"
            try:
                return call(*args, **kwargs)
            finally:
                self.returned.set()

        return held

    def release(self) -> None:
        self._gate.set()

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, BOUND_S), "the held call was never made"
