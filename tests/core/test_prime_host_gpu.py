"""The warm-up primes torch's caching host allocator (``kernels/warmup.py``, step 4).

A copy's slot index goes to the GPU through a fresh pinned buffer (``PageMover._index``); the first
request of a size class called ``cudaHostAlloc`` on the event loop: a load right after
``wait_warm`` stalled the loop 14 ms there on an H100 host (``test_warmup_gpu.py``, timing pass at
``-n 6``). The GPU case runs in a fresh process (the allocator and the primed set are per process)
and counts the blocks the allocator creates (``torch.cuda.host_memory_stats()['num_host_alloc']``)
for indices of every primed class: none after priming; the control, without it, creates some, so
the check can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from aiokv.kernels.warmup import prime_host_allocator

DEVICE = os.environ.get("AIOKV_TEST_DEVICE", "cpu")

SCRIPT = r"""
import json, sys
import torch
from aiokv.kernels.warmup import PRIMED_BLOCKS, prime_host_allocator, primed_elements

device = torch.device("cuda")
torch.zeros(1, device=device)  # the context first: its own pinned buffers are not ours to count
MOST = 1 << 18  # a 256K-slot cache
primed = prime_host_allocator(device, MOST) if sys.argv[1] == "primed" else None
again = prime_host_allocator(device, MOST) if primed else None
before = torch.cuda.host_memory_stats()["num_host_alloc"]
stream = torch.cuda.Stream()
with torch.cuda.stream(stream):
    # What PageMover._index does, for every primed class at once (blocks of a class in flight together).
    held = []
    for elements in primed_elements(MOST):
        for _ in range(PRIMED_BLOCKS):
            pinned = torch.empty(elements, dtype=torch.int64, pin_memory=True)
            held.append(pinned.to(device, non_blocking=True))
stream.synchronize()
created = torch.cuda.host_memory_stats()["num_host_alloc"] - before
print(json.dumps({"primed": primed, "again": again, "created": created}))
"""


def _run(mode: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert isinstance(result, dict)
    return result


@pytest.mark.skipif(
    not (DEVICE.startswith("cuda") and torch.cuda.is_available()), reason="GPU check: AIOKV_TEST_DEVICE=cuda"
)
def test_indices_after_priming_create_no_pinned_block() -> None:
    control = _run("control")
    assert isinstance(control["created"], int) and control["created"] > 0, control
    primed = _run("primed")
    assert primed["primed"] is True and primed["again"] is False, primed  # once a process per device
    assert primed["created"] == 0, f"indices allocated pinned blocks after priming: {primed} (control {control})"


def test_a_cpu_device_primes_nothing() -> None:
    assert prime_host_allocator(torch.device("cpu"), 1 << 18) is False
