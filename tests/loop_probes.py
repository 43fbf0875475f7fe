"""Event-driven probes for async tests: where a task waits, and a bounded wait on a condition.

Importable from every test folder (``tests/`` is on ``sys.path`` through ``tests/conftest.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


def waiting_in(task: asyncio.Future[Any] | None, function: str) -> bool:
    """Whether ``task`` is suspended in a coroutine named ``function`` (anywhere down its await chain)."""
    coro = task.get_coro() if isinstance(task, asyncio.Task) else None
    while coro is not None:
        code = getattr(coro, "cr_code", None)
        if code is not None and code.co_name == function:
            return True
        coro = getattr(coro, "cr_await", None)
    return False


async def until(condition: Callable[[], bool], turns: int = 10_000) -> None:
    """Let the loop run until ``condition()`` holds; ``AssertionError`` after ``turns`` loop turns
    (counted in turns, not seconds: a condition that needs no thread never depends on the load)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")
