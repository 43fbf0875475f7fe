"""The disk workers' outcome inbox (``storage/outcomes.py``) settles every outcome of a batch even
when one job raised ``StopIteration`` (or a subclass): an asyncio future refuses it
(``TypeError`` in ``set_exception``), and raised out of the drain it left every later outcome of
the batch unsettled, their awaiting reads hung. The bridge of CPU copies had the same defect
(review 137); review 138 named this twin, not reachable through ``os.*`` calls today."""

from __future__ import annotations

import asyncio
import threading

import pytest

from aiokv.storage.outcomes import Outcomes


class _Stop(StopIteration):
    pass


@pytest.mark.parametrize("stop", [StopIteration, _Stop], ids=["StopIteration", "subclass"])
@pytest.mark.asyncio
async def test_a_job_raising_stop_iteration_strands_no_other_outcome(stop: type[StopIteration]) -> None:
    loop = asyncio.get_running_loop()
    outcomes = Outcomes(loop)
    futures: list[asyncio.Future[object]] = [loop.create_future() for _ in range(4)]

    def worker() -> None:  # one batch: all posted before the loop runs the drain
        outcomes.post(futures[0], None, None)
        outcomes.post(futures[1], None, stop())
        outcomes.post(futures[2], 2, None)
        outcomes.post(futures[3], None, OSError(5, "EIO"))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert outcomes.wakes == 1
    _, pending = await asyncio.wait(futures, timeout=5)
    assert not pending, f"{len(pending)} outcomes never settled"
    assert futures[0].result() is None and futures[2].result() == 2
    error = futures[1].exception()
    assert isinstance(error, RuntimeError) and isinstance(error.__cause__, stop)
    assert isinstance(futures[3].exception(), OSError)
