"""Adversarial (review 107): a process of another user listening where a rank worker reconnects.

A closed ``TPCache`` removes the private directory it created, while its rank workers keep
reconnecting to the same path (a new manager may come). Another user can then create that
directory and listen there: a worker that spoke to it would map the pool it names and run its
specs (copy the engine's KV into that user's memory, or that user's bytes into the engine's KV).
Checked for real (a child process that drops to another uid and listens): the worker sends the
stranger nothing (not even its hello), counts the refused connection and keeps trying.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from tp_helpers import full_kv, rank_kv

from aiokv.layout import KVLayout
from aiokv.tp import RankWorker, TPConfig

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
STRANGER_UID = 65534
BOUND_S = 20.0
FAST = TPConfig(reconnect_initial_s=0.001, reconnect_max_s=0.05)

# The stranger: drops to another uid, listens in its own directory, reports what the first
# connection sent it before its end (a worker that talks sends its hello at once).
STRANGER = """
import os, socket, sys
os.setgid({uid}); os.setuid({uid})
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind({path!r}); server.listen(4)
print("listening", flush=True)
server.settimeout({bound}); conn, _ = server.accept(); conn.settimeout({bound})
got = b""
try:
    got = conn.recv(4096)
except OSError:
    pass
print(len(got), flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
@pytest.mark.asyncio
async def test_a_worker_sends_nothing_to_a_listener_of_another_user() -> None:
    directory = Path(tempfile.mkdtemp(prefix="aiokv-rev107-"))
    try:
        os.chown(directory, STRANGER_UID, STRANGER_UID)
        address = directory / "manager.sock"
        stranger = await asyncio.create_subprocess_exec(
            sys.executable, "-c", STRANGER.format(uid=STRANGER_UID, path=os.fspath(address), bound=BOUND_S),
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert stranger.stdout is not None
            async with asyncio.timeout(BOUND_S):
                assert (await stranger.stdout.readline()).strip() == b"listening"
            kv = rank_kv(full_kv(LAYOUT, 3, 32), LAYOUT, 0, 2)
            async with RankWorker(address, 0, 2, LAYOUT, kv, FAST) as worker:
                async with asyncio.timeout(BOUND_S):
                    sent = int(await stranger.stdout.readline())
                assert sent == 0, f"the worker sent {sent} bytes to a process of uid {STRANGER_UID}"
                assert not worker.attached
            assert worker.statistics().link_errors >= 1
        finally:
            if stranger.returncode is None:
                stranger.kill()
            await stranger.wait()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
