"""Adversarial (helper-307): io_uring refused for real, in the middle of a cache's life, by a seccomp
filter (``io_uring_setup``, ``io_uring_enter`` and ``io_uring_register`` answered EPERM, for every
thread of the process), as a container runtime or a hardening policy does.

The storage tests make a ring refuse by pointing its descriptor elsewhere (review 120/284) or
monkeypatching its setup; here the process's own kernel interface refuses, under the public calls.
A child process runs a cache on the io_uring backend: offloads, then loads of pages on disk only
(the pool is small), the filter installed, then the same calls again, a flush and the close; then a
second cache in that process (its ring refused at setup: ``AUTO`` falls back to threads) loads the
directory. Oracle: each token's KV is a function of its whole prefix (``prefix_oracle``). Checked:
nothing reported loaded is wrong, no call raises or hangs (each bounded), the refusals are counted,
the close keeps its bound, and a cache of this process (no filter) serves only the oracle's KV.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import platform
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import LAYOUT, assert_quiescent, config
from child_procs import end_child, fork_context
from test_adv_crash_restart import SLOTS, prefix_oracle, prompts_of

from aiokv import DiskBackend, KVCache

SEED = 3071
PROMPTS = 24
BOUND_S = 30.0
CLOSE_S = 2.0

_SYS_SECCOMP = 317
_IO_URING_SYSCALLS = (425, 426, 427)  # io_uring_setup, io_uring_enter, io_uring_register (x86_64)
_AUDIT_ARCH_X86_64 = 0xC000003E


def refuse_io_uring() -> None:
    """Install a seccomp filter on every thread of this process (TSYNC): the io_uring system calls
    fail with EPERM from now on, everything else is allowed."""
    ld, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_RET|K
    allow, deny = 0x7FFF0000, 0x00050000 | errno.EPERM
    program = [
        (ld, 0, 0, 4),  # seccomp_data.arch
        (jeq, 0, 4, _AUDIT_ARCH_X86_64),  # another ABI: allow
        (ld, 0, 0, 0),  # seccomp_data.nr
        (jeq, 3, 0, _IO_URING_SYSCALLS[0]),
        (jeq, 2, 0, _IO_URING_SYSCALLS[1]),
        (jeq, 1, 0, _IO_URING_SYSCALLS[2]),
        (ret, 0, 0, allow),
        (ret, 0, 0, deny),
    ]
    filters = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *insn) for insn in program))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = SockFprog(len(program), ctypes.addressof(filters))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    # SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC: the loop's and every I/O thread at once.
    if libc.syscall(_SYS_SECCOMP, 1, 1, ctypes.byref(prog)) != 0:
        raise OSError(ctypes.get_errno(), "seccomp(SECCOMP_SET_MODE_FILTER)")


def _config(directory: Path, backend: DiskBackend) -> Any:
    return config(directory, pool_pages=8, disk_pages=200, backend=backend, launch_pages=1, launch_turn_s=0,
                  close_timeout=CLOSE_S)


async def _round(cache: KVCache, kv: torch.Tensor, prompts: list[list[int]], tally: dict[str, int]) -> None:
    """Offload every prompt (oracle KV), then prefetch and load each back, every other one as a
    compute-or-load stream; what a load reports loaded must be right."""
    for tokens in prompts:
        slots = torch.arange(len(tokens))
        kv[:, slots] = prefix_oracle(tokens)
        async with asyncio.timeout(BOUND_S):
            await cache.offload(tokens, slots)
    for i, tokens in enumerate(prompts):
        async with asyncio.timeout(BOUND_S):
            if i % 3 == 0:
                await cache.prefetch(tokens)
            match = await cache.match(tokens)
            slots = torch.arange(SLOTS - match.tokens, SLOTS)
            kv[:, slots] = 0
            if i % 2:
                async with await cache.start_load(match, slots) as stream:
                    low = (await stream.finish()).loaded_from  # the engine computes [0, low)
                high = match.tokens
            else:
                low, high = 0, (await cache.load(match, slots)).tokens
        tally["loaded"] += high - low
        if not torch.equal(kv[:, slots[low:high]], prefix_oracle(tokens[:high])[:, low:high]):
            tally["wrong"] += 1


def refused_child(directory: str, conn: Any) -> None:
    """See the module docstring; sends ``("ok", report)`` or ``("failed", text)``."""

    async def main() -> dict[str, Any]:
        kv = torch.zeros(LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
        prompts = prompts_of(SEED, PROMPTS)
        before = {"loaded": 0, "wrong": 0}
        after = {"loaded": 0, "wrong": 0}
        second = {"loaded": 0, "wrong": 0}
        cache = KVCache(_config(Path(directory), DiskBackend.URING_FIXED), LAYOUT, kv)
        await cache.start()
        try:
            await cache.wait_started()
            await _round(cache, kv, prompts[: PROMPTS // 2], before)
            async with asyncio.timeout(BOUND_S):
                await cache.flush()
            refuse_io_uring()
            await _round(cache, kv, prompts, after)
            async with asyncio.timeout(BOUND_S):
                await cache.flush()
            errors = dict(cache.stats().errors)
        finally:
            began = time.monotonic()
            async with asyncio.timeout(BOUND_S):
                await cache.aclose()
            closed_in = time.monotonic() - began
        # A new cache in this process: its ring is refused at setup, the threads serve the directory.
        async with KVCache(_config(Path(directory), DiskBackend.AUTO), LAYOUT, kv) as again:
            await _round(again, kv, prompts[:4], second)
            async with asyncio.timeout(BOUND_S):
                await again.flush()
            disk = again.stats().disk
            backend = None if disk is None else disk.backend.value
        return {"before": before, "after": after, "second": second, "errors": errors, "closed_in": closed_in,
                "backend": backend}

    try:
        conn.send(("ok", asyncio.run(main())))
    except BaseException as exc:  # reported to the test, which fails with it
        conn.send(("failed", repr(exc)))


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the filter's system call numbers are x86_64's")
@pytest.mark.asyncio
async def test_io_uring_refused_mid_run_by_seccomp_serves_only_right_kv(tmp_path: Path) -> None:
    ctx = fork_context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=refused_child, args=(str(tmp_path), child), daemon=True)
    proc.start()
    child.close()
    try:
        assert await asyncio.to_thread(parent.poll, 120), "the child hung"
        status, report = parent.recv()
    finally:
        end_child(proc, 30)
        parent.close()
    assert status == "ok", report
    assert report["before"]["wrong"] == report["after"]["wrong"] == report["second"]["wrong"] == 0, report
    assert report["before"]["loaded"] > 0, report  # the ring served before the filter
    assert report["second"]["loaded"] > 0 and report["backend"] == "threads", report
    assert report["closed_in"] < CLOSE_S + 5, report
    assert report["errors"]["disk_eperm"] > 0, report  # the refusals were counted
    # This process has no filter: the directory holds only the oracle's KV.
    kv = torch.zeros(LAYOUT.num_layers, SLOTS, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    tally = {"loaded": 0, "wrong": 0}
    async with KVCache(_config(tmp_path, DiskBackend.URING_FIXED), LAYOUT, kv) as cache:
        for tokens in prompts_of(SEED, PROMPTS):
            match = await cache.match(tokens)
            slots = torch.arange(match.tokens)
            result = await cache.load(match, slots)
            tally["loaded"] += result.tokens
            if not torch.equal(kv[:, : result.tokens], prefix_oracle(tokens[: result.tokens])):
                tally["wrong"] += 1
        await assert_quiescent(cache)
    assert tally["wrong"] == 0 and tally["loaded"] > 0, tally
