"""Operators' view of page-pool segments in shared memory: ``python -m aiokv.segments list|clean``.

A pool's segment outlives a creator killed by SIGKILL (or the OOM killer); pool creation reclaims
such segments, and this command lists and cleans them by hand. The rules (which segment is live,
dead, being created, legacy or foreign, and when one may be unlinked) are in :mod:`aiokv.reclaim`,
re-exported here.

Operators::

    python -m aiokv.segments list            # every aiokv segment, its size, creator and state
    python -m aiokv.segments clean           # unlink segments of dead owners (what pool creation does)
    python -m aiokv.segments clean --legacy  # also pre-lock segments whose creator is gone

``import aiokv`` does not import this module (only :mod:`aiokv.reclaim`): ``python -m`` would warn
about running a module that is imported already.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from aiokv.reclaim import SegmentInfo, SegmentState, reclaim, reclaimable_bytes, scan
from aiokv.shm import SHM_DIR, SHM_NAME_PREFIX

__all__ = ["SegmentInfo", "SegmentState", "main", "reclaim", "reclaimable_bytes", "scan"]


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m aiokv.segments list|clean``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m aiokv.segments",
        description="List or reclaim aiokv page-pool segments in shared memory (" + SHM_DIR + ").",
    )
    parser.add_argument("command", choices=["list", "clean"])
    parser.add_argument("--prefix", default=SHM_NAME_PREFIX, help="segment name prefix (default: %(default)s)")
    parser.add_argument(
        "--legacy",
        action="store_true",
        help="clean: also remove segments of older aiokv versions whose creator pid is gone and that no "
        "process maps, and empty ones of dead creators",
    )
    args = parser.parse_args(argv)
    if args.command == "list":
        segments = scan(args.prefix)
        print(f"{'name':<48} {'size':>12} {'uid':>6} {'pid':>8}  state")
        for seg in segments:
            creator = "creator alive" if seg.creator_alive else "creator gone"
            print(f"{seg.name:<48} {_gib(seg.size):>12} {seg.uid:>6} {seg.pid:>8}  {seg.state.value} ({creator})")
        dead = [s for s in segments if s.state is SegmentState.DEAD]
        # The memory they hold (a sparse or hard-linked one frees less than its size).
        print(f"{len(segments)} segments, {len(dead)} reclaimable ({_gib(sum(s.frees for s in dead))})")
        return 0
    removed = reclaim(args.prefix, legacy=args.legacy)
    for seg in removed:
        print(f"removed {seg.name} ({_gib(seg.size)}, {seg.state.value}, pid {seg.pid})")
    print(f"{len(removed)} segments removed, {_gib(sum(s.frees for s in removed))} freed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
