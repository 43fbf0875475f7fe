"""Review 220: at a start, any read fault of the pending-delete record (:mod:`storage.deletelog`)
was taken for a record that cannot be trusted: every page found counted as deleted, and the lock
holder unlinked them all. A passing fault (EMFILE: the process short of descriptors; ENFILE,
ENOMEM) thereby wiped the whole disk cache for good. Such a read is now tried again after a short
back-off (:func:`storage.deletelog.load_deletes_retrying`), each failure counted; a record that is
damaged (or a fault that outlasts the tries, or EIO) keeps the old handling.

Real fault: a start (:func:`storage.layoutdir.prepare`) in a process of its own whose free
descriptors are all taken (held open) once the pages' fan-out directory is listed (from its stop
flag, asked between fan-out directories): the later ones and the record's open meet EMFILE. The
held descriptors are freed when the start logs the failed read (on the start's own thread): the
fault passes while the start backs off, as a descriptor shortage does. Then a real restart serves
the pages kept, never the one the record names."""

from __future__ import annotations

import errno
import logging
import os
import resource
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from child_procs import end_child, fork_context
from disk_helpers import assert_clean, config, key_of, small_layout
from follow_helpers import started
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev188_deletes_away import _served

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.deletelog import DELETES_NAME, save_deletes

TAG = 0x01  # a fan-out directory listed before the descriptors run out
KEPT = [key_of(i, TAG) for i in range(3)]
VICTIM = key_of(9, TAG)
WAIT_S = 60.0


class _FreeOnRecordFault(logging.Handler):
    """Closes the held descriptors when the start logs that the record's read failed."""

    def __init__(self, held: list[int]) -> None:
        super().__init__()
        self.held = held

    def emit(self, record: logging.LogRecord) -> None:
        if DELETES_NAME in record.getMessage():
            while self.held:
                os.close(self.held.pop())


def starting_child(root: str, conn: Connection) -> None:
    """Starts (prepares) the layout directory under ``root`` short of descriptors; sends the keys
    found and the record faults as ``(errno, what)``."""
    from aiokv.storage.layoutdir import prepare
    from aiokv.storage.pagefile import PageFiles

    files = PageFiles(Path(root), small_layout())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024), hard))
    held: list[int] = []
    logger = logging.getLogger("aiokv.storage.disk")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(_FreeOnRecordFault(held))
    asked = 0

    def use_up_descriptors() -> bool:
        # prepare's stop flag, asked before each fan-out directory (and in a listing, at most once
        # in these small ones): well past TAG's, every free descriptor is taken (each time: a
        # listing that failed closed its own), so the later ones and the record's open meet EMFILE.
        nonlocal asked
        asked += 1
        if asked > 2 * (TAG + 1) + 8:
            try:
                while True:
                    held.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
            except OSError as exc:
                if exc.errno != errno.EMFILE:
                    raise
        return False

    state = prepare(files, stop=use_up_descriptors)
    try:
        found = sorted(key for _mtime, key in state.found)
        faults = [(exc.errno, what) for exc, what in state.faults if DELETES_NAME in what]
        conn.send((found, faults, state.read_only is None))
    finally:
        state.close()


def _start_short_of_descriptors(root: Path) -> tuple[list[bytes], list[tuple[int, str]], bool]:
    ctx = fork_context()
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=starting_child, args=(str(root), theirs), daemon=True)
    proc.start()
    theirs.close()
    try:
        assert ours.poll(WAIT_S), "the start short of descriptors did not answer"
        found, faults, writer = ours.recv()
        return found, faults, writer
    finally:
        end_child(proc, WAIT_S)
        ours.close()


@pytest.mark.asyncio
async def test_a_passing_emfile_on_the_record_unlinks_no_page(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    assert layout.fingerprint == small_layout().fingerprint
    size = layout.page_bytes
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0, min_free_bytes=0)
    async with started(DiskTier(cfg, layout, pool)) as tier:
        for key in (*KEPT, VICTIM):
            assert await tier.write_from(key, memoryview(_bytes_of(key, size)))
        await tier.flush()
        files = tier.files
    paths = {key: files.layout_dir / f"{key[0]:02x}" / key.hex() for key in (*KEPT, VICTIM)}
    assert all(path.exists() for path in paths.values())
    # VICTIM's delete failed before a crash: named in the record, its file left on disk.
    dir_fd = os.open(files.layout_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        save_deletes(dir_fd, {VICTIM: time.time_ns()})
    finally:
        os.close(dir_fd)

    found, faults, writer = _start_short_of_descriptors(tmp_path / "disk")
    assert writer, "the start short of descriptors did not hold the lock: it could unlink nothing"
    assert [p for key, p in paths.items() if key != VICTIM and not p.exists()] == [], (
        f"a passing EMFILE reading the record unlinked the pages on disk (record faults: {faults})")
    assert faults and all(err == errno.EMFILE for err, _what in faults), faults
    assert found == sorted(KEPT), "the start did not index the pages the record does not name"
    assert not paths[VICTIM].exists(), "the page the record names was not unlinked by the lock holder"

    async with started(DiskTier(cfg, layout, pool)) as tier:
        for key in KEPT:
            assert await _served(tier, key, size), "a page kept on disk was not served after the fault"
        assert not await _served(tier, VICTIM, size), "the page the record names was served"
    assert_clean(pool)
