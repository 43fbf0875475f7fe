"""The wait before each cancel of a cancel-at-every-point sweep: loop turns, then growing sleeps.

A sweep starts a call, waits, cancels it, checks what the cancel left, and waits a little longer
next time, until the call completes first. The first ``dense`` attempts wait ``attempt`` loop turns
(every interleaving the loop alone decides); later ones sleep, from TIMED_FIRST_S growing by
TIMED_GROWTH, up to TIMED_LAST_S. The rest of a call waits on threads, the kernel or other
processes, and a loop spinning through ``sleep(0)`` turns starves threads of the GIL: a disk load
of 39 small pages took ~100,000 turns (about 1 s) under the default loop spinning so, where it
takes a few ms beside an idle loop, and the sweeps that grew their turn counts instead took
minutes and ran past the suite's per-test timeout on a slower CI machine.

Importable from every test folder (``tests/`` is on ``sys.path`` through ``tests/conftest.py``).
"""

from __future__ import annotations

import asyncio
import math

TIMED_FIRST_S = 2e-4
TIMED_GROWTH = 1.25
TIMED_LAST_S = 10.0


def most_attempts(dense: int) -> int:
    """How many attempts a sweep gets: ``dense`` counted in turns, then sleeps up to TIMED_LAST_S;
    a call still cancelled at the last one never completes (a hang, not a slow machine)."""
    if dense < 0:
        raise ValueError(f"dense must be >= 0, got {dense}")
    return dense + math.ceil(math.log(TIMED_LAST_S / TIMED_FIRST_S, TIMED_GROWTH)) + 1


async def pause(attempt: int, dense: int) -> str:
    """Wait before the ``attempt``-th cancel (attempts count from 0); returns the wait, in words,
    for the sweep's messages."""
    if not 0 <= attempt < most_attempts(dense):
        raise ValueError(f"attempt {attempt} is outside [0, {most_attempts(dense)})")
    if attempt < dense:
        for _ in range(attempt):
            await asyncio.sleep(0)
        return f"{attempt} loop turns"
    delay = min(TIMED_FIRST_S * TIMED_GROWTH ** (attempt - dense), TIMED_LAST_S)
    await asyncio.sleep(delay)
    return f"{delay * 1e3:.2f} ms"
