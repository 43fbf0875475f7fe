"""Review 188: a follower's look whose STATX ring was closed (a batch ended by an exception
abandons it: :mod:`aiokv.storage.statxring`) and whose new ring cannot be made for lack of
descriptors (EMFILE) examines its directories with ``fstat`` this time, and makes a ring again at
a later look. Before, ``state.ring`` still held the closed ring, so the EMFILE of the new ring's
setup was taken for a failed ``io_uring_enter`` of a ring in use: STATX was marked refused for
good (``statx_refused``) and every later look made 256 ``fstat`` calls.

The EMFILE is real: ``RLIMIT_NOFILE`` lowered in a child process to its lowest free descriptor
number. The ring is closed with ``StatxRing.close()``, the state a batch's failed wait leaves it
in (test_adv_rev183_statx makes that one with signals)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_CHILD = r"""
import json, os, resource, sys
from aiokv.storage import follow
from aiokv.storage.follow import FollowState, FollowSeed, _stat_batch
from aiokv.storage.layoutdir import FANOUT
from aiokv.storage.statxring import StatxRefused, open_ring

out = {}
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
fanout = [-1] * FANOUT
fanout[0x3a] = fd
state = FollowState(FollowSeed())
try:
    state.ring = open_ring(FANOUT)
except StatxRefused as exc:
    print(json.dumps({"skip": str(exc)}))
    sys.exit(0)
state.ring.close()  # as a batch ended by an exception leaves it
free = os.dup(0)
os.close(free)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (free, hard))  # the next descriptor: EMFILE
try:
    stats = _stat_batch(state, fanout)
finally:
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
out["first"] = None if stats is None else sorted(stats)
out["refused_after_emfile"] = None if state.statx_refused is None else str(state.statx_refused)
stats = _stat_batch(state, fanout)
out["second"] = None if stats is None else {str(k): type(v).__name__ for k, v in stats.items()}
out["ring_open"] = state.ring is not None and not state.ring.closed
out["ino_matches"] = stats is not None and stats[fd].st_ino == os.fstat(fd).st_ino
state.close_ring()
print(json.dumps(out))
"""


def test_a_closed_ring_that_cannot_be_made_again_falls_back_once(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in report:
        import pytest

        pytest.skip(f"io_uring STATX refused here: {report['skip']}")
    assert report["first"] is None  # fstat this time
    assert report["refused_after_emfile"] is None, "an EMFILE at the new ring's setup refused STATX for good"
    assert report["second"] is not None and set(report["second"].values()) == {"stat_result"}
    assert report["ring_open"] and report["ino_matches"]
