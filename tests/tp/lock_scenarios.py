"""A manager's stop and a manager's start held inside the directory's start lock, each in a process
of its own (real flocks): the stop runs the real ``remove_endpoint`` held at its ``rmdir`` (the lock
taken shared), the start the real ``start_lock`` held inside its block (the lock taken exclusive).
Each prints ``held`` there and goes on at a line on its stdin; the stop then prints ``removed`` or
``left``. Kill one to end it there."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

STOPPING = r"""
import os, sys
from pathlib import Path
from aiokv.tp import endpoint

directory = Path(sys.argv[1])
rmdir = os.rmdir
removed = []

def held_rmdir(path, *args, **kwargs):
    print("held", flush=True)
    sys.stdin.readline()
    rmdir(path, *args, **kwargs)
    removed.append(path)

# Whether its rmdir succeeded (remove_endpoint swallows its error), not whether the path exists
# after: a start waiting for this stop makes the directory anew at once, and "left" came then.
endpoint.os.rmdir = held_rmdir
endpoint.remove_endpoint(endpoint.Endpoint(directory, True))
print("removed" if removed else "left", flush=True)
"""

STARTING = r"""
import sys
from pathlib import Path
from aiokv.tp import endpoint

with endpoint.start_lock(Path(sys.argv[1])) as found:
    print("held", found.created, flush=True)
    sys.stdin.readline()
"""


async def spawn(scenario: str, directory: Path) -> asyncio.subprocess.Process:
    """Run ``scenario`` (:data:`STOPPING` or :data:`STARTING`) on ``directory``; returns once it holds the lock."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", scenario, os.fspath(directory),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=REPO,
    )
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 30)
    assert line.startswith(b"held"), line
    return process


async def go_on(process: asyncio.subprocess.Process) -> bytes:
    """Let a held scenario go on; returns the line it prints next (the stop's ``removed`` or ``left``)."""
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(b"go\n")
    await process.stdin.drain()
    return await process.stdout.readline()


async def reap(process: asyncio.subprocess.Process) -> None:
    """Kill it unless it ended, and wait for it."""
    if process.returncode is None:
        process.kill()
    await process.wait()
