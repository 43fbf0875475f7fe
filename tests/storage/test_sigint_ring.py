"""A KeyboardInterrupt (a real SIGINT, raised by Python's own handler in the loop thread) inside the
ring's own drain and submission (``storage/uring.py``) and the checksum threads' deliveries
(``storage/checksum.py``) loses no page job: the loop's next run (the application's cleanup) ends
every caller, gives back every I/O slot, reader count and pool reference, leaves no descriptor open
and never serves a wrong byte (:class:`~interrupt_helpers.JobsScenario`).

Before the fix a sweep over this code hung 14-16 of 40 scenarios of 10 rounds: an interrupt at
``_complete``'s entry or at a call of its before the request was updated lost the CQE it had
consumed; one as a chain's count was popped in ``_enter``, or at its clock read, lost the count or
left the prepared SQEs unsubmitted; one at a wake-up's clock read before its end-of-wake-up calls,
or as it moved them on one by one, lost them (a hash batch: every inline hash after it waited); and
the checksum deliveries lost the results they had taken out of the queue together."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from interrupt_helpers import (
    PAGE_JOB_FILES,
    JobsScenario,
    SignalPoints,
    Variant,
    idle_turns,
    open_engine,
    open_fds,
    private_loop,
    random_sigint_sweep,
    run,
    settled_fds,
)

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, checksum, uring

RING_FILES = {module.__file__ for module in (uring, checksum) if module.__file__ is not None}
"""The ring's engine and the checksums' code, beside the page-job code."""

URING = [DiskBackend.URING_FIXED, DiskBackend.URING]

POINTS: list[tuple[str, tuple[str, str, str | None], Variant]] = [
    # A CQE's handling: the request's lookup, and the handling's entry from the drain.
    ("complete-lookup-return", ("return", "get", "UringEngine._complete"), "plain"),
    ("complete-entry", ("call", "UringEngine._complete", "UringEngine._drain"), "plain"),
    # The submission's clock read (its entry: test_an_interrupt_at_a_submissions_entry_submits_later).
    ("enter-clock-return", ("return", "perf_counter", "UringEngine._enter"), "plain"),
    # A wake-up's clock read before the calls asked for at its end (the reads' inline hash batch).
    ("wake-calls-clock-return", ("return", "perf_counter", "UringEngine._on_eventfd"), "plain"),
    # The checksum thread's results delivered from the ring's wake-up hook.
    ("deliver-entry", ("call", "Checksums._deliver", "Checksums.deliver"), "thread-hashes"),
    ("deliver-lock-return", ("return", "__exit__", "Checksums._deliver"), "thread-hashes"),
]


@pytest.mark.parametrize("backend", URING, ids=[b.value for b in URING])
@pytest.mark.parametrize(("where", "variant"), [(p[1], p[2]) for p in POINTS], ids=[p[0] for p in POINTS])
def test_an_interrupt_in_the_ring_loses_no_page_job(tmp_path: Path, backend: DiskBackend, layout: KVLayout,
                                                   pool: PagePool, where: tuple[str, str, str | None],
                                                   variant: Variant) -> None:
    before = settled_fds(pool)
    with private_loop() as loop:
        scenario = JobsScenario(loop, tmp_path / "disk", backend, layout, pool, variant, capacity=14, stored=12)
        scenario.start()
        points = scenario.round(SignalPoints(PAGE_JOB_FILES | RING_FILES, 0, where))
        assert points.fired is not None, "the point was never reached"
        assert scenario.interrupted == 1
        scenario.round()
        scenario.check_all()
        scenario.close()
    assert open_fds() <= before


@pytest.mark.parametrize("caller", ["UringEngine._submit", "UringEngine._on_eventfd"],
                         ids=["from-the-submission-callback", "at-a-wake-ups-end"])
def test_an_interrupt_at_a_submissions_entry_submits_later(caller: str) -> None:
    # The last SQE prepared, with nothing else in flight: a NOP (from the submission callback), or
    # a second NOP its first one's completion callback submits (prepared in a wake-up, submitted at
    # its end). Before: the SIGINT at _enter's entry left it prepared, with no submission asked
    # for: its caller and aclose waited for ever.
    with private_loop() as loop:
        engine = run(loop, open_engine())
        second: asyncio.Future[list[int]] = loop.create_future()

        def then(_: list[int]) -> None:
            engine.submit([uring.sqe(uring.OP_NOP)], None, None, second)

        async def scenario() -> list[int]:
            if caller == "UringEngine._submit":
                return [await engine.nop()]
            engine.submit([uring.sqe(uring.OP_NOP)], None, then)
            return await second

        points = SignalPoints(RING_FILES, 0, ("call", "UringEngine._enter", caller))
        task = loop.create_task(scenario())
        with points, pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(task)
        assert points.fired is not None
        assert run(loop, asyncio.shield(task)) == [0]
        run(loop, idle_turns())
        assert engine._prepared == 0 and not engine._chains and not engine._submit_scheduled
        run(loop, engine.aclose())


ROUNDS = 12
"""Rounds per backend and variant: 132 in all, a few seconds."""


@pytest.mark.parametrize("variant", ["plain", "spares", "thread-hashes", "ring-opens"])
def test_random_sigints_in_the_ring_and_the_page_jobs_lose_nothing(tmp_path: Path, backend: DiskBackend,
                                                                   layout: KVLayout, pool: PagePool,
                                                                   variant: Variant) -> None:
    # As test_sigint_page_jobs_sweep, with the ring's and the checksums' code among the points.
    random_sigint_sweep(tmp_path, backend, layout, pool, variant, PAGE_JOB_FILES | RING_FILES,
                        f"ring-{backend.value}-{variant}", ROUNDS)

