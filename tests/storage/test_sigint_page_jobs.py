"""A KeyboardInterrupt (a real SIGINT, raised by Python's own handler in the loop thread) inside the
disk tier's page-job code loses no job: the loop's next run (the application's cleanup) ends every
caller, gives back every I/O slot, reader count and pool reference, leaves no descriptor open and
never serves a wrong byte. Each point is where Python raises a pending signal's exception: a
function's entry, or a C call's return (:class:`~interrupt_helpers.SignalPoints`).

Before the fix an interrupt at any of these points left its job holding its I/O slot (or never
counted its end): the callers and ``aclose`` hung, and one at ``openat2``'s return also leaked the
descriptor it had opened."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from disk_helpers import BACKENDS
from interrupt_helpers import (
    PAGE_JOB_FILES,
    JobsScenario,
    SignalAfterCall,
    SignalPoints,
    open_fds,
    private_loop,
    settled_fds,
)

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend
from aiokv.storage.safefiles import CachedOpen

URING = [DiskBackend.URING_FIXED, DiskBackend.URING]

POINTS: list[tuple[str, tuple[str, str, str | None], list[DiskBackend]]] = [
    # A read: its start on a slot, the backend's start and its open, the hand-over to the ring or
    # to a worker, and its completions.
    ("read-slot-entry", ("call", "ReadPath._read_slot", None), BACKENDS),
    ("start-load-entry", ("call", "*.start_load", None), BACKENDS),
    ("read-file-entry", ("call", "UringPageIO._read_file", None), URING),
    ("read-submit-entry", ("call", "UringEngine.submit", "UringPageIO._read_file"), URING),
    ("worker-queue-return", ("return", "put", None), [DiskBackend.THREADS]),
    ("take-entry", ("call", "IOSlots.take", "ReadPath._launch_read"), BACKENDS),
    ("read-loaded-entry", ("call", "ReadPath._read_loaded", None), BACKENDS),
    ("read-hash-entry", ("call", "Checksums.start", "ReadPath._read_loaded"), BACKENDS),
    ("read-hashed-entry", ("call", "ReadPath._read_hashed", None), BACKENDS),
    # A write: its hash, its room (a victim taken from the index), its slot, the backend's start
    # (a new file, a recycled one) and its completions; the caller's pool reference.
    ("write-owned-entry", ("call", "WritePath._write_owned", None), BACKENDS),
    ("write-hash-entry", ("call", "Checksums.start", "WritePath._start_write"), BACKENDS),
    ("claim-entry", ("call", "WritePath._claim", None), BACKENDS),
    ("victim-evict-entry", ("call", "PageIndex.evict_to", "PageIndex.claim"), BACKENDS),
    ("write-slot-entry", ("call", "WritePath._write_slot", None), BACKENDS),
    ("start-publish-entry", ("call", "*.start_publish", None), BACKENDS),
    ("start-recycle-entry", ("call", "*.start_recycle", None), BACKENDS),
    ("recycle-submit-entry", ("call", "UringEngine.submit", "UringPageIO._overwrite"), URING),
    ("recycled-entry", ("call", "WritePath._recycled_done", None), BACKENDS),
]


@pytest.mark.parametrize(("where", "backends"), [(p[1], p[2]) for p in POINTS], ids=[p[0] for p in POINTS])
def test_an_interrupt_in_a_page_job_loses_nothing(tmp_path: Path, backend: DiskBackend, layout: KVLayout,
                                                   pool: PagePool, where: tuple[str, str, str | None],
                                                   backends: list[DiskBackend]) -> None:
    if backend not in backends:
        pytest.skip(f"no such point on the {backend.value} backend")
    interrupted_at(tmp_path, backend, layout, pool, SignalPoints(PAGE_JOB_FILES, 0, where))


@pytest.mark.parametrize("backend", URING, ids=[b.value for b in URING])
def test_an_interrupt_as_openat2_returns_leaves_no_descriptor_open(tmp_path: Path, backend: DiskBackend,
                                                                    layout: KVLayout, pool: PagePool) -> None:
    # A read's open on the loop (openat2 with RESOLVE_CACHED), the signal raised as the syscall
    # returns: the fd was on Python's stack only and was dropped. Before: it stayed open, and the
    # job, holding its slot, never ended.
    interrupted_at(tmp_path, backend, layout, pool, SignalAfterCall(CachedOpen.open.__code__, "_syscall"))


def interrupted_at(tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool,
                   points: SignalPoints | SignalAfterCall) -> None:
    """A round of reads and writes with one SIGINT at ``points``' point, then one with none on the
    same tier (every slot there, nothing hangs), then every page read back, the close, and no
    descriptor left open."""
    before = settled_fds(pool)
    with private_loop() as loop:
        # Room for 14 files, 12 written at the start: the round's writes make new files, then recycle.
        scenario = JobsScenario(loop, tmp_path / "disk", backend, layout, pool, capacity=14, stored=12)
        scenario.start()
        closed = False
        try:
            scenario.round(points)
            assert points.fired is not None, "the point was never reached"
            assert scenario.interrupted == 1
            scenario.round()
            scenario.check_all()
            scenario.close()
            closed = True
        finally:
            if not closed:  # a failed check: close anyway, so that the next tests start clean
                with contextlib.suppress(BaseException):
                    scenario.close()
    assert open_fds() <= before, "descriptors left open after the close"
