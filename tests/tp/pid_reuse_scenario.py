"""Run inside a fresh user and pid namespace (``unshare -Urpf --mount-proc``) by
``test_adv_rev182_pid_reuse.py``: the process that connected to the group exits, its pid is given
to an unrelated process (``ns_last_pid``: a real reuse, not a simulation), and only then is the
hello read, from a child that inherited the socket. Exit status 0: the rank's job ended once that
child was killed; 1: it stayed in flight (the group watched the unrelated process); 2: set-up failed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from aiokv import KVLayout
from aiokv.tp import RankGroup
from aiokv.tp.specs import Direction

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
NOTICE_S = 10.0

# The connecting process: connects, forks the child that will speak for it, and exits. The child
# waits for a line on stdin, then says hello, attaches (it maps nothing: the group trusts the
# epoch) and reads specs without ever reporting (a copy that runs until it is killed).
PEER = r"""
import os, socket, sys
import torch
from aiokv import KVLayout
from aiokv.tp.wire import PROTOCOL_VERSION, Attached, FrameKind, FrameParser, Hello, Welcome, frame
layout = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
child = os.fork()
if child:
    print(child, flush=True)
    os._exit(0)
sys.stdin.readline()
sock.sendall(frame(FrameKind.HELLO, Hello(PROTOCOL_VERSION, 0, 1, layout.for_tp(1).fingerprint, "cpu").encode()))
parser = FrameParser(1 << 20)
while True:
    data = sock.recv(65536)
    if not data:
        os._exit(0)
    for kind, payload in parser.feed(data):
        if kind is FrameKind.WELCOME:
            sock.sendall(frame(FrameKind.ATTACHED, Attached(Welcome.decode(payload).epoch, True).encode()))
"""


def _connect(address: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", PEER, os.fspath(address)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def _take_pid(pid: int) -> subprocess.Popen[bytes]:
    """An unrelated process given ``pid`` (free: its owner exited and was reaped)."""
    for _ in range(20):
        Path("/proc/sys/kernel/ns_last_pid").write_text(f"{pid - 1}\n")
        proc = subprocess.Popen(["sleep", "1000"])
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    raise RuntimeError(f"pid {pid} could not be taken")


async def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        async with RankGroup(LAYOUT, 1, "/aiokv-rev182-pid-reuse", 4, directory=Path(tmp) / "g") as group:
            connector = _connect(group.address)
            assert connector.stdout is not None and connector.stdin is not None
            speaker = int(await asyncio.to_thread(connector.stdout.readline))
            if await asyncio.to_thread(connector.wait, 60) != 0:  # the loop accepts meanwhile
                return 2
            stranger = _take_pid(connector.pid)  # the connecting process's pid, now another's
            try:
                connector.stdin.write(b"go\n")
                connector.stdin.flush()
                (link,) = group._links  # accepted while the connector ran
                changed = asyncio.ensure_future(group.wait_change())
                async with asyncio.timeout(NOTICE_S):  # the hello settled: attached, or the link ended
                    await asyncio.wait({changed, link.closed}, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                job = group.submit_nowait(group.spec(Direction.LOAD, [0], [0, 1, 2, 3]))
                os.kill(speaker, signal.SIGKILL)  # the socket's last holder: the connection ends
                try:
                    async with asyncio.timeout(NOTICE_S):
                        await job.wait()
                except TimeoutError:
                    print(f"job in flight {NOTICE_S} s after the rank's process died; the group watches "
                          f"pid {connector.pid}, which is now an unrelated process", flush=True)
                    return 1
                print("job ended:", job.outcome(), flush=True)
                return 0
            finally:
                stranger.kill()
                stranger.wait()  # its exit releases a rank held on it: the close ends


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
