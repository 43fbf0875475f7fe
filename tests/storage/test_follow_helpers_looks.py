"""follow_helpers.Looks.until ends (TimeoutError, or the predicate held) once the tier no longer
follows: next() then returned without yielding, the loop spun for good and until's timeout, a loop
callback, never fired (a regression run hung in ``Looks(third).until``)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from follow_helpers import Looks


class _NotFollowing:
    """The attributes Looks uses, of a tier whose follow task ended (it took over)."""

    def __init__(self) -> None:
        self._follow_task: asyncio.Task[None] | None = None
        self._follow_started = 3

    async def _apply_look(self, found: Any) -> None:
        del found

    def _look_soon(self) -> None:
        pass


def _in_thread(main: Any) -> list[BaseException | str]:
    """Run ``main()`` on a loop of its own in a daemon thread; what it raised or "returned", or
    nothing when it has not ended within 10 s (a spin that never yields cannot be cancelled)."""
    out: list[BaseException | str] = []

    def run() -> None:
        try:
            asyncio.run(main())
            out.append("returned")
        except BaseException as exc:  # reported to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    return out


def test_until_times_out_when_no_look_comes() -> None:
    async def main() -> None:
        await Looks(_NotFollowing()).until(lambda: False, limit_s=0.2)  # type: ignore[arg-type]

    out = _in_thread(main)
    assert out, "Looks.until spun for good"
    assert isinstance(out[0], TimeoutError), out


def test_until_sees_what_the_loop_makes_true_after_the_take_over() -> None:
    async def main() -> None:
        done = [False]
        asyncio.get_running_loop().call_later(0.05, done.__setitem__, 0, True)
        await Looks(_NotFollowing()).until(lambda: done[0], limit_s=5)  # type: ignore[arg-type]

    assert _in_thread(main) == ["returned"]
