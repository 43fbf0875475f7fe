"""Review 284 (chaos soak): ``io_uring_enter`` refused for good after the ring was set up (here for
real, as in test_adv_rev120_enter_fails: the ring's descriptor number made to name an eventfd, which
the kernel answers with EOPNOTSUPP) fails each submission's requests, and the tier counts each
failed I/O; the fault is logged once per engine, not at every submission. Before, every refused
submission logged an error: the soak's cache, whose process had io_uring_enter refused by a seccomp
filter mid-run, wrote 1,506 identical error lines in 4 s of traffic (the README: faults below are
counted and logged once per kind)."""

from __future__ import annotations

import errno
import logging

import pytest
from test_adv_rev120_enter_fails import refusing_ring

from aiokv.storage.uring import UringEngine

SUBMISSIONS = 20


async def _errno_of(engine: UringEngine) -> int:
    """A nop through the ring: 0, or the errno it failed with."""
    try:
        await engine.nop()
    except OSError as exc:
        return exc.errno or -1
    return 0


@pytest.mark.asyncio
async def test_a_ring_refused_for_good_logs_its_fault_once(caplog: pytest.LogCaptureFixture) -> None:
    engine = UringEngine.open(8)
    try:
        with caplog.at_level(logging.WARNING, logger="aiokv.storage.uring"), refusing_ring(engine):
            # One submission per loop turn: each awaited nop went out in a submit of its own.
            results = [await _errno_of(engine) for _ in range(SUBMISSIONS)]
        assert results == [errno.EOPNOTSUPP] * SUBMISSIONS
        logged = [r for r in caplog.records if "io_uring_enter failed" in r.getMessage()]
        assert len(logged) == 1, f"{len(logged)} error lines for {SUBMISSIONS} refused submissions"
        assert engine.enter_failures == SUBMISSIONS  # each still counted
        assert await _errno_of(engine) == 0  # the ring works again once the kernel takes submissions
    finally:
        await engine.aclose()
