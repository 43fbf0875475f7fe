"""Review 212: does a rank's teardown reclaim read other processes' ``/proc/<pid>/maps``?

The concern: ``_reclaim_left`` (a session's teardown reclaims the segment a killed manager left)
reading every peer's maps file whole, without bound, on the loop. It does not: it runs on a thread
(``cancels.in_thread``), and it reclaims only current-format DEAD segments (``reclaim`` without
``legacy``), whose creator's pid and start time decide; only a LEGACY name's check scans the maps
files (``aiokv.reclaim._mapped_anywhere``, reached through ``aiokv clean --legacy``). This pins it:
with a LEGACY segment of a dead pid planted beside a DEAD one, no maps file is opened, the DEAD
one is removed and the LEGACY one left.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import threading
from pathlib import Path

from aiokv.shm import SHM_DIR
from aiokv.tp.worker import _reclaim_left

_MAPS = re.compile(r"/proc/\d+/maps")
_opened: list[str] = []
_watching = threading.local()


def _audit(event: str, args: tuple[object, ...]) -> None:
    if event == "open" and getattr(_watching, "on", False) and args and isinstance(args[0], str) \
            and _MAPS.fullmatch(args[0]):
        _opened.append(args[0])


sys.addaudithook(_audit)  # audit hooks stay for the process: it records only while a test watches


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_the_teardown_reclaim_reads_no_maps_file() -> None:
    prefix = f"aiokvt212{secrets.token_hex(4)}"
    dead = _dead_pid()
    legacy = Path(SHM_DIR) / f"{prefix}-{dead}-{secrets.token_hex(8)}"
    gone = Path(SHM_DIR) / f"{prefix}-{dead}-12345-{secrets.token_hex(8)}"
    for path in (legacy, gone):
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.ftruncate(fd, 4096)
        finally:
            os.close(fd)
    try:
        _opened.clear()
        _watching.on = True
        try:
            _reclaim_left(f"/{prefix}-{os.getpid()}-1-{secrets.token_hex(8)}")
        finally:
            _watching.on = False
        assert not _opened, f"the teardown reclaim read maps files: {_opened[:5]}"
        assert not gone.exists(), "the DEAD segment was not reclaimed (the scan did not run)"
        assert legacy.exists(), "a LEGACY segment was reclaimed without the legacy check"
    finally:
        for path in (legacy, gone):
            path.unlink(missing_ok=True)
