"""Review 289: a cold read's chain (OPENAT into the I/O slot's entry, header and page,
FIXED_FD_INSTALL, CLOSE) in a submission the kernel refused (``io_uring_enter`` failed: every op it
carried answers the enter's errno, none ran). The chain's failure handling read "the install did
not answer -ECANCELED" as "the kernel cannot install opened files here" and turned chain reads
off for the process: a passing refusal (a seccomp filter for a moment, a ring briefly broken)
cost every later cold read an OPENAT round trip and a look on the loop, for good, and the log said
the kernel could not install files. Now such a read is a counted miss that keeps the file, and
cold reads go on as chains once the ring takes submissions again.

Both of the engine's completion modes: a CQE for every op (kernels before 5.17), where the
refused chain's ops all answered the enter's errno and chain reads went off at the first refusal;
and silent successes, where the engine ended the chain at its first op's failure, the rest
``-ECANCELED`` (read as an open that failed), until it too completed a refused chain op by op
(test_adv_rev289_refused_chain_closes_once: a CLOSE it ran read as skipped).

Real refusal, as in test_adv_rev120_enter_fails: the ring's descriptor number made to name an
eventfd, which the kernel answers with EOPNOTSUPP. Both io_uring backends (the threads backend
has no chain)."""

from __future__ import annotations

import asyncio
import errno
import logging

import pytest
import torch
from disk_helpers import assert_clean, key_of, payload, reserve, stored_page
from test_adv_rev120_enter_fails import refusing_ring
from test_adv_rev142_install_emfile import DEPTH, _entries, cold_tier, opcodes

from aiokv.pool import PagePool
from aiokv.storage import DiskTier, uring
from aiokv.storage.backends import UringPageIO

__all__ = ["cold_tier"]  # the fixture: every read a chain from its open, on each io_uring backend

READS = 3


@pytest.mark.asyncio
@pytest.mark.parametrize("skip", [True, False], ids=["silent-successes", "every-cqe"])
async def test_a_refused_submission_of_a_cold_read_leaves_chain_reads_on(
        cold_tier: DiskTier, pool: PagePool, caplog: pytest.LogCaptureFixture, skip: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``skip``: the engine's two ways of completing a chain (successes silent where the kernel
    can, or a CQE for every op: kernels before 5.17)."""
    io = cold_tier.backend
    assert isinstance(io, UringPageIO)
    expect = await stored_page(cold_tier, pool, 1)
    monkeypatch.setattr(io.engine, "skip_success", skip and io.engine.skip_success)
    before = cold_tier.statistics()
    seen = opcodes(io)
    with caplog.at_level(logging.INFO, logger="aiokv.storage"), refusing_ring(io.engine):
        for _ in range(READS):
            into = reserve(pool, key_of(1))
            try:
                async with asyncio.timeout(10):
                    assert not await cold_tier.read(key_of(1), into)  # the enter's EOPNOTSUPP
            finally:
                pool.table.abort(into)
    assert uring.OP_FIXED_FD_INSTALL in seen, "no read went by a chain: no test"
    assert io.chain_reads, "a refused submission turned chain reads off for good"
    assert not [r for r in caplog.records if "cannot install opened files" in r.getMessage()]
    after = cold_tier.statistics()
    assert after.misses == before.misses + READS and after.corrupt == before.corrupt
    assert sum(after.errors.values()) == sum(before.errors.values()) + READS  # each read's fault counted
    assert cold_tier.contains(key_of(1))  # a fault of the read, not of the file
    # The ring takes submissions again: the next cold read is a chain from its open, and reads.
    seen.clear()
    into = reserve(pool, key_of(1))
    try:
        async with asyncio.timeout(10):
            assert await cold_tier.read(key_of(1), into)
        assert torch.equal(payload(pool, into), expect)
    finally:
        pool.table.abort(into)
    assert seen[0] == uring.OP_OPENAT and uring.OP_FIXED_FD_INSTALL in seen, seen
    assert io.engine.in_flight == 0 and cold_tier.statistics().in_flight == 0
    assert await _entries(io) == [-errno.EBADF] * DEPTH
    assert_clean(pool)
