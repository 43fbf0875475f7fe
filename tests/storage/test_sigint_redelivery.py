"""A completion delivered twice (at least once: whoever cannot tell whether its ``done`` ran delivers
it again after a KeyboardInterrupt) runs once, even when the job moved on to another hand-off of the
same kind meanwhile; and a ring callback that ran is never run again.

A recycle whose victim's file is gone is not taken: its ``done`` goes on at once to a new file's
publish (a second write hand-off). A real SIGINT raised as that ``done`` returns makes the backend
deliver it again in the next turn (an EINTR, or the same outcome). Before, the job then waited for
"a write" again (``Job.step`` named the kind of hand-off, not the hand-off), so the stale completion
ran as the publish's: the job ended as a bug (counted ``disk_other``, the caller told False) while
the publish was still in flight with the job's I/O slot and page, and the file it published stayed
on disk unindexed.

A broken read chain's clean-up callback was a ``functools.partial``: the ring runs a callback again
when an interrupt left it before it started, which it cannot tell for a partial (see
``uring.not_started``), so a SIGINT as it returned read the page a second time, into a slot and page
the read had given back."""

from __future__ import annotations

import functools
import os
import types
from pathlib import Path
from typing import Any

import pytest
from disk_helpers import config, key_of, stored_page, write_page
from interrupt_helpers import SignalAfterCall, open_fds, private_loop, run, settled_fds

from aiokv.keys import PageKey
from aiokv.layout import KVLayout
from aiokv.pagetable import PageHandle, ReserveOutcome
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, backends, uring
from aiokv.storage.config import ErrorKind
from aiokv.storage.pagefile import file_bytes

STORED = 4


def _nested(code: types.CodeType, name: str) -> types.CodeType:
    return next(c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == name)


def test_a_recycle_not_taken_delivered_twice_runs_once(tmp_path: Path, backend: DiskBackend, layout: KVLayout,
                                                       pool: PagePool) -> None:
    before = settled_fds(pool)
    with private_loop() as loop:
        tier = DiskTier(config(tmp_path / "disk", backend, capacity=STORED * file_bytes(layout)), layout, pool)
        run(loop, tier.start())
        for i in range(STORED):
            run(loop, stored_page(tier, pool, i))
        if backend is DiskBackend.THREADS:
            point = SignalAfterCall(backends._recycled.__wrapped__.__code__, "done")  # the worker's outcome delivered
        else:
            # Opens through the ring: the victim's ENOENT comes to ``opened``, which calls ``done``.
            io = tier.backend
            assert isinstance(io, backends.UringPageIO)
            io._cached.available = False
            point = SignalAfterCall(_nested(backends.UringPageIO.start_recycle.__code__, "opened"), "done")
        os.unlink(tier.files.path(key_of(0)))  # the next write's victim (least recently used) is gone
        task = loop.create_task(write_page(tier, pool, 100))
        with point:
            try:
                loop.run_until_complete(task)
            except KeyboardInterrupt:
                pass
        assert point.fired is not None, "the recycle's done was never called"
        assert run(loop, task)[0], "the write was published, but its caller was told it was not"
        run(loop, tier._until_idle())
        assert tier.contains(key_of(100)) and os.path.exists(tier.files.path(key_of(100)))
        errors = tier.statistics().errors
        assert errors.get(ErrorKind.OTHER, 0) == 0, f"a stale completion ran as a bug: {errors}"
        slots = tier._io_slots
        assert slots.in_use == 0 and not slots.waiting
        index = tier._index
        assert index.used == len(index) * index.file_bytes
        on_disk = sum(len(files) for _, _, files in os.walk(tier.files.layout_dir)) - 1  # less the lock
        assert on_disk == len(index), "a published file is not indexed"
        run(loop, tier.aclose())
    assert open_fds() <= before


URING = [DiskBackend.URING_FIXED, DiskBackend.URING]


@pytest.mark.parametrize("backend", URING, ids=[b.value for b in URING])
def test_a_broken_read_chain_is_read_again_once(tmp_path: Path, backend: DiskBackend, layout: KVLayout,
                                               pool: PagePool, monkeypatch: pytest.MonkeyPatch) -> None:
    # A cold read (one chain from the open) of a truncated file breaks at its transfer, before its
    # CLOSE: the entry is closed through the ring, then the read goes the checked way (an open
    # through the ring, then a chain into the same slot and page). A SIGINT as the CLOSE's
    # callback returns made the ring run that callback again in the next turn (it was a
    # ``functools.partial``: its frame gone, it read as never started): a second open and chain
    # into the slot and page, still writing into them after the read had ended.
    reads_again: list[str] = []
    checked_way = backends.UringPageIO._open_then_read

    def counted(io: backends.UringPageIO, dir_fd: int, name: str, *rest: Any) -> None:
        reads_again.append(name)
        checked_way(io, dir_fd, name, *rest)

    monkeypatch.setattr(backends.UringPageIO, "_open_then_read", counted)
    before = settled_fds(pool)
    with private_loop() as loop:
        tier = DiskTier(config(tmp_path / "disk", backend), layout, pool)
        run(loop, tier.start())
        io = tier.backend
        assert isinstance(io, backends.UringPageIO) and io.chain_reads, "no read chains here"
        run(loop, stored_page(tier, pool, 0))
        io._cached.available = False  # a cold name: the read is one chain from its open
        os.truncate(tier.files.path(key_of(0)), file_bytes(layout) - 4096)

        seen: list[object] = []

        def entry_closed(frame: types.FrameType) -> bool:
            # The CLOSE's callback, where Python checks for signals as it returns: a callable it
            # does not inline (a functools.partial of _entry_closed, before); a Python function
            # (``closed``, now) returns with no check (nothing to fire at then).
            callback = frame.f_locals.get("callback")
            func = callback.func if isinstance(callback, functools.partial) else callback
            if getattr(func, "__name__", "") not in ("_entry_closed", "closed"):
                return False
            seen.append(callback)
            return not isinstance(callback, types.FunctionType)

        point = SignalAfterCall(uring.UringEngine._complete.__code__, "callback", entry_closed)
        handle = _reserve(pool, key_of(50))
        task = loop.create_task(_read_then_look(tier, handle))
        with point:
            try:
                loop.run_until_complete(task)
            except KeyboardInterrupt:
                pass
        assert seen, "the broken chain's entry was never closed"
        assert point.fired is not None or isinstance(seen[0], types.FunctionType)
        ok, in_flight = run(loop, task)
        assert not ok  # truncated: refused
        assert reads_again == [bytes.hex(key_of(0))], "the read went the checked way twice"
        assert not in_flight, "the ring still opened or read for the read when it returned"
        pool.table.abort(handle)
        run(loop, tier._until_idle())
        assert tier._io_slots.in_use == 0
        run(loop, tier.aclose())
    assert open_fds() <= before


def _reserve(pool: PagePool, key: PageKey) -> PageHandle:
    (res,) = pool.reserve([key])
    assert res.outcome is ReserveOutcome.RESERVED and res.handle is not None
    return res.handle


_READS = {uring.OP_OPENAT, uring.OP_READ, uring.OP_READV, uring.OP_READ_FIXED}


async def _read_then_look(tier: DiskTier, handle: PageHandle) -> tuple[bool, int]:
    """The read's answer, and the ring's requests in flight as it came that open or read (none:
    the read was the only such I/O; the unlink of the refused file and the close of its descriptor
    may still be in flight)."""
    ok = await tier.read(key_of(0), handle)
    io = tier.backend
    assert isinstance(io, backends.UringPageIO)
    return ok, sum(any(op[0] in _READS for op in request.ops) for request in io.engine._inflight.values())
