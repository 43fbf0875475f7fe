"""Review 205: 458e74a runs ``RankGroup._close`` anew when a loop-wide cancel ended its task; every
step of the close may then run twice. A sweep of that cancel over the close's await points after
the fenced rank's held copy is let go (its report coming in, the job's end, the links aborted and
awaited, the server's close, the endpoint's removal): a later ``aclose()`` ends, the load ended with
the rank's report (never before its copy finished), the socket is removed, the rank fenced once and
counted disconnected once, and no job is left in flight. The cuts after the report are swept in
loop turns from the job's end (review 216: counted from the release, a loaded machine's report came
within 7 turns and the coverage check failed).

A real rank process per point (the held-copy worker of ``test_adv_rev201_loop_shutdown_drain``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import pytest
from cancel_points import most_attempts, pause
from loop_probes import cancel_every_task_but_nowait, until_spin, until_thread
from shutdown_helpers import BOUND_S, held_load, new_held, rank_child
from test_adv_rev197_farewell_race import MHA, RANK_CONFIG, T
from test_adv_rev201_loop_shutdown_drain import _rank_main
from tp_helpers import CONFIG

from aiokv.pool import PagePool
from aiokv.tp import RankGroup

CLOSE_S = 0.05  # close_timeout_s: the close fences the rank soon
DENSE = 8  # loop turns first, then growing sleeps (cancel_points) between the release and the cancel
AFTER_MOST = 64  # loop turns after the job's end by which the close must have ended (else a hang)
# Cuts of the close after the job's end, at least: 0 turns always cuts it (the test's step runs
# before the close's wake-up in that turn); 5-6 do here, but where the rank's end of the link
# arrives with its report the close has no link to wait for and ends in its next step.
AFTER_LEAST = 1


# The sweep cancels every task of the loop, asyncio's own too: a cancel that lands on the task
# asyncio runs for an accepted connection (``_accept_connection2``, a rank reconnecting while the
# close runs) before its first step leaves that socket unclosed (CPython 3.11 and 3.12; reproduced
# without aiokv, review 216), and its ResourceWarning at collection is no leak of the library's.
@pytest.mark.filterwarnings("ignore:unclosed:ResourceWarning")
@pytest.mark.asyncio
async def test_a_loop_wide_cancel_at_each_point_of_the_group_s_close_after_the_report(
        tmp_path: Path, pool: PagePool) -> None:
    # Counted from the release, the cuts land before the rank's report (the close waiting for it),
    # and, where the report comes soon enough, after it. How many turns the report takes depends on
    # the machine (under load the rank's process runs while the loop's thread waits for a CPU:
    # 7 turns did it once), so the cuts after the report are swept apart, counted from the job's
    # end, where the rest of the close is this loop's alone (abort, the links' ends, the server's
    # close, the endpoint's removal): the same turns on any machine, but for the rank's own end of
    # the link (see AFTER_LEAST).
    before = 0
    for attempt in range(most_attempts(DENSE)):
        point = await _one_point(tmp_path / f"m{attempt}", pool, attempt, from_the_end=False)
        if point is None:
            break
        before += not point
    else:
        raise AssertionError("the close never ended before the cancel: a hang")
    assert before >= 1, "no cancel landed on the close waiting for the rank's report"
    after = 0
    for turns in range(AFTER_MOST):
        point = await _one_point(tmp_path / f"e{turns}", pool, turns, from_the_end=True)
        if point is None:
            break
        after += 1
    else:
        raise AssertionError(f"the close went on {AFTER_MOST} turns after the job's end: a hang")
    assert after >= AFTER_LEAST, (
        f"only {after} cuts of the close after the job's end ({before} before the rank's report)"
    )


async def _one_point(
        directory: Path, pool: PagePool, attempt: int, *, from_the_end: bool) -> bool | None:
    """The loop-wide cancel ``attempt`` (cancel_points) after the held copy was let go, or
    ``attempt`` loop turns after the job's end (``from_the_end``): None when the close had ended by
    then, else whether the job had ended (the rank's report in) when the cancel landed."""
    config = dataclasses.replace(CONFIG, close_timeout_s=CLOSE_S)
    held = new_held()
    group = RankGroup(MHA, 1, pool.name, pool.num_pages, config, directory)
    await group.start()
    address = group.address
    async with rank_child(group, held, _rank_main, os.fspath(address), RANK_CONFIG, held):
        load = await held_load(group, held, list(range(T)))
        at_end: list[int] = []  # the rank's finished copies when the job ended
        load.add_done_callback(lambda _: at_end.append(held.finished_copies()))
        closing = asyncio.ensure_future(group.aclose())
        await until_thread(lambda: group.statistics().fenced == 1, "the close fencing the rank", BOUND_S)
        held.release()
        if from_the_end:
            await until_spin(load.done, "the job's end after the copy was let go", BOUND_S)
            for _ in range(attempt):
                await asyncio.sleep(0)
            where = f"cancel {attempt} loop turns after the job's end"
        else:
            waited = await pause(attempt, DENSE)
            where = f"cancel {waited} after the held copy was let go"
        ended_first = closing.done()
        reported = load.done()
        cancel_every_task_but_nowait(asyncio.current_task())  # the application's SIGTERM handler
        await asyncio.wait({closing}, timeout=BOUND_S)
        assert closing.done(), where
        async with asyncio.timeout(BOUND_S):
            await group.aclose()  # raised the loop-wide cancel at once when the close never ran anew
        assert load.done(), f"{where}: the close ended with the job in flight"
        assert at_end == [1], f"{where}: the job ended before the rank's copy did ({at_end})"
        assert not await asyncio.to_thread(os.path.exists, address), f"{where}: the socket is left"
        stats = group.statistics()
        assert stats.fenced == 1, f"{where}: fenced {stats.fenced} times"
        assert stats.disconnects <= 1, f"{where}: counted {stats.disconnects} disconnects"
        assert group._jobs.in_flight == 0, f"{where}: jobs left in flight"
        await group.aclose()  # again: at once
    return None if ended_first else reported
